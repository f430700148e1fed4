"""Speculative decoding of many requests at once on a batched static engine (eyrie.decoding.batched_greedy.BatchedRows):
the EAGLE-3 chain or prompt lookup, each row accepting its own number of drafts per round.

  slots    every row writes the same k + 1 target cache slots per round (and the drafter the same 2k of its own), as
           batched greedy writes one: the cache stays one static buffer indexed by slot. A row keeps the slots of its
           current token and its accepted drafts; the rest become holes, masked for that row from then on (`valid`).
  rope     a row's positions are its own: the count of its valid slots, not the slot index (left padding and holes
           cancel), so each row sees exactly the sequence batch-1 decoding sees.
  finished rows are masked: they still ride in the batch (static shapes), emit nothing and stop counting.

Holes cost attention width: a round spans k + 1 slots whatever it accepts, so the span grows by k + 1 per round; at
the benchmark's lengths (a few hundred slots) attention is a small part of a step. Trees are not batched: EAGLE's
maintainers advise no trees above batch 1. Rounds run eagerly, one host read per round (accepted counts and tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eyrie.decoding.batched_greedy import BatchedRows
from eyrie.decoding.common import emit
from eyrie.decoding.ngram import MAX_NGRAM, MIN_NGRAM, lookup
from eyrie.decoding.static_common import round_up, span_for
from eyrie.drafter.model import Eagle3Drafter
from eyrie.target.aux_layers import capture_indices


@dataclass
class BatchedSpecResult:
    tokens: list[list[int]]  # per request: new tokens, ending with the stop token if one was produced
    seconds: float  # the whole batch, prefill included
    rounds: int  # verify rounds the batch ran (a target forward each)
    acceptance_lengths: list[list[int]]  # per request, per round it was active: tokens the round emitted for it


def needed_slots(width: int, max_new_tokens: int, draft_tokens: int) -> tuple[int, int]:
    """(target cache slots, drafter cache slots) for prompts padded to `width`: each round may emit only its bonus token,
    so up to max_new_tokens - 1 rounds of k + 1 target slots (2k drafter slots) each."""
    rounds = max(max_new_tokens - 1, 1)
    return round_up(width + rounds * (draft_tokens + 1) + 1), round_up(width + rounds * 2 * draft_tokens + 2 * draft_tokens + 1)


class ChainDrafts:
    """The EAGLE-3 chain for every row: the drafter's own modules on a (rows, heads, slots, head_dim) cache written by
    slot, as eyrie.decoding.static_drafter.ChainRounds runs them at batch 1 (extend k + 1 rows, then k - 1 steps)."""

    def __init__(self, engine: BatchedRows, drafter: Eagle3Drafter):
        self.engine, self.drafter = engine, drafter
        self.aux_layers = tuple(i - 1 for i in capture_indices(drafter.shape.aux_layer_ids, len(engine.layers)))
        self.device, self.dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.capacity = 0

    def allocate(self, capacity: int) -> None:
        rows, attention = self.engine.rows, self.drafter.midlayer.self_attn
        shape = (rows, attention.heads, capacity, attention.head_dim)  # project() repeats kv heads
        self.keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.slots = torch.arange(capacity, device=self.device)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=self.device)
        cos, sin = self.drafter.rotary(torch.zeros(1, device=self.device, dtype=self.dtype), self.slots[None])
        self.cos, self.sin = cos[0, 0].to(self.dtype), sin[0, 0].to(self.dtype)  # (capacity, hd), by position
        self.capacity = capacity

    def _forward(self, hidden, ids, positions, first_slot: int, visible):
        """The drafter layer's outputs (R, T, H) for hidden (R, T, H), the next tokens ids (R, T) at positions (R, T),
        written at slots first_slot.. (shared by every row); visible (R, T, span) over the first `span` slots."""
        span = visible.shape[-1]
        rotary = (self.cos[positions][:, None], self.sin[positions][:, None])
        x, cos, sin = self.drafter.layer_inputs(hidden, ids, positions, rotary)
        attention = self.drafter.midlayer.self_attn
        q, k, v = attention.project(x, cos, sin)
        written = self.slots[first_slot : first_slot + ids.shape[1]]
        self.keys.index_copy_(2, written, k)
        self.values.index_copy_(2, written, v)
        attended = attention.attend(q, [(self.keys[:, :, :span], self.values[:, :, :span], visible[:, None])])
        return self.drafter.layer_output(hidden, attended)

    def _visible(self, first_slot: int, count: int, span: int):
        """(R, count, span): each row's valid slots, and query i the new slots first_slot..first_slot + i."""
        keys = self.slots[:span]
        new = (keys[None] >= first_slot) & (keys[None] <= first_slot + torch.arange(count, device=self.device)[:, None])
        return self.valid[:, None, :span] | new[None]

    def start(self, ids, pads, aux, first) -> None:
        """After the target's prefill of left-padded ids (R, W) with aux (R, W, 3H): the drafter's prefill over slots
        0..W-2, and the first round's extend (the last prompt position with the first new token)."""
        width = ids.shape[1]
        self.valid.zero_()
        self.slot = width - 1
        if width > 1:
            slots, keys = self.slots[: width - 1], self.slots[: width - 1]
            query = slots[None, :, None]
            pad = pads[:, None, None]
            visible = (keys[None, None] <= query) & ((keys[None, None] >= pad) | (query < pad))
            positions = (slots[None] - pads[:, None]).clamp(min=0)
            self._forward(self.drafter.project_aux(aux[:, :-1].to(self.dtype)), ids[:, 1:], positions, 0, visible)
            self.valid[:, : width - 1] = slots[None] >= pads[:, None]
        self.ext_aux, self.ext_ids = aux[:, -1:], first[:, None]
        self.ext_start = width - 1 - pads  # logical position of the last prompt token
        self.ext_last = torch.zeros_like(pads)

    def draft(self, k: int, sequences) -> torch.Tensor:
        """(R, k) drafts: extend with the last round's accepted positions (padding rows past ext_last), then chain."""
        count = self.ext_ids.shape[1]
        offsets = torch.arange(count, device=self.device)
        span = span_for(self.slot + 2 * k, self.capacity)
        visible = self._visible(self.slot, count, span)
        out = self._forward(self.drafter.project_aux(self.ext_aux.to(self.dtype)), self.ext_ids, self.ext_start[:, None] + offsets, self.slot, visible)
        self.valid[:, self.slot : self.slot + count] = offsets[None] <= self.ext_last[:, None]
        self.slot += count
        out = out.gather(1, self.ext_last[:, None, None].expand(-1, 1, out.shape[-1]))  # (R, 1, H): the last real row's
        last = self.ext_start + self.ext_last
        drafts = [self._token(out)]
        chain = self.slot
        for j in range(1, k):  # each step sees the chain's earlier steps (slots chain..), not kept after the round
            visible = self._visible(chain, j, span)[:, -1:]
            out = self._forward(out, drafts[-1], (last + j)[:, None], chain + j - 1, visible)
            drafts.append(self._token(out))
        self.slot += k - 1
        return torch.cat(drafts, dim=1)

    def _token(self, out):
        return self.drafter.draft_ids_to_target(self.drafter.head(out).argmax(-1))  # (R, 1)

    def accepted(self, aux, predicted, start, accepted) -> None:
        """The next round's extend: the verify's features of current..current+k, the token after each, from `start`."""
        self.ext_aux, self.ext_ids, self.ext_start, self.ext_last = aux, predicted, start, accepted


