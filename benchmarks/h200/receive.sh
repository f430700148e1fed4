#!/usr/bin/env bash
# One GPU call per piece (the first also carrying .device/clean.tar): keep the carried piece(s) of .device/pieces in
# $STATE, the machine's directory that outlives a call while calls follow closely.
set -u; cd "$(dirname "$0")/../.."; STATE=${STATE:-/tmp/persist}
mkdir -p $STATE/pieces && cp .device/pieces/* $STATE/pieces/ && ls -la $STATE/pieces && df -h /tmp | tail -1
# Carried with the first piece: the committed tree (prepare.sh's `git archive HEAD`), so the pipeline runs from what
# was committed even while the working tree that travels with each call is being edited.
if [ -f .device/clean.tar ]; then
    rm -rf $STATE/clean && mkdir -p $STATE/clean && tar xf .device/clean.tar -C $STATE/clean && echo "clean tree in $STATE/clean"
fi
# Carried with any piece: regeneration's resume logs an earlier machine brought back (collect.sh's COLLECT_DATA, gathered
# here into .device/data), kept for pipeline.sh's RESTORE_DATA=$STATE/data.
if [ -f .device/data/data.sha256 ]; then
    rm -rf $STATE/data && cp -r .device/data $STATE/data && echo "resume logs in $STATE/data"
fi
