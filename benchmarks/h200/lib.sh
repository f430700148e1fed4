# Shared by the stage scripts: environment, a time-bounded step that keeps its log under $OUT, and STATE: the GPU
# machine's directory that outlives one call (default /tmp/persist; it holds the pieces, the installed wheels and $W).
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # required on multi-GPU machines without NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; STATE=${STATE:-/tmp/persist}
step() {  # step NAME SECONDS COMMAND...: run bounded, log to $OUT/NAME.log, show its tail
    local name=$1 limit=$2; shift 2
    echo "=== $name"; local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$? in $((SECONDS - t0)) s"; grep -v "^DEBUG" "$OUT/$name.log" | tail -n "${TAIL:-14}"
}
