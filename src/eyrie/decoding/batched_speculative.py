"""Speculative decoding of many requests at once on a batched static engine (eyrie.decoding.batched_greedy.BatchedRows):
the EAGLE-3 chain or prompt lookup, each row accepting its own number of drafts per round.

  slots    every row writes the same k + 1 target cache slots per round (and the drafter the same 2k of its own), as
           batched greedy writes one: the cache stays one static buffer indexed by slot. A row keeps the slots of its
           current token and its accepted drafts; the rest become holes, masked for that row from then on (`valid`).
  rope     a row's positions are its own: the count of its valid slots, not the slot index (left padding and holes
           cancel), so each row sees exactly the sequence batch-1 decoding sees.
  rounds   every round has the same shapes (the first round's drafter extend is padded to k + 1 like the others), and
           its state lives in device buffers (slots, positions, the drafter's extend inputs), so a round is one CUDA
           graph per pair of attention spans, captured before the prefill (`prepare`, untimed) as batched greedy
           captures its steps; on a CPU the same function runs eagerly. One host read per round: accepted counts and
           tokens. Prompt lookup drafts on the host; its drafts enter the graph through a buffer.
  finished rows are masked: they still ride in the batch (static shapes, as in batched greedy), emit nothing and stop
           counting.

Holes cost attention width: a round moves the caches on by S + 1 slots whatever it accepts (a tree's kept path is
moved to the front of its slots), so the span grows by S + 1 per round; at
the benchmark's lengths (a few hundred slots) attention is a small part of a step. Every drafting is a Proposal: a
tree over the verify's rows (a chain is one branch), verified and accepted the same way; trees of SGLang's (S, K, N)
are drafted by eyrie.decoding.batched_tree.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from eyrie.decoding.batched_greedy import BatchedRows
from eyrie.decoding.common import emit
from eyrie.decoding.graphs import Replay
from eyrie.decoding.ngram import MAX_NGRAM, MIN_NGRAM, lookup
from eyrie.decoding.static_common import round_up, span_for
from eyrie.drafter.model import Eagle3Drafter
from eyrie.target.aux_layers import capture_indices


@dataclass
class BatchedSpecResult:
    tokens: list[list[int]]  # per request: new tokens, ending with the stop token if one was produced
    seconds: float  # the whole batch, prefill included (graph capture excluded: prepare() runs before the clock)
    rounds: int  # verify rounds the batch ran (a target forward each)
    acceptance_lengths: list[list[int]]  # per request, per round it was active: tokens the round emitted for it


def needed_slots(width: int, max_new_tokens: int, advance: int, verify_rows: int, drafter_rows: int) -> tuple[int, int]:
    """(target cache slots, drafter cache slots) for prompts padded to `width`: each round may emit only its bonus token,
    so up to max_new_tokens - 1 rounds, each moving both caches on by `advance` slots (S + 1: the longest path it can
    keep) and writing verify_rows target slots and drafter_rows drafter slots from there (a chain of k: k + 1 and 2k)."""
    rounds = max(max_new_tokens - 1, 1)
    return round_up(width + (rounds - 1) * advance + verify_rows + 1), round_up(width + (rounds - 1) * advance + drafter_rows + 1)


@dataclass
class Proposal:
    """A round's drafts for every row, as a tree over the verify's rows (row 0: the current token; a chain is a tree of
    one branch). tokens (R, T - 1): the drafted target ids after the current token; parents (R, T): each row's
    parent row (row 0 its own); depths (R, T); ancestry (R, T, T): row j is row i's ancestor or i itself; steps: the
    deepest depth."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestry: torch.Tensor
    steps: int


def chain_layout(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parents, depths, ancestry) of a chain of k drafts for `rows` rows: row i's parent is i - 1, its depth i."""
    index = torch.arange(k + 1, device=device)
    parents = (index - 1).clamp(min=0)
    ancestry = index[None, :] <= index[:, None]
    return parents.expand(rows, -1), index.expand(rows, -1), ancestry.expand(rows, -1, -1)


