"""What the static decoder's modules share (eyrie.decoding.static, static_drafter, static_tree): the cache's capacity
and attention spans, how their pieces are compiled, and the error for a target or drafter it cannot run."""

from __future__ import annotations

import torch

from eyrie.core.errors import EyrieError

# Rope types whose frequencies do not depend on the sequence length, so one table serves every step.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
CAPACITY_STEP = 64  # cache slots are rounded up to this: fewer recaptures, aligned attention masks
SMALLEST_SPAN = 256  # attention spans are this times a power of two (or the whole cache)
# torch.compile modes a static step may be fused with (bench.compile_mode). Neither captures graphs of its own: Replay
# captures each step. "default": inductor fuses the small kernels, cuBLAS keeps the matrix products.
# AUTOTUNED: inductor also times Triton templates against cuBLAS for every matrix product's shape and fuses the winner
# with its neighbours; its tuning lands in inductor's cache (bench.compile_cache), so a later job reuses it.
AUTOTUNED = "max-autotune-no-cudagraphs"
COMPILE_MODES = ("default", AUTOTUNED)
RECOMPILE_LIMIT = 64  # compiled step widths per piece: far more than any sweep uses


def fused(function, mode: str = "default"):
    """torch.compile of `function` in `mode` (one of COMPILE_MODES), static shapes: each step width (and tree shape) is one graph."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}; use one of {', '.join(COMPILE_MODES)}")
    return torch.compile(function, dynamic=False, mode=None if mode == "default" else mode)


def compiled_pieces(owner, names, mode: str = "default") -> dict:
    """fused(...) of each method `names` of owner."""
    return {name: fused(getattr(owner, name), mode) for name in names}


class UnsupportedTargetError(EyrieError):
    """The static decoder cannot run this target; bench falls back to transformers' decode."""


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


def rotary_at(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rope tables' rows at `positions`, shaped (1, 1, T, hd) to broadcast over heads."""
    return cos.index_select(0, positions)[None, None], sin.index_select(0, positions)[None, None]


def needed_capacity(prompt_tokens: int, max_new_tokens: int, draft_tokens: int = 0) -> int:
    """Cache slots for one decode: the verify writes k + 1 slots past the current token, the drafter's padded extend and chain up to 2k past it."""
    return round_up(prompt_tokens + max_new_tokens + 2 * draft_tokens + 2)
