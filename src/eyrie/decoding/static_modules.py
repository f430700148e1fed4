"""Any transformers decoder on the static KV cache: each decoder layer runs through its own modules.

StaticLlama (eyrie.decoding.static) re-implements Llama's layer around the static cache to fuse it. Every other
family (Qwen3's qk-norm, Qwen3-MoE and DeepSeek-V3's routed experts, DeepSeek-V3's MLA latent cache, gpt-oss's
attention sinks, Gemma 3's (1 + w) norms, scaled embeddings and per-layer-type rope, sliding windows) runs here:
the target's own embed_tokens, decoder layers, norm and lm_head are called as its model's forward calls them, with

  cache   a ModuleCache in place of transformers' Cache: a layer's attention calls update(k, v, layer), which writes
          this forward's K/V (whatever the attention caches: per-head K/V, or MLA's latent and rope key) at their
          slots in preallocated buffers and hands back the first `span` slots. Shapes come from one probe forward.
  masks   additive (0 / dtype min) 4D masks, one per attention window, passed as the layer's attention_mask (eager
          and sdpa attention both add it). A sliding-window layer sees a key when it is visible and its position is
          within the window of the query's (transformers' rule: query - key < window), over the full-length cache,
          so trees and rejected drafts need nothing else.
  rope    the target's own rotary tables over every slot (one per layer type where the rotary takes a layer type, as
          Gemma 3's does), looked up by position.

The batch-1 decoder, the drafter's rounds, trees and batched greedy are StaticLlama's, unchanged; every step keeps
static shapes and no host sync, so CUDA graphs capture it unless a layer itself syncs (transformers' routed-expert
loops do: Replay then records why and runs the step eagerly, and the label says so). Compile does not apply.
"""

from __future__ import annotations

import inspect

import torch

from eyrie.decoding.static_common import STATIC_ROPE_TYPES, UnsupportedTargetError, round_up
from eyrie.decoding.static_llama import StaticLlama

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")  # the ones that take a 4D additive attention_mask as it is
PROBE_TOKENS = 24  # the self-check's forward: past the small windows the tests use
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}  # max |logit difference| / max |logit|; 16-bit: HALF_TOLERANCE
HALF_TOLERANCE = 0.1  # a misread layer (a norm, the rope, a window) is off by the order of the logits themselves


def text_decoder(model):
    """The decoder stack of a causal LM, or of the language model inside a multimodal one (Gemma 3, Llama 4, ...)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", inner)


def _inner(model):
    inner = text_decoder(model)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
        return None, f"{type(model).__name__} does not have model.{{{','.join(needed)}}} and lm_head"
    return inner, None


def _rope_types(rotary) -> list:
    kind = getattr(rotary, "rope_type", "default")
    return list(kind.values()) if isinstance(kind, dict) else [kind]


def _takes_layer_type(rotary) -> bool:
    return "layer_type" in inspect.signature(type(rotary).forward).parameters


def _cache_keyword(layer) -> str:
    parameters = inspect.signature(type(layer).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def layer_windows(model) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), read as the model's own forward builds its masks."""
    config, layers = model.config.get_text_config(decoder=True), text_decoder(model).layers
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    windows = []
    for index, layer in enumerate(layers):
        if layer_types is not None:
            windows.append(window if layer_types[index] == "sliding_attention" else None)
        elif hasattr(layer.self_attn, "sliding_window"):
            windows.append(layer.self_attn.sliding_window)
        else:  # Mistral: no layer types, one window for every layer when the config sets it
            windows.append(window if getattr(config, "use_sliding_window", True) else None)
    return windows


def modules_reason(model) -> str | None:
    """Why StaticModules cannot run `model`, or None when it can (the self-check against transformers comes at build)."""
    inner, reason = _inner(model)
    if reason is not None:
        return reason
    implementation = getattr(model.config.get_text_config(decoder=True), "_attn_implementation", None) or "eager"
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        return f"attention implementation {implementation!r}: the static cache passes 4D masks, which {', '.join(ATTENTION_IMPLEMENTATIONS)} take"
    dynamic = [kind for kind in _rope_types(inner.rotary_emb) if kind not in STATIC_ROPE_TYPES]
    if dynamic:
        return f"rope_type {dynamic[0]!r} changes with the sequence length; static rope types: {', '.join(STATIC_ROPE_TYPES)}"
    for index, layer in enumerate(inner.layers):
        if not hasattr(layer, "self_attn"):
            return f"decoder layer {index} ({type(layer).__name__}) has no self_attn"
        if not hasattr(layer.self_attn, "layer_idx") or layer.self_attn.layer_idx != index:
            return f"layer {index}'s attention does not know its layer index (it must name its cache layer)"
    return None


