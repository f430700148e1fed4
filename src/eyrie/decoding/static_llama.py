"""Batch-1 decoding on a preallocated KV cache, replayed as CUDA graphs on CUDA.

transformers' eager decode of a small target is launch-bound (~40 tok/s on an H200), and its static
cache under torch.compile(reduce-overhead) fails there. This module runs the same weights in a loop
of our own, whose every step has static shapes:

  cache   [layers, 1, kv_heads, capacity, head_dim]; a forward over tokens at positions p writes
          K/V into slots p (index_copy_) and attends to the first `span` slots with the mask
          slot <= p. Slots of rejected drafts are simply overwritten by the next forward (gpt-fast's
          trick): no crop.
  span    attention reads only the filled prefix, rounded up to a power-of-two bucket: on an H200
          attending over the whole cache made a token cost 3.6 ms at 256 slots and 13 ms at ~2,900.
          Each bucket has its own graph, all captured before the prefill.
  greedy  one graph per span: next = argmax(target(token, position)); token <- next; position += 1.
  round   one graph for a whole speculative round: drafter extend (k + 1 rows, padded), k - 1
          chained draft steps, the (k + 1)-token verify, the accepted count and the next round's
          inputs, all on device; the host reads [accepted, *predicted] once per round. The drafter's
          side is eyrie.decoding.static_drafter, trees are eyrie.decoding.static_tree, and what the
          three share (spans, capacity, compile settings) is eyrie.decoding.static_common.

Prefills (variable length) run eagerly. Without CUDA the same functions run eagerly: that is the
CPU fallback the tests check against transformers. The target's own modules (norms, MLPs, rotary,
projections, lm_head) and the drafter's own modules are called, so the math cannot drift from
transformers or from training; only attention over the static cache is ours.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from eyrie.decoding.common import DecodeResult, DraftSession, SpecResult, finished, speculative_rounds
from eyrie.decoding.graphs import Replay, cuda_graphs_usable
from eyrie.decoding.static_common import (
    RECOMPILE_LIMIT,
    STATIC_ROPE_TYPES,
    UnsupportedTargetError,
    fused,
    needed_capacity,
    round_up,
    span_for,
    spans_up_to,
)
from eyrie.decoding.static_drafter import StaticEagle3
from eyrie.drafter.model import Eagle3Drafter
from eyrie.drafter.pointwise import rotate_half
from eyrie.target.aux_layers import capture_indices

# Architectures whose decoder layer is exactly Llama's: pre-norm attention (q/k/v/o, biases allowed)
# and a gated MLP, one rotary table, full attention everywhere. They run on StaticLlama, the fused fast path;
# every other decoder runs its own modules on the static cache (eyrie.decoding.static_modules).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


# --------------------------------------------------------------------------- support


def llama_reason(model) -> str | None:
    """Why StaticLlama (the Llama fast path) cannot run `model`, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)} (decoder layers identical to Llama's)"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        return f"{model_type} with sliding-window attention layers (layer_types {sorted(set(layer_types))})"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return f"mistral with sliding_window {config.sliding_window}; the Llama path attends to every position"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed) or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} does not have model.{{{','.join(needed)}}} and lm_head like LlamaForCausalLM"
    for index, layer in enumerate(inner.layers):
        attention = layer.self_attn
        extra = {"q_norm", "k_norm"} & {name for name, _ in attention.named_children()}
        if extra:
            return f"layer {index} attention has {sorted(extra)}, which Llama's does not"
        if not all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return f"layer {index} attention is not Llama's (q_proj, k_proj, v_proj, o_proj, scaling)"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} changes with the sequence length; static rope types: {', '.join(STATIC_ROPE_TYPES)}"
    return None


def check_supported(model) -> None:
    reason = llama_reason(model)
    if reason is not None:
        raise UnsupportedTargetError(
            f"the static Llama decoder cannot run this target: {reason}. eyrie.decoding.static.open_engine picks the engine that can."
        )


# --------------------------------------------------------------------------- target


