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
          inputs, all on device; the host reads [accepted, *predicted] once per round.

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

from eyrie.core.errors import EyrieError
from eyrie.decoding.common import DecodeResult, DraftSession, SpecResult, emit, finished, speculative_rounds
from eyrie.decoding.graphs import Replay, cuda_graphs_usable
from eyrie.drafter.model import Eagle3Drafter, rotate_half
from eyrie.target.aux_layers import capture_indices

# Architectures whose decoder layer is exactly Llama's: pre-norm attention (q/k/v/o, biases allowed)
# and a gated MLP, one rotary table, full attention everywhere.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rope types whose frequencies do not depend on the sequence length, so one table serves every step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
CAPACITY_STEP = 64  # cache slots are rounded up to this: fewer recaptures, aligned attention masks
SMALLEST_SPAN = 256  # attention spans are this times a power of two (or the whole cache)
# Inductor's default mode: it fuses the small kernels, cuBLAS keeps the matrix products, Replay captures the
# step. With max-autotune-no-cudagraphs the H200 was still tuning after 9.5 minutes (floor, greedy and round steps).
COMPILE_MODE = None
RECOMPILE_LIMIT = 64  # compiled step widths per piece: far more than any sweep uses


def compiled_pieces(owner, names) -> dict:
    """torch.compile of each method `names` of owner, static shapes: each step width (and tree shape) is one graph."""
    return {name: torch.compile(getattr(owner, name), dynamic=False, mode=COMPILE_MODE) for name in names}


class UnsupportedTargetError(EyrieError):
    """The static decoder cannot run this target; bench falls back to transformers' decode."""


# --------------------------------------------------------------------------- support


def unsupported_reason(model) -> str | None:
    """Why the static decoder cannot run `model`, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)} (decoder layers identical to Llama's)"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        return f"{model_type} with sliding-window attention layers (layer_types {sorted(set(layer_types))})"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return f"mistral with sliding_window {config.sliding_window}; the static cache attends to every position"
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
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedTargetError(
            f"the static decoder cannot run this target: {reason}. Set bench.decoder: transformers (or auto) to use transformers' decode."
        )


def round_up(length: int, step: int = CAPACITY_STEP) -> int:
    return -(-length // step) * step


def spans_up_to(capacity: int) -> list[int]:
    """The attention spans of a cache: SMALLEST_SPAN, doubling, then the capacity itself."""
    spans, span = [], SMALLEST_SPAN
    while span < capacity:
        spans.append(span)
        span *= 2
    return spans + [capacity]


def span_for(slots: int, capacity: int) -> int:
    """The smallest span that holds `slots` slots (positions 0..slots-1)."""
    if slots > capacity:
        raise ValueError(f"{slots} cache slots needed, the cache holds {capacity}")
    return next(span for span in spans_up_to(capacity) if span >= slots)


def needed_capacity(prompt_tokens: int, max_new_tokens: int, draft_tokens: int = 0) -> int:
    """Cache slots for one decode: the verify writes k + 1 slots past the current token, the drafter's padded extend and chain up to 2k past it."""
    return round_up(prompt_tokens + max_new_tokens + 2 * draft_tokens + 2)


# --------------------------------------------------------------------------- target


