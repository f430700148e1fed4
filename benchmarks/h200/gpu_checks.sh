#!/usr/bin/env bash
# The GPU-only tests and the microbenchmarks that need no pipeline output, each bounded in time
# so one failure cannot eat the lease. Run from the repo root on a CUDA machine; results in $OUT.
# Needs .device/tok/smol_tokenizer.tar.xz (SmolLM2's config + tokenizer) for the regeneration benchmark.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "=== $name rc=$? in $((SECONDS - t0)) s"; tail -n 25 "$OUT/$name.log"; }
mkdir -p /tmp/smol && tar xJf .device/tok/smol_tokenizer.tar.xz -C /tmp/smol
step gpu_tests 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_static_decode.py tests/test_train.py -k cuda
step spec_small 80 python3 benchmarks/speculative_decode.py --small --device cuda --out "$OUT/spec_small.json"
step train_throughput 170 python3 benchmarks/train_throughput.py --steps 5 --max-seconds 20 --out "$OUT/train_throughput.json"
step regeneration 100 python3 benchmarks/regeneration.py --model /tmp/smol --random-weights --prompts 256 --max-new-tokens 128 --out "$OUT/regeneration.json"
[ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && step train_ddp 130 python3 benchmarks/train_ddp.py --steps 5 --out "$OUT/train_ddp.json"
exit 0
