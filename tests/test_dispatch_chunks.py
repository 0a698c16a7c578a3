"""Chunking arithmetic of the dispatcher (pure; the real dispatch runs in every mpiexec test)."""

from __future__ import annotations

import random

import pytest

from mpitp.evaluation.dispatch import make_chunks, prefetch_order, refill_now


@pytest.mark.parametrize("n,groups,batch", [(1, 4, 1), (7, 2, 1), (100, 4, 4), (333, 3, 8), (50, 1, 16)])
def test_chunks_cover_every_item_once_heaviest_first(n, groups, batch):
    rng = random.Random(n)
    weights = [rng.randint(1, 500) for _ in range(n)]
    chunks = make_chunks("k", list(range(n)), weights, groups, min_items=batch)
    seen = [i for c in chunks for i in c.indices]
    assert sorted(seen) == list(range(n))
    assert [c.items for c in chunks] == [list(c.indices) for c in chunks]
    assert all(weights[a] >= weights[b] for a, b in zip(seen, seen[1:]))  # longest first
    assert all(len(c.indices) % batch == 0 for c in chunks[:-1])  # whole batches except the tail


def test_chunks_are_balanced_by_tokens_not_count():
    weights = [1000] * 4 + [10] * 400  # four long requests, many short ones
    chunks = make_chunks("k", list(range(404)), weights, n_groups=2, per_group=2)
    loads = [sum(weights[i] for i in c.indices) for c in chunks]
    first = sum(weights) // 4
    assert all(load <= max(first, 1000) + 1000 for load in loads), loads  # a target plus at most one item
    assert len(chunks[0].indices) < len(chunks[-1].indices)  # long requests travel in small chunks


@pytest.mark.parametrize("groups", [2, 3, 8])
def test_chunks_shrink_towards_the_end_for_several_groups(groups):
    """Guided self-scheduling: the tail is cut fine, so DP groups finish close together."""
    rng = random.Random(groups)
    weights = [rng.randint(20, 200) for _ in range(2000)]
    chunks = make_chunks("k", list(range(2000)), weights, n_groups=groups, per_group=4, tail_split=8)
    loads = [sum(weights[i] for i in c.indices) for c in chunks]
    first = sum(weights) // (groups * 4)
    assert loads[0] >= first
    assert max(loads[-3:]) <= first // 8 + 200, (loads[:3], loads[-3:])
    assert len(chunks) > groups * 4


def test_one_group_gets_equal_chunks():
    weights = [50] * 400
    chunks = make_chunks("k", list(range(400)), weights, n_groups=1, per_group=4, min_items=8)
    assert [len(c.indices) for c in chunks] == [104, 104, 104, 88]


class _ShuffledDispatcher:
    """Stands in for the DP dispatch (pure bookkeeping test): real chunks, landing in a random order."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def run(self, kind, items, weights, on_chunk, owners=None):
        assert owners is not None and len(owners) == len(items)  # each window says whose it is (speed_json)
        self.owners = owners
        chunks = make_chunks(kind, items, weights, n_groups=3, per_group=2)
        self.rng.shuffle(chunks)
        for c in chunks:
            on_chunk(list(c.indices), [(-float(row[0][0]), row[0][0] % 2 == 0, row[1]) for row, _ in c.items])
        self.kind, self.n = kind, len(items)


class _Progress:
    total = done = tokens = 0

    def add_total(self, n):
        self.total += n

    def __call__(self, n, tokens):
        self.done += n
        self.tokens += tokens


@pytest.mark.parametrize("seed", range(5))
def test_rolling_windows_reassemble_per_request(seed):
    """Windows of one request may land in any order, in any chunk: each request is recorded once, when complete,
    with lm-eval's sum over its windows; a request with no window is recorded at once as 0.0."""
    import math

    from mpitp.evaluation.lm import KIND_WINDOW
    from mpitp.evaluation.runner import _run_windows

    rng = random.Random(seed)
    docs = [[([rng.randint(1, 9)] * rng.randint(2, 40), rng.randint(1, 5)) for _ in range(n)]
            for n in (3, 0, 1, 7, 2, 0, 12)]
    recorded = []
    disp, progress = _ShuffledDispatcher(seed), _Progress()
    tasks = [f"t{j % 2}" for j in range(len(docs))]
    out = _run_windows(disp, progress, docs, lambda idx, res: recorded.extend(zip(idx, res)), tasks)
    assert disp.kind == KIND_WINDOW and disp.n == sum(len(d) for d in docs)
    assert disp.owners == [(f"t{j % 2}", j, len(d)) for j, d in enumerate(docs) for _ in d]
    assert progress.total == progress.done == len(docs)  # the bar counts requests, not windows
    assert progress.tokens == sum(len(r[0]) for d in docs for r in d)
    want = [(math.fsum(-float(r[0][0]) for r in d), all(r[0][0] % 2 == 0 for r in d), sum(r[1] for r in d))
            for d in docs]
    assert out == want
    assert sorted(recorded) == sorted(enumerate(want))  # each request once, with its final value
    assert [j for j, _ in recorded[:2]] == [1, 5]  # the empty ones first, before any window lands


@pytest.mark.parametrize("chunks,groups,prefetch,order", [
    (2, 2, 2, [1]),  # 4 questions in two batches at dp=2: one each (sent ahead whole, rank 0's group sat idle)
    (3, 2, 2, [1]),  # a second one ahead would leave rank 0 one and group 1 none after its first
    (10, 2, 2, [1, 1]),  # a long queue: the full prefetch
    (10, 4, 2, [1, 2, 3, 1, 2, 3]),
    (5, 4, 2, [1, 2, 3]),
    (2, 4, 2, [1, 2]),  # fewer chunks than groups: the remote ones first, as before
    (0, 2, 2, []),
    (7, 1, 2, []),  # one group: nothing remote
])
def test_prefetch_leaves_rank_0s_group_a_chunk(chunks, groups, prefetch, order):
    assert prefetch_order(chunks, groups, prefetch) == order


def test_a_remote_group_is_refilled_ahead_only_while_chunks_are_plenty():
    """Prefetched while more chunks are left than groups; on the last ones a group holding a chunk gets no second one
    (rank 0's group takes it instead of idling at the end), a group holding none gets the next at once."""
    assert refill_now(left=5, n_groups=2, holding=1) and refill_now(left=3, n_groups=2, holding=1)
    assert not refill_now(left=2, n_groups=2, holding=1) and not refill_now(left=1, n_groups=4, holding=1)
    assert refill_now(left=2, n_groups=2, holding=0) and refill_now(left=1, n_groups=2, holding=0)