class NgramDrafts:
    """Prompt lookup per row over that row's own sequence (eyrie.decoding.ngram.lookup), on the host."""

    aux_layers = ()

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.capacity = 0

    def allocate(self, capacity: int) -> None:
        self.capacity = capacity

    def start(self, ids, pads, aux, first) -> None:
        self.device = ids.device

    def draft(self, k: int, sequences) -> torch.Tensor:
        rows = []
        for sequence in sequences:  # as NgramSession: the tokens after positions 0.. (the first token is never looked up)
            proposed = lookup(sequence[1:], k, self.max_ngram, self.min_ngram) if len(sequence) > 1 else None
            rows.append(proposed if proposed is not None else [sequence[-1]] * k)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def accepted(self, aux, predicted, start, accepted) -> None:
        pass


class BatchedSpeculative:
    """Speculative decoding of many prompts at once on `engine` (a BatchedRows: its cache, rows and forward), drafted by
    an Eagle3Drafter (the chain) or, with drafter "ngram", by prompt lookup. Each row's tokens equal its greedy decode."""

    def __init__(self, engine: BatchedRows, drafter):
        self.engine = engine
        self.drafts = NgramDrafts() if drafter == "ngram" else ChainDrafts(engine, drafter)
        self.windowed = engine.windowed

    def _prepare(self, count: int, width: int, max_new_tokens: int, k: int) -> None:
        engine = self.engine
        target_slots, drafter_slots = needed_slots(width, max_new_tokens, k)
        if count > engine.rows or target_slots > engine.capacity:
            # BatchedRows' own allocation: its greedy graphs are rebuilt on the new buffers too
            engine._allocate(max(count, engine.rows), max(target_slots, engine.capacity), max(max_new_tokens, engine.max_new))
        if drafter_slots > self.drafts.capacity or getattr(self.drafts, "keys", None) is not None and self.drafts.keys.shape[0] != engine.rows:
            self.drafts.allocate(max(drafter_slots, self.drafts.capacity))
        device = engine.device
        self.valid = torch.zeros(engine.rows, engine.capacity, dtype=torch.bool, device=device)  # slots each row keeps
        self.key_positions = torch.zeros(engine.rows, engine.capacity, dtype=torch.long, device=device)  # for windows

    def _run(self, ids, first_slot: int, positions, visible, aux_layers):
        """(predicted (R, T), aux or None): the target over ids (R, T) written at slots first_slot.. at positions (R, T)."""
        engine = self.engine
        span = visible.shape[-1]
        slots = engine.slots[first_slot : first_slot + ids.shape[1]]
        self.key_positions[:, first_slot : first_slot + ids.shape[1]] = positions
        distance = positions[:, :, None] - self.key_positions[:, None, :span] if self.windowed else None
        x, aux = engine.run_layers(ids, slots, engine.rope_at(positions), engine.masks_for(visible, distance), span, aux_layers=aux_layers, normed=False)
        return engine.head(x), aux

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids, draft_tokens: int) -> BatchedSpecResult:
        """Up to max_new_tokens tokens per prompt, k = draft_tokens drafts per row per round."""
        start_time = time.perf_counter()
        engine, k, stop_ids = self.engine, draft_tokens, set(stop_ids)
        count, width = len(prompts), max(len(p) for p in prompts)
        self._prepare(count, width, max_new_tokens, k)
        device, rows = engine.device, engine.rows
        dummies = rows - count  # one padding token each, finished from the start
        pad_id = engine.pad_id
        padded = [[pad_id] * (width - len(p)) + list(p) for p in prompts] + [[pad_id] * width] * dummies
        ids = torch.tensor(padded, device=device)
        pads = torch.tensor([width - len(p) for p in prompts] + [width - 1] * dummies, device=device)

        # Prefill: left-padded as BatchedRows does; a padding query sees the padding before it (no empty softmax row).
        slots = engine.slots[:width]
        span = span_for(width, engine.capacity)
        keys, query, pad = engine.slots[None, None, :span], slots[None, :, None], pads[:, None, None]
        visible = (keys <= query) & ((keys >= pad) | (query < pad))
        positions = (slots[None] - pads[:, None]).clamp(min=0)
        predicted, aux = self._run(ids, 0, positions, visible, self.drafts.aux_layers)
        first = predicted[:, -1]
        self.valid[:, :width] = slots[None] >= pads[:, None]
        self.drafts.start(ids, pads, aux, first)

        current, position, slot = first[:, None], width - pads, width  # each row's next input, its position, the next slot
        tokens = [[t] for t in first[:count].tolist()]
        active = [not (row[-1] in stop_ids or max_new_tokens <= 1) for row in tokens]
        lengths: list[list[int]] = [[] for _ in range(count)]
        offsets = torch.arange(k + 1, device=device)
        rounds = 0
        while any(active):
            sequences = [list(prompts[r]) + tokens[r] if r < count else [pad_id] for r in range(rows)]
            drafts = self.drafts.draft(k, sequences)  # (R, k)
            verify = torch.cat([current, drafts], dim=1)
            positions = position[:, None] + offsets
            span = span_for(slot + k + 1, engine.capacity)
            keys = engine.slots[:span]
            new = (keys[None] >= slot) & (keys[None] <= slot + offsets[:, None])  # query i sees new slots slot..slot+i
            predicted, aux = self._run(verify, slot, positions, self.valid[:, None, :span] | new[None], self.drafts.aux_layers)
            accepted = (drafts == predicted[:, :k]).long().cumprod(1).sum(1)  # (R,)
            self.valid[:, slot : slot + k + 1] = offsets[None] <= accepted[:, None]
            self.drafts.accepted(aux, predicted, position, accepted)
            current = predicted.gather(1, accepted[:, None])
            position = position + accepted + 1
            slot += k + 1
            rounds += 1
            read = torch.cat([accepted[:count, None], predicted[:count]], dim=1).tolist()  # the round's one host read
            for r, (a, *row) in enumerate(read):
                if not active[r]:
                    continue
                emitted = emit(tokens[r], row[: a + 1], max_new_tokens, stop_ids)
                tokens[r] += emitted
                lengths[r].append(len(emitted))
                active[r] = not (tokens[r][-1] in stop_ids or len(tokens[r]) >= max_new_tokens)
        return BatchedSpecResult(tokens, time.perf_counter() - start_time, rounds, lengths)


def trimmed(row: list[int], stop_ids) -> list[int]:
    """A BatchedRows.generate row up to its first stop token (the padding after it dropped)."""
    for i, token in enumerate(row):
        if token in stop_ids:
            return row[: i + 1]
    return row
