#!/usr/bin/env bash
# Put a drafter that an earlier machine brought back (collect.sh with COLLECT_DRAFTER=1: results/drafter and the
# held-out prompts, in 15 MiB pieces with their sha256) into the pipeline's working directory, so that a later machine
# benchmarks it without regenerating or training. Carry the pieces as .device/collected/ (about 45 MiB: a call of
# its own), then run pipeline.sh with the benchmark targets and --allowed-rules.
set -u; cd "$(dirname "$0")/../.."; source benchmarks/h200/lib.sh
W=${W:-$STATE/w}; FROM=$(realpath "${FROM:-.device/collected}")
mkdir -p "$W" && cat "$FROM"/drafter.tar.* | tar xf - -C "$W" || exit 1
(cd "$W" && sha256sum -c --quiet "$FROM/drafter.sha256") || { echo "the restored drafter does not match its sha256"; exit 1; }
ls -la "$W/results/drafter" "$W"/results/prompts/*
