"""Launch checks: the launcher's task count must be the MPI world's size.

A launcher that starts N processes without wiring them into one MPI world (``srun --mpi=none`` or a plugin the MPI
library does not speak, ``torchrun``, a PMIx launcher for a PMI-2 MPI) leaves N singletons, each of which is its own
rank 0: each would run the whole evaluation and write the same results file. Every launcher leaves its task count in
the environment, so the mismatch is visible before anything is loaded, and every process can refuse by itself (no
communication is possible between them: that is the problem).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mpitp.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Mapping

#: (variable holding the task count, variable that must be present as well for it to count, launcher name).
#: SLURM's step variables are only set inside ``srun`` steps (a batch script's own shell has ``SLURM_NTASKS`` of
#: the allocation, which ``mpirun -n 2`` inside a 4-task allocation legitimately undercuts).
_SOURCES = (
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "srun"),
    ("OMPI_COMM_WORLD_SIZE", None, "Open MPI's mpirun"),
    ("PMI_SIZE", None, "a PMI launcher (mpiexec/Hydra, srun --mpi=pmi2, PALS)"),
    ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "torchrun"),
)


def launcher_tasks(env: Mapping[str, str] = os.environ) -> list[tuple[int, str, str]]:
    """Every task count the environment states: ``(count, variable, launcher)``."""
    found = []
    for var, companion, who in _SOURCES:
        if var not in env or (companion and companion not in env):
            continue
        try:
            n = int(str(env[var]).split("(")[0])
        except ValueError:
            continue
        found.append((n, var, who))
    return found


def _fix(who: str, n: int, mpi_name: str) -> str:
    if who == "srun":
        plugin = "pmix" if mpi_name.startswith("Open MPI") else "pmi2"
        return (f"srun's MPI plugin does not match this MPI library ({mpi_name}): run `srun --mpi={plugin} ...` "
                f"(see `srun --mpi=list`) or `mpirun -n {n}` inside the allocation")
    if who == "torchrun":
        return f"mpitp is launched by MPI, not torchrun: run `mpiexec -n {n} mpitp ...`"
    return f"the launcher and mpi4py use different MPI libraries ({mpi_name}): use the mpiexec of that MPI"


def check_launch(world_size: int, mpi_name: str = "", env: Mapping[str, str] = os.environ) -> None:
    """Refuse (:class:`UsageError`, collective: every process reaches the same verdict alone) when a launcher
    started more tasks than the MPI world has ranks."""
    for n, var, who in launcher_tasks(env):
        if n > world_size:
            raise UsageError(f"{who} started {n} tasks ({var}={n}) but MPI sees a world of {world_size}: each process "
                             f"would run the whole evaluation alone; {_fix(who, n, mpi_name)}", collective=True)


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "t", "true", "yes", "y", "enabled")


def _open_mpi_yields(launcher: str, env: Mapping[str, str]) -> bool:
    """Open MPI's ``mpi_yield_when_idle`` is on here: set by the user, or by ``prterun`` because it mapped more ranks
    than the slots it was given (``--oversubscribe`` on a node of fewer cores: ``OMPI_UNIVERSE_SIZE``, the slots, is
    below the world's size). A host list or hostfile that claims a slot per rank (``--host localhost:4`` on 2 cores)
    leaves it off: there ``mpi_show_mca_params`` shows ``mpi_yield_when_idle=false (default)``."""
    if _truthy(env.get("OMPI_MCA_mpi_yield_when_idle")):
        return True
    if not launcher.startswith("prterun"):
        return False
    try:
        return int(env["OMPI_UNIVERSE_SIZE"]) < int(env["OMPI_COMM_WORLD_SIZE"])
    except (KeyError, ValueError):
        return True  # not known: no advice rather than a wrong one


def oversubscription_warning(ranks_on_node: int, cores_on_node: int, mpi_name: str, launcher: str = "",
                             env: Mapping[str, str] = os.environ) -> str | None:
    """A warning when more ranks than cores share a node, naming the setting known to hurt there.

    Open MPI busy-polls in its progress engine unless ``mpi_yield_when_idle`` is on. Open MPI 5 turns it on by itself
    only when its own launcher knows the node is oversubscribed (``mpirun --oversubscribe``: ``mpi_show_mca_params``
    shows ``mpi_yield_when_idle=true (default)``); started by ``srun``, or by ``mpirun`` with a hostfile that claims
    more slots than cores, it stays off and each waiting rank holds a core its peer needs (:func:`_open_mpi_yields`).
    """
    if ranks_on_node <= cores_on_node:
        return None
    head = f"{ranks_on_node} ranks on {cores_on_node} cores: oversubscribed (slow; fine for trying things out)"
    if mpi_name.startswith("Open MPI") and not _open_mpi_yields(launcher, env):
        return f"{head}; Open MPI busy-polls while waiting unless told: export OMPI_MCA_mpi_yield_when_idle=1"
    return head


def binding_warning(bound: int, offered: int, mpi_name: str, launcher: str) -> str | None:
    """A warning when Open MPI's ``mpirun`` bound a node's ranks to fewer cores than it may use itself.

    Open MPI binds each rank to one core when it starts two or fewer (to a package above that): ``mpirun -n 2`` on a
    16-core node leaves 14 cores idle, and mpitp's threads per rank (the node's bound cores over its ranks) come out
    at 1. MPICH's Hydra binds nothing unless asked. A binding the user asked for is kept: this only says so."""
    if not (mpi_name.startswith("Open MPI") and launcher.startswith("prterun")) or bound >= offered:
        return None
    return (f"its ranks are bound to {bound} of the {offered} cores their launcher may use (Open MPI binds each rank "
            f"to a core when it starts 2 or fewer): `mpirun --bind-to none` lets their threads use all {offered}")
