"""What the benchmark's floor costs to build when inductor's cache holds its step, and when it does not.

    python benchmarks/floor_compile_cache.py --model <run>/resources/models/SmolLM2-135M-Instruct --capacities 320 320 448 512 512

Each capacity is built in a fresh process (as each benchmark job is), one after another, against one inductor cache
directory that starts empty: a capacity seen before finds its compiled step there, a new one compiles it. Prints the
seconds each process spent building the compiled floor (eyrie.decoding.floor.FloorDecoder) and decoding 8 tokens.
The benchmark's floor sizes its cache with eyrie.bench.floor.floor_capacity, powers of two, so that benchmarks whose
first prompts are near in length share the second row's cost instead of the first's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ONE = """
import sys, time, torch
from transformers import AutoModelForCausalLM
from eyrie.decoding.floor import FloorDecoder
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[3])).to(sys.argv[4]).eval()
t0 = time.perf_counter()
floor = FloorDecoder(model, int(sys.argv[2]), compile=True, graphs=sys.argv[4] == "cuda")
floor.decode([1, 2, 3, 4], 8)
print(f"{time.perf_counter() - t0:.1f}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF Llama directory (the pipeline's resources/models/<name>)")
    parser.add_argument("--capacities", type=int, nargs="+", default=[320, 320, 448, 512, 512])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        seen = set()
        for capacity in args.capacities:
            out = subprocess.run([sys.executable, "-c", ONE, args.model, str(capacity), args.dtype, args.device],
                                 env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
            print(f"capacity {capacity:5d} ({'in the cache' if capacity in seen else 'new'}): build and first decode {out} s", flush=True)
            seen.add(capacity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
