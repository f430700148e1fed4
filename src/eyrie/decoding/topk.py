"""torch.topk over the last dimension of a few long rows, in two stages of short ones.

A tree round takes the top K of the draft vocabulary for each of its K frontier nodes: ~10 rows of 32,000. For so
few, so long rows PyTorch's CUDA topk switches to its multi-block radix select, ~17 kernels per call (three per 8-bit
digit of a float32, four digits, then scans and a gather); on an H200 that was ~37 us of a frontier step's ~130 us
(benchmarks/round_profile.py, twelfth session's engine). Cut into chunks of at most MAX_CHUNK, the rows take the
single-block path: the top K of each chunk, then the top K of those candidates, in a handful of kernels.

The values are torch.topk's exactly (the global top K is among the chunks' top Ks); so are the indices, except
which of several equal values is taken, which torch.topk leaves unspecified too.
"""

from __future__ import annotations

import torch

MAX_CHUNK = 2048  # longest chunk: PyTorch's single-block path for any row count, and enough chunks to fill the GPU
CHUNKED_FROM = 4096  # rows up to this long already take the single-block path in one call


def chunks_for(width: int, k: int) -> int:
    """How many equal chunks a row of `width` is cut into: 1 (one topk call) for short rows, or when no divisor of
    width gives chunks of k to MAX_CHUNK values."""
    if width <= CHUNKED_FROM:
        return 1
    return next((count for count in range(2, width // k + 1) if width % count == 0 and width // count <= MAX_CHUNK), 1)


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row of `values` (rows, width), largest first, as torch.topk."""
    rows, width = values.shape
    chunks = chunks_for(width, k)
    if chunks == 1:
        return values.topk(k, dim=-1)
    size = width // chunks
    chunk_values, chunk_ids = values.view(rows, chunks, size).topk(k, dim=-1, sorted=False)  # (rows, chunks, k)
    starts = torch.arange(0, width, size, device=values.device)[None, :, None]
    candidates = (chunk_ids + starts).view(rows, chunks * k)
    best_values, best = chunk_values.view(rows, chunks * k).topk(k, dim=-1)
    return best_values, candidates.gather(1, best)
