#!/usr/bin/env bash
# Stop the cluster that .ci/slurm/start_cluster.sh started from DIR (default
# /tmp/megalite-slurm): slurmd, slurmctld, then munged, each by the pid in its pid file.
# Jobs still running are ended with slurmd. Safe to run when nothing is up.
set -uo pipefail
DIR=${1:-/tmp/megalite-slurm}

running() {  # running PIDFILE NAME: the pid file names a live NAME (pids are reused)
    [ -s "$1" ] && grep -qx "$2" "/proc/$(cat "$1")/comm" 2>/dev/null
}

stop() {  # stop PIDFILE NAME: TERM, wait up to 10 s, then KILL
    local pidfile=$1 name=$2 pid
    if running "$pidfile" "$name"; then
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL "$pid" 2>/dev/null && echo "stop_cluster: killed $name ($pid)"
    fi
    rm -f "$pidfile"
}

# Jobs first, while slurmctld is there to end them (scancel would wait 10 s for a dead one).
if running "$DIR/slurmctld.pid" slurmctld; then
    SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --full --user="$(id -un)" 2>/dev/null
    sleep 1
fi
stop "$DIR/slurmd.pid" slurmd
stop "$DIR/slurmctld.pid" slurmctld
stop "$DIR/munge/munged.pid" munged
echo "stop_cluster: stopped what ran from $DIR"
