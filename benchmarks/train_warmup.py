"""The compile warm-up of a training run whose batches change shape, as the pipeline's do.

In the H200 pipeline run the drafter trained at ~78K tok/s once warm, but its first 50 steps ran at
10K tok/s: flex attention compiles for new shapes (rows x padded length, 7 key-block counts) and
builds a BlockMask per padded length. This benchmark trains the pipeline's drafter shape (SmolLM2-135M:
H 576, draft vocab 14,294, 7 TTT steps) on random features in batches planned exactly as train_drafter
plans them (eyrie.core.batching.batches_by_tokens over ShareGPT-like lengths, 16,384 tokens per batch, epoch order
shuffled), each variant in its own process with an empty inductor cache, i.e. a fresh job:

    default         torch.compile(flex_attention): the first shape compiles static, the first change dynamic
    dynamic         torch.compile(flex_attention, dynamic=True) from the first step
    dynamic+2tiles  and lengths padded to at least two 128-token tiles (one tile recompiled: size-1 dims)

Prints per variant the seconds for the first N steps, the warm median step, the warm-up overhead
(total - N x warm median) and compiled graphs, then the ratio of overheads. CUDA only (flex attention
runs compiled only there); --small runs the same code on the CPU as a smoke test.

    python benchmarks/train_warmup.py --steps 60 --out warmup.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import SMALL, VARIANTS, _compiled_graphs, build, random_batch, timed_step  # noqa: E402

SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, draft_vocab=14294, vocab=49152)
FLEX_SETTINGS = {"default": (None, 1), "dynamic": (True, 1), "dynamic+2tiles": (True, 2)}  # (dynamic, fewest tiles)


def sample_lengths(count: int, seed: int, longest: int) -> list[int]:
    """ShareGPT-like token counts: log-normal around 400 tokens (the H200 run averaged 508), 32..longest."""
    rng = random.Random(seed)
    return [min(longest, max(32, int(math.exp(rng.gauss(math.log(400), 0.8))))) for _ in range(count)]


def run_variant(name: str, args) -> dict:
    import eyrie.training.ttt_attention as ttt_attention
    from eyrie.core.batching import batches_by_tokens

    ttt_attention.FLEX_DYNAMIC, ttt_attention.MIN_FLEX_BLOCKS = FLEX_SETTINGS[name]
    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    dims = SMALL if args.small else SMOLLM2
    objective, optimizer, head, draft_ids, t2d = build(dims, VARIANTS["flex+chunked"], device, 7, args.seed)
    lengths = sample_lengths(args.samples, args.seed, args.longest)
    batches = batches_by_tokens(lengths, args.batch_tokens)
    random.Random(args.seed).shuffle(batches)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    times, shapes = [], []
    for i, members in enumerate(batches[: args.steps]):
        rows, length = len(members), max(lengths[m] for m in members)
        batch = random_batch(dims, rows, length, head, draft_ids, device, dtype, args.seed + i)
        _, seconds = timed_step(objective, optimizer, batch, head, draft_ids, t2d, device)
        times.append(seconds)
        shapes.append([rows, length])
        print(f"  {name} step {i}: {rows} x {length}, {seconds * 1000:.0f} ms, compiled graphs {_compiled_graphs()}", flush=True)
    warm = statistics.median(times[-args.warm_steps :])
    return {"variant": name, "flex_dynamic": FLEX_SETTINGS[name][0], "min_tiles": FLEX_SETTINGS[name][1], "steps": len(times), "total_s": sum(times),
            "warm_median_s": warm, "overhead_s": sum(times) - warm * len(times), "compiled_graphs": _compiled_graphs(),
            "step_times_s": times, "shapes": shapes, "batches_in_epoch": len(batches), "device": device}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(FLEX_SETTINGS))
    parser.add_argument("--steps", type=int, default=60, help="steps timed from a cold start")
    parser.add_argument("--warm-steps", type=int, default=15, help="last steps whose median is the warm step time")
    parser.add_argument("--samples", type=int, default=2265, help="samples in the epoch (the H200 run had 2,265)")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--longest", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="CPU smoke test: tiny shapes, short samples")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.small:
        args.samples, args.longest, args.batch_tokens = min(args.samples, 64), 96, 512
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one, args)), flush=True)
        return 0

    results = []
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="eyrie-inductor-") as cache:  # a cold compile cache per variant
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": f"{cache}/triton"}
            command = [sys.executable, __file__, "--one", name, "--steps", str(args.steps), "--warm-steps", str(args.warm_steps),
                       "--samples", str(args.samples), "--batch-tokens", str(args.batch_tokens), "--longest", str(args.longest),
                       "--seed", str(args.seed)] + (["--small"] if args.small else [])
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        print("\n".join(lines[:3] + ["  ..."] + lines[-4:-1]), flush=True)
        found = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
        results.append(found[0] if found else {"variant": name, "error": (proc.stderr or proc.stdout)[-1500:]})
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(f"\n{'variant':<10} {'steps':>5} {'total s':>8} {'warm ms':>8} {'overhead s':>10} {'graphs':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<10} FAILED {r['error'][-300:]}")
            continue
        print(f"{r['variant']:<10} {r['steps']:>5} {r['total_s']:>8.1f} {r['warm_median_s'] * 1000:>8.0f} {r['overhead_s']:>10.1f} {str(r['compiled_graphs']):>6}")
    ok = [r for r in results if "error" not in r]
    if len(ok) >= 2 and ok[0]["overhead_s"] > 0:
        print(f"warm-up overhead {ok[1]['variant']} / {ok[0]['variant']}: {ok[1]['overhead_s'] / ok[0]['overhead_s']:.2f}x; "
              f"first {ok[0]['steps']} steps {ok[1]['total_s'] / ok[0]['total_s']:.2f}x the time")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
