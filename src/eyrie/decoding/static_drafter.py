"""An Eagle3Drafter on its own preallocated cache beside a StaticLlama (eyrie.decoding.static), and the chain's rounds:
drafter extend, k - 1 chained drafts, the k + 1 token verify and the accept in one replay per round, the host reading
one small tensor per round. Trees are eyrie.decoding.static_tree's."""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from eyrie.decoding.common import SpecResult, emit, finished
from eyrie.decoding.graphs import Replay
from eyrie.decoding.static_common import STATIC_ROPE_TYPES, UnsupportedTargetError, compiled_pieces, rotary_at, span_for, spans_up_to
from eyrie.decoding.topk import top_k
from eyrie.drafter.model import Eagle3Drafter
from eyrie.target.aux_layers import capture_indices


class StaticEagle3:
    """An Eagle3Drafter on its own preallocated cache, with the target: one speculative round per replay.

    Calls the drafter's own fc, layer_inputs, rotary_heads, attend, layer_output, head and d2t mapping, as
    Eagle3Drafter.decode does; only the cache is a fixed buffer written by position, and the layer's q, k and v
    products are one product, as are gate and up (MergedProducts), as SGLang and vLLM serve them.

    With the target's compile, the drafter runs in compiled pieces, one graph per step width each: a round's extend
    (fc, the layer, the cache write), a chain's draft step (the layer, the cache write, the head's argmax and d2t
    mapping) and the head's token alone; trees take the head's top-K (_top) inside their own pieces. A piece writes
    the cache inside (index_copy_ on its input), so a draft step launches no eager kernel. At batch 1 nearly every
    kernel is tiny and costs ~2 us on an H200 however little it does (a greedy step: 610 kernels, 1.36 ms of kernel
    time in a 1.7 ms step, benchmarks/decode_floor.py --profile-round), so fewer kernels is what pays.
    """

    PIECES = ("_forward", "_extend", "_draft_step", "_token")

    def __init__(self, target, drafter: Eagle3Drafter):  # target: the StaticLlama drafted for
        rope_type = getattr(drafter.rotary.rope, "rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedTargetError(f"the drafter's rope_type {rope_type!r} changes with the sequence length; use bench.decoder: transformers")
        self.target, self.drafter = target, drafter
        self.device, self.dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.aux_layers = tuple(i - 1 for i in capture_indices(drafter.shape.aux_layer_ids, len(target.layers)))
        self.products = MergedProducts(drafter)
        self.rounds: dict[int, ChainRounds] = {}  # by draft length
        self.fusion_failure: str | None = None  # why a compiled piece failed: the drafter then runs eagerly
        self._fused = compiled_pieces(self, self.PIECES, target.compile_mode) if target.compile else {}
        self.reallocate(target.capacity)

    @torch.inference_mode()
    def reallocate(self, capacity: int) -> None:
        attention = self.drafter.midlayer.self_attn
        shape = (1, attention.heads, capacity, attention.head_dim)  # project() returns kv heads already repeated
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slots = torch.arange(capacity, device=self.device)
        # The drafter's own rotary tables at every slot, looked up by position: computed per step, they cost a float32
        # matrix product (~3 us on an H200) in every draft step. Each entry is the same product either way.
        cos, sin = self.drafter.rotary(torch.zeros(1, device=self.device, dtype=self.dtype), self.slots[None])
        self.cos, self.sin = cos[0, 0].to(self.dtype), sin[0, 0].to(self.dtype)  # (capacity, hd)
        self.capacity = capacity
        self.rounds = {}  # by draft length: their graphs point at the old buffers
        self.trees = {}  # eyrie.decoding.static_tree's rounds, by TreeShape: the same

    @property
    def cache(self) -> tuple[torch.Tensor, ...]:
        """(keys, values, slots, cos, sin): what the pieces that run the drafter's layer on its cache take."""
        return self.keys, self.values, self.slots, self.cos, self.sin

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs (1, T, H) of hidden (1, T, H) with the next tokens ids (1, T) at positions (T,), the
        cache written at `positions`."""
        return self.piece("_forward", hidden, ids, positions, *self.cache)

    def draft_token(self, out: torch.Tensor) -> torch.Tensor:
        """Target id (1, 1) of the drafter's greedy token after its output out (1, 1, H)."""
        return self.piece("_token", out)

    # The pieces: the drafter's own methods, in the order Eagle3Drafter.decode calls them.

    def _forward(self, hidden, ids, positions, keys, values, slots, cos, sin):
        """The drafter's layer over the cache keys/values (1, h, slots, hd), after writing this step's K/V at `positions`;
        cos and sin are the rotary tables (slots, hd).

        The drafter attends over its whole cache, masked by position, not over the target's span: one layer's
        attention over a few hundred or thousand slots costs microseconds, while a piece per span was one more
        compile per step width and span (and per tree shape and span for eyrie.decoding.static_tree): with those,
        warm-up took 98-128 s per benchmark job on an H200.
        """
        rotary = rotary_at(cos, sin, positions)
        x, cos, sin = self.drafter.layer_inputs(hidden, ids, positions[None], rotary)
        q, k, v = self.products.project(x, cos, sin)  # (1, h, T, hd)
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        mask = slots[None, None, None, :] <= positions[None, None, :, None]  # (1, 1, T, slots)
        return self.products.layer_output(hidden, self.drafter.midlayer.self_attn.attend(q, [(keys, values, mask)]))

    def _extend(self, aux, ids, start, last_row, offsets, *cache):
        """A round's extend: the target's aux states (1, T, 3H) of positions start + offsets, each with the token after
        it (ids (1, T)), rows past `last_row` (1,) padding. Returns (the last real row's output (1, 1, H), its position (1,))."""
        out = self._forward(self.drafter.project_aux(aux.to(self.dtype)), ids, start + offsets, *cache)
        return out.index_select(1, last_row), start + last_row

    def _draft_step(self, out, token, last, offset, *cache):
        """A chain's next draft: the layer on its own output out (1, 1, H) and the previous draft token (1, 1) at
        position last + offset (1,). Returns (its output, its draft token (1, 1))."""
        out = self._forward(out, token, last + offset, *cache)
        return out, self._token(out)

    def _token(self, out):
        return self.drafter.draft_ids_to_target(self.drafter.head(out).argmax(-1))

    def _top(self, out, k: int):
        """(log-probabilities, draft ids) of the k likeliest draft tokens after each row of out (1, T, H): (T, k) each."""
        return top_k(torch.log_softmax(self.drafter.head(out)[0].float(), dim=-1), k)

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


class MergedProducts:
    """The drafter layer's q, k and v weights as one matrix, and gate and up as another: one matrix product each where
    there were three and two. At batch 1 each product is a kernel of a few microseconds whatever its width, and a tree
    round runs the layer S + 1 times (benchmarks/decode_floor.py --profile-round). SGLang's and vLLM's Llama layers merge the same
    weights. The values are the separate products' (each output column is the same dot product); the kernels may
    sum in another order, so they can differ in the last bit."""

    def __init__(self, drafter: Eagle3Drafter):
        attention, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
        self.drafter, self.attention, self.down_proj = drafter, attention, mlp.down_proj
        with torch.no_grad():  # inference only: copies of the weights, made once
            projections = (attention.q_proj, attention.k_proj, attention.v_proj)
            self.qkv = torch.cat([p.weight for p in projections]).detach()
            self.qkv_widths = [p.weight.shape[0] for p in projections]
            self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()

    def project(self, x, cos, sin):
        """DraftAttention.project: q (B, h, T, hd); k, v with kv heads repeated."""
        q, k, v = F.linear(x, self.qkv).split(self.qkv_widths, dim=-1)
        return self.attention.rotary_heads(q, k, v, cos, sin)

    def mlp(self, x):
        """DraftMLP.forward."""
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def layer_output(self, hidden, attended):
        """Eagle3Drafter.layer_output with the merged MLP."""
        return self.drafter.layer_output(hidden, attended, mlp=self.mlp)


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
        self.step_offsets = [torch.full((1,), j, device=device) for j in range(1, k)]  # one tensor each: one compile for every j
        self._fused = compiled_pieces(self, ("_accept",), eagle.target.compile_mode) if eagle.target.compile else {}
        target = eagle.target
        step = target.step_function(self._round)
        self.replays = {}
        for span in spans_up_to(eagle.capacity):
            target.token.zero_()
            target.position.zero_()
            self.replays[span] = Replay(functools.partial(step, span), target.use_graphs, target.capture_failures)

    def _round(self, span: int) -> None:
        """Extend, draft k, verify, accept: every input and output is a static buffer; the target attends over `span` slots."""
        eagle, target, k = self.eagle, self.eagle.target, self.k
        # Extend: the target's features of the newly accepted positions (padding rows write slots the chain overwrites).
        out, last = eagle.piece("_extend", self.ext_aux, self.ext_ids, self.ext_start, self.ext_last, self.offsets, *eagle.cache)
        drafts = [eagle.draft_token(out)]
        for j in range(1, k):  # chain: own output and the previous draft's embedding, at position last + j
            out, draft = eagle.piece("_draft_step", out, drafts[-1], last, self.step_offsets[j - 1], *eagle.cache)
            drafts.append(draft)
        # Verify [current, *drafts]; predicted[i] is the target's token after input i.
        ids = torch.cat([target.token, *drafts], dim=1)  # (1, k+1)
        predicted, aux = target.predict(ids, target.position + self.offsets, eagle.aux_layers, span=span)
        eagle.piece("_accept", ids, predicted, aux, owner=self)

    def _accept(self, ids, predicted, aux):
        """The longest agreeing prefix of the drafts ids[0, 1:], then the target's own token (the bonus); the next
        round's extend: features of current..current+k, the token after each (predicted), from `current`."""
        target, k = self.eagle.target, self.k
        drafts = ids[0, 1:]
        accepted = (drafts == predicted[0, :k]).long().cumprod(0).sum().view(1)  # (1,)
        self.ext_aux.copy_(aux)
        self.ext_ids.copy_(predicted)
        self.ext_start.copy_(target.position)
        self.ext_last.copy_(accepted)
        target.token.copy_(predicted.index_select(1, accepted))
        target.position.add_(accepted + 1)
        self.round_out[:1].copy_(accepted)
        self.round_out[1 : k + 2].copy_(predicted[0])
        self.round_out[k + 2 :].copy_(drafts)
