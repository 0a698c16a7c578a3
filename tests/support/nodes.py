"""Launches across emulated compute nodes (``hpc/local-nodes.sh``: a network namespace, hostname and sshd per node).

Ranks start over real ssh on nodes whose own hostname resolves to 127.0.1.1 (as on many clusters); MPICH's Hydra
and Open MPI's prterun run here, in the machine's own namespace, and reach the nodes through the bridge. A test that
needs the nodes asks for :func:`require_nodes`: skipped where none are up, failed under CI (``.ci/run`` starts them).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from . import REPO
from .mpi import mpi_family, mpiexec_path

DIR = Path(os.environ.get("MPITP_NODES_DIR", "/var/tmp/mpitp-nodes"))
SSH = DIR / "ssh"
BRIDGE = "mpitpbr0"
SUBNET = "10.77.0.0/24"
NODES = ("nodea", "nodeb")
SCRIPT = REPO / "hpc" / "local-nodes.sh"

#: Variables Open MPI's prterun must be told to pass on (-x); MPICH's Hydra passes the whole environment.
_FORWARD_PREFIXES = ("HF_", "MPITP_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "OMP_", "GLOO_", "TQDM_")


def require_nodes() -> None:
    """Skip the test unless the emulated nodes answer over ssh; under CI their absence is a failure."""
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True, timeout=60) \
        if SSH.exists() else None
    if status is not None and status.returncode == 0:
        return
    why = status.stdout.strip() if status is not None else f"no {SSH}"
    if os.environ.get("CI"):
        pytest.fail(f"emulated nodes are not up under CI ({why}); .ci/run starts them with hpc/local-nodes.sh")
    pytest.skip(f"emulated nodes are not up ({why}); hpc/local-nodes.sh start")


def launcher(per_node: dict[str, int]) -> list[str]:
    """The launch prefix for ``per_node`` ranks on each node, under the suite's MPI."""
    n = sum(per_node.values())
    hosts = ",".join(f"{node}:{k}" for node, k in per_node.items())
    if mpi_family() == "openmpi":
        forward = sorted({k for k in os.environ if k.startswith(_FORWARD_PREFIXES)} | {"PATH", "MPITP_TEST_LAUNCH_TAG"}
                         | {"HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONUNBUFFERED"})
        prefix = str(Path(mpiexec_path()).parent.parent)
        return [mpiexec_path(), "--prefix", prefix, "--mca", "plm_rsh_agent", str(SSH),
                "--prtemca", "oob_tcp_if_include", SUBNET, "--mca", "btl_tcp_if_include", SUBNET,
                "--host", hosts, "--map-by", "slot", "--oversubscribe", "-n", str(n),
                *[a for k in forward for a in ("-x", k)]]
    # The emulated nodes share one kernel, and UCX (MPICH's network module) would reach the other node's ranks
    # through shared memory and cross-memory attach: node traffic goes over the bridge only with TCP alone, as
    # between real nodes (a cut network then cuts it).
    return [mpiexec_path(), "-launcher", "ssh", "-launcher-exec", str(SSH), "-iface", BRIDGE, "-hosts", hosts,
            "-genv", "UCX_TLS", "tcp,self", "-n", str(n)]


def launcher_on(node: str, per_node: dict[str, int]) -> list[str]:
    """MPICH's launch prefix run *on* ``node``, as a batch script runs on a job's first node: Hydra starts that node's
    proxy itself (no ssh) and the others over ssh, through the node's own interface."""
    n = sum(per_node.values())
    hosts = ",".join(f"{name}:{k}" for name, k in per_node.items())
    return ["ip", "netns", "exec", namespace(node), "unshare", "--uts", "sh", "-c", f'hostname {node}; exec "$@"',
            "sh", mpiexec_path(), "-launcher", "ssh", "-launcher-exec", str(SSH), "-iface", "eth0", "-hosts", hosts,
            "-genv", "UCX_TLS", "tcp,self", "-n", str(n)]


def namespace(node: str) -> str:
    return f"mpitp-{node}"


def set_link(node: str, up: bool) -> None:
    """Cut (or restore) a node's network: its interface on the bridge goes down (or up)."""
    subprocess.run(["ip", "-n", namespace(node), "link", "set", "eth0", "up" if up else "down"], check=True,
                   timeout=30)


#: SLURM node states (sinfo's ``%t``) a step can start on.
SCHEDULABLE = frozenset({"idle", "mix", "alloc"})


def slurm_nodes_ready(nodes=NODES, timeout: float = 60.0) -> list[str]:
    """Bring the local SLURM's emulated nodes back to a state a step can start on, and return their states (sinfo's
    ``%t``). A slurmctld ping that met a cut link (or failed after it was restored: a ping waits its MessageTimeout)
    leaves a node "not responding" (``idle*``) until a ping a hundred seconds later succeeds, or DOWN once
    SlurmdTimeout passes; until then ``srun`` queues with "Required node not available" (a CI run waited 240 s).
    ``scontrol reconfigure`` makes every slurmd register again, which clears the first; ``state=resume`` the second.
    Call it before a step on these nodes, not only after a cut: the ping's failure may land after the link is back."""
    states: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True,
                                 timeout=30).stdout.strip() for node in nodes]
        if set(states) <= SCHEDULABLE or not all(states):  # ready, or not SLURM's nodes
            break
        for node, state in zip(nodes, states):
            if state.startswith(("down", "drain")):
                subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True,
                               timeout=30)
        if any(s.endswith("*") for s in states):
            subprocess.run(["scontrol", "reconfigure"], capture_output=True, timeout=30)
        time.sleep(1.0)
    return states
