#!/usr/bin/env bash
# CI: stop the daemons that .ci/slurm_up.sh started (and only those), by PID. Idempotent.
# Jobs still queued or running on the cluster are cancelled first when this script's slurmctld is the one serving.
# Then the slurm.conf that slurm_up.sh wrote goes too, once no SLURM daemon runs: left behind, it names a controller
# that no longer answers, and every Snakemake start then waits ~9 s in the SLURM executor plugin's `scontrol show
# config` (`python benchmarks/dag_scale.py` shows it in its start-up time).
set -uo pipefail

if [ "$(id -u)" -ne 0 ]; then
    exec sudo -n -- bash "$0" "$@"
fi

STATE=/run/eyrie-ci-slurm
CONF=/etc/slurm/slurm.conf
MARKER="# written by eyrie .ci/slurm_up.sh"

remove_our_conf() {
    if [ -f "$CONF" ] && grep -qF "$MARKER" "$CONF" && ! pgrep -x slurmctld >/dev/null && ! pgrep -x slurmd >/dev/null; then
        rm -f "$CONF" && echo "slurm_down: removed $CONF (written by slurm_up.sh)" >&2
    fi
}

[ -s "$STATE/started" ] || { echo "slurm_down: nothing started by slurm_up.sh" >&2; remove_our_conf; exit 0; }

if grep -q '^slurmctld ' "$STATE/started"; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
fi

# Reverse start order: slurmd, slurmctld, munged. A PID whose process has another name is not ours any more.
tac "$STATE/started" | while read -r name pid; do
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$name" ]; then
        echo "slurm_down: $name ($pid) already gone" >&2
        continue
    fi
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        echo "slurm_down: $name ($pid) ignored SIGTERM for 10 s: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null
    fi
    echo "slurm_down: stopped $name ($pid)" >&2
done
rm -f "$STATE/started"
remove_our_conf
