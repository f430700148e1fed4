#!/usr/bin/env bash
# One GPU call, nothing carried but the working tree: this engine's tree rounds against an earlier commit's, side by
# side (decode_floor.py --against), with the frontier's top-K of each way in WAYS (eyrie.decoding.topk) and, with PROFILE=<top-K way>, where the new round's time goes (decode_floor.py --profile-round). Random
# weights at the default target's shape, a 32,000-token draft vocabulary, bf16.
#   BASE: a folder holding the earlier commit's src/ and benchmarks/ (git archive <commit> src benchmarks | tar -x -C BASE),
#   placed inside the repository (untracked) so that it travels with the call.
#   WAYS (default "ranked", top_k's way on CUDA): the top-K ways this engine runs with, each WAY or WAY@VOCAB (a draft
#   vocabulary); TREES: the tree shapes (S,K,N ...).
set -u; cd "$(dirname "$0")/../.."
BASE=${BASE:?a folder holding an earlier commit: src/ and benchmarks/}; OUT=${OUT:-/tmp}
A="--dtypes bfloat16 --tokens 128 --repeats 3 --drafter-k 4 --trees ${TREES:-6,8,32 6,10,48 8,10,64} --no-floor --compiled-only --draft-vocab 32000"
quiet() { grep -v -i -e warn -e "online softmax" -e "split the reduction" -e "important use case" -e '^\s*$'; }
(cd "$BASE/benchmarks" && PYTHONPATH=../src python decode_floor.py $A --out "$OUT/base.json" > "$OUT/base.txt" 2>&1) \
    || { tail -20 "$OUT/base.txt"; exit 1; }
grep -A8 "^dtype" "$OUT/base.txt"
for run in ${WAYS:-ranked}; do  # WAY or WAY@VOCAB: this engine's top-K way, at another draft vocabulary
    way=${run%@*}; vocab=32000; [ "$run" != "$way" ] && vocab=${run#*@}
    echo "=== this engine, top-K $way, draft vocabulary $vocab, over the base (32,000)"
    (cd benchmarks && PYTHONPATH=../src python decode_floor.py $A --top-k $way --draft-vocab $vocab --out "$OUT/$way-$vocab.json" \
        --against "$OUT/base.json" 2>&1 | quiet | tail -9)
done
[ -n "${PROFILE:-}" ] && (cd benchmarks && PYTHONPATH=../src python decode_floor.py --profile-round --dtypes bfloat16 --trees 8,10,64 --drafter-k 0 --kernels 14 --top-k "$PROFILE" 2>&1 | quiet | sed -n '/tree (8, 10, 64)/,$p' | head -60)
