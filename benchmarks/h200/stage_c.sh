#!/usr/bin/env bash
# Lease call 3 of 3, on the working directory stage_b.sh built: the speculative-decoding benchmark
# at batch 1 on the trained drafter, extraction against the roofline at Llama-3.1-8B's shape, and
# the fp8 cache against bf16 (two drafters trained side by side).
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site
W=${W:-/tmp/w}
# 8 prompts x 256 tokens in fp32 and bf16 did not finish in 200 s (eager HF decoding is the slow part)
TAIL=20 step speculative 200 python3 benchmarks/speculative_decode.py --workdir "$W" --dataset sharegpt --prompts 4 --max-new-tokens 128 --dtype float32 --out "$OUT/speculative.json"
TAIL=16 step extraction 130 python3 benchmarks/extraction.py --out "$OUT/extraction.json"
TAIL=16 step cache_precision 220 python3 benchmarks/cache_precision.py --workdir "$W" --epochs 3 --out "$OUT/cache_precision.json"
exit 0
