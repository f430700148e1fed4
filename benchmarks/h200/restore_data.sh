#!/usr/bin/env bash
# Put back regeneration's resume logs that an earlier machine brought back (collect.sh with COLLECT_DATA=1), so that
# every shard job on this one resumes the turns they hold instead of generating them (on the H200 the full config
# reached its draft vocabulary in 316 s against 468 s regenerating). The logs are keyed by the
# generation settings and the model's fingerprint, and a turn is reused only when its user text is the same
# (eyrie.generation.regenerate.resume): logs of another config are simply not read.
# Usage: restore_data.sh WORKDIR FOLDER (pipeline.sh runs it once when RESTORE_DATA names the carried folder).
set -u
W=$1; FROM=$(realpath "$2")
mkdir -p "$W" && cat "$FROM"/data.tgz.* | tar xzf - -C "$W" || exit 1
(cd "$W" && sha256sum -c --quiet "$FROM/data.sha256") || { echo "the restored resume logs do not match their sha256"; exit 1; }
echo "restored $(wc -l < "$FROM/data.sha256") resume logs into $W"
