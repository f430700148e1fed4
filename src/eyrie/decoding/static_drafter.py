"""An Eagle3Drafter on its own preallocated cache beside a StaticLlama (eyrie.decoding.static), and the chain's rounds:
drafter extend, k - 1 chained drafts, the k + 1 token verify and the accept in one replay per round, the host reading
one small tensor per round. Trees are eyrie.decoding.static_tree's."""

from __future__ import annotations

import functools
import time

import torch

from eyrie.decoding.common import SpecResult, emit, finished
from eyrie.decoding.graphs import Replay
from eyrie.decoding.static_common import STATIC_ROPE_TYPES, UnsupportedTargetError, compiled_pieces, span_for, spans_up_to
from eyrie.drafter.model import Eagle3Drafter
from eyrie.target.aux_layers import capture_indices


class StaticEagle3:
    """An Eagle3Drafter on its own preallocated cache, with the target: one speculative round per replay.

    Calls the drafter's own fc, layer_inputs, project, attend, layer_output, head and d2t mapping,
    exactly as Eagle3Drafter.decode does; only the cache is a fixed buffer written by position.
    """

    def __init__(self, target, drafter: Eagle3Drafter):  # target: the StaticLlama drafted for
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
        # inside its graph cost roughly 3.7 us each on an H200 whatever they do (an estimate), so fewer kernels is
        # what pays. Only the cache writes stay eager.
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
        """Extend, draft k, verify, accept: every input and output is a static buffer; the target attends over `span` slots."""
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
