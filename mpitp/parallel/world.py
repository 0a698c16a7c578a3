"""The MPI process world: who am I, which node am I on, which device and how many threads do I get.

Node-local rank comes from ``Split_type(COMM_TYPE_SHARED)`` rather than launcher environment variables, because
``mpiexec``, ``mpirun``, ``srun`` and PBS's ``mpiexec`` all name them differently (and some not at all).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpi4py import MPI

if TYPE_CHECKING:
    from collections.abc import Mapping


def detect_launcher(env: Mapping[str, str] = os.environ) -> str:
    """Name the launcher that started this process, from the variables each one is known to set."""
    if "OMPI_COMM_WORLD_RANK" in env or "PRTE_LAUNCHED" in env:
        # Open MPI 5's mpirun/mpiexec are PRRTE's prterun; Open MPI 4's orterun set OMPI_* without PMIx's PRTE_*.
        return "prterun (Open MPI)" if any(k.startswith("PRTE_") for k in env) else "mpirun (Open MPI)"
    if "SLURM_STEP_ID" in env and ("PMI_RANK" in env or "PMIX_RANK" in env or "SLURM_PROCID" in env):
        if "PMIX_RANK" in env:
            return "srun (PMIx)"
        return "srun (PMI-2)" if "PMI_RANK" in env or "PMI_FD" in env else "srun (no MPI plugin)"
    if "PALS_RANKID" in env:
        return "mpiexec (PALS/PBS)"
    if "PMI_RANK" in env or "PMIX_RANK" in env or "HYDRA_CONTROL_FD" in env or "PMI_FD" in env:
        return "mpiexec (Hydra/PMI)"
    return "singleton"


def clean_mpi_string(text: str | bytes) -> str:
    """A string from the MPI library made safe to store: C strings can carry their NUL terminator (Open MPI's
    library version does) and HDF5's variable-length strings refuse embedded NULs; other control characters go too."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = str(text).split("\x00", 1)[0]
    return "".join(ch if ch.isprintable() or ch in "\n\t" else " " for ch in text).strip()


def mpi_implementation() -> str:
    """The MPI family mpi4py is linked against: ``MPICH``, ``Open MPI``, ``Intel MPI``, ... (mpi4py's own guess)."""
    name, version = MPI.get_vendor()
    return f"{clean_mpi_string(name)} {'.'.join(map(str, version))}"


def _available_cpus(pid: int = 0) -> set[int]:
    try:
        return set(os.sched_getaffinity(pid))
    except AttributeError:  # pragma: no cover - non-Linux
        return set(range(os.cpu_count() or 1))
    except OSError:  # the parent is gone or not ours to read: only this process's own set is known
        return set(os.sched_getaffinity(0))


@dataclass(frozen=True)
class World:
    """This process's place in the MPI job. Immutable; built once by :func:`world_from_comm`."""

    comm: MPI.Comm = field(repr=False)
    node_comm: MPI.Comm = field(repr=False)
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_name: str
    node_index: int
    n_nodes: int
    node_of_rank: tuple[int, ...]
    cores_per_node: int
    launcher: str
    node_names: tuple[str, ...] = ()  # by node index
    #: The cores the node's ranks' parents (their launcher: prterun, prted, hydra's proxy, slurmstepd) may use; more
    #: than ``cores_per_node`` where the launcher bound its ranks to fewer (Open MPI binds each to a core at np <= 2).
    launcher_cores: int = 0

    @property
    def nodes_text(self) -> str:
        """``nodea:2,nodeb:2``: each node's name and how many ranks it holds, in node order."""
        counts = [self.node_of_rank.count(i) for i in range(self.n_nodes)]
        names = self.node_names or tuple(str(i) for i in range(self.n_nodes))
        return ",".join(f"{name}:{k}" for name, k in zip(names, counts))

    @property
    def default_threads(self) -> int:
        """cores-per-node / ranks-per-node (min 1): ranks that share cores must not oversubscribe them."""
        return max(1, self.cores_per_node // self.local_size)


def world_from_comm(comm: MPI.Comm | None = None) -> World:
    """Describe the world of ``comm`` (default COMM_WORLD). Collective over ``comm``."""
    comm = comm or MPI.COMM_WORLD
    if comm == MPI.COMM_WORLD:
        from mpitp.parallel.launch import check_launch

        check_launch(comm.Get_size(), mpi_implementation())
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    name = clean_mpi_string(MPI.Get_processor_name())
    # Node identity: the lowest world rank on each node names it; nodes are numbered in order of first rank.
    node_leader = node_comm.allreduce(comm.Get_rank(), op=MPI.MIN)
    leaders = comm.allgather(node_leader)
    order = {leader: i for i, leader in enumerate(sorted(set(leaders)))}
    names = comm.allgather(name)
    cpus = node_comm.allgather((_available_cpus(), _available_cpus(os.getppid())))
    cores = len(set().union(*(own for own, _ in cpus)))
    return World(
        comm=comm,
        node_comm=node_comm,
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=node_comm.Get_rank(),
        local_size=node_comm.Get_size(),
        node_name=name,
        node_index=order[node_leader],
        n_nodes=len(order),
        node_of_rank=tuple(order[x] for x in leaders),
        cores_per_node=cores,
        launcher=detect_launcher(),
        node_names=tuple(names[leader] for leader in sorted(order)),
        launcher_cores=len(set().union(*(parent for _, parent in cpus))),
    )


def mpi_library_version() -> str:
    """The MPI library's own one-line version (e.g. ``MPICH Version: 5.0.2``), cleaned for storing."""
    lines = clean_mpi_string(MPI.Get_library_version()).splitlines()
    return lines[0].strip() if lines else "unknown"
