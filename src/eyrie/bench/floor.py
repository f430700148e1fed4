"""Greedy on the benchmark's engine against the floor (eyrie.decoding.floor), timed side by side in one process.

Speedups measured on an engine several times slower than the hardware allows are not the speedups a user's engine
will show, so the benchmark records how far its greedy is from a minimal fused step on the same weights and prompt.
On CUDA the floor is fused with inductor's max-autotune (Triton templates timed against cuBLAS for each product),
whatever bench.compile_mode fuses the engine with: the ratio is to the best the compiler finds, not to a floor as
untuned as the engine.
"""

from __future__ import annotations

import statistics

from eyrie.decoding.decode import greedy_decode
from eyrie.decoding.floor import FloorDecoder
from eyrie.decoding.graphs import cuda_graphs_usable
from eyrie.decoding.static import StaticLlama
from eyrie.decoding.static_common import AUTOTUNED, SMALLEST_SPAN

WARMUPS, REPEATS = 2, 3


def floor_capacity(needed: int) -> int:
    """The floor's cache slots: the power of two that holds `needed` (at least SMALLEST_SPAN).

    Inductor's cache keys a compiled step on its shapes, and compiling the floor's 30-layer step is most of its
    time: the phase took 51-53 s per benchmark on the H200, of which its timed decodes are a few seconds, and on two
    CPU cores a build took 78-87 s new against 8 s from the cache (benchmarks/README.md, retired probes). Sized to the
    prompt, every benchmark compiled its own; in powers of two, benchmarks whose first prompts are near in length
    share one. The extra slots are masked: a step's attention reads a few more rows of the cache.
    """
    return max(SMALLEST_SPAN, 1 << (needed - 1).bit_length())


def floor_block(model, engine, prompt_id: str, prompt_ids: list[int], new_tokens: int, compile: bool) -> dict:
    """ms per greedy token of the floor and of `engine` (decode steps only, median of REPEATS after WARMUPS) and their ratio."""
    if type(engine) is not StaticLlama:  # the floor is a Llama step: other families' static engine has none to compare with
        return {"error": f"the floor is compared with the static decoder; this run used {getattr(engine, 'label', 'transformers')}"}
    capacity = floor_capacity(len(prompt_ids) + new_tokens + 2)
    mode = AUTOTUNED if engine.device.type == "cuda" else "default"  # inductor's CPU templates tune slowly and gain little
    floor = FloorDecoder(model, capacity, compile=compile, graphs=cuda_graphs_usable(engine.device), mode=mode)
    runs = [floor.decode(prompt_ids, new_tokens) for _ in range(WARMUPS + REPEATS)][WARMUPS:]
    floor_ms = 1000 * statistics.median(seconds for _, seconds in runs) / (new_tokens - 1)
    # greedy_decode times its prefill too: take a prefill-only run's median off.
    greedy = [greedy_decode(engine, prompt_ids, new_tokens, set()).seconds for _ in range(WARMUPS + REPEATS)][WARMUPS:]
    prefill = statistics.median(greedy_decode(engine, prompt_ids, 1, set()).seconds for _ in range(REPEATS))
    greedy_ms = 1000 * (statistics.median(greedy) - prefill) / (new_tokens - 1)
    return {"prompt": prompt_id, "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "compiled": compile, "capacity": capacity,
            "floor_mode": mode if compile else None, "engine_mode": engine.compile_mode if engine.compile else None,
            "floor_ms_per_token": floor_ms, "greedy_ms_per_token": greedy_ms, "ratio": greedy_ms / floor_ms,
            "capture_failures": floor.failures, "error": None}
