#!/usr/bin/env bash
# One lease call, nothing carried: which top-K over the draft vocabulary the tree rounds should take
# (eyrie.decoding.topk). First each way alone (benchmarks/topk_variants.py), then the tree rounds with the two-stage
# top_k (the default) and with ranked_top_k, side by side (decode_floor.py --top-k ... --against). Random weights at
# the default target's shape, a 32,000-token draft vocabulary, bf16; ~4 minutes with the machine's start.
set -u; cd "$(dirname "$0")/.."
export PYTHONPATH=../src OUT=${OUT:-/tmp}
python topk_variants.py --rows 10 8 1 2>&1 | grep -v -i warn
A="--dtypes bfloat16 --tokens 128 --repeats 3 --drafter-k 4 --trees 6,8,32 6,10,48 8,10,64 --no-floor --compiled-only --draft-vocab 32000"
python decode_floor.py $A --top-k two-stage --out "$OUT/two_stage.json" > "$OUT/two_stage.txt" 2>&1 || { tail -20 "$OUT/two_stage.txt"; exit 1; }
python decode_floor.py $A --top-k ranked --against "$OUT/two_stage.json" 2>&1 | grep -v -i warn | tail -14
