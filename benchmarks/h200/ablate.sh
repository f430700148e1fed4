#!/usr/bin/env bash
# On the lease, after pipeline.sh has built a run's cache and vocabulary in $W: train the recipe settings on it
# (benchmarks/recipe_ablation.py: one after another on one GPU, one per GPU on several) and write the best one's
# changes as a config overlay for the pipeline's own training (OVERLAY=$RECIPE pipeline.sh results/drafter ...).
#   ABLATION_EPOCHS (default 1): every setting's epochs; ABLATION_LIMIT (default 500): seconds; a setting that cannot
#   finish within it is not started (on several GPUs: is stopped), the finished ones are kept and judged.
# At the pipeline's shape one setting-epoch of the 12,000-conversation cache is ~70 s of training plus its start.
# Settings: the arguments (recipe_ablation.py's NAME=KEY=VALUE[,...]), else the list below.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
W=${W:-/tmp/persist/w}; RECIPE=${RECIPE:-/tmp/persist/recipe.yaml}; KEEP=/tmp/persist/ablation
export PYTHONPATH=$PYTHONPATH:/tmp/persist/site PATH=/tmp/persist/site/bin:$PATH
gpus=$(nvidia-smi -L 2>/dev/null | wc -l); gpu_args=()
[ "$gpus" -gt 1 ] && gpu_args=(--gpus "$(seq -s, 0 $((gpus - 1)))") && export OMP_NUM_THREADS=$((16 / gpus))
settings=("$@")
# The default list: the issue's knobs the ninth session's ablation did not reach (it measured the learning rate,
# argmax labels and a 3x MLP: only the rate moved the walk). Baseline is configs/h200.yaml's recipe (2e-3, 4 epochs
# in the pipeline; one here). Most promising first, as a cut run judges those it finished.
[ ${#settings[@]} -eq 0 ] && settings=(
    "baseline="
    "noise-0.05=train.hidden_noise=0.05"
    "vocab-16k=drafter.draft_vocab_size=16000"
    "both-norms=drafter.norm_before_fc=true,drafter.norm_output=true"
    "decay-0.6=drafter.step_weight_decay=0.6"
    "noise-0.2=train.hidden_noise=0.2"
    "lr-4e-3=train.learning_rate=0.004"
    "lr-constant=train.lr_schedule=constant"
)
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
