"""Top-K of a few rows of the draft vocabulary, several ways, side by side on one GPU (each inside a CUDA graph).

    python benchmarks/topk_variants.py            # on a GPU; --rows 10 1 --width 32000 --k 10 by default

A tree round's frontier step takes the top K of K rows of ~32,000 log-probabilities (eyrie.decoding.topk). Prints
microseconds per call and the ratio to torch.topk for: torch.topk; two stages of topk over chunks (eyrie's
two_stage_top_k, its top_k off CUDA); two stages whose first sorts each chunk (PyTorch's in-block bitonic sort for
chunks up to 4,096). eyrie's ranked_top_k (no radix select, no sort: reductions and gathers; its top_k on CUDA) runs
compiled, as the tree's pieces run it, at its own chunk length and at others, and eagerly; sorted_top_k (rounds of
sorts of at most 512) compiled. Every variant's values are checked against torch.topk's.
"""

from __future__ import annotations

import argparse
import functools

import torch

from eyrie.decoding.topk import ranked_top_k, sorted_top_k, two_stage_top_k


def sorted_first(values, k, size):
    """Two stages as eyrie's two_stage_top_k, the first sorting each chunk of `size` (PyTorch's in-block bitonic sort)
    in place of its top-K."""
    rows, width = values.shape
    chunks = width // size
    part_values, part_ids = values.view(rows, chunks, size).sort(dim=-1, descending=True)
    part_values, part_ids = part_values[..., :k], part_ids[..., :k]
    starts = torch.arange(0, width, size, device=values.device)[None, :, None]
    best_values, best = part_values.reshape(rows, chunks * k).topk(k, dim=-1)
    return best_values, (part_ids + starts).reshape(rows, chunks * k).gather(1, best)


def time_call(fn, calls: int = 50, repeats: int = 5) -> float:
    """Microseconds per call: `calls` calls captured in one CUDA graph, median of `repeats` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1000 * start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[10, 1])
    parser.add_argument("--width", type=int, default=32000)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    variants = {"torch.topk": lambda x, k: x.topk(k, dim=-1), "two stages, chunks of 2,000": two_stage_top_k,
                "ranked_top_k, compiled": torch.compile(ranked_top_k, dynamic=False), "ranked_top_k, eager": ranked_top_k,
                "sorted_top_k, compiled": torch.compile(sorted_top_k, dynamic=False)}
    for size in (1000, 2000, 4000):
        if args.width % size == 0:
            variants[f"topk chunks of {size}"] = lambda x, k, size=size: two_stage_top_k(x, k, max_chunk=size)
            variants[f"sort chunks of {size}"] = lambda x, k, size=size: sorted_first(x, k, size)
    for size in (32, 64, 100, 160, 250):  # the ranked way's chunk length (its default at 32,000 and k 10: 50)
        if args.width % size == 0:
            variants[f"ranked, chunks of {size}"] = torch.compile(functools.partial(ranked_top_k, chunk=size), dynamic=False)
    for rows in args.rows:
        values = torch.log_softmax(torch.randn(rows, args.width, device="cuda"), dim=-1)
        expected = values.topk(args.k, dim=-1).values
        print(f"\n{rows} rows of {args.width}, k {args.k}: us per call (x torch.topk)")
        base = None
        for name, fn in variants.items():
            got_values, got_ids = fn(values, args.k)
            assert torch.equal(got_values, expected) and torch.equal(values.gather(1, got_ids), expected), name
            us = time_call(lambda fn=fn: fn(values, args.k))
            base = base or us
            print(f"  {name:30} {us:8.2f}  x{us / base:.2f}")


if __name__ == "__main__":
    main()
