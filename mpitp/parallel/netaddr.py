"""The address (and interface) this node uses for torch traffic with other nodes: the replica leader's rendezvous
store when pipeline stages sit on other nodes, and gloo's sockets.

Resolving the host name is not enough: Debian-style ``/etc/hosts`` maps it to 127.0.1.1 (many clusters keep that),
which another node cannot reach (it waited until ``--timeout``), and gloo itself binds to what the host name resolves
to unless ``GLOO_SOCKET_IFNAME`` names an interface. One setting names the node network: ``MPITP_IFACE`` (``--iface``
in ``mpitp eval``/``run``, ``iface:`` in job files, written into the scripts ``mpitp submit`` generates).
:func:`choose_address` is the pure rule (tested case by case); :func:`use_node_network` feeds it this host's facts.
"""

from __future__ import annotations

import ipaddress
import os
import socket

#: Interfaces that carry no traffic between nodes (container and VM bridges, virtual pairs).
_VIRTUAL_PREFIXES = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel", "tun", "tap")


def _usable(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return ip.version == 4 and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def _ifnames(value: str | None) -> list[str]:
    """Interface names from ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` (comma lists; NCCL's ``=`` exact-match
    prefix is dropped, its ``^`` exclusion lists name no interface to use)."""
    if not value or value.startswith("^"):
        return []
    return [v.strip().lstrip("=") for v in value.split(",") if v.strip()]


def choose_address(interfaces: dict[str, list[str]], host_addrs: list[str], env: dict) -> str:
    """The first of: ``MPITP_STORE_ADDR``; the address of the interface ``MPITP_IFACE`` names, else
    ``GLOO_SOCKET_IFNAME``, else ``NCCL_SOCKET_IFNAME`` (prefix match, as NCCL does); a non-loopback address the
    host name resolves to; the first usable IPv4 address of a physical-looking interface (sorted by name).
    Raises ``RuntimeError`` when there is none, naming the setting."""
    if env.get("MPITP_STORE_ADDR"):
        return env["MPITP_STORE_ADDR"]
    for var in ("MPITP_IFACE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        for want in _ifnames(env.get(var)):
            for name in sorted(interfaces):
                if name.startswith(want):
                    usable = [a for a in interfaces[name] if _usable(a)]
                    if usable:
                        return usable[0]
    for addr in host_addrs:
        if _usable(addr):
            return addr
    for name in sorted(interfaces):
        if name.startswith(_VIRTUAL_PREFIXES):
            continue
        usable = [a for a in interfaces[name] if _usable(a)]
        if usable:
            return usable[0]
    raise RuntimeError("no address other nodes can reach: the host name resolves to "
                       f"{', '.join(host_addrs) or 'nothing'} and no interface has a non-loopback IPv4 address; "
                       "set MPITP_IFACE (--iface) to the interface of the node network")


def iface_objection(env: dict, node: str, interfaces: dict[str, list[str]] | None = None) -> str | None:
    """Why ``MPITP_IFACE`` (``--iface``) cannot be used on ``node``, or None. An interface that does not exist (a typo,
    ``ib0`` where the nodes say ``ib1``) was passed over silently for the host name's address: the traffic went over
    another network, slower, or one the nodes cannot reach each other on (a wait until ``--timeout``); ``mpitp info``
    printed that address as if asked for. NCCL and gloo refuse their own variables so. ``interfaces``: this host's
    (:func:`interface_addresses`) unless given; none listed (not Linux) is no objection."""
    value = env.get("MPITP_IFACE")
    wanted = _ifnames(value)
    if not wanted:
        return None
    interfaces = interface_addresses() if interfaces is None else interfaces
    if not interfaces:
        return None
    if any(name.startswith(want) and any(_usable(a) for a in addrs)
           for want in wanted for name, addrs in interfaces.items()):
        return None
    have = ", ".join(f"{name} {' '.join(addrs)}" for name, addrs in sorted(interfaces.items()))
    return (f"--iface {value} (MPITP_IFACE): node {node} has no interface of that name with a non-loopback IPv4 "
            f"address (it has {have})")


def interface_addresses() -> dict[str, list[str]]:
    """IPv4 address of each network interface (Linux ``SIOCGIFADDR``); empty where that is unavailable."""
    out: dict[str, list[str]] = {}
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            out[name] = [socket.inet_ntoa(packed[20:24])]
    return out


def host_addresses() -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    except OSError:
        return []


def interface_of(addr: str, interfaces: dict[str, list[str]] | None = None) -> str | None:
    """The name of this host's interface that holds ``addr`` (None when none does)."""
    interfaces = interface_addresses() if interfaces is None else interfaces
    return next((name for name in sorted(interfaces) if addr in interfaces[name]), None)


def node_network() -> tuple[str, str | None]:
    """``(address, interface)`` this node uses for torch traffic with other nodes; ``("-", None)`` when there is
    none (a single-node machine without a network)."""
    interfaces = interface_addresses()
    try:
        addr = choose_address(interfaces, host_addresses(), dict(os.environ))
    except RuntimeError:
        return "-", None
    return addr, interface_of(addr, interfaces)


def use_node_network() -> str:
    """Point gloo (and NCCL, where ``MPITP_IFACE`` names the interface) at the node network before a torch world
    that spans nodes starts; returns the address other nodes reach this rank at. Variables already set win."""
    interfaces = interface_addresses()
    addr = choose_address(interfaces, host_addresses(), dict(os.environ))  # raises, naming the setting
    iface = interface_of(addr, interfaces)
    if iface and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = iface  # else gloo binds to what the host name resolves to (127.0.1.1)
    if os.environ.get("MPITP_IFACE"):
        os.environ.setdefault("NCCL_SOCKET_IFNAME", os.environ["MPITP_IFACE"])
    return addr