class ModuleCache:
    """The Cache the target's attention modules write to: update() puts this forward's K/V at slots `slots` of rows
    `rows` of the engine's buffers and returns the first `span` slots. With `shapes` set (the probe) it only records
    what each layer caches."""

    is_compileable = True

    def __init__(self, engine: StaticModules):
        self.engine, self.slots, self.rows, self.span, self.shapes = engine, None, slice(None), 0, None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.shapes is not None:
            self.shapes[layer_idx] = (tuple(key_states.shape[1:2] + key_states.shape[3:]), tuple(value_states.shape[1:2] + value_states.shape[3:]),
                                      key_states.dtype, value_states.dtype)
            return key_states, value_states
        keys, values = self.engine.keys[layer_idx][self.rows], self.engine.values[layer_idx][self.rows]
        keys.index_copy_(2, self.slots, key_states)
        values.index_copy_(2, self.slots, value_states)
        return keys[:, :, : self.span], values[:, :, : self.span]


class StaticModules(StaticLlama):
    """A transformers causal LM of any family above on the static cache, its decoder layers called as they are."""

    def __init__(self, model, capacity: int = 512, cuda_graphs: bool | None = None, compile: bool = False):
        reason = modules_reason(model)
        if reason is not None:
            raise UnsupportedTargetError(f"the static decoder cannot run this target: {reason}")
        if compile:
            raise UnsupportedTargetError("compile fuses StaticLlama's Llama layer; StaticModules runs the target's own layers unfused")
        inner = self.decoder = text_decoder(model)
        self.windows = layer_windows(model)
        self.windowed = any(window is not None for window in self.windows)
        types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
        per_type = _takes_layer_type(inner.rotary_emb)
        self.rope_keys = [types[i] if per_type else None for i in range(len(inner.layers))]
        self.cache_keyword = _cache_keyword(inner.layers[0])
        self.module_cache = ModuleCache(self)
        self.cache_shapes = None
        super().__init__(model, capacity=capacity, cuda_graphs=cuda_graphs, compile=False)
        self.self_check()

    def check_target(self, model) -> None:
        pass  # modules_reason ran in __init__

    decoder_of = staticmethod(text_decoder)

    @property
    def label(self) -> str:
        return "static-modules-cudagraph" if self.use_graphs and not self.capture_failures else "static-modules"

    # ---- buffers

    @torch.inference_mode()
    def _probe_shapes(self):
        """What each layer's attention caches: one forward of one token through a recording ModuleCache."""
        self.module_cache.shapes = {}
        try:
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            positions = torch.zeros(1, dtype=torch.long, device=self.device)
            self.rope_tables = self._tables(1)
            visible = torch.ones(1, 1, 1, dtype=torch.bool, device=self.device)
            self.run_layers(ids, positions, self.rope_at(positions[None]), self.masks_for(visible, torch.zeros_like(positions)[None, None]), 1)
            shapes = self.module_cache.shapes
        finally:
            self.module_cache.shapes = None
        missing = [i for i in range(len(self.layers)) if i not in shapes]
        if missing:
            raise UnsupportedTargetError(f"the static decoder cannot run this target: layers {missing[:5]} never wrote their cache")
        return [shapes[i] for i in range(len(self.layers))]

    def _tables(self, capacity: int) -> dict:
        """The target's rotary (cos, sin) at every slot, per rope key (layer type, or None for one table)."""
        rotary, slots = self.decoder.rotary_emb, torch.arange(capacity, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        tables = {}
        for key in set(self.rope_keys):
            cos, sin = rotary(probe, slots) if key is None else rotary(probe, slots, key)
            tables[key] = (cos[0], sin[0])
        return tables

    @torch.inference_mode()
    def ensure_capacity(self, length: int) -> None:
        if length <= self.capacity:
            return
        if self.cache_shapes is None:
            self.cache_shapes = self._probe_shapes()
        self.capacity = round_up(length)
        self.keys, self.values = self._buffers(0), self._buffers(1)
        self.slots = torch.arange(self.capacity, device=self.device)
        self.rope_tables = self._tables(self.capacity)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.greedy_steps = {}
        for drafter in self.drafters.values():
            drafter.reallocate(self.capacity)

    def _buffers(self, which: int):
        """Keys (which 0) or values (1) of every layer: one (layers, rows, heads, capacity, dim) tensor when every layer
        caches the same shape (one gather moves a tree's path), else one tensor per layer."""
        shapes = [(shape[which], shape[2 + which]) for shape in self.cache_shapes]  # ((heads, dim), dtype) per layer
        layers = [len(shapes)] if len(set(shapes)) == 1 else []
        buffers = [torch.zeros(*layers, self.rows, heads, self.capacity, dim, device=self.device, dtype=dtype)
                   for (heads, dim), dtype in (shapes[:1] if layers else shapes)]
        return buffers[0] if layers else buffers

    def move_slots(self, moved_from: torch.Tensor, moved_to: torch.Tensor) -> None:
        for cache in (self.keys, self.values):
            for layer in [cache] if torch.is_tensor(cache) else cache:
                axis = layer.dim() - 2  # the slot axis
                layer.index_copy_(axis, moved_to, layer.index_select(axis, moved_from))

    # ---- the forward pieces

    def rope_at(self, positions: torch.Tensor):
        """{rope key: (cos, sin) (B, T, dim)} at positions (B, T): the position_embeddings each layer takes."""
        return {key: (cos[positions], sin[positions]) for key, (cos, sin) in self.rope_tables.items()}

    def masks_for(self, visible: torch.Tensor, distance: torch.Tensor | None = None):
        """{window: additive mask (B, 1, T, S)} from visible (B, T, S); a window's mask also hides keys whose
        position is `window` or more before the query's (distance: query position - key position)."""
        low = torch.finfo(self.dtype).min
        masks = {}
        for window in set(self.windows):
            seen = visible if window is None else visible & (distance < window)
            masks[window] = torch.zeros(seen.shape, device=self.device, dtype=self.dtype).masked_fill(~seen, low)[:, None]
        return masks

    def run_layers(self, ids, slots, rope, mask, span: int, rows: slice = slice(None), aux_layers=(), normed: bool = True):
        """StaticLlama.run_layers through the target's own layers: rope as rope_at and mask as masks_for give them."""
        x = self.decoder.embed_tokens(ids)
        cache = self.module_cache
        cache.slots, cache.rows, cache.span = slots, rows, span
        masks = {window: m[..., :span] for window, m in mask.items()}
        saved = {}
        for index, layer in enumerate(self.layers):
            out = layer(x, attention_mask=masks[self.windows[index]], position_embeddings=rope[self.rope_keys[index]],
                        use_cache=True, **{self.cache_keyword: cache})
            x = out[0] if isinstance(out, tuple) else out
            if index in aux_layers:
                saved[index] = x
        aux = torch.cat([saved[i] for i in aux_layers], dim=-1) if aux_layers else None
        return (self.decoder.norm(x) if normed else x), aux

    def _head(self, x):
        return self.logits_of(x).argmax(-1)

    def logits_of(self, x):
        """The target's logits after its last layer's output x: final norm, lm_head, and the soft-cap where the config has one."""
        logits = self.model.lm_head(self.decoder.norm(x))
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, _ = self.forward(ids, positions, normed=False)
        return self.logits_of(x)

    # ---- the guard

    @torch.inference_mode()
    def self_check(self) -> None:
        """One forward of PROBE_TOKENS tokens here and through the target's own forward: their logits must agree, or
        this engine refuses the target (a family whose model forward does more than its layers, say) with the numbers."""
        count = min(PROBE_TOKENS, self.capacity)
        vocab = self.model.lm_head.weight.shape[0]
        ids = (torch.arange(count, device=self.device) * 7919 % vocab)[None]
        positions = torch.arange(count, device=self.device)
        keys = self.slots[None, :count]
        masks = self.masks_for((keys <= positions[:, None])[None], positions[:, None] - keys)
        x, _ = self.run_layers(ids, positions, self.rope_at(positions[None]), masks, count, rows=slice(0, 1), normed=False)
        ours = self.logits_of(x).float()
        theirs = self.model(input_ids=ids, use_cache=False).logits.float()
        error = float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-12))
        tolerance = PROBE_TOLERANCE.get(self.dtype, HALF_TOLERANCE)
        if not error <= tolerance:
            raise UnsupportedTargetError(
                f"the static decoder cannot run this target: its logits over {count} probe tokens differ from the model's own "
                f"forward by {error:.2e} of their largest (tolerance {tolerance:.0e} in {self.dtype})")
