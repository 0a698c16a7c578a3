"""The dp x pp x tp layout: an explicit, immutable object passed to everything that needs to know who works with whom.

TP is the fastest-varying axis, then PP: a DP group (one model replica) is ``pp * tp`` consecutive global ranks,
``[g*pp*tp, (g+1)*pp*tp)``, and inside it pipeline stage ``s`` holds ranks ``s*tp .. s*tp+tp-1`` of the replica. With
ranks packed by node a TP group's heavy per-layer traffic stays inside one node, while consecutive pipeline stages,
which exchange only activations, may sit on different nodes. The replica's first rank (stage 0, TP rank 0) is its
leader: it drives the replica's forwards and is its member of the DP-leader communicator (whose rank 0 is global
rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI

from mpitp.errors import UsageError
from mpitp.parallel.world import World


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{name}={value!r} must be a positive integer")


def check_layout(world_size: int, tp: int, node_of_rank: tuple[int, ...] | None = None, pp: int = 1) -> int:
    """Validate ``world = dp x pp x tp`` and return dp. Messages spell the arithmetic out."""
    _positive("tp", tp)
    _positive("pp", pp)
    if pp == 1 and world_size % tp != 0:
        raise UsageError(f"tp={tp} does not divide world size {world_size}")
    if world_size % (tp * pp) != 0:
        raise UsageError(f"tp={tp} x pp={pp} = {tp * pp} does not divide world size {world_size}")
    if node_of_rank is not None:
        for g in range(world_size // tp):
            nodes = sorted({node_of_rank[r] for r in range(g * tp, (g + 1) * tp)})
            if len(nodes) > 1:
                what = f"TP group {g}" if pp == 1 else f"TP group of stage {g % pp} of DP group {g // pp}"
                raise UsageError(
                    f"{what} (ranks {g * tp}..{(g + 1) * tp - 1}) would span nodes {nodes}: "
                    f"place ranks so that each node holds a multiple of tp={tp} consecutive ranks"
                )
    return world_size // (tp * pp)


def tp_group_ranks(world_size: int, tp: int, pp: int = 1) -> list[list[int]]:
    """Global ranks of each TP group (one per DP group and stage), in (DP rank, stage) order."""
    check_layout(world_size, tp, pp=pp)
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world_size // tp)]


def split_layers(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each pipeline stage: an even split, the remainder one layer each to the first stages.

    The same rule as transformers' ``PipelineStage.layer_range_for_rank``, which decides what each stage loads (the
    engine cuts micro-batches with it too).
    """
    per, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        end = start + per + (s < extra)
        out.append((start, end))
        start = end
    return out


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in ``world = dp x pp x tp`` and the MPI sub-communicators that go with it."""

    world: World = field(repr=False)
    tp: int
    dp: int
    dp_rank: int
    tp_rank: int
    tp_comm: MPI.Comm = field(repr=False)  # this rank's TP group (its stage's, with pp > 1)
    dp_leader_comm: MPI.Comm = field(repr=False)  # COMM_NULL on non-leaders
    replica_comm: MPI.Comm = field(repr=False)  # the whole DP group (the same communicator as tp_comm for pp=1)
    pp: int = 1
    pp_rank: int = 0

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def replica_size(self) -> int:
        """Ranks holding one copy of the model: ``pp * tp``."""
        return self.pp * self.tp

    @property
    def replica_rank(self) -> int:
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def is_leader(self) -> bool:
        """True on the first rank of each DP group: it drives the group's forwards and talks to other groups."""
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def is_root(self) -> bool:
        """Global rank 0: runs lm-eval, dispatches work, writes results."""
        return self.world.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def last_stage_leader(self) -> int:
        """Replica rank of the last stage's TP rank 0: it sends the scores (or next tokens) back to the leader."""
        return (self.pp - 1) * self.tp

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's TP group (its stage's)."""
        start = self.dp_rank * self.replica_size + self.pp_rank * self.tp
        return tuple(range(start, start + self.tp))

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's DP group, stage by stage."""
        return tuple(range(self.dp_rank * self.replica_size, (self.dp_rank + 1) * self.replica_size))

    @property
    def leader_ranks(self) -> tuple[int, ...]:
        """Global ranks of all DP-group leaders, in DP-rank order."""
        return tuple(g * self.replica_size for g in range(self.dp))

    def describe(self) -> dict:
        return {"world_size": self.world.size, "dp": self.dp, "pp": self.pp, "tp": self.tp}


def make_layout(world: World, tp: int, pp: int = 1) -> Layout:
    """Validate and build the layout. Collective over ``world.comm`` (every rank must call it with the same tp, pp)."""
    dp = check_layout(world.size, tp, world.node_of_rank, pp=pp)
    dp_rank, replica_rank = divmod(world.rank, tp * pp)
    pp_rank, tp_rank = divmod(replica_rank, tp)
    tp_comm = world.comm.Split(color=dp_rank * pp + pp_rank, key=tp_rank)
    replica_comm = tp_comm if pp == 1 else world.comm.Split(color=dp_rank, key=replica_rank)
    leader = tp_rank == 0 and pp_rank == 0
    leader_comm = world.comm.Split(color=0 if leader else MPI.UNDEFINED, key=dp_rank)
    return Layout(world=world, tp=tp, dp=dp, dp_rank=dp_rank, tp_rank=tp_rank, tp_comm=tp_comm,
                  dp_leader_comm=leader_comm, pp=pp, pp_rank=pp_rank, replica_comm=replica_comm)
