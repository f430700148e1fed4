"""torch.topk over the last dimension of a few long rows: by ranking chunk maxima on a GPU, in two stages of short
rows elsewhere.

A tree round takes the top K of the draft vocabulary for each of its K frontier nodes: ~10 rows of 32,000. For so
few, so long rows PyTorch's CUDA topk switches to its multi-block radix select, ~17 kernels per call (three per 8-bit
digit of a float32, four digits, then scans and a gather); on an H200 that was ~37 us of a frontier step's ~130 us
(benchmarks/decode_floor.py --profile-round). Cut into chunks of at most MAX_CHUNK, the rows take the
single-block path: the top K of each chunk, then the top K of those candidates, in a handful of kernels.

The values are torch.topk's exactly (the global top K is among the chunks' top Ks); so are the indices, except
which of several equal values is taken, which torch.topk leaves unspecified too.

ranked_top_k goes further: no radix select or sort at all. Measured in the tree rounds on an H200
(benchmarks/decode_floor.py --top-k, random weights, 32,000-token draft vocabulary, bf16, one call): a (6, 10, 48) round 2.846 -> 2.742 ms
(0.964x) against the two stages, (6, 8, 32) 0.981x, (8, 10, 64) 0.955x. So top_k takes it on CUDA for a tree's few
rows; its rankings compare every pair of chunk maxima and of candidates, (rows, ~570, ~570) at a 32,000-token
vocabulary and K = 10, which grows with the rows (640 for a batch of 64 trees: ~200M comparisons a ranking), so beyond
RANKED_MAX_ROWS, and on the CPU, where it was not timed, the two stages stay.
"""

from __future__ import annotations

import torch

MAX_CHUNK = 2048  # longest chunk: PyTorch's single-block path for any row count, and enough chunks to fill the GPU
CHUNKED_FROM = 4096  # rows up to this long already take the single-block path in one call
RANKED_MAX_ROWS = 32  # ranked_top_k's quadratic rankings only for a batch-1 tree's frontier (K rows) and a few more


def chunks_for(width: int, k: int, max_chunk: int = MAX_CHUNK) -> int:
    """How many equal chunks a row of `width` is cut into: 1 (one topk call) for short rows, or when no divisor of
    width gives chunks of k to max_chunk values."""
    if width <= CHUNKED_FROM:
        return 1
    return next((count for count in range(2, width // k + 1) if width % count == 0 and width // count <= max_chunk), 1)


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest of each row of `values` (rows, width), largest first, as torch.topk: the
    ranked way on CUDA for up to RANKED_MAX_ROWS rows, the two stages elsewhere (the module's docstring says why)."""
    return ranked_top_k(values, k) if values.is_cuda and values.shape[0] <= RANKED_MAX_ROWS else two_stage_top_k(values, k)


def two_stage_top_k(values: torch.Tensor, k: int, max_chunk: int = MAX_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k as the top k of each chunk, then the top k of those candidates.
    max_chunk: the longest chunk (chunks of 1,000 and 4,000 timed no better: benchmarks/README.md)."""
    rows, width = values.shape
    chunks = chunks_for(width, k, max_chunk)
    if chunks == 1:
        return values.topk(k, dim=-1)
    size = width // chunks
    chunk_values, chunk_ids = values.view(rows, chunks, size).topk(k, dim=-1, sorted=False)  # (rows, chunks, k)
    starts = torch.arange(0, width, size, device=values.device)[None, :, None]
    candidates = (chunk_ids + starts).view(rows, chunks * k)
    best_values, best = chunk_values.view(rows, chunks * k).topk(k, dim=-1)
    return best_values, candidates.gather(1, best)


def ranked_top_k(values: torch.Tensor, k: int, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k without any radix select or sort: only reductions and gathers, which inductor fuses into a few kernels.

    The k largest values of a row lie in the k chunks with the largest maxima (each of those k maxima is at least
    the k-th largest chunk maximum, so the row's k-th largest value is too, and no other chunk holds a larger one).
    So: chunk maxima, each ranked by counting the maxima before it; the k best chunks gathered; their values ranked
    the same way. Ties go to the smaller index, so the result is deterministic. chunk: the chunks' length (a divisor of
    the width; any gives the same result), else chunk_size_for_ranking's. Falls back to the two stages
    where the row has no suitable chunk size.
    """
    rows, width = values.shape
    chunk = chunk or chunk_size_for_ranking(width, k)
    if chunk is None:
        return two_stage_top_k(values, k)
    chunks = width // chunk
    parts = values.view(rows, chunks, chunk)
    chunk_ids = torch.arange(chunks, device=values.device).expand(rows, chunks)
    chosen = _by_rank(_ranks(parts.amax(-1), chunk_ids), chunk_ids, k)  # (rows, k): the best chunks, best first
    candidates = parts.gather(1, chosen[..., None].expand(rows, k, chunk)).reshape(rows, k * chunk)
    candidate_ids = (chosen[..., None] * chunk + torch.arange(chunk, device=values.device)).reshape(rows, k * chunk)
    ranks = _ranks(candidates, candidate_ids)
    return _by_rank(ranks, candidates, k), _by_rank(ranks, candidate_ids, k)


def chunk_size_for_ranking(width: int, k: int) -> int | None:
    """The divisor of width nearest sqrt(width / k), which balances the two rankings' work (chunks^2 and (k * chunk)^2
    comparisons per row); None when no divisor lies within a factor of two of it."""
    ideal = (width / k) ** 0.5
    sizes = [size for size in range(max(1, int(ideal / 2)), int(ideal * 2) + 1) if width % size == 0 and width // size >= k]
    return min(sizes, key=lambda size: abs(size - ideal)) if sizes else None


def _ranks(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each column's rank in its row (rows, n): how many columns have a larger key, or an equal key and a smaller id."""
    above = keys[:, None, :] > keys[:, :, None]
    tied_before = (keys[:, None, :] == keys[:, :, None]) & (ids[:, None, :] < ids[:, :, None])
    return (above | tied_before).sum(-1)


def _by_rank(ranks: torch.Tensor, items: torch.Tensor, k: int) -> torch.Tensor:
    """The items of ranks 0..k-1 of each row, in rank order (rows, k): for each rank, the one item holding it (ranks
    are distinct), summed out of zeros. A reduction, which inductor compiles into one kernel with its neighbours,
    where a scatter into zeros was two kernels of its own (~4.6 us each on an H200, benchmarks/decode_floor.py --profile-round)."""
    hit = ranks[:, None, :] == torch.arange(k, device=ranks.device)[None, :, None]  # (rows, k, n)
    return torch.where(hit, items[:, None, :], torch.zeros((), dtype=items.dtype, device=items.device)).sum(-1)
