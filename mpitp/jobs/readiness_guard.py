"""The ground ``mpitp check`` (:mod:`mpitp.jobs.readiness`) stands on: the network blocked as on a compute node,
the offline variables set, and the libraries' own logging quieted while it checks.

Why a guard in the process rather than trusting the offline variables: libraries reach the network by paths those
variables do not cover (nltk's downloader, ``evaluate``'s Hub lookup), and some swallow the error. The guard catches
every connection at the socket layer and records the host, so the report can name it. The patch is
:mod:`mpitp.compat`'s, undone on leaving like every other."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from mpitp import compat

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
EVALUATE_OFFLINE = "HF_EVALUATE_OFFLINE"
"""``evaluate`` asks the Hub for a metric's script before it looks in its cache unless this is set (read when
``evaluate`` is imported); the batch scripts set it as well."""
#: The socket layer's entry points the guard replaces while it is on (:mod:`mpitp.compat` targets). Python's audit
#: hooks (``socket.connect``, ``socket.getaddrinfo``) would see the same calls through public API, but a hook cannot
#: be removed: the guard would outlive ``mpitp check`` in a process that imports it (the tests, a notebook).
_SOCKET = ("socket.socket.connect", "socket.socket.connect_ex", "socket.getaddrinfo")
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def _local(host) -> bool:
    if host is None:
        return True
    host = str(host).strip("[]")
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified


@contextmanager
def block_network(tried: list[str]) -> Iterator[list[str]]:
    """Refuse connections to non-local addresses in this process, recording ``host:port`` in ``tried``.

    Set in the ``mpitp check`` process only (our own process, not a library under test): the guard sits on the
    socket layer every HTTP client goes through, name resolution included, so a host is caught even when the
    library swallows the error (nltk's downloader does)."""
    saved = os.environ.copy()
    for var in (*OFFLINE_VARS, EVALUATE_OFFLINE, "TQDM_DISABLE"):  # TQDM_DISABLE: no progress bar per task built
        os.environ[var] = "1"
    for var in PROXY_VARS:  # a proxy on this host is a local address the guard would let through to the world
        os.environ.pop(var, None)
    os.environ["EVALUATE_VERBOSITY"] = "error"  # evaluate sets its logger's level when imported (here, by a task)
    real_connect, real_connect_ex, real_getaddrinfo = (compat.attribute(k) for k in _SOCKET)

    def refuse(host: str | bytes | None, port: int | str | None) -> NoReturn:
        where = f"{host}:{port}" if port is not None else str(host)
        if where not in tried:
            tried.append(where)
        raise OSError(errno.ENETUNREACH, f"mpitp check: network blocked (compute nodes have none): {where}")

    def guarded(real: Callable[[socket.socket, Any], object]) -> Callable[[socket.socket, Any], object]:
        # socket.connect and connect_ex: the same test before the real call
        def connect(sock: socket.socket, address: Any) -> object:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
                refuse(address[0], address[1])
            return real(sock, address)
        return connect

    connect, connect_ex = guarded(real_connect), guarded(real_connect_ex)

    def getaddrinfo(host: str | bytes | None, port: int | str | None, *args, **kwargs) -> list:
        if not _local(host.decode() if isinstance(host, bytes) else host):
            refuse(host, port)
        return real_getaddrinfo(host, port, *args, **kwargs)

    try:
        with contextlib.ExitStack() as patches:  # process-wide, put back on leaving (mpitp.compat)
            for key, guard in zip(_SOCKET, (connect, connect_ex, getaddrinfo)):
                patches.enter_context(compat.replaced(key, guard))
            yield tried
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """The libraries' own logging at ERROR while checking: what matters comes back as problems. lm-eval's metric
    registry logs an ``evaluate`` module it could not load as an error and keeps None, which the check reports as a
    problem with its fetch command (:func:`mpitp.jobs.readiness_tasks.unloaded_metrics`): that log line would say it
    twice, once unasked."""
    names = {"lm-eval": logging.ERROR, "lm_eval": logging.ERROR, "datasets": logging.ERROR, "evaluate": logging.ERROR,
             "transformers": logging.ERROR, "lm_eval.api.registry": logging.CRITICAL}
    quiet = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in quiet]
    for lg, level in zip(quiet, names.values()):
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
