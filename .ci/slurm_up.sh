#!/usr/bin/env bash
# CI: a one-node SLURM cluster on this machine, for tests/test_slurm.py. Idempotent; undo with .ci/slurm_down.sh.
#
# Installs Debian's slurm-wlm (slurmctld, slurmd, slurm-client) and munge, writes /etc/slurm/slurm.conf for one
# node (this host, all its cores, memory capped at 8 GB), starts munged, slurmctld and slurmd, and waits until
# `sinfo` shows the node idle. Daemons already running are left alone and are not recorded, so slurm_down.sh
# stops only what this script started (by PID, from $STATE/started).
#
# Needs root (or sudo). Refuses to overwrite an /etc/slurm/slurm.conf that it did not write.
# Recipe and the facts behind it: shared/MACHINES.md ("A one-node SLURM for tests").
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    exec sudo -n -- bash "$0" "$@"
fi

STATE=/run/eyrie-ci-slurm
CONF=/etc/slurm/slurm.conf
MARKER="# written by eyrie .ci/slurm_up.sh"
started_at=$(date +%s)
mkdir -p "$STATE"

log() { echo "slurm_up: $*" >&2; }

# 1. Packages (skipped when present). policy-rc.d or no init system: nothing is started by apt.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sinfo >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    if ! apt-get install -y -qq --no-install-recommends slurm-wlm slurmctld slurmd slurm-client munge >"$STATE/apt.log" 2>&1; then
        tail -30 "$STATE/apt.log" >&2
        exit 1
    fi
fi

# 2. Munge key (the package normally creates one).
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key; else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key

# 3. slurm.conf for one node. The job-step plugin drops SLURM_CONF, so it must live at the default path.
NODE=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024) - 1024}' /proc/meminfo)
[ "$MEM_MB" -gt 8000 ] && MEM_MB=8000
if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    log "$CONF exists and was not written by this script: refusing to touch it"
    exit 1
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
cat >"$CONF.tmp" <<EOF
$MARKER: a one-node test cluster. Safe to delete.
ClusterName=ci
SlurmctldHost=$NODE(127.0.0.1)
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# No slurmdbd: sacct has nothing to say, so the executor plugin must poll with squeue
# (slurm-status-command: squeue). Finished jobs stay visible to "squeue -t all" for MinJobAge seconds
# (the plugin needs >= 120 s to see their final state) and are appended to the job-completion log.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
MinJobAge=600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
DefMemPerCPU=1000
InactiveLimit=0
KillWait=5
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
mv "$CONF.tmp" "$CONF"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
started() { echo "$1 $(cat "$2")" >>"$STATE/started"; }  # name and PID of a daemon this script started

# Forget daemons recorded by an earlier run that are gone (slurm_down.sh also checks the name behind a PID).
if [ -s "$STATE/started" ]; then
    while read -r name pid; do
        [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] && echo "$name $pid"
    done <"$STATE/started" >"$STATE/started.tmp" || true
    mv "$STATE/started.tmp" "$STATE/started"
fi

# 4. Daemons: start what is not running, remember what we started.
if ! alive /run/munge/munged.pid; then
    chown -R munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
    chmod 0755 /run/munge
    su -s /bin/sh munge -c /usr/sbin/munged
    for _ in $(seq 50); do alive /run/munge/munged.pid && break; sleep 0.1; done
    alive /run/munge/munged.pid || { log "munged did not start"; exit 1; }
    started munged /run/munge/munged.pid
fi
munge -n | unmunge >/dev/null || { log "munge round trip failed"; exit 1; }

if ! alive /run/slurmctld.pid; then
    # -c: forget jobs left from an earlier CI run; this cluster holds nothing worth keeping.
    /usr/sbin/slurmctld -c
    for _ in $(seq 100); do alive /run/slurmctld.pid && break; sleep 0.1; done
    alive /run/slurmctld.pid || { log "slurmctld did not start"; tail -20 /var/log/slurm/slurmctld.log >&2; exit 1; }
    started slurmctld /run/slurmctld.pid
fi
if ! alive /run/slurmd.pid; then
    /usr/sbin/slurmd
    for _ in $(seq 100); do alive /run/slurmd.pid && break; sleep 0.1; done
    alive /run/slurmd.pid || { log "slurmd did not start"; tail -20 /var/log/slurm/slurmd.log >&2; exit 1; }
    started slurmd /run/slurmd.pid
fi

# 5. Wait for the node to be schedulable.
for _ in $(seq 120); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case "$state" in
        idle* | mixed* | allocated*) break ;;
        down* | drain*) scontrol update nodename="$NODE" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
done
case "$state" in
    idle* | mixed* | allocated*) ;;
    *)
        log "node $NODE is '$state', not idle"
        tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2
        exit 1
        ;;
esac
sinfo >&2
log "one-node cluster up ($CPUS CPUs, $MEM_MB MB) in $(($(date +%s) - started_at)) s"
