#!/usr/bin/env bash
# Start a one-node Slurm cluster on loopback, for tests/slurm/ and for trying the sbatch
# examples by hand: munged, slurmctld and slurmd, each with its config, key, socket, pid
# file, log and state under one directory, so nothing in /etc is touched and nothing
# outside 127.0.0.1 is contacted.
#
#   .ci/slurm/start_cluster.sh [DIR]        # DIR defaults to /tmp/megalite-slurm
#   export SLURM_CONF=DIR/slurm.conf        # what the script prints last
#   sbatch ...; squeue; sinfo
#   .ci/slurm/stop_cluster.sh [DIR]
#
# Re-running it is safe: a cluster already up in DIR with the same config is reused;
# otherwise whatever runs from DIR is stopped and started afresh. Needs slurm-wlm and
# munge (.ci/slurm/install.sh); runs the daemons as the calling user (root in CI, so that
# slurmd can start jobs as their owner). Environment: SLURMCTLD_PORT (default 16817) and
# SLURMD_PORT (default 16818), away from a system Slurm's 6817/6818.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-/tmp/megalite-slurm}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
CONF=$DIR/slurm.conf
NODE=$(hostname -s)
USER_NAME=$(id -un)
# --all: plain nproc honours OMP_NUM_THREADS, and a node sized at 1 CPU leaves every
# 2-CPU test job pending forever.
CPUS=$(nproc --all)
# Half the machine's memory: slurmd drains a node whose RealMemory exceeds what it has.
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024 / 2)}' /proc/meminfo)

for tool in munged mungekey slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || {
        echo "start_cluster: $tool not found; run .ci/slurm/install.sh" >&2; exit 1; }
done

write_conf() {
    cat <<CONF
# One node on loopback, written by .ci/slurm/start_cluster.sh.
ClusterName=megalite
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
SlurmUser=$USER_NAME
SlurmdUser=$USER_NAME
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (none may be writable here): processes are tracked by parent pid, and
# tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
# Trust the node line below, not slurmd's view of the hardware, and bring the node back
# to service on its own after a restart.
SlurmdParameters=config_overrides
ReturnToService=2
# Finished jobs stay visible to scontrol (exit code, state) for 10 minutes.
MinJobAge=600
KillWait=10
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
}

alive() {  # alive PIDFILE: the process named in it runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_state() {
    SLURM_CONF=$CONF timeout 10 sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1 || true
}

# Reuse a healthy cluster that runs this very config.
if [ -f "$CONF" ] && cmp -s "$CONF" <(write_conf) &&
   alive "$DIR/munge/munged.pid" && alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" &&
   [[ "$(node_state)" =~ ^(idle|mixed|allocated)$ ]]; then
    echo "start_cluster: reusing the cluster in $DIR"
    echo "export SLURM_CONF=$CONF"
    exit 0
fi

bash "$HERE/stop_cluster.sh" "$DIR" >/dev/null
rm -rf "$DIR/state" "$DIR/spool"
for log in "$DIR"/*.log; do [ -f "$log" ] && mv "$log" "$log.old"; done
mkdir -p "$DIR/munge/key" "$DIR/state" "$DIR/spool"
# munged wants its key private and its socket directory reachable by every user (jobs
# run as their owner) but writable only by its own.
chmod 755 "$DIR" "$DIR/munge"
chmod 700 "$DIR/munge/key"
write_conf >"$CONF"

[ -s "$DIR/munge/key/munge.key" ] || mungekey --create --keyfile="$DIR/munge/key/munge.key"
chmod 600 "$DIR/munge/key/munge.key"
munged --key-file="$DIR/munge/key/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed"

# Both daemonize; -i ignores state from a previous run of this directory.
slurmctld -f "$CONF" -i
slurmd -f "$CONF" -N "$NODE"

for _ in $(seq 60); do
    state=$(node_state)
    if [ "$state" = idle ]; then
        echo "start_cluster: node $NODE idle ($(slurmctld -V))"
        echo "export SLURM_CONF=$CONF"
        exit 0
    fi
    sleep 1
done
echo "start_cluster: node $NODE is not idle after 60 s (state: ${state:-none})" >&2
tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" "$DIR/munge/munged.log" >&2 || true
exit 1
