#!/usr/bin/env bash
# Emulated compute nodes on one machine, for trying (and testing) multi-node launches on a laptop or in CI: each node
# is a network namespace with its own loopback, its own address on a bridge, its own hostname (a UTS namespace) and its
# own sshd. The filesystem is shared, as on a cluster. Root's processes reach a node by ssh as root, with a key this
# script makes (the ssh wrapper below carries it, so ~/.ssh is not touched).
#
#   hpc/local-nodes.sh start    install openssh-server (apt) if needed, create the bridge and the nodes, start sshd
#   hpc/local-nodes.sh status   the nodes, their addresses and whether each sshd answers
#   hpc/local-nodes.sh stop     stop the sshds and remove the namespaces, veths and the bridge this script created
#   hpc/local-nodes.sh env      print the variables that launch across the nodes (eval "$(hpc/local-nodes.sh env)")
#
# The nodes are named by MPITP_NODES (default "nodea nodeb"); the bridge is $BRIDGE with $NET.1 on the host and
# $NET.(10+i) on node i. Each node's own /etc/hosts (ip netns' /etc/netns/<ns>/hosts) maps its hostname to 127.0.1.1,
# the Debian default many clusters keep, so code that derives an address from the hostname breaks here as it would
# there. Idempotent; needs root. State lives in $MPITP_NODES_DIR (default /var/tmp/mpitp-nodes).
#
# Launch across the nodes (after `eval "$(hpc/local-nodes.sh env)"`):
#   MPICH:    mpiexec -launcher ssh -launcher-exec "$MPITP_NODES_SSH" -iface mpitpbr0 -hosts nodea:2,nodeb:2 -n 4 ...
#   Open MPI: mpirun --mca plm_rsh_agent "$MPITP_NODES_SSH" --host nodea:2,nodeb:2 -n 4 ...
set -euo pipefail

DIR=${MPITP_NODES_DIR:-/var/tmp/mpitp-nodes}
NODES=(${MPITP_NODES:-nodea nodeb})
BRIDGE=mpitpbr0
NET=10.77.0

say() { echo "local-nodes: $*" >&2; }

install() {
    command -v sshd >/dev/null && command -v ip >/dev/null && command -v unshare >/dev/null && return
    say "installing openssh-server and iproute2 (apt)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server iproute2 util-linux >/dev/null
}

sshd_bin() { command -v sshd || echo /usr/sbin/sshd; }

