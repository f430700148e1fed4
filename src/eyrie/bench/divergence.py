"""Where a speculative decode's output first differs from plain greedy's: None when they are identical."""

from __future__ import annotations


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
