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
# With the emulated compute nodes of hpc/local-nodes.sh up (start them first), each gets a slurmd of its own inside
# its namespaces (its own NodeName, hostname and address) and a partition `nodes` holds them, so a job with
# --partition nodes --nodes 2 runs a real two-node srun step; slurmctld is then reached at the bridge's address.
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
NODES_DIR=${MPITP_NODES_DIR:-/var/tmp/mpitp-nodes}
EMULATED=()  # the emulated nodes that are up: "name address"
if [[ -f $NODES_DIR/hosts ]] && command -v ip >/dev/null; then
    while read -r addr name; do
        ip netns list 2>/dev/null | grep -qw "mpitp-$name" && EMULATED+=("$name $addr")
    done < "$NODES_DIR/hosts"
fi

say() { echo "local-slurm: $*" >&2; }

alive() {  # alive NAME: the pid this script recorded for NAME (slurmd-NODE: that node's slurmd) still runs it
    local f="$DIR/started/$1.pid" pid
    [[ -f $f ]] || return 1
    pid=$(cat "$f")
    [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q "${1%%-*}"
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
    local ctld=$HOST nodes_conf="" names="" n
    if ((${#EMULATED[@]})); then
        ctld="$HOST(10.77.0.1)"  # the emulated nodes reach slurmctld on the bridge (hpc/local-nodes.sh)
        for n in "${EMULATED[@]}"; do
            nodes_conf+="NodeName=${n% *} NodeAddr=${n#* } CPUs=$CPUS RealMemory=$mem State=UNKNOWN"$'\n'
            names+="${names:+,}${n% *}"
        done
        nodes_conf+="PartitionName=nodes Nodes=$names MaxTime=INFINITE State=UP"
    fi
    cat > "$CONF.new" <<EOF
$MARK
ClusterName=mpitp-local
SlurmctldHost=$ctld
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120): short here, for quick requeues.
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
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
$nodes_conf
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

start_daemon() {  # start_daemon NAME [NODE]: slurmctld, or the slurmd of NODE (default: this host, else an emulated
    # node, inside its namespaces), unless the one we started runs (restarted: new config)
    local name=$1 node=${2:-} key=$1 pidfile=$DIR/$1.pid log=$DIR/$1.log
    if [[ $name == slurmd ]]; then
        node=${node:-$HOST}; key=slurmd-$node; pidfile=$DIR/slurmd-$node.pid; log=$DIR/slurmd-$node.log
    fi
    if alive "$key" && [[ $CONFIG_CHANGED == 1 ]]; then
        say "config changed: restarting $key"; stop_one "$key"
    fi
    if alive "$key"; then return; fi
    if [[ $key == slurmctld || $node == "$HOST" ]] && pgrep -x "$name" >/dev/null && ! running_ours; then
        say "a $name this script did not start is running: leaving it"; return
    fi
    rm -f "$pidfile"
    if [[ $name == slurmd && $node != "$HOST" ]]; then
        # `ip netns exec` mounts a fresh /sys for the namespace, without the cgroup hierarchies slurmd looks for:
        # they are mounted again (the same v1 hierarchies as the host's: proctrack/linuxproc puts nothing in them).
        ip netns exec "mpitp-$node" unshare --uts sh -c "hostname $node
            mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
            for c in cpu cpuacct cpuset memory devices freezer blkio pids; do
                mkdir -p /sys/fs/cgroup/\$c && mount -t cgroup -o \$c cgroup /sys/fs/cgroup/\$c 2>/dev/null
            done
            mkdir -p /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
            exec /usr/sbin/slurmd -N $node"
    elif [[ $name == slurmd ]]; then
        /usr/sbin/slurmd -N "$HOST"
    else
        "/usr/sbin/$name"
    fi
    for _ in $(seq 100); do [[ -s $pidfile ]] && break; sleep 0.1; done
    [[ -s $pidfile ]] || { say "$key did not start; see $log"; tail -5 "$log" >&2; exit 1; }
    cp "$pidfile" "$DIR/started/$key.pid"
}

running_ours() {  # some daemon this script started is alive (then other slurmds beside it are ours too)
    local f
    for f in "$DIR"/started/slurm*.pid; do [[ -f $f ]] && alive "$(basename "$f" .pid)" && return 0; done
    return 1
}

wait_idle() {  # wait_idle NODE PARTITION
    local node=$1 part=$2 state
    for _ in $(seq 120); do
        state=$(sinfo -h -n "$node" -o %t 2>/dev/null | head -1)
        case $state in
            idle|mix|alloc) say "node $node $state ($CPUS CPUs declared), partition $part; logs in $DIR"; return;;
            down*|drain*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true;;
        esac
        sleep 0.5
    done
    say "node $node did not become idle (state '${state:-?}'); see $DIR/slurmctld.log and $DIR/slurmd-$node.log"
    exit 1
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
    local f
    for f in "$DIR"/started/slurmd*.pid; do [[ -f $f ]] && stop_one "$(basename "$f" .pid)"; done
    for name in slurmctld munged; do stop_one "$name"; done
}

case ${1:-start} in
    start)
        [[ $(id -u) == 0 ]] || { say "run as root (apt-get, slurmd)"; exit 1; }
        install; write_config; start_munge; start_daemon slurmctld; start_daemon slurmd; wait_idle "$HOST" local
        for n in "${EMULATED[@]}"; do start_daemon slurmd "${n% *}"; wait_idle "${n% *}" nodes; done;;
    stop) stop;;
    status)
        for name in munged slurmctld "slurmd-$HOST" "${EMULATED[@]/#/slurmd-}"; do
            name=${name%% *}
            if alive "$name"; then echo "$name: running (pid $(cat "$DIR/started/$name.pid"))"; else echo "$name: not started by this script"; fi
        done
        sinfo 2>/dev/null || true;;
    *) echo "usage: $0 [start|status|stop]" >&2; exit 2;;
esac