def _new_slots(slots: torch.Tensor, first: torch.Tensor, count: int) -> torch.Tensor:
    """(count, S): query i of a forward written at slots first..first+count-1 sees the new slots first..first+i."""
    offsets = torch.arange(count, device=slots.device)[:, None]
    return (slots[None] >= first) & (slots[None] <= first + offsets)


class ChainDrafts:
    """The EAGLE-3 chain for every row: the drafter's own modules on a (rows, heads, slots, head_dim) cache written by
    slot, as eyrie.decoding.static_drafter.ChainRounds runs them at batch 1 (extend k + 1 rows, then k - 1 steps).

    Its round state is in device buffers: `slot` (the next drafter slot), and the extend's inputs (the verify's features
    `ext_aux`, the tokens after them `ext_ids`, the first one's position `ext_start`, the last accepted `ext_last`).
    `host_slot` mirrors `slot` so the host picks the attention span without reading the device."""

    def __init__(self, engine: BatchedRows, drafter: Eagle3Drafter):
        self.engine, self.drafter = engine, drafter
        self.aux_layers = tuple(i - 1 for i in capture_indices(drafter.shape.aux_layer_ids, len(engine.layers)))
        self.device, self.dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.capacity = 0

    def allocate(self, capacity: int, k: int) -> None:
        rows, attention, device = self.engine.rows, self.drafter.midlayer.self_attn, self.device
        shape = (rows, attention.heads, capacity, attention.head_dim)  # project() repeats kv heads
        self.keys = torch.zeros(shape, device=device, dtype=self.dtype)
        self.values = torch.zeros(shape, device=device, dtype=self.dtype)
        self.slots = torch.arange(capacity, device=device)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        cos, sin = self.drafter.rotary(torch.zeros(1, device=device, dtype=self.dtype), self.slots[None])
        self.cos, self.sin = cos[0, 0].to(self.dtype), sin[0, 0].to(self.dtype)  # (capacity, hd), by position
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.ext_aux = torch.zeros(rows, k + 1, self.drafter.fc.in_features, device=device, dtype=self.engine.dtype)
        self.ext_ids = torch.zeros(rows, k + 1, dtype=torch.long, device=device)
        self.ext_start = torch.zeros(rows, dtype=torch.long, device=device)
        self.ext_last = torch.zeros(rows, dtype=torch.long, device=device)
        self.capacity, self.host_slot = capacity, 0
        self.layout = chain_layout(rows, k, device)

    def state(self) -> list[torch.Tensor]:
        """The buffers a round changes besides the cache (zeroed before a graph's capture)."""
        return [self.valid, self.slot, self.ext_aux, self.ext_ids, self.ext_start, self.ext_last]

    def _forward(self, hidden, ids, positions, written, visible):
        """The drafter layer's outputs (R, T, H) for hidden (R, T, H), the next tokens ids (R, T) at positions (R, T),
        written at cache slots `written` (T,) (shared by every row); visible (R, T, span) over the first `span` slots."""
        span = visible.shape[-1]
        rotary = (self.cos[positions][:, None], self.sin[positions][:, None])
        x, cos, sin = self.drafter.layer_inputs(hidden, ids, positions, rotary)
        attention = self.drafter.midlayer.self_attn
        q, k, v = attention.project(x, cos, sin)
        self.keys.index_copy_(2, written, k)
        self.values.index_copy_(2, written, v)
        attended = attention.attend(q, [(self.keys[:, :, :span], self.values[:, :, :span], visible[:, None])])
        return self.drafter.layer_output(hidden, attended)

    def start(self, ids, pads, aux, first) -> None:
        """After the target's prefill of left-padded ids (R, W) with aux (R, W, 3H): the drafter's prefill over slots
        0..W-2, and the first round's extend (the last prompt position with the first new token; its other k rows are
        padding, past ext_last, so that every round's extend has k + 1 rows)."""
        width = ids.shape[1]
        self.valid.zero_()
        if width > 1:
            slots = self.slots[: width - 1]
            query = slots[None, :, None]
            pad = pads[:, None, None]
            visible = (slots[None, None] <= query) & ((slots[None, None] >= pad) | (query < pad))
            positions = (slots[None] - pads[:, None]).clamp(min=0)
            self._forward(self.drafter.project_aux(aux[:, :-1].to(self.dtype)), ids[:, 1:], positions, slots, visible)
            self.valid[:, : width - 1] = slots[None] >= pads[:, None]
        self.ext_aux.zero_()
        self.ext_aux[:, 0] = aux[:, -1]
        self.ext_ids.copy_(first[:, None].expand_as(self.ext_ids))
        self.ext_start.copy_(width - 1 - pads)  # logical position of the last prompt token
        self.ext_last.zero_()
        self.slot.fill_(width - 1)
        self.host_slot = width - 1

    def steps(self, k: int) -> int:
        return k

    def rows_per_round(self, k: int) -> tuple[int, int]:
        """(target slots, drafter slots) a round writes: k + 1 verified; an extend of k + 1, then k - 1 chain steps."""
        return k + 1, 2 * k

    def span(self, k: int) -> int:
        """The attention span of the next round's drafting."""
        return span_for(self.host_slot + self.rows_per_round(k)[1], self.capacity)

    def advance(self, k: int) -> None:
        self.host_slot += self.steps(k) + 1  # past the extend; the steps' slots after it are scratch, reused next round

    def extend(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The extend with the last round's accepted positions (padding rows past ext_last) at slots slot..slot+S:
        (the last real row's output (R, 1, H), its position (R,))."""
        count = self.ext_ids.shape[1]
        offsets = torch.arange(count, device=self.device)
        written = self.slot + offsets
        visible = self.valid[:, None, :span] | _new_slots(self.slots[:span], self.slot, count)[None]
        out = self._forward(self.drafter.project_aux(self.ext_aux.to(self.dtype)), self.ext_ids, self.ext_start[:, None] + offsets, written, visible)
        self.valid.index_copy_(1, written, offsets[None] <= self.ext_last[:, None])
        out = out.gather(1, self.ext_last[:, None, None].expand(-1, 1, out.shape[-1]))  # (R, 1, H): the last real row's
        return out, self.ext_start + self.ext_last

    def draft(self, k: int, span: int) -> Proposal:
        """The chain: the extend, then k - 1 steps, each seeing the chain's earlier steps (slots after the extend, not
        kept after the round)."""
        out, last = self.extend(span)
        drafts = [self._token(out)]
        chain = self.slot + (k + 1)
        for j in range(1, k):
            visible = self.valid[:, None, :span] | _new_slots(self.slots[:span], chain, j)[None][:, -1:]
            out = self._forward(out, drafts[-1], (last + j)[:, None], chain + (j - 1), visible)
            drafts.append(self._token(out))
        self.slot.add_(k + 1)
        return Proposal(torch.cat(drafts, dim=1), *self.layout, steps=k)

    def _token(self, out):
        return self.drafter.draft_ids_to_target(self.drafter.head(out).argmax(-1))  # (R, 1)

    def accepted(self, aux, predicted, start, accepted) -> None:
        """The next round's extend: the verify's features of current..current+k, the token after each, from `start`."""
        self.ext_aux.copy_(aux)
        self.ext_ids.copy_(predicted)
        self.ext_start.copy_(start)
        self.ext_last.copy_(accepted)


class NgramDrafts:
    """Prompt lookup per row over that row's own sequence (eyrie.decoding.ngram.lookup), on the host; the round reads
    the drafts from a buffer."""

    aux_layers = ()

    def __init__(self, engine: BatchedRows, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.engine, self.max_ngram, self.min_ngram = engine, max_ngram, min_ngram
        self.capacity = 0

    def allocate(self, capacity: int, k: int) -> None:
        rows, device = self.engine.rows, self.engine.device
        self.proposed = torch.zeros(rows, k, dtype=torch.long, device=device)
        self.layout = chain_layout(rows, k, device)
        self.capacity = capacity

    def steps(self, k: int) -> int:
        return k

    def rows_per_round(self, k: int) -> tuple[int, int]:
        return k + 1, 0

    def state(self) -> list[torch.Tensor]:
        return []

    def start(self, ids, pads, aux, first) -> None:
        pass

    def span(self, k: int) -> int:
        return 0

    def advance(self, k: int) -> None:
        pass

    def propose(self, k: int, sequences) -> None:
        """Look up each row's drafts on the host and put them in the round's buffer."""
        rows = []
        for sequence in sequences:  # as NgramSession: the tokens after positions 0.. (the first token is never looked up)
            proposed = lookup(sequence[1:], k, self.max_ngram, self.min_ngram) if len(sequence) > 1 else None
            rows.append(proposed if proposed is not None else [sequence[-1]] * k)
        self.proposed.copy_(torch.tensor(rows, dtype=torch.long))

    def draft(self, k: int, span: int) -> Proposal:
        return Proposal(self.proposed, *self.layout, steps=k)

    def accepted(self, aux, predicted, start, accepted) -> None:
        pass


class BatchedSpeculative:
    """Speculative decoding of many prompts at once on `engine` (a BatchedRows: its cache, rows and forward), drafted by
    an Eagle3Drafter (the chain), "ngram" (prompt lookup) or a drafts object such as
    eyrie.decoding.batched_tree.TreeDrafts. Each row's tokens equal its greedy decode. Reuse one for repeated decodes
    of a batch shape: its round graphs stay captured while the buffers do."""

    def __init__(self, engine: BatchedRows, drafter):
        self.engine = engine
        self.ngram = isinstance(drafter, str) and drafter == "ngram"
        if self.ngram:
            self.drafts = NgramDrafts(engine)
        else:
            self.drafts = ChainDrafts(engine, drafter) if isinstance(drafter, Eagle3Drafter) else drafter
        self.windowed = engine.windowed
        self.rounds: dict[tuple[int, int], Replay] = {}  # by (target span, drafter span)
        self.made_for = None  # the buffers the graphs point at

    @torch.inference_mode()
    def prepare(self, count: int, width: int, max_new_tokens: int, k: int) -> None:
        """Buffers for `count` prompts padded to `width`, and a round graph for each pair of spans the decode will
        reach: call before timing a decode (generate calls it too, and finds it done)."""
        engine = self.engine
        target_slots, drafter_slots = self.needed_slots(width, max_new_tokens, k)
        engine.reserve(count, target_slots, max_new_tokens)
        capacity = max(drafter_slots, self.drafts.capacity)
        key = (id(engine.keys), engine.rows, engine.capacity, capacity, k)
        if key != self.made_for:
            device = engine.device
            self.drafts.allocate(capacity, k)
            self.valid = torch.zeros(engine.rows, engine.capacity, dtype=torch.bool, device=device)  # slots each row keeps
            self.key_positions = torch.zeros(engine.rows, engine.capacity, dtype=torch.long, device=device)  # for windows
            self.current = torch.zeros(engine.rows, 1, dtype=torch.long, device=device)  # each row's next input
            self.position = torch.zeros(engine.rows, dtype=torch.long, device=device)  # its position
            self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the target slot the next round writes first
            steps = self.drafts.steps(k)
            self.read = torch.zeros(engine.rows, steps + 2, dtype=torch.long, device=device)  # accepted count, the path's tokens and the bonus
            self.depth_range = torch.arange(1, steps + 1, device=device)
            self.rounds, self.made_for = {}, key
        self._capture(self._spans(width, max_new_tokens, k), k)

    def needed_slots(self, width: int, max_new_tokens: int, k: int) -> tuple[int, int]:
        """(target cache slots, drafter cache slots) a decode of prompts padded to `width` may use (needed_slots)."""
        return needed_slots(width, max_new_tokens, self.drafts.steps(k) + 1, *self.drafts.rows_per_round(k))

    def _spans(self, width: int, max_new_tokens: int, k: int) -> list[tuple[int, int]]:
        """The (target span, drafter span) of every round a decode may run (each may emit only its bonus token)."""
        verify_rows, drafter_rows = self.drafts.rows_per_round(k)
        advance = self.drafts.steps(k) + 1
        pairs, drafter_slot = [], width - 1
        for r in range(max(max_new_tokens - 1, 1)):
            drafter_span = 0 if self.ngram else span_for(drafter_slot + drafter_rows, self.drafts.capacity)
            pairs.append((span_for(width + r * advance + verify_rows, self.engine.capacity), drafter_span))
            drafter_slot += advance
        return list(dict.fromkeys(pairs))

    def _capture(self, pairs, k: int) -> None:
        """A Replay per new pair. Its warm-up runs write the round state and cache slots from slot 0 (far inside the
        cache); generate's prefill then sets every piece of state afresh, and the slots written are rewritten by the
        prefill and the rounds before any row reads them."""
        state = [self.valid, self.key_positions, self.current, self.position, self.slot, self.read] + self.drafts.state()
        for pair in pairs:
            if pair not in self.rounds:
                for t in state:
                    t.zero_()
                self.rounds[pair] = Replay(functools.partial(self._round, k, *pair), self.engine.use_graphs, self.engine.capture_failures,
                                          self.engine.graph_pool)

    def _run(self, ids, slots, positions, visible, aux_layers):
        """(predicted (R, T), aux or None): the target over ids (R, T) written at cache slots `slots` (T,) at positions (R, T)."""
        engine = self.engine
        span = visible.shape[-1]
        self.key_positions.index_copy_(1, slots, positions)
        distance = positions[:, :, None] - self.key_positions[:, None, :span] if self.windowed else None
        x, aux = engine.run_layers(ids, slots, engine.rope_at(positions), engine.masks_for(visible, distance), span, aux_layers=aux_layers, normed=False)
        return engine.head(x), aux

    def _round(self, k: int, span: int, drafter_span: int) -> None:
        """One round on the buffers: draft, verify the proposal's rows (row r at slot + r, position + its depth, seeing
        the row's kept slots and its ancestors), keep the deepest path the target agrees with (a tree's path moved to
        slots slot + 1.. row by row, so each round moves the cache on by S + 1 slots however wide the tree), and the
        next round's inputs."""
        proposal = self.drafts.draft(k, drafter_span)
        ids = torch.cat([self.current, proposal.tokens], dim=1)  # (R, T)
        rows, count = ids.shape
        offsets = torch.arange(count, device=ids.device)
        slots = self.slot + offsets
        relative = self.engine.slots[:span] - self.slot  # (span,): which verify row a key slot holds, if any
        in_round = (relative >= 0) & (relative < count)
        ancestors = proposal.ancestry.gather(2, relative.clamp(0, count - 1)[None, None].expand(rows, count, -1)) & in_round
        predicted, aux = self._run(ids, slots, self.position[:, None] + proposal.depths, self.valid[:, None, :span] | ancestors,
                                   self.drafts.aux_layers)
        # Accept: the deepest row whose whole path the target agrees with (the first of them), then the bonus.
        root = offsets[None] == 0
        agreed = root.expand(rows, -1)
        for _ in range(proposal.steps):
            agreed = ((ids == predicted.gather(1, proposal.parents)) & agreed.gather(1, proposal.parents)) | root
        best = (proposal.depths * agreed).argmax(1, keepdim=True)  # (R, 1)
        accepted = proposal.depths.gather(1, best)[:, 0]
        on_path = proposal.ancestry.gather(1, best[:, :, None].expand(-1, 1, count))[:, 0]  # (R, T)
        by_depth = (on_path[:, None] & (proposal.depths[:, None] == self.depth_range[None, :, None])).long().argmax(2)
        path = torch.cat([torch.zeros_like(best), by_depth], dim=1)  # (R, S + 1): the path's rows by depth (past accepted: row 0)
        new = predicted.gather(1, path)  # the path's own tokens after the current one, then the bonus
        if count > proposal.steps + 1:  # a tree: its path's K/V to slots slot + 1.. (past `accepted`: holes, masked)
            self.engine.move_row_slots(self.slot + path[:, 1:], (self.slot + self.depth_range).expand(rows, -1))
        kept = offsets[None] <= accepted[:, None]  # the current token and the path, at slots slot..slot + accepted
        self.valid.index_copy_(1, slots, kept)
        self.key_positions.index_copy_(1, slots, self.position[:, None] + offsets)
        path_aux = None if aux is None else aux.gather(1, path[:, :, None].expand(-1, -1, aux.shape[-1]))
        self.drafts.accepted(path_aux, new, self.position, accepted)
        self.current.copy_(new.gather(1, accepted[:, None]))
        self.position.add_(accepted + 1)
        self.slot.add_(proposal.steps + 1)
        self.read[:, 0] = accepted
        self.read[:, 1:] = new

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids, draft_tokens: int) -> BatchedSpecResult:
        """Up to max_new_tokens tokens per prompt, k = draft_tokens drafts per row per round (a chain or prompt lookup;
        a tree's drafts object has its own shape)."""
        engine, k, stop_ids = self.engine, draft_tokens, set(stop_ids)
        count, width = len(prompts), max(len(p) for p in prompts)
        self.prepare(count, width, max_new_tokens, k)
        start_time = time.perf_counter()
        device, rows = engine.device, engine.rows
        dummies = rows - count  # one padding token each, finished from the start
        pad_id = engine.pad_id
        padded = [[pad_id] * (width - len(p)) + list(p) for p in prompts] + [[pad_id] * width] * dummies
        ids = torch.tensor(padded, device=device)
        pads = torch.tensor([width - len(p) for p in prompts] + [width - 1] * dummies, device=device)

        # Prefill, eager: left-padded as BatchedRows does; a padding query sees the padding before it (no empty softmax row).
        slots = engine.slots[:width]
        span = span_for(width, engine.capacity)
        keys, query, pad = engine.slots[None, None, :span], slots[None, :, None], pads[:, None, None]
        visible = (keys <= query) & ((keys >= pad) | (query < pad))
        positions = (slots[None] - pads[:, None]).clamp(min=0)
        self.valid.zero_()
        predicted, aux = self._run(ids, slots, positions, visible, self.drafts.aux_layers)
        first = predicted[:, -1]
        self.valid[:, :width] = slots[None] >= pads[:, None]
        self.drafts.start(ids, pads, aux, first)
        self.current.copy_(first[:, None])
        self.position.copy_(width - pads)
        self.slot.fill_(width)

        tokens = [[t] for t in first[:count].tolist()]
        active = [not (row[-1] in stop_ids or max_new_tokens <= 1) for row in tokens]
        lengths: list[list[int]] = [[] for _ in range(count)]
        verify_rows, advance = self.drafts.rows_per_round(k)[0], self.drafts.steps(k) + 1
        slot, rounds = width, 0  # the host's copy of self.slot: it picks the round's spans
        while any(active):
            if self.ngram:
                self.drafts.propose(k, [list(prompts[r]) + tokens[r] if r < count else [pad_id] for r in range(rows)])
            pair = (span_for(slot + verify_rows, engine.capacity), self.drafts.span(k))
            self.rounds[pair]()
            self.drafts.advance(k)
            slot += advance
            rounds += 1
            for r, (a, *row) in enumerate(self.read[:count].tolist()):  # the round's one host read
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
