"""The address a replica leader's rendezvous store listens on when pipeline stages sit on other nodes.

Resolving the host name is not enough: Debian-style ``/etc/hosts`` maps it to 127.0.1.1, which the other node
cannot reach (it waited until ``--timeout``). :func:`choose_address` is the pure rule (tested case by case);
:func:`store_address` feeds it this host's facts. The chosen address travels to the other ranks over MPI.
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
    """The first of: ``MPITP_STORE_ADDR``; the address of the interface ``GLOO_SOCKET_IFNAME`` (else
    ``NCCL_SOCKET_IFNAME``) names (prefix match, as NCCL does); a non-loopback address the host name resolves to;
    the first usable IPv4 address of a physical-looking interface (sorted by name). Raises ``RuntimeError`` when
    there is none, naming the variable to set."""
    if env.get("MPITP_STORE_ADDR"):
        return env["MPITP_STORE_ADDR"]
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
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
                       "set MPITP_STORE_ADDR (or GLOO_SOCKET_IFNAME) to the address/interface of the node network")


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


def store_address() -> str:
    return choose_address(interface_addresses(), host_addresses(), dict(os.environ))
