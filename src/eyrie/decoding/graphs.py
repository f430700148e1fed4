"""fn() on static buffers replayed as one CUDA graph, or called plainly: the CPU fallback and the capture-failure path."""

from __future__ import annotations

import contextlib
import gc
import warnings

import torch

WARMUP_REPLAYS = 2  # eager runs on a side stream before capture, as torch.cuda.graphs requires
CAPTURE_ATTEMPTS = 2  # a capture invalidated by something outside fn (another graph freed, say) is tried once more


class Replay:
    """fn() (on static buffers) as a CUDA graph when asked for, else plain calls: the CPU fallback.

    A capture that fails is tried once more after a collection; one that fails again (an op that
    syncs, a torch version that refuses something) falls back to plain calls with a warning instead
    of failing the benchmark: slower, still correct, and the reason goes to `failures` (the owning
    decoder's list), so its label stops saying "cudagraph".
    """

    def __init__(self, fn, use_graph: bool, failures: list[str], pool=None):
        """pool: a torch.cuda.graph_pool_handle() shared with other Replays (see shared_pool), or None for the graph's own."""
        self.fn, self.graph = fn, None
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: kernel choice and allocations happen outside the capture
                for _ in range(WARMUP_REPLAYS):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            for attempt in range(CAPTURE_ATTEMPTS):
                graph = torch.cuda.CUDAGraph()
                try:
                    with no_garbage_collection(), torch.cuda.graph(graph, pool=pool):
                        fn()
                    self.graph = graph
                    break
                except Exception as exc:  # noqa: BLE001 -- any capture error: try again once, then run eagerly, say why
                    torch.cuda.synchronize()
                    reason = f"{type(exc).__name__}: {exc}"[:300]
                    if attempt + 1 < CAPTURE_ATTEMPTS:
                        gc.collect()  # outside the capture: a stray graph freed now cannot invalidate the next one
                        continue
                    failures.append(reason)
                    warnings.warn(f"CUDA graph capture failed {CAPTURE_ATTEMPTS} times, running eagerly: {reason}")

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


@contextlib.contextmanager
def no_garbage_collection():
    """Python's collector off for a capture. A decoder that is done with still holds its graphs in a reference cycle
    (its replays' partials point back at it), and a collection that runs mid-capture destroys them; destroying a graph
    while another is being captured invalidates the capture (pytorch/pytorch#161037). On the H200 that silently sent
    one benchmark's chain rounds down the eager path. torch.cuda.graph no longer collects before
    capturing, so nothing else stops it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def shared_pool(use_graphs: bool):
    """One memory pool for graphs replayed one at a time whose results all land in buffers allocated outside any capture:
    each graph's own allocations are then scratch the next replay may reuse, so the pool holds the largest graph's scratch,
    not the sum of every graph's (a batched decoder's round graphs per setting and span pair at B = 64 on SmolLM2-135M
    summed to over 60 GiB on an H100). None without graphs."""
    return torch.cuda.graph_pool_handle() if use_graphs else None


def free_unused_graphs() -> None:
    """Free the graphs and buffers of decoders no longer referenced (their replays' partials keep them in reference
    cycles) and hand their memory back: between batch sizes, so that one B's graphs do not crowd out the next B's."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cuda_graphs_usable(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch.cuda, "CUDAGraph")
