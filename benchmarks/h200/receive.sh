#!/usr/bin/env bash
# One lease call per piece (the first also carrying .device/clean.tar): keep the carried piece(s) of .device/pieces in /tmp/persist (kept while calls follow closely).
set -u; cd "$(dirname "$0")/../.."
mkdir -p /tmp/persist/pieces && cp .device/pieces/* /tmp/persist/pieces/ && ls -la /tmp/persist/pieces && df -h /tmp | tail -1
# Carried with the first piece: the committed tree (prepare.sh's `git archive HEAD`), so the pipeline runs from what
# was committed even while the working tree that travels with each call is being edited.
if [ -f .device/clean.tar ]; then
    rm -rf /tmp/persist/clean && mkdir -p /tmp/persist/clean && tar xf .device/clean.tar -C /tmp/persist/clean && echo "clean tree in /tmp/persist/clean"
fi
# Carried with any piece: regeneration's resume logs an earlier lease brought back (collect.sh's COLLECT_DATA, gathered
# here into .device/data), kept for pipeline.sh's RESTORE_DATA=/tmp/persist/data.
if [ -f .device/data/data.sha256 ]; then
    rm -rf /tmp/persist/data && cp -r .device/data /tmp/persist/data && echo "resume logs in /tmp/persist/data"
fi
