"""The dp x tp layout arithmetic, for every world size 1..8 and every tp 1..8 (no MPI launch).

Written size-agnostic: each case derives what it expects from ``size`` and ``tp`` alone, so the same checks hold for
any world (the MPI tests in test_mpi_foundation.py then check the same layout on real communicators).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
from mpi4py import MPI

from mpitp.errors import UsageError
from mpitp.parallel.layout import Layout, check_layout, make_layout, split_layers, tp_group_ranks
from mpitp.parallel.world import World

SIZES = range(1, 9)
TPS = range(1, 9)
ALL = list(itertools.product(SIZES, TPS))
VALID = [(n, tp) for n, tp in ALL if n % tp == 0]
INVALID = [(n, tp) for n, tp in ALL if n % tp != 0]


def _id(case):
    return "size{}-tp{}".format(*case)


# --------------------------------------------------------------------------- valid layouts


@pytest.mark.parametrize("case", VALID, ids=_id)
def test_valid_layout_groups_and_dp(case):
    size, tp = case
    dp = check_layout(size, tp)
    assert dp == size // tp and dp * tp == size

    groups = tp_group_ranks(size, tp)
    assert len(groups) == dp
    # Group 0 is ranks 0..tp-1; TP is the fastest-varying axis, so each group is a run of tp consecutive ranks.
    assert groups[0] == list(range(tp))
    for g, ranks in enumerate(groups):
        assert ranks == list(range(g * tp, g * tp + tp))
        for r in ranks:
            assert divmod(r, tp) == (g, r - g * tp)  # (dp_rank, tp_rank)
    # Together the groups partition the world exactly once.
    flat = [r for ranks in groups for r in ranks]
    assert flat == list(range(size))


@pytest.mark.parametrize("case", VALID, ids=_id)
def test_valid_layout_accepts_nodes_holding_whole_groups(case):
    size, tp = case
    dp = size // tp
    # One node; one node per TP group; and every packing of k whole groups per node.
    assert check_layout(size, tp, (0,) * size) == dp
    assert check_layout(size, tp, tuple(r // tp for r in range(size))) == dp
    for k in range(1, dp + 1):
        assert check_layout(size, tp, tuple(r // (k * tp) for r in range(size))) == dp


# --------------------------------------------------------------------------- invalid layouts


@pytest.mark.parametrize("case", INVALID, ids=_id)
def test_tp_not_dividing_world_is_refused(case):
    size, tp = case
    expected = f"tp={tp} does not divide world size {size}"
    for call in (lambda: check_layout(size, tp), lambda: tp_group_ranks(size, tp),
                 lambda: check_layout(size, tp, (0,) * size)):
        with pytest.raises(UsageError) as info:
            call()
        assert str(info.value) == expected
        assert info.value.collective is False


def test_exact_message_tp3_world4():
    with pytest.raises(UsageError) as info:
        check_layout(4, 3)
    assert str(info.value) == "tp=3 does not divide world size 4"


@pytest.mark.parametrize("tp", [0, -1, -8, 2.0, "2", None, True, False])
def test_tp_must_be_a_positive_integer(tp):
    with pytest.raises(UsageError) as info:
        check_layout(8, tp)
    assert str(info.value) == f"tp={tp!r} must be a positive integer"


def _first_spanning_group(size, tp, node_of_rank):
    """Reference: the first TP group whose ranks live on more than one node, as (g, sorted nodes), or None."""
    for g in range(size // tp):
        nodes = sorted({node_of_rank[r] for r in range(g * tp, g * tp + tp)})
        if len(nodes) > 1:
            return g, nodes
    return None


@pytest.mark.parametrize("case", VALID, ids=_id)
def test_tp_group_spanning_nodes_is_refused(case):
    size, tp = case
    seen_refusal = False
    # Every "ranks per node" packing (the last node may hold fewer ranks).
    for per_node in range(1, size + 1):
        node_of_rank = tuple(r // per_node for r in range(size))
        spanning = _first_spanning_group(size, tp, node_of_rank)
        if spanning is None:
            assert check_layout(size, tp, node_of_rank) == size // tp
            continue
        seen_refusal = True
        g, nodes = spanning
        with pytest.raises(UsageError) as info:
            check_layout(size, tp, node_of_rank)
        assert str(info.value) == (
            f"TP group {g} (ranks {g * tp}..{g * tp + tp - 1}) would span nodes {nodes}: "
            f"place ranks so that each node holds a multiple of tp={tp} consecutive ranks"
        )
    # With tp > 1 putting one rank per node always splits group 0.
    assert seen_refusal == (tp > 1)


def test_spanning_message_example():
    # 4 ranks on 2 nodes as 3 + 1: the second TP group (ranks 2, 3) straddles them.
    with pytest.raises(UsageError) as info:
        check_layout(4, 2, (0, 0, 0, 1))
    assert str(info.value) == ("TP group 1 (ranks 2..3) would span nodes [0, 1]: "
                               "place ranks so that each node holds a multiple of tp=2 consecutive ranks")
    # Round-robin placement splits every group; the first one is named.
    with pytest.raises(UsageError, match=r"^TP group 0 \(ranks 0\.\.1\) would span nodes \[0, 1\]"):
        check_layout(4, 2, (0, 1, 0, 1))


# --------------------------------------------------------------------------- make_layout on a recorded communicator


class _RecordingComm:
    """Stands in for a communicator: records Split calls and hands back a token naming them."""

    def __init__(self):
        self.splits = []

    def Split(self, color=0, key=0):  # noqa: N802 - MPI spelling
        self.splits.append((color, key))
        return ("comm", color, key)


def _world(rank, size, node_of_rank=None):
    node_of_rank = node_of_rank or (0,) * size
    return World(comm=_RecordingComm(), node_comm=None, rank=rank, size=size, local_rank=rank, local_size=size,
                 node_name="n", node_index=node_of_rank[rank], n_nodes=len(set(node_of_rank)),
                 node_of_rank=tuple(node_of_rank), cores_per_node=size, launcher="test")


@pytest.mark.parametrize("case", VALID, ids=_id)
def test_make_layout_per_rank(case):
    size, tp = case
    dp = size // tp
    groups = tp_group_ranks(size, tp)
    layouts = []
    for rank in range(size):
        world = _world(rank, size)
        lay = make_layout(world, tp)
        assert isinstance(lay, Layout)
        layouts.append(lay)
        g = next(i for i, ranks in enumerate(groups) if rank in ranks)
        assert (lay.tp, lay.dp, lay.dp_rank, lay.tp_rank) == (tp, dp, g, groups[g].index(rank))
        assert lay.rank == rank and lay.is_root == (rank == 0)
        assert lay.is_leader == (rank == groups[g][0])
        assert lay.tp_ranks == tuple(groups[g])
        assert lay.leader_ranks == tuple(ranks[0] for ranks in groups)
        assert lay.describe() == {"world_size": size, "dp": dp, "pp": 1, "tp": tp}
        # The TP communicator: one colour per group, ordered by tp_rank. The leader communicator: leaders only,
        # ordered by dp_rank (so its rank 0 is global rank 0).
        (tp_color, tp_key), (lead_color, lead_key) = world.comm.splits
        assert (tp_color, tp_key) == (g, lay.tp_rank)
        if lay.is_leader:
            assert (lead_color, lead_key) == (0, g)
        else:
            assert lead_color == MPI.UNDEFINED
    # Every (dp_rank, tp_rank) pair occurs exactly once.
    assert sorted((x.dp_rank, x.tp_rank) for x in layouts) == [(d, t) for d in range(dp) for t in range(tp)]


def test_make_layout_refuses_before_any_split():
    world = _world(0, 4, node_of_rank=(0, 0, 0, 1))
    with pytest.raises(UsageError, match="would span nodes"):
        make_layout(world, 2)
    world = _world(0, 4)
    with pytest.raises(UsageError, match="^tp=3 does not divide world size 4$"):
        make_layout(world, 3)
    assert world.comm.splits == []  # nothing collective started, so every rank can leave together


# --------------------------------------------------------------------------- pipeline stages: dp x pp x tp

PP_CASES = [(size, pp, tp) for size in range(1, 13) for pp in range(1, size + 1) for tp in range(1, size + 1)
            if size % (pp * tp) == 0]


@pytest.mark.parametrize("case", PP_CASES, ids=lambda c: f"size{c[0]}-pp{c[1]}-tp{c[2]}")
def test_make_layout_with_stages_per_rank(case):
    """TP fastest, then PP: a DP group is pp*tp consecutive ranks, each stage tp consecutive ranks of it."""
    size, pp, tp = case
    dp = size // (pp * tp)
    seen = set()
    for rank in range(size):
        world = _world(rank, size)
        lay = make_layout(world, tp, pp=pp)
        assert (lay.dp, lay.pp, lay.tp) == (dp, pp, tp)
        assert lay.dp_rank * pp * tp + lay.pp_rank * tp + lay.tp_rank == rank
        assert rank in lay.tp_ranks and rank in lay.replica_ranks and len(lay.tp_ranks) == tp
        assert set(lay.tp_ranks) <= set(lay.replica_ranks) and len(lay.replica_ranks) == pp * tp
        assert lay.is_leader == (rank == lay.replica_ranks[0])
        assert lay.leader_ranks == tuple(range(0, size, pp * tp))
        assert lay.first_stage == (lay.pp_rank == 0) and lay.last_stage == (lay.pp_rank == pp - 1)
        assert lay.describe() == {"world_size": size, "dp": dp, "pp": pp, "tp": tp}
        seen.add((lay.dp_rank, lay.pp_rank, lay.tp_rank))
    assert len(seen) == size


@pytest.mark.parametrize("size,pp,tp,message", [
    (4, 3, 1, "tp=1 x pp=3 = 3 does not divide world size 4"),
    (6, 2, 2, "tp=2 x pp=2 = 4 does not divide world size 6"),
    (8, 0, 2, "pp=0 must be a positive integer"),
])
def test_stage_arithmetic_is_spelled_out(size, pp, tp, message):
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        check_layout(size, tp, pp=pp)


def test_stage_may_span_nodes_but_its_tp_group_may_not():
    assert check_layout(4, 2, (0, 0, 1, 1), pp=2) == 1  # stage 0 on node 0, stage 1 on node 1
    with pytest.raises(UsageError, match="TP group of stage 0 of DP group 0 .*span nodes"):
        check_layout(4, 2, (0, 1, 1, 1), pp=2)


@pytest.mark.parametrize("n,pp", [(n, pp) for n in range(1, 12) for pp in range(1, n + 1)])
def test_split_layers_even_with_remainder_first(n, pp):
    parts = split_layers(n, pp)
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [e - s for s, e in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("size", "cores", "nodes", "importers"), [
    (4, 2, 1, [1]),  # the README's demo on 2 cores: rank 0 checks on one, rank 1 imports on the other
    (4, 4, 1, [1, 2, 3]),  # a core per rank: every rank but 0 (as before)
    (8, 2, 2, [1, 4, 5]),  # two nodes of 4 ranks on 2 cores: the second node's first two
    (2, 1, 1, []),  # one core: rank 0's checks have it alone
])
def test_ranks_import_the_model_code_during_the_checks_only_on_spare_cores(size, cores, nodes, importers):
    """Ranks that wait for rank 0's checks import torch and transformers meanwhile on the cores rank 0 leaves, no
    more (issue 41: the demo's 4 ranks on 2 cores, rank 0 alone 10.0-10.6 -> 8.0-8.9 s, its checks unchanged)."""
    from mpitp.parallel.runtime import warms_imports

    per_node = size // nodes
    found = [r for r in range(size) if warms_imports(dataclasses.replace(
        _world(r, size, [r // per_node for r in range(size)]), local_rank=r % per_node, local_size=per_node,
        cores_per_node=cores))]
    assert found == importers
