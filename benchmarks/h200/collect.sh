#!/usr/bin/env bash
# What comes back from a pipeline working directory: the report and the figures behind it (with the benchmarks' own
# logs: a CUDA graph capture failure shows only in Snakemake's log).
W=$1; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cp "$W/report.html" "$OUT/" 2>/dev/null
(cd "$W" && tar czf "$OUT/figures.tgz" --ignore-failed-read results/bench results/drafter/*.json results/drafter/*/*.json \
    results/vocab/*.json logs/benchmarks logs/bench logs/completions logs/hidden logs/train 2>/dev/null)
python3 - "$W" <<'PY'
import json, sys, glob, pyarrow.parquet as pq
w = sys.argv[1]
for path in sorted(glob.glob(f"{w}/results/bench/*.json")):
    r = json.load(open(path))
    print(f"bench {r.get('benchmark')}: acceptance {r.get('mean_acceptance_length')}, speedup {r.get('speedup')}, greedy {r.get('greedy_tokens_per_s')} tok/s, spec {r.get('spec_tokens_per_s')} tok/s, lossless {r.get('lossless')}, decoder {r.get('decoder')}, prompts {r.get('prompts')}")
    print("  phases", r.get("phase_seconds"), "| drafter fusion failure", r.get("drafter_fusion_failure"), "| ngram", (r.get("ngram") or {}).get("mean_acceptance_length"), (r.get("ngram") or {}).get("tokens_per_s"))
    print("  floor", {k: v for k, v in (r.get("floor") or {}).items() if not isinstance(v, (list, dict))})
    print("  parity", {k: v for k, v in (r.get("parity") or {}).items() if k in ("simulated", "measured", "gap", "judged")})
    for x in (r.get("sweep") or {}).get("settings", []):
        print("  sweep", x.get("label"), "acc", x.get("mean_acceptance_length"), "tok/s", x.get("tokens_per_s"), "speedup", x.get("speedup"), "over ngram", x.get("speedup_over_ngram"), "lossless", x.get("lossless"))
    print("  best", ((r.get("sweep") or {}).get("best") or {}).get("label"), "| fp32", {k: v for k, v in (r.get("float32_check") or {}).items() if not isinstance(v, (list, dict))})
for path in sorted(glob.glob(f"{w}/results/completions/*/*.parquet")):
    meta = json.loads(pq.read_schema(path).metadata[b"eyrie"])["stats"]
    print("completions", "/".join(path.rsplit("/", 2)[-2:]), {k: v for k, v in meta.items() if not isinstance(v, (list, dict))})
PY
# COLLECT_DRAFTER=1 (the call that ends with training): the drafter and the held-out prompts come back too, in
# pieces of 15 MiB (PIECE_MB), so that a later machine can benchmark them without regenerating.
if [ "${COLLECT_DRAFTER:-0}" = 1 ] && [ -f "$W/results/drafter/model.safetensors" ]; then
    (cd "$W" && tar cf - results/drafter results/prompts/*/heldout.parquet) | split -b "${PIECE_MB:-15}M" -d - "$OUT/drafter.tar."
    (cd "$W" && sha256sum results/drafter/* results/prompts/*/heldout.parquet) > "$OUT/drafter.sha256"
fi
# COLLECT_DATA=1 (a call that ended regeneration): regeneration's own resume logs come back too, compressed, in pieces
# of 15 MiB (PIECE_MB). A later machine puts them back (pipeline.sh's RESTORE_DATA) and every shard job
# resumes its finished turns instead of generating them: the log is keyed by the generation settings and the model's
# fingerprint, and a turn is reused only when its user text is the same (eyrie.generation.regenerate.resume).
# Synthesis's partial log comes too: sampled again on a fresh machine, the synthetic prompts came out a little
# different (1,525 / 1,418 kept against 1,523 / 1,420), so 39 of their turns were generated again.
if [ "${COLLECT_DATA:-0}" = 1 ] && [ -d "$W/results/partial/completions" ]; then
    logs=(results/partial/completions); [ -d "$W/results/partial/synthetic" ] && logs+=(results/partial/synthetic)
    (cd "$W" && tar czf - "${logs[@]}") | split -b "${PIECE_MB:-15}M" -d - "$OUT/data.tgz."
    (cd "$W" && find "${logs[@]}" -type f -print0 | xargs -0 sha256sum) > "$OUT/data.sha256"
fi
ls -la "$OUT"
