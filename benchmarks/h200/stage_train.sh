#!/usr/bin/env bash
# Any GPU call (needs nothing carried, no pipeline output): drafter training on random features --
# the CUDA tests, throughput and memory at the Llama-3.1-8B drafter shape against SpecForge, the cold
# and (on a 2-GPU machine) data-parallel scaling.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
step gpu_tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/training/test_train.py -k "cuda or compile"
TAIL=12 step train_throughput 200 python3 benchmarks/train_throughput.py --variants flex+chunked,flex+chunked+compiled --steps 8 --max-seconds 12 --out "$OUT/train_throughput.json"
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && step train_ddp 100 python3 benchmarks/train_throughput.py --processes 2 --batch 4 --steps 5 --out "$OUT/train_ddp.json"
exit 0
