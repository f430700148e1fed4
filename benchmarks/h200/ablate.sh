#!/usr/bin/env bash
# On the GPU machine, after pipeline.sh has built a run's cache and vocabulary in $W: train the recipe settings on it
# (benchmarks/recipe_ablation.py: one after another on one GPU, one per GPU on several) and write the best one's
# changes as a config overlay for the pipeline's own training (OVERLAY=$RECIPE pipeline.sh results/drafter ...).
#   ABLATION_EPOCHS (default 1): every setting's epochs; ABLATION_LIMIT (default 500): seconds; a setting that cannot
#   finish within it is not started (on several GPUs: is stopped), the finished ones are kept and judged.
# At the pipeline's shape one setting-epoch of the 12,000-conversation cache is ~70 s of training plus its start.
# Settings: the arguments (recipe_ablation.py's NAME=KEY=VALUE[,...]), else recipe_ablation.py's DEFAULT_SETTINGS.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
W=${W:-$STATE/w}; RECIPE=${RECIPE:-$STATE/recipe.yaml}; KEEP=$STATE/ablation
export PYTHONPATH=$PYTHONPATH:$STATE/site PATH=$STATE/site/bin:$PATH
gpus=$(nvidia-smi -L 2>/dev/null | wc -l); gpu_args=()
[ "$gpus" -gt 1 ] && gpu_args=(--gpus "$(seq -s, 0 $((gpus - 1)))") && export OMP_NUM_THREADS=$((16 / gpus))
settings=("$@")
args=(); for s in "${settings[@]}"; do args+=(--setting "$s"); done
rm -rf "$KEEP"; mkdir -p "$KEEP"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 20 > "$OUT/ablation-gpu.csv" 2>/dev/null &
smi=$!
TAIL=40 step ablation $(( ${ABLATION_LIMIT:-500} + 60 )) python3 benchmarks/recipe_ablation.py "$W" "${args[@]}" "${gpu_args[@]}" \
    --set "train.epochs=${ABLATION_EPOCHS:-1}" --keep "$KEEP" --out "$OUT/ablation.json" --overlay "$RECIPE" --limit "${ABLATION_LIMIT:-500}"
kill $smi 2>/dev/null; pkill -9 -f recipe_ablation.py 2>/dev/null  # what the step's timeout left
cp "$KEEP"/*.log "$KEEP"/*.row.json "$OUT/" 2>/dev/null
for d in "$KEEP"/*/; do [ -f "$d/training_log.json" ] && cp "$d/training_log.json" "$OUT/$(basename "$d").training_log.json"; done
[ -f "$RECIPE" ] && { echo "--- $RECIPE"; cat "$RECIPE"; cp "$RECIPE" "$OUT/"; }