class StaticLlama:
    """A Llama-structured HF causal LM run on a preallocated KV cache (batch 1).

    `forward` is the one code path: prefill, greedy step, verify and the tests' logits all use it.
    """

    rows = 1  # cache rows (sequences); BatchedGreedy holds many

    def __init__(self, model, capacity: int = 512, cuda_graphs: bool | None = None, compile: bool = False):
        check_supported(model)
        self.model, self.config = model, model.config
        self.layers = list(model.model.layers)
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
        self.compile = bool(compile)
        self.fusing = False  # set while a step function runs: run_layers then takes the compiled layer pieces
        if self.compile:
            # Each step width (greedy 1, a chain's k + 1, a tree's K, S + 1 and N) is one more compile of the same pieces;
            # a sweep reaches dynamo's default limit of 8, past which it runs them unfused without a word.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self._fused_project = torch.compile(self._project, dynamic=False, mode=COMPILE_MODE)
            self._fused_finish = torch.compile(self._finish, dynamic=False, mode=COMPILE_MODE)
        self._greedy_step_fn = self.step_function(self._greedy_step)
        self.capacity = 0
        self.ensure_capacity(capacity)

    @property
    def label(self) -> str:
        label = "static-cudagraph" if self.use_graphs and not self.capture_failures else "static"
        return label + "-compiled" if self.compile else label

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

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, aux_layers=(), span: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final normed hidden (1, T, H), aux (1, T, 3H) or None): ids (1, T) at positions (T,), cache written.

        aux_layers: decoder layer indices whose outputs are concatenated (SGLang ids: layer i's output).
        span: cache slots attended (every position must be below it); None = the whole cache.
        """
        span = self.capacity if span is None else span
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]  # (1, 1, T, hd)
        mask = self.slots[None, :span] <= positions[:, None]  # (T, span): a key slot is visible up to the query's position
        mask = mask.repeat(self.heads // self.kv_heads, 1)  # (group * T, span): the rows of _attend's grouped queries
        return self.run_layers(ids, positions, cos, sin, mask, span, aux_layers=aux_layers)

    def run_layers(self, ids, slots, cos, sin, mask, span: int, rows: slice = slice(None), aux_layers=()):
        """(final normed hidden (B, T, H), aux (B, T, 3H) or None) of ids (B, T) whose K/V go to cache
        `slots` (T,) of cache rows `rows`; cos, sin and mask as _project and _attend take them."""
        x = self.model.model.embed_tokens(ids)
        project, finish = (self._fused_project, self._fused_finish) if self.fusing else (self._project, self._finish)
        saved = {}
        for index, layer in enumerate(self.layers):
            q, k, v = project(layer, x, cos, sin)
            attended = self._attend(self.keys[index, rows], self.values[index, rows], layer.self_attn, q, k, v, slots, mask, span)
            x = finish(layer, x, attended)
            if index in aux_layers:
                saved[index] = x
        aux = torch.cat([saved[i] for i in aux_layers], dim=-1) if aux_layers else None
        return self.model.model.norm(x), aux

    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(1, T, vocab): for tests and callers that need more than the argmax."""
        hidden, _ = self.forward(ids, positions)
        return self.model.lm_head(hidden)

    def predict(self, ids, positions, aux_layers=(), last_only: bool = False, span: int | None = None):
        """(argmax token ids (1, T) or (1, 1) when last_only, aux or None): no vocab-sized tensor leaves the device."""
        hidden, aux = self.forward(ids, positions, aux_layers, span)
        if last_only:
            hidden = hidden[:, -1:]
        return self.model.lm_head(hidden).argmax(-1), aux

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


# --------------------------------------------------------------------------- drafter


class StaticEagle3:
    """An Eagle3Drafter on its own preallocated cache, with the target: one speculative round per replay.

    Calls the drafter's own fc, layer_inputs, project, attend, layer_output, head and d2t mapping,
    exactly as Eagle3Drafter.decode does; only the cache is a fixed buffer written by position.
    """

    def __init__(self, target: StaticLlama, drafter: Eagle3Drafter):
        rope_type = getattr(drafter.rotary.rope, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedTargetError(f"the drafter's rope_type {rope_type!r} changes with the sequence length; use bench.decoder: transformers")
        self.target, self.drafter = target, drafter
        self.device, self.dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.aux_layers = tuple(i - 1 for i in capture_indices(drafter.shape.aux_layer_ids, len(target.layers)))
        self.rounds: dict[int, ChainRounds] = {}  # by draft length
        # With the target's compile, the drafter's step is fused in pieces: fc (the extend's), the layer up to its
        # q/k/v, its attention over the cache with everything after it, and the head's norm, argmax and d2t mapping.
        # Each draft step was ~0.3 ms on an H200 unfused, about six of the target's fused layers; a round's kernels
        # inside its graph cost ~3.7 us each on an H200 whatever they do, so fewer kernels is what pays. Only the
        # cache writes stay eager.
        self.fusion_failure: str | None = None  # why a compiled piece failed: the drafter then runs eagerly
        self._fused = compiled_pieces(self, ("_project_aux", "_inputs", "_attend_outputs", "_token", "_top")) if target.compile else {}
        self.reallocate(target.capacity)

    @torch.inference_mode()
    def reallocate(self, capacity: int) -> None:
        attention = self.drafter.midlayer.self_attn
        shape = (1, attention.heads, capacity, attention.head_dim)  # project() returns kv heads already repeated
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slots = torch.arange(capacity, device=self.device)
        self.capacity = capacity
        self.rounds = {}  # by draft length: their graphs point at the old buffers
        self.trees = {}  # eyrie.decoding.static_tree's rounds, by TreeShape: the same

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs (1, T, H) of hidden (1, T, H) with the next tokens ids (1, T) at positions (T,).

        The drafter attends over its whole cache, masked by position, not over the target's span: one layer's
        attention over a few hundred or thousand slots costs microseconds, while a piece per span was one more
        compile per step width and span (and per tree shape and span for eyrie.decoding.static_tree): with those,
        warm-up took 98-128 s per benchmark job on an H200.
        """
        q, k, v = self.piece("_inputs", hidden, ids, positions)  # (1, h, T, hd)
        self.keys.index_copy_(2, positions, k)
        self.values.index_copy_(2, positions, v)
        return self.piece("_attend_outputs", hidden, q, self.keys, self.values, self.slots, positions)

    def draft_token(self, out: torch.Tensor) -> torch.Tensor:
        """Target id (1, 1) of the drafter's greedy token after its output out (1, 1, H)."""
        return self.piece("_token", out)

    # The pieces forward and draft_token are made of: the drafter's own methods, in the order Eagle3Drafter.decode calls them.

    def _project_aux(self, aux):
        """The extend's g (1, T, H) from the target's aux states (1, T, 3H)."""
        return self.drafter.project_aux(aux.to(self.dtype))

    def _inputs(self, hidden, ids, positions):
        x, cos, sin = self.drafter.layer_inputs(hidden, ids, positions[None])
        return self.drafter.midlayer.self_attn.project(x, cos, sin)

    def _attend_outputs(self, hidden, q, keys, values, slots, positions):
        """The layer's output (1, T, H) after its attention: queries q at `positions` over cached keys/values (1, h,
        slots, hd) of cache slots `slots`, each slot visible up to the query's position."""
        mask = slots[None, None, None, :] <= positions[None, None, :, None]  # (1, 1, T, slots)
        return self.drafter.layer_output(hidden, self.drafter.midlayer.self_attn.attend(q, [(keys, values, mask)]))

    def _token(self, out):
        return self.drafter.draft_ids_to_target(self.drafter.head(out).argmax(-1))

    def _top(self, out, k: int):
        """(log-probabilities, draft ids) of the k likeliest draft tokens after each row of out (1, T, H): (T, k) each."""
        return torch.log_softmax(self.drafter.head(out)[0].float(), dim=-1).topk(k, dim=-1)

    def piece(self, name: str, *args, owner=None):
        """Piece `name` of `owner` (this drafter, or a StaticTree of it), compiled while the target fuses a step
        (StaticLlama.step_function), else eager. A piece that fails to compile turns fusion off for this drafter and
        its trees (fusion_failure says why): slower, never wrong."""
        owner = self if owner is None else owner
        if not (self.target.fusing and self.target.compile and self.fusion_failure is None):
            return getattr(owner, name)(*args)
        try:
            return owner._fused[name](*args)
        except Exception as error:  # inductor or dynamo: the eager piece computes the same values
            self.fusion_failure = f"{name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            return getattr(owner, name)(*args)

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's prefill, then the drafter's over positions 0..P-2, eagerly: (the target's first token (1, 1),
        the aux states of the last prompt position (1, 1, 3H)), which go into the first round's extend."""
        predicted, aux = self.target.prefill(prompt_ids, self.aux_layers)  # (1, P), (1, P, 3H)
        count = len(prompt_ids)
        if count > 1:
            ids = torch.tensor([prompt_ids[1:]], device=self.device)
            self.forward(self.drafter.project_aux(aux[:, :-1].to(self.dtype)), ids, torch.arange(count - 1, device=self.device))
        return predicted[:, -1:], aux[:, -1:]

    def start(self, prompt_ids: list[int], rounds) -> tuple[int, int]:
        """Prefill, then set the first round's inputs: the extend buffers of `rounds` (ChainRounds or a StaticTree:
        ext_aux, ext_ids, ext_start, ext_last) and the target's next token and position. (first token, prompt length)."""
        first, last_aux = self.prefill(prompt_ids)
        count = len(prompt_ids)
        rounds.ext_aux[:, :1].copy_(last_aux)
        rounds.ext_ids[:, :1].copy_(first)
        rounds.ext_start.fill_(count - 1)
        rounds.ext_last.zero_()
        self.target.token.copy_(first)
        self.target.position.fill_(count)
        return int(first), count

    # ---- one round on device

    def _rounds_for(self, k: int) -> ChainRounds:
        """The rounds for draft length k, captured on first use and kept: a sweep alternating draft lengths
        prompt by prompt replays them instead of capturing (and compiling) again."""
        if k not in self.rounds:
            self.rounds[k] = ChainRounds(self, k)
        return self.rounds[k]

    def decode(self, prompt_ids: list[int], max_new_tokens: int, stop_ids, k: int) -> SpecResult:
        start_time = time.perf_counter()
        chain = self._rounds_for(k)  # captured before the prefills: their warm-ups write cache slots
        first, count = self.start(prompt_ids, chain)
        tokens = [first]
        forwards, lengths, accepted_per_position = 1, [], [0] * k
        self.drafted = []  # per round: the k drafts, for tests and diagnosis
        while not finished(tokens, max_new_tokens, stop_ids):
            current = count + len(tokens) - 1  # position of target.token; the round writes slots up to current + k
            chain.replays[span_for(current + k + 1, self.capacity)]()
            out = chain.round_out.tolist()  # the round's one host sync
            accepted, predicted = out[0], out[1 : k + 2]
            self.drafted.append(out[k + 2 :])
            forwards += 1
            for j in range(accepted):
                accepted_per_position[j] += 1
            emitted = emit(tokens, predicted[: accepted + 1], max_new_tokens, stop_ids)  # accepted drafts == predicted
            tokens += emitted
            lengths.append(len(emitted))
        return SpecResult(tokens, time.perf_counter() - start_time, forwards, lengths, accepted_per_position)


class ChainRounds:
    """Chain rounds of draft length k for one StaticEagle3: their static buffers and one Replay per attention span.

    Each Replay's warm-up and capture write cache slots 0..2k: harmless before a prefill, which overwrites them.
    """

    def __init__(self, eagle: StaticEagle3, k: int):
        self.eagle, self.k = eagle, k
        device, hidden3 = eagle.device, 3 * eagle.drafter.shape.target_hidden_size
        self.offsets = torch.arange(k + 1, device=device)
        self.ext_aux = torch.zeros(1, k + 1, hidden3, device=device, dtype=eagle.target.dtype)  # target features, padded
        self.ext_ids = torch.zeros(1, k + 1, dtype=torch.long, device=device)  # the token after each position
        self.ext_start = torch.zeros(1, dtype=torch.long, device=device)  # position of row 0
        self.ext_last = torch.zeros(1, dtype=torch.long, device=device)  # last real row: rows past it are padding
        self.round_out = torch.zeros(2 * k + 2, dtype=torch.long, device=device)  # [accepted, *predicted, *drafts]
        target = eagle.target
        step = target.step_function(self._round)
        self.replays = {}
        for span in spans_up_to(eagle.capacity):
            target.token.zero_()
            target.position.zero_()
            self.replays[span] = Replay(functools.partial(step, span), target.use_graphs, target.capture_failures)

    def _round(self, span: int) -> None:
        """Extend, draft k, verify, accept: every input and output is a static buffer; attention over `span` slots."""
        eagle, target, k = self.eagle, self.eagle.target, self.k
        # Extend: the target's features of the newly accepted positions (padding rows write slots the chain overwrites).
        hidden = eagle.piece("_project_aux", self.ext_aux)  # (1, k+1, 3H) -> (1, k+1, H)
        out = eagle.forward(hidden, self.ext_ids, self.ext_start + self.offsets)
        out = out.index_select(1, self.ext_last)  # (1, 1, H): the last real row
        last = self.ext_start + self.ext_last  # (1,)
        drafts = [eagle.draft_token(out)]
        for j in range(1, k):  # chain: own output and the previous draft's embedding
            out = eagle.forward(out, drafts[-1], last + j)
            drafts.append(eagle.draft_token(out))
        drafts = torch.cat(drafts, dim=1)  # (1, k)
        # Verify [current, *drafts]; predicted[i] is the target's token after input i.
        ids = torch.cat([target.token, drafts], dim=1)  # (1, k+1)
        predicted, aux = target.predict(ids, target.position + self.offsets, eagle.aux_layers, span=span)
        # Accept the longest agreeing prefix, then the target's own token (the bonus).
        accepted = (drafts[0] == predicted[0, :k]).long().cumprod(0).sum().view(1)  # (1,)
        # The next round's extend: features of current..current+k, the token after each (predicted), from `current`.
        self.ext_aux.copy_(aux)
        self.ext_ids.copy_(predicted)
        self.ext_start.copy_(target.position)
        self.ext_last.copy_(accepted)
        target.token.copy_(predicted.index_select(1, accepted))
        target.position.add_(accepted + 1)
        self.round_out[:1].copy_(accepted)
        self.round_out[1 : k + 2].copy_(predicted[0])
        self.round_out[k + 2 :].copy_(drafts[0])


# --------------------------------------------------------------------------- choosing


DECODERS = ("auto", "static", "transformers")


def open_decoder(model, setting: str, capacity: int, cuda_graphs: bool | None = None, compile: str | bool = False):
    """(what greedy_decode/speculative_decode take as target, decoder label, why static was not used or None).

    compile: True/False, or "auto" = fuse the static decoder's steps on CUDA, where they are launch-bound
    (bf16 on an H200 at the default target's shape: 3.00 -> 1.72 ms per greedy token, benchmarks/decode_floor.py).
    """
    if setting not in DECODERS:
        raise UnsupportedTargetError(f"bench.decoder is {setting!r}; use one of {', '.join(DECODERS)}")
    if setting == "transformers":
        return model, "transformers", "bench.decoder: transformers"
    reason = unsupported_reason(model)
    if reason is not None:
        if setting == "static":
            check_supported(model)
        return model, "transformers", reason
    if compile == "auto":
        compile = next(model.parameters()).device.type == "cuda"
    engine = StaticLlama(model, capacity=capacity, cuda_graphs=cuda_graphs, compile=bool(compile))
    return engine, engine.label, None
