"""Greedy regeneration of many turns at once on a preallocated KV cache, replayed as CUDA graphs.

transformers' padded generate() of a small target is launch-bound: on an H200, SmolLM2-135M ran at
2.5-3.1K tok/s with 384 rows, about 90 ms per step for well under a millisecond of arithmetic.
This loop is static_decode's batch-1 decoder widened to many rows:

  rows     prompts are left-padded to one width W, so every row writes the same cache slot each step
           (slot W + t) and row r's rope position is slot - pad_r, as transformers' left padding gives.
  mask     a key slot is visible to a real query when pad_r <= slot <= the query's slot; a padding
           query (prefill only) sees the padding before it, so no softmax row is empty (no NaN).
  step     one graph per attention span: every row's argmax; finished rows emit padding; tokens go
           to a device buffer. The host reads "all finished?" once every CHECK_EVERY steps.
  prefill  eager, in row chunks of at most PREFILL_TOKENS tokens (its width varies per batch).

Greedy only: TransformersEngine runs sampled settings through transformers' generate().
"""

from __future__ import annotations

import functools

import torch

from eyrie.decoding.graphs import Replay, shared_pool
from eyrie.decoding.static_common import round_up, span_for, spans_up_to
from eyrie.decoding.static_llama import StaticLlama, llama_reason
from eyrie.decoding.static_modules import StaticModules

CHECK_EVERY = 16  # decode steps between host reads of "all rows finished"
PREFILL_TOKENS = 32768  # padded prompt tokens per eager prefill chunk (bounds the attention mask's memory)
ROW_STEP = 8  # row buffers are rounded up to this; smaller batches fill the rest with finished dummy rows