write_ssh() {
    mkdir -p "$DIR"
    chmod 700 "$DIR"
    [[ -f $DIR/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/id_ed25519" -C mpitp-local-nodes
    [[ -f $DIR/ssh_host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N "" -f "$DIR/ssh_host_ed25519_key"
    cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
    chmod 600 "$DIR/authorized_keys"
    : > "$DIR/hosts"
    local i=0 n
    for n in "${NODES[@]}"; do
        echo "$NET.$((10 + i)) $n" >> "$DIR/hosts"
        i=$((i + 1))
    done
    {
        echo "Host ${NODES[*]}"
        echo "  IdentityFile $DIR/id_ed25519"
        echo "  IdentitiesOnly yes"
        echo "  User root"
        echo "  StrictHostKeyChecking no"
        echo "  UserKnownHostsFile /dev/null"
        echo "  LogLevel ERROR"
        echo "  BatchMode yes"
        echo "  ConnectTimeout 5"
        # A launcher that loses a node must notice: the session ends when the peer stops answering.
        echo "  ServerAliveInterval 2"
        echo "  ServerAliveCountMax 3"
    } > "$DIR/ssh_config"
    # hostnames -> addresses for ssh, without editing /etc/hosts: one Host block per node
    while read -r addr name; do
        printf 'Host %s\n  HostName %s\n' "$name" "$addr" >> "$DIR/ssh_config"
    done < "$DIR/hosts"
    cat > "$DIR/ssh" <<EOF
#!/bin/sh
# ssh to the emulated nodes (hpc/local-nodes.sh): the launchers' -launcher-exec / plm_rsh_agent
exec ssh -F "$DIR/ssh_config" "\$@"
EOF
    chmod 755 "$DIR/ssh"
    cat > "$DIR/sshd_config" <<EOF
Port 22
ListenAddress 0.0.0.0
HostKey $DIR/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AuthorizedKeysFile $DIR/authorized_keys
# The user's environment reaches the ranks through the launcher (MPICH passes it, Open MPI with -x), not through ssh.
AcceptEnv LANG LC_*
MaxStartups 100:30:200
MaxSessions 100
ClientAliveInterval 2
ClientAliveCountMax 3
PidFile none
EOF
}

ns() { echo "mpitp-$1"; }

node_hosts() {  # the node's /etc/hosts: its own name -> 127.0.1.1 (Debian style), the others by bridge address
    local me=$1
    echo "127.0.0.1 localhost"
    echo "127.0.1.1 $me"
    grep -v " $me\$" "$DIR/hosts"
}

up_bridge() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
}

up_node() {  # up_node NAME INDEX
    local n=$1 i=$2 s
    s=$(ns "$n")
    ip netns list | grep -qw "$s" || ip netns add "$s"
    if ! ip link show "v-$n" >/dev/null 2>&1; then
        ip link add "v-$n" type veth peer name eth0 netns "$s"
        ip link set "v-$n" master "$BRIDGE"
        ip -n "$s" addr add "$NET.$((10 + i))/24" dev eth0
    fi
    ip link set "v-$n" up
    ip -n "$s" link set lo up
    ip -n "$s" link set eth0 up
    mkdir -p "/etc/netns/$s"
    node_hosts "$n" > "/etc/netns/$s/hosts"
    echo "$n" > "/etc/netns/$s/hostname"
    if [[ -f $DIR/$n.sshd.pid ]] && kill -0 "$(cat "$DIR/$n.sshd.pid")" 2>/dev/null; then
        return
    fi
    # sshd -D in the node's namespaces; the sessions it starts inherit them (hostname included).
    ip netns exec "$s" unshare --uts sh -c "hostname $n; exec $(sshd_bin) -D -e -f $DIR/sshd_config" \
        >"$DIR/$n.sshd.log" 2>&1 &
    echo $! > "$DIR/$n.sshd.pid"
}

wait_ssh() {
    local n deadline=$((SECONDS + 30))
    for n in "${NODES[@]}"; do
        until [[ $("$DIR/ssh" "$n" hostname 2>/dev/null) == "$n" ]]; do
            if ((SECONDS > deadline)); then say "sshd on $n does not answer (see $DIR/$n.sshd.log)"; exit 1; fi
            sleep 0.3
        done
    done
}

start() {
    [[ $(id -u) == 0 ]] || { say "run as root (namespaces, sshd)"; exit 1; }
    install
    mkdir -p /run/sshd
    write_ssh
    up_bridge
    local i=0 n
    for n in "${NODES[@]}"; do
        up_node "$n" "$i"
        i=$((i + 1))
    done
    wait_ssh
    say "up: ${NODES[*]} on $BRIDGE ($NET.0/24); eval \"\$($0 env)\" to launch across them"
}

stop() {
    local n s
    for n in "${NODES[@]}"; do
        s=$(ns "$n")
        if [[ -f $DIR/$n.sshd.pid ]]; then
            kill "$(cat "$DIR/$n.sshd.pid")" 2>/dev/null || true
            rm -f "$DIR/$n.sshd.pid"
        fi
        # whatever still runs inside the node (ranks left behind by a killed launcher)
        if ip netns list | grep -qw "$s"; then
            for pid in $(ip netns pids "$s" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$s"
        fi
        ip link del "v-$n" 2>/dev/null || true
        rm -rf "/etc/netns/$s"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    say "stopped"
}

status() {
    local n rc=0
    for n in "${NODES[@]}"; do
        if [[ $("$DIR/ssh" "$n" hostname 2>/dev/null) == "$n" ]]; then
            echo "$n $(grep " $n\$" "$DIR/hosts" | cut -d' ' -f1) up"
        else
            echo "$n down"; rc=1
        fi
    done
    return $rc
}

env_vars() {
    local hosts="" n
    for n in "${NODES[@]}"; do hosts+="${hosts:+ }$n"; done
    # UCX (MPICH's network module) would reach the other nodes' ranks through the shared kernel's memory: TCP only,
    # so node traffic crosses the bridge as between real nodes.
    echo "export MPITP_NODES_SSH=$DIR/ssh MPITP_NODES_IFACE=$BRIDGE MPITP_NODES_LIST='$hosts' UCX_TLS=tcp,self"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) env_vars ;;
    *) echo "usage: $0 start|status|stop|env" >&2; exit 2 ;;
esac