class StaticLlama:
    """A Llama-structured HF causal LM run on a preallocated KV cache (batch 1).

    `forward` is the one code path: prefill, greedy step, verify and the tests' logits all use it.
    """

    rows = 1  # cache rows (sequences); BatchedGreedy holds many

    def __init__(self, model, capacity: int = 512, cuda_graphs: bool | None = None, compile: bool = False, compile_mode: str = "default"):
        self.check_target(model)
        self.model, self.config = model, model.config.get_text_config(decoder=True)  # a multimodal config nests it
        self.layers = list(self.decoder_of(model).layers)
        self.device, self.dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.use_graphs = cuda_graphs_usable(self.device) if cuda_graphs is None else bool(cuda_graphs)
        if self.use_graphs and not cuda_graphs_usable(self.device):
            raise UnsupportedTargetError(f"CUDA graphs asked for, but the target is on {self.device}; pass cuda_graphs=False")
        attention = self.layers[0].self_attn
        self.heads = self.config.num_attention_heads
        self.kv_heads = getattr(self.config, "num_key_value_heads", None) or self.heads
        self.head_dim = attention.head_dim if hasattr(attention, "head_dim") else self.config.hidden_size // self.heads
        self.drafters: dict[int, StaticEagle3] = {}
        self.capture_failures: list[str] = []  # why a graph capture failed: those steps run eagerly
        self.compile, self.compile_mode = bool(compile), compile_mode  # the drafter's and trees' pieces fuse in the same mode
        self.fusing = False  # set while a step function runs: run_layers then takes the compiled layer pieces
        if self.compile:
            # Each step width (greedy 1, a chain's k + 1, a tree's K, S + 1 and N) is one more compile of the same pieces;
            # a sweep reaches dynamo's default limit of 8, past which it runs them unfused without a word.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self._fused_project = fused(self._project, compile_mode)
            self._fused_finish = fused(self._finish, compile_mode)
            self._fused_head = fused(self._head, compile_mode)
        self._greedy_step_fn = self.step_function(self._greedy_step)
        self.capacity = 0
        self.ensure_capacity(capacity)

    def check_target(self, model) -> None:
        check_supported(model)

    @staticmethod
    def decoder_of(model):
        """The module holding embed_tokens, layers, norm and rotary_emb."""
        return model.model

    @property
    def label(self) -> str:
        label = "static-cudagraph" if self.use_graphs and not self.capture_failures else "static"
        if not self.compile:
            return label
        return label + ("-compiled" if self.compile_mode == "default" else "-autotuned")

    def step_function(self, method):
        """`method` (a step on static buffers, taking the span) as Replay will run it: its layers fused when compile is set.

        Fusion is per decoder layer, not per step: each layer's elementwise work around the matrix products
        (norms, rotary, residual adds, SiLU * up) is compiled in two pieces (before and after attention) that
        every layer shares, so inductor compiles two small graphs per number of tokens a step feeds, whatever
        the layer count, attention span or draft length. Compiling whole steps cost a 30-layer graph per span
        and draft length, minutes per benchmark job on an H200. The attention itself (cache write, SDPA over
        the span) stays eager. Compilation happens in Replay's warm-up, before any capture; prefills, which
        vary in length, run eagerly.
        """
        if not self.compile:
            return method

        def fused(*args, **kwargs):
            self.fusing = True
            try:
                return method(*args, **kwargs)
            finally:
                self.fusing = False

        return fused

    @torch.inference_mode()
    def ensure_capacity(self, length: int) -> None:
        """Grow the cache to hold `length` positions; graphs point at the old buffers, so they go too."""
        if length <= self.capacity:
            return
        self.capacity = round_up(length)
        shape = (len(self.layers), self.rows, self.kv_heads, self.capacity, self.head_dim)
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slots = torch.arange(self.capacity, device=self.device)
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.model.model.rotary_emb(probe, self.slots[None])  # the target's own rope: every type matches
        self.cos, self.sin = cos[0], sin[0]  # (capacity, hd)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # the next input token
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)  # its position
        self.greedy_steps: dict[int, Replay] = {}  # by span
        for drafter in self.drafters.values():
            drafter.reallocate(self.capacity)

    # ---- the forward

    def _project(self, layer, x, cos, sin):
        """A layer's attention inputs: q (1, h, T, hd), k and v (1, kvh, T, hd), rotated, from the residual stream x (B, T, H)."""
        attention = layer.self_attn
        B, T, _ = x.shape
        x = layer.input_layernorm(x)
        q = attention.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = attention.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attention.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _attend(self, keys, values, attention, q, k, v, positions, mask, span: int):
        """Attention over the first `span` slots of a layer's cache keys/values (B, kvh, capacity, hd), after
        writing this forward's K/V at slots `positions` (T,): (B, T, h * hd), before o_proj."""
        B, _, T, _ = q.shape
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        keys, values = keys[:, :, :span], values[:, :, :span]
        # GQA without repeating the cache: the `group` query heads of one kv head become rows.
        group = self.heads // self.kv_heads
        q = q.reshape(B, self.kv_heads, group * T, self.head_dim)  # head g*group + r -> kv head g
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attention.scaling)
        return out.reshape(B, self.heads, T, self.head_dim).transpose(1, 2).reshape(B, T, self.heads * self.head_dim)

    def _finish(self, layer, x, attended):
        """The residual stream after the layer: x + o_proj(attended), then the MLP block."""
        x = x + layer.self_attn.o_proj(attended)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _head(self, x):
        """The target's greedy token ids (B, T) after its last layer's output x (B, T, H): final norm, lm_head, argmax."""
        return self.model.lm_head(self.model.model.norm(x)).argmax(-1)

    def head(self, x):
        """_head, fused (one piece per step width) while a step function runs."""
        return (self._fused_head if self.fusing else self._head)(x)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, aux_layers=(), span: int | None = None,
                normed: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final normed hidden (1, T, H), or the last layer's output with normed=False; aux (1, T, 3H) or None): ids
        (1, T) at positions (T,), cache written.

        aux_layers: decoder layer indices whose outputs are concatenated (SGLang ids: layer i's output).
        span: cache slots attended (every position must be below it); None = the whole cache.
        """
        span = self.capacity if span is None else span
        keys = self.slots[None, :span]
        visible = (keys <= positions[:, None])[None]  # (1, T, span): a key slot is visible up to the query's position
        distance = positions[:, None] - keys if self.windowed else None
        masks = self.masks_for(visible, distance)
        return self.run_layers(ids, positions, self.rope_at(positions[None]), masks, span, aux_layers=aux_layers, normed=normed)

    # ---- what callers build a forward from (eyrie.decoding.batched_greedy, static_tree): rope and masks per engine

    windowed = False  # whether any layer attends within a sliding window (then masks_for needs query-key distances)

    def rope_at(self, positions: torch.Tensor):
        """The rotary inputs of queries at positions (B, T): cos, sin (B, 1, T, hd), as _project takes them."""
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def masks_for(self, visible: torch.Tensor, distance: torch.Tensor | None = None):
        """What run_layers attends with, from visible (B, T, S): key slot s visible to query t (S >= the span; run_layers
        takes the first span columns). distance (query position - key position, broadcast to visible) only matters
        to sliding-window layers, which this engine has none of. Here: (B, 1, group * T, S), the rows of _attend's
        grouped queries."""
        return visible[:, None].repeat(1, 1, self.heads // self.kv_heads, 1)

    def move_slots(self, moved_from: torch.Tensor, moved_to: torch.Tensor) -> None:
        """Every layer's K/V of cache slots moved_from to slots moved_to (index_select copies before the write)."""
        for cache in (self.keys, self.values):
            cache.index_copy_(3, moved_to, cache.index_select(3, moved_from))

    def run_layers(self, ids, slots, rope, mask, span: int, rows: slice = slice(None), aux_layers=(), normed: bool = True):
        """(final normed hidden (B, T, H), or the last layer's output with normed=False; aux (B, T, 3H) or None) of
        ids (B, T) whose K/V go to cache `slots` (T,) of cache rows `rows`; rope as rope_at and mask as masks_for
        give them."""
        x = self.model.model.embed_tokens(ids)
        project, finish = (self._fused_project, self._fused_finish) if self.fusing else (self._project, self._finish)
        cos, sin = rope
        mask = mask[..., :span]
        saved = {}
        for index, layer in enumerate(self.layers):
            q, k, v = project(layer, x, cos, sin)
            attended = self._attend(self.keys[index, rows], self.values[index, rows], layer.self_attn, q, k, v, slots, mask, span)
            x = finish(layer, x, attended)
            if index in aux_layers:
                saved[index] = x
        aux = torch.cat([saved[i] for i in aux_layers], dim=-1) if aux_layers else None
        return (self.model.model.norm(x) if normed else x), aux

    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(1, T, vocab): for tests and callers that need more than the argmax."""
        hidden, _ = self.forward(ids, positions)
        return self.model.lm_head(hidden)

    def predict(self, ids, positions, aux_layers=(), last_only: bool = False, span: int | None = None):
        """(argmax token ids (1, T) or (1, 1) when last_only, aux or None): no vocab-sized tensor leaves the device."""
        x, aux = self.forward(ids, positions, aux_layers, span, normed=False)
        if last_only:
            x = x[:, -1:]
        return self.head(x), aux

    def prefill(self, prompt_ids: list[int], aux_layers=()):
        ids = torch.tensor([prompt_ids], device=self.device)
        span = span_for(len(prompt_ids), self.capacity)
        return self.predict(ids, torch.arange(len(prompt_ids), device=self.device), aux_layers, last_only=True, span=span)

    # ---- greedy

    def _greedy_step(self, span: int) -> None:
        predicted, _ = self.predict(self.token, self.position, span=span)
        self.token.copy_(predicted)
        self.position.add_(1)

    @torch.inference_mode()
    def greedy_decode(self, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> DecodeResult:
        """Same result as eyrie.decoding.transformers_path.greedy_decode (transformers' path): one replay and one host read per token."""
        start = time.perf_counter()
        self.ensure_capacity(needed_capacity(len(prompt_ids), max_new_tokens))
        for span in spans_up_to(self.capacity):  # captured before the prefill: their warm-ups write cache slots
            if span not in self.greedy_steps:
                self.greedy_steps[span] = Replay(functools.partial(self._greedy_step_fn, span), self.use_graphs, self.capture_failures)
        predicted, _ = self.prefill(prompt_ids)
        self.token.copy_(predicted[:, -1:])
        self.position.fill_(len(prompt_ids))
        tokens, forwards = [int(self.token)], 1
        while not finished(tokens, max_new_tokens, stop_ids):
            position = len(prompt_ids) + len(tokens) - 1  # of self.token, which this step feeds
            self.greedy_steps[span_for(position + 1, self.capacity)]()
            tokens.append(int(self.token))
            forwards += 1
        return DecodeResult(tokens, time.perf_counter() - start, forwards)

    # ---- speculative

    def drafter_for(self, drafter: Eagle3Drafter) -> StaticEagle3:
        if id(drafter) not in self.drafters:
            self.drafters[id(drafter)] = StaticEagle3(self, drafter)
        return self.drafters[id(drafter)]

    @torch.inference_mode()
    def speculative_decode(self, drafter, prompt_ids: list[int], max_new_tokens: int, stop_ids, draft_tokens: int) -> SpecResult:
        """Same result as eyrie.decoding.transformers_path.speculative_decode; an Eagle3Drafter runs one replay per round."""
        self.ensure_capacity(needed_capacity(len(prompt_ids), max_new_tokens, draft_tokens))
        if isinstance(drafter, Eagle3Drafter):
            return self.drafter_for(drafter).decode(prompt_ids, max_new_tokens, stop_ids, draft_tokens)
        return self._session_decode(drafter, prompt_ids, max_new_tokens, stop_ids, draft_tokens)

    def _session_decode(self, session: DraftSession, prompt_ids, max_new_tokens, stop_ids, k) -> SpecResult:
        """Host-driven rounds for drafter doubles: the static target, the drafter's own extend/draft."""
        return speculative_rounds(_StaticVerifier(self, session.aux_layer_ids), session, prompt_ids, max_new_tokens, stop_ids, k)


class _StaticVerifier:
    """The target side of a host-driven round on the static cache (eyrie.decoding.common.Verifier)."""

    def __init__(self, target: StaticLlama, aux_layer_ids):
        self.target = target
        self.aux_layers = tuple(i - 1 for i in capture_indices(aux_layer_ids, len(target.layers)))

    def prefill(self, prompt_ids):
        predicted, aux = self.target.prefill(prompt_ids, self.aux_layers)
        return int(predicted[0, -1]), aux

    def verify(self, ids, position):
        device = self.target.device
        predicted, aux = self.target.predict(torch.tensor([ids], device=device), position + torch.arange(len(ids), device=device), self.aux_layers)
        return predicted[0].tolist(), aux

    def keep(self, length):
        pass  # slots past `length` are overwritten by the next forward, never cropped
