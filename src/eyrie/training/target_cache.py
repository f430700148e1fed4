"""The target's view of each training batch, kept across epochs while it fits a byte budget.

objective.target_distribution turns a batch's cached final states into the target's distribution over the draft
vocabulary, its row map and its argmax: a product with the target's whole head (V x H) at every needed position.
It depends on the batch's states only, never on the drafter, so a batch seen again in a later epoch can reuse it.
What it costs and what keeping it costs decide where it pays: on the CPU default (851 draft ids, 20 epochs of ten
small batches) the head product is ~14% of a step and a batch's view is ~3 MB; at the H200 config's shape (27K draft
ids, 16K-token batches) it is ~4% of a step's FLOPs and a batch's view is ~1.8 GB, over any sensible budget, so
nothing is kept there and every step computes it as before.
"""

from __future__ import annotations

import torch

BUDGET_BYTES = 256 << 20  # per process; a batch that would take the cache past it is computed and not kept


class TargetCache:
    """Batch key -> the tuple target_distribution returned for it, kept while the kept tuples fit `budget` bytes."""

    def __init__(self, budget: int | None = None):
        self.budget, self.used = BUDGET_BYTES if budget is None else budget, 0
        self.entries: dict[object, tuple[torch.Tensor, ...]] = {}

    def get(self, key) -> tuple[torch.Tensor, ...] | None:
        return self.entries.get(key)

    def keep(self, key, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """value, kept under key if it fits what is left of the budget."""
        size = sum(t.numel() * t.element_size() for t in value)
        if self.used + size <= self.budget:
            self.entries[key] = value
            self.used += size
        return value
