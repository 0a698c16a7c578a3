"""The dp x tp layout: an explicit, immutable object passed to everything that needs to know who works with whom.

TP is the fastest-varying axis: global ranks ``[g*tp, (g+1)*tp)`` form TP group ``g`` (DP rank ``g``), so with
ranks packed by node a TP group's heavy tensor traffic stays inside one node. The first rank of each TP group is its
leader: it drives the group and is the group's member of the DP-leader communicator (whose rank 0 is global rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI

from .errors import UsageError
from .world import World


def check_layout(world_size: int, tp: int, node_of_rank: tuple[int, ...] | None = None) -> int:
    """Validate ``world = dp x tp`` and return dp. Messages spell the arithmetic out."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UsageError(f"tp={tp!r} must be a positive integer")
    if world_size % tp != 0:
        raise UsageError(f"tp={tp} does not divide world size {world_size}")
    if node_of_rank is not None:
        for g in range(world_size // tp):
            nodes = sorted({node_of_rank[r] for r in range(g * tp, (g + 1) * tp)})
            if len(nodes) > 1:
                raise UsageError(
                    f"TP group {g} (ranks {g * tp}..{(g + 1) * tp - 1}) would span nodes {nodes}: "
                    f"place ranks so that each node holds a multiple of tp={tp} consecutive ranks"
                )
    return world_size // tp


def tp_group_ranks(world_size: int, tp: int) -> list[list[int]]:
    """Global ranks of each TP group, in DP-rank order."""
    dp = check_layout(world_size, tp)
    return [list(range(g * tp, (g + 1) * tp)) for g in range(dp)]


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in ``world = dp x tp`` and the MPI sub-communicators that go with it."""

    world: World = field(repr=False)
    tp: int
    dp: int
    dp_rank: int
    tp_rank: int
    tp_comm: MPI.Comm = field(repr=False)
    dp_leader_comm: MPI.Comm = field(repr=False)  # COMM_NULL on non-leaders

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def is_leader(self) -> bool:
        """True on the first rank of each TP group: it drives the group's forwards and talks to other groups."""
        return self.tp_rank == 0

    @property
    def is_root(self) -> bool:
        """Global rank 0: runs lm-eval, dispatches work, writes results."""
        return self.world.rank == 0

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's TP group."""
        return tuple(range(self.dp_rank * self.tp, (self.dp_rank + 1) * self.tp))

    @property
    def leader_ranks(self) -> tuple[int, ...]:
        """Global ranks of all TP-group leaders, in DP-rank order."""
        return tuple(g * self.tp for g in range(self.dp))

    def describe(self) -> dict:
        return {"world_size": self.world.size, "dp": self.dp, "tp": self.tp}


def make_layout(world: World, tp: int) -> Layout:
    """Validate and build the layout. Collective over ``world.comm`` (every rank must call it with the same tp)."""
    dp = check_layout(world.size, tp, world.node_of_rank)
    dp_rank, tp_rank = divmod(world.rank, tp)
    tp_comm = world.comm.Split(color=dp_rank, key=tp_rank)
    leader_comm = world.comm.Split(color=0 if tp_rank == 0 else MPI.UNDEFINED, key=dp_rank)
    return Layout(world=world, tp=tp, dp=dp, dp_rank=dp_rank, tp_rank=tp_rank, tp_comm=tp_comm,
                  dp_leader_comm=leader_comm)
