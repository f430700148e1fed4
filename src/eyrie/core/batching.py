"""One way to batch variable-length work by tokens, shared by regeneration, extraction and training."""

from __future__ import annotations


def batches_by_tokens(lengths: list[int], budget: int, *, extra: int = 0, max_size: int | None = None) -> list[list[int]]:
    """Indices grouped longest first so each batch's rows x (longest + extra) <= budget.

    Sorting by length keeps padding small and puts the largest batch first, so running out of
    memory shows at once; an item larger than the budget runs alone. Ties keep input order.
    """
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    current: list[int] = []
    for k in order:
        longest = lengths[current[0]] if current else lengths[k]
        full = (len(current) + 1) * (longest + extra) > budget or (max_size is not None and len(current) >= max_size)
        if current and full:
            batches.append(current)
            current = []
        current.append(k)
    if current:
        batches.append(current)
    return batches