class BatchedRows:
    """Greedy continuations of many prompts on one static cache; same tokens as transformers' left-padded generate().

    Mixed into a static engine (StaticLlama or StaticModules): the rows, masks and loop are these, the forward the engine's.
    """

    def __init__(self, model, pad_id: int, stop_ids, rows: int = ROW_STEP, capacity: int = 512, cuda_graphs: bool | None = None,
                 row_step: int = ROW_STEP):
        # row_step 1: exactly the rows asked for (a benchmark of B requests computes B rows, not B rounded up).
        self.row_step = row_step
        self.rows, self.max_new, self.steps = round_up(rows, row_step), 0, {}
        super().__init__(model, capacity, cuda_graphs)
        # The greedy steps and every BatchedSpeculative round on this engine: all write only preallocated buffers.
        self.graph_pool = shared_pool(self.use_graphs)
        self.pad_id = int(pad_id)
        self.stop = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.long, device=self.device)
        # Row buffers and graphs come with the first generate(), sized for its budget.

    @torch.inference_mode()
    def _allocate(self, rows: int, capacity: int, max_new: int) -> None:
        """Cache and row buffers for this many rows, slots and new tokens; graphs point at old buffers, so they go."""
        self.steps = {}
        self.rows, self.max_new, self.capacity = round_up(rows, self.row_step), max_new, 0
        self.ensure_capacity(capacity)
        device = self.device
        self.next_ids = torch.zeros(self.rows, 1, dtype=torch.long, device=device)  # each row's last token
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the cache slot next_ids is written to
        self.pads = torch.zeros(self.rows, dtype=torch.long, device=device)  # left padding per row
        self.done = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.out = torch.zeros(self.rows, max_new, dtype=torch.long, device=device)  # new tokens per row
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # the column of out written next
        for span in spans_up_to(self.capacity):  # before any prefill: warm-ups write cache slots and state
            self.slot.zero_()
            self.step.zero_()
            self.steps[span] = Replay(functools.partial(self._decode_step, span), self.use_graphs, self.capture_failures, self.graph_pool)

    def reserve(self, rows: int, slots: int, max_new: int) -> None:
        """Grow the row buffers and cache to hold `rows` rows, `slots` cache slots and `max_new` new tokens (recapturing
        the greedy graphs): before a timed decode, so that none of it happens inside the timing."""
        slots = round_up(slots)
        if rows > self.rows or slots > self.capacity or max_new > self.max_new:
            self._allocate(max(rows, self.rows), max(slots, self.capacity), max(max_new, self.max_new))

    def move_row_slots(self, moved_from: torch.Tensor, moved_to: torch.Tensor) -> None:
        """Each row's K/V of slots moved_from[r] to slots moved_to[r] ((rows, S) each), in every layer: a tree's accepted
        path, row by row (all gathered before any is written). Caches are (..., rows, heads, slots, dim)."""
        for cache in (self.keys, self.values):
            for layer in [cache] if torch.is_tensor(cache) else cache:
                axis = layer.dim() - 2
                view = [1] * layer.dim()
                view[-4], view[axis] = moved_from.shape
                size = list(layer.shape)
                size[axis] = moved_from.shape[1]
                moved = layer.gather(axis, moved_from.view(view).expand(size))
                layer.scatter_(axis, moved_to.view(view).expand(size), moved)

    def _emit(self, predicted: torch.Tensor) -> None:
        """Store each row's new token (padding once finished) and feed it to the next step."""
        predicted = torch.where(self.done, self.pad_id, predicted)
        # Clamped for the capture warm-ups, which run past the budget; a real decode stays below it.
        self.out.index_copy_(1, self.step.clamp(max=self.max_new - 1), predicted[:, None])
        self.done |= (predicted[:, None] == self.stop[None]).any(-1)
        self.next_ids.copy_(predicted[:, None])
        self.step.add_(1)

    def _decode_step(self, span: int) -> None:
        keys = self.slots[None, :span]
        rope = (self.slot - self.pads).clamp(min=0)  # (R,)
        visible = ((keys <= self.slot) & (keys >= self.pads[:, None]))[:, None]  # (R, 1, span)
        distance = (self.slot - keys)[None] if self.windowed else None  # query position - key position: the pads cancel
        hidden, _ = self.run_layers(self.next_ids, self.slot, self.rope_at(rope[:, None]), self.masks_for(visible, distance), span)
        self._emit(self.model.lm_head(hidden[:, -1]).argmax(-1))
        self.slot.add_(1)

    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Argmax after each row's prompt (R,), the prompts' K/V written at slots 0..W-1."""
        width = ids.shape[1]
        span = span_for(width, self.capacity)
        slots, keys = self.slots[:width], self.slots[None, None, :span]
        distance = (slots[:, None] - keys[0])[None] if self.windowed else None  # (1, W, span)
        chunk = max(1, PREFILL_TOKENS // width)
        firsts = []
        for a in range(0, self.rows, chunk):
            rows = slice(a, min(self.rows, a + chunk))
            pads = self.pads[rows][:, None, None]  # (c, 1, 1)
            rope = (slots[None] - pads[:, 0]).clamp(min=0)  # (c, W)
            query = slots[None, :, None]  # (1, W, 1)
            visible = (keys <= query) & ((keys >= pads) | (query < pads))  # (c, W, span)
            hidden, _ = self.run_layers(ids[rows], slots, self.rope_at(rope), self.masks_for(visible, distance), span, rows)
            firsts.append(self.model.lm_head(hidden[:, -1]).argmax(-1))
        return torch.cat(firsts)

    # ---- the loop

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Up to max_new_tokens greedy tokens per prompt; a row stops after its first stop token (padding follows)."""
        count, width = len(prompts), max(len(p) for p in prompts)
        self.reserve(count, width + max_new_tokens, max_new_tokens)
        dummies = self.rows - count  # one padding token each, finished from the start
        ids = [[self.pad_id] * (width - len(p)) + list(p) for p in prompts] + [[self.pad_id] * width] * dummies
        self.pads.copy_(torch.tensor([width - len(p) for p in prompts] + [width - 1] * dummies))
        first = self._prefill(torch.tensor(ids, device=self.device))
        self.done.copy_(torch.arange(self.rows, device=self.device) >= count)
        self.out.fill_(self.pad_id)
        self.step.zero_()
        self._emit(first)
        self.slot.fill_(width)  # of the first new token, which the first step feeds
        for t in range(1, max_new_tokens):
            if t % CHECK_EVERY == 0 and bool(self.done.all()):
                break
            self.steps[span_for(width + t, self.capacity)]()  # feeds token t-1 at slot width+t-1
        produced = int(self.step)
        return self.out[:count, :produced].tolist()


class BatchedGreedy(BatchedRows, StaticLlama):
    """BatchedRows on the Llama fast path."""


class BatchedModules(BatchedRows, StaticModules):
    """BatchedRows on the target's own decoder layers (eyrie.decoding.static_modules)."""


def open_batched_greedy(model, pad_id: int, stop_ids, rows: int = ROW_STEP, capacity: int = 512, cuda_graphs: bool | None = None,
                        row_step: int = ROW_STEP) -> BatchedRows:
    """The batched greedy loop on the fastest static engine for `model` (eyrie.decoding.static.open_engine's choice)."""
    engine = BatchedGreedy if llama_reason(model) is None else BatchedModules
    return engine(model, pad_id, stop_ids, rows=rows, capacity=capacity, cuda_graphs=cuda_graphs, row_step=row_step)
