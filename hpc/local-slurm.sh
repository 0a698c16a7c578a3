#!/usr/bin/env bash
# A real single-node SLURM on this machine, for trying (and testing) `mpitp submit --scheduler slurm` on a laptop or
# in CI: Debian's slurm-wlm and munge, one node, one partition, daemons as root.
#
#   hpc/local-slurm.sh start    install (apt) if needed, write the config, start munged, slurmctld, slurmd; wait idle
#   hpc/local-slurm.sh status   which of the daemons it started are alive, and sinfo
#   hpc/local-slurm.sh stop     stop the daemons this script started (by the pids it recorded), nothing else
#
# Idempotent: `start` again leaves running daemons alone. It refuses to replace an /etc/slurm/slurm.conf it did not
# write. State, logs and pids live in $MPITP_SLURM_DIR (default /var/tmp/mpitp-slurm). Needs root (apt, slurmd).
# The node declares MPITP_SLURM_CPUS CPUs (default 16, more than most laptops have: slurmd is told to trust the
# config, SlurmdParameters=config_overrides) so 4-rank jobs fit on 2 cores; cgroups are not used
# (proctrack/linuxproc, task/none) so it runs in containers too.
set -euo pipefail

DIR=${MPITP_SLURM_DIR:-/var/tmp/mpitp-slurm}
CPUS=${MPITP_SLURM_CPUS:-16}
CONF=/etc/slurm/slurm.conf
CONFIG_CHANGED=0
MARK="# written by mpitp hpc/local-slurm.sh"
HOST=$(hostname -s)

say() { echo "local-slurm: $*" >&2; }

alive() {  # alive NAME: the pid this script recorded for NAME still runs that daemon
    local f="$DIR/started/$1.pid" pid
    [[ -f $f ]] || return 1
    pid=$(cat "$f")
    [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "$1"
}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    say "installing slurm-wlm and munge (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_config() {
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        say "$CONF exists and was not written by this script: not touching it"; exit 1
    fi
    local mem
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
    mkdir -p /etc/slurm "$DIR/state" "$DIR/spool" "$DIR/started"
    cat > "$CONF.new" <<EOF
$MARK
ClusterName=mpitp-local
SlurmctldHost=$HOST
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120): short here, for quick requeues.
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
InactiveLimit=0
NodeName=$HOST CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    if [[ -f $CONF ]] && cmp -s "$CONF" "$CONF.new"; then rm "$CONF.new"; return; fi
    mv "$CONF.new" "$CONF"
    CONFIG_CHANGED=1
}

start_munge() {
    if alive munged || munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    [[ -s /etc/munge/munge.key ]] || { mungekey --create 2>/dev/null || create-munge-key -f; }
    local user=munge
    id munge >/dev/null 2>&1 || user=root
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown -R "$user" /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge; chmod 0600 /etc/munge/munge.key
    if [[ $user == munge ]]; then runuser -u munge -- /usr/sbin/munged; else /usr/sbin/munged --force; fi
    for _ in $(seq 50); do [[ -s /run/munge/munged.pid ]] && break; sleep 0.1; done
    cp /run/munge/munged.pid "$DIR/started/munged.pid"
}

start_daemon() {  # start_daemon NAME: slurmctld or slurmd, unless the one we started runs (restarted: new config)
    local name=$1
    if alive "$name" && [[ $CONFIG_CHANGED == 1 ]]; then
        say "config changed: restarting $name"; stop_one "$name"
    fi
    if alive "$name"; then return; fi
    if pgrep -x "$name" >/dev/null; then say "a $name this script did not start is running: leaving it"; return; fi
    rm -f "$DIR/$name.pid"
    "/usr/sbin/$name"
    for _ in $(seq 100); do [[ -s $DIR/$name.pid ]] && break; sleep 0.1; done
    [[ -s $DIR/$name.pid ]] || { say "$name did not start; see $DIR/$name.log"; tail -5 "$DIR/$name.log" >&2; exit 1; }
    cp "$DIR/$name.pid" "$DIR/started/$name.pid"
}

wait_idle() {
    for _ in $(seq 120); do
        state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null | head -1)
        case $state in
            idle|mix|alloc) say "node $HOST $state ($CPUS CPUs declared), partition local; logs in $DIR"; return;;
            down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true;;
        esac
        sleep 0.5
    done
    say "node $HOST did not become idle (state '${state:-?}'); see $DIR/slurmctld.log and $DIR/slurmd.log"; exit 1
}

stop_one() {
    local name=$1 pid
    if alive "$name"; then
        pid=$(cat "$DIR/started/$name.pid")
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        say "stopped $name (pid $pid)"
    fi
    rm -f "$DIR/started/$name.pid"
}

stop() {
    for name in slurmd slurmctld munged; do stop_one "$name"; done
}

case ${1:-start} in
    start)
        [[ $(id -u) == 0 ]] || { say "run as root (apt-get, slurmd)"; exit 1; }
        install; write_config; start_munge; start_daemon slurmctld; start_daemon slurmd; wait_idle;;
    stop) stop;;
    status)
        for name in munged slurmctld slurmd; do
            if alive "$name"; then echo "$name: running (pid $(cat "$DIR/started/$name.pid"))"; else echo "$name: not started by this script"; fi
        done
        sinfo 2>/dev/null || true;;
    *) echo "usage: $0 [start|status|stop]" >&2; exit 2;;
esac
