"""Vocab-parallel scoring maths against torch's own log_softmax/argmax, with a fake in-process TP group.

The fake group runs one thread per shard and combines their tensors with the same reduction the real all-reduce
applies; it checks only the maths (uneven shards, ties, blocking). The real collectives are covered by the parity
tests under mpiexec.
"""

from __future__ import annotations

import threading

import pytest
import torch

from mpitp.replica.scoring import CommCounter, TPOps, VocabParallelHead
from support import torch_threads


class FakeGroup:
    """N ranks in threads; ``reduce(rank, t, fn)`` returns fn over every rank's tensor once all have arrived."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n

    def reduce(self, rank: int, t: torch.Tensor, fn) -> torch.Tensor:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        out = fn(torch.stack(self.slots))
        self.barrier.wait()
        return out


class FakeOps(TPOps):
    def __init__(self, group: FakeGroup, rank: int):
        super().__init__(size=group.n, counter=CommCounter(), reduce_counter=CommCounter())
        self.g, self.rank = group, rank

    def _fake(self, t, fn):
        self.counter.add(t)
        self.reduce_counter.add(t)
        t.copy_(self.g.reduce(self.rank, t, fn))
        return t

    def max(self, t):
        return self._fake(t, lambda s: s.max(0).values)

    def sum(self, t):
        return self._fake(t, lambda s: s.sum(0))

    def min(self, t):
        return self._fake(t, lambda s: s.min(0).values)

    def gather(self, t):
        self.counter.add(t)
        self.reduce_counter.add(t)
        return self.g.reduce(self.rank, t, lambda s: s)


def _shards(vocab: int, tp: int):
    per = -(-vocab // tp)
    return [(r * per, min(vocab, (r + 1) * per)) for r in range(tp)]


def _run_sharded(weight, h, targets, tp, block_elems=1 << 24, rows=None):
    group = FakeGroup(tp)
    out: dict = {}

    errors: list = []

    def rank_fn(r, lo, hi):
        try:
            head = VocabParallelHead(weight=weight[lo:hi], offset=lo, vocab_size=weight.shape[0],
                                     ops=FakeOps(group, r), block_elems=block_elems)
            lp, greedy = head.score(h, targets, rows=rows)
            out[r] = (lp, greedy, head.argmax(h), head.ops.reduce_counter.bytes)
        except BaseException as exc:  # noqa: BLE001 - surfaced below; a dead rank must fail the test
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_fn, args=(r, lo, hi)) for r, (lo, hi) in enumerate(_shards(
        weight.shape[0], tp))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert sorted(out) == list(range(tp)), "every rank must finish"
    return out


@pytest.mark.parametrize("vocab,tp", [(512, 1), (512, 2), (509, 2), (509, 3), (509, 4), (50257, 4)])
def test_matches_log_softmax(vocab, tp):
    g = torch.Generator().manual_seed(vocab + tp)
    n, hidden = 37, 16
    weight = torch.randn(vocab, hidden, generator=g)
    h = torch.randn(n, hidden, generator=g)
    logits = h @ weight.T
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[:5] = logits[:5].argmax(-1)  # some greedy hits
    ref_lp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    ref_greedy = logits.argmax(-1) == targets
    out = _run_sharded(weight, h, targets, tp, block_elems=vocab * 8)  # several blocks (uneven shards too)
    assert len(out) == tp
    for _r, (lp, greedy, am, nbytes) in out.items():
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        assert torch.equal(greedy, ref_greedy)
        assert torch.equal(am, logits.argmax(-1))
        if tp > 1:  # score: 4 + 8 + 4 bytes per token; argmax: one gather of (max, index) as float64, 16
            assert nbytes == n * 16 + n * 16


@pytest.mark.parametrize("tp", [1, 3])
def test_targets_sharing_a_row_score_as_that_row_repeated(tp):
    """``rows``: several targets scored at one row of ``h`` (a prefix tree's context predicts each continuation's
    first token), in any order and over several blocks: the scores of the same rows given once per target, the same
    16 bytes per target crossing ranks."""
    g = torch.Generator().manual_seed(tp)
    vocab, hidden, u = 509, 16, 23
    weight, h = torch.randn(vocab, hidden, generator=g), torch.randn(u, hidden, generator=g)
    rows = torch.cat([torch.arange(u), torch.randint(0, u, (30,), generator=g)])[torch.randperm(u + 30, generator=g)]
    targets = torch.randint(0, vocab, (rows.numel(),), generator=g)
    targets[:6] = (h[rows[:6]] @ weight.T).argmax(-1)  # some greedy hits
    shared = _run_sharded(weight, h, targets, tp, block_elems=vocab * 4, rows=rows)
    repeated = _run_sharded(weight, h[rows], targets, tp, block_elems=vocab * 4)
    for r in range(tp):
        torch.testing.assert_close(shared[r][0], repeated[r][0], rtol=1e-6, atol=1e-6)
        assert torch.equal(shared[r][1], repeated[r][1]) and shared[r][1][:6].all()
        if tp > 1:  # score's bytes per target as without rows (argmax's differ: fewer rows)
            assert shared[r][3] - u * 16 == repeated[r][3] - rows.numel() * 16 == rows.numel() * 16


def test_argmax_reports_nan_rows_past_the_vocabulary():
    """A row whose logits hold NaN on any shard has no maximum: its id is past the vocabulary on every rank (the
    greedy head then reports it: mpitp.replica.generation.chosen_token_logits)."""
    vocab, tp, hidden = 10, 2, 4
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    weight[7] = float("nan")
    h = torch.ones(2, hidden)
    out = _run_sharded(weight, h, torch.tensor([0, 0]), tp)
    for _lp, _greedy, am, _ in out.values():
        assert (am >= vocab).all()


@pytest.mark.parametrize("tied", [[2, 5, 9], [5, 6, 9], [1, 2, 3]],
                         ids=["across-shards", "two-in-a-shard", "one-shard"])
def test_ties_take_the_lowest_index_like_torch_argmax(tied):
    vocab, tp, hidden = 10, 3, 4
    weight = torch.zeros(vocab, hidden)
    weight[tied] = 1.0  # three tied maxima: in different shards, two in one, all in one
    h = torch.ones(3, hidden)
    out = _run_sharded(weight, h, torch.tensor(tied), tp)
    for _lp, greedy, am, _ in out.values():
        assert am.tolist() == [tied[0]] * 3 == (h @ weight.T).argmax(-1).tolist()
        assert greedy.tolist() == [True, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_head_product_in_blocks_is_the_single_product(dtype, bias, threads):
    """On a CPU the head's product runs in blocks of vocabulary rows (:func:`head_product`, for speed): the logits must
    be those of one ``linear`` with the shard's last, partial block and a bias, in fp32 and bf16, up to rounding
    (MKL's kernels for the two shapes may round a dot product differently: bit for bit on AMD, not on an Intel
    AVX-512 VM with two threads or bf16; a block in the wrong place would be off by whole logits)."""
    from mpitp.replica.scoring import CPU_HEAD_COLUMNS, head_product

    g = torch.Generator().manual_seed(7)
    vocab = 3 * CPU_HEAD_COLUMNS + 77  # blocks, the last one partial
    with torch_threads(threads):
        for hidden in (96, 512):
            w = torch.randn(vocab, hidden, generator=g).to(dtype)
            b = torch.randn(vocab, generator=g).to(dtype) if bias else None
            for rows in (1, 4, 16, 300):
                h = torch.randn(rows, hidden, generator=g).to(dtype)
                got, ref = head_product(h, w, b), torch.nn.functional.linear(h, w, b)
                assert got.dtype == dtype and got.shape == (rows, vocab)
                # a dot product summed in another order: a few roundings of its terms' magnitude
                size = h.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0.0)
                d = (got.double() - ref.double()).abs()
                assert bool((d <= 4 * torch.finfo(dtype).eps * size).all()), (hidden, rows, float(d.max()))


@pytest.mark.parametrize("tp", [1, 2])
def test_pieces_of_a_shard_keep_argmax_ties_and_nan_rows(tp):
    """A shard wider than two pieces (:data:`CPU_HEAD_COLUMNS` rows each) is summed up piece by piece: a maximum tied
    in two pieces of a shard (and across shards) still reports torch.argmax's lowest index, the log-probabilities
    stay torch's, and a row with a NaN logit in any piece scores NaN and is never greedy."""
    from mpitp.replica.scoring import CPU_HEAD_COLUMNS

    vocab, hidden = 4 * CPU_HEAD_COLUMNS + 13, 8
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(vocab, hidden, generator=g) * 0.1
    tied = [CPU_HEAD_COLUMNS + 3, 2 * CPU_HEAD_COLUMNS + 7, vocab - 2]  # other pieces, and the second shard at tp 2
    h = torch.randn(4, hidden, generator=g)
    h[:, 0] = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    weight[tied] = h[0] * 3  # row 0's maximum, three times
    weight[3 * CPU_HEAD_COLUMNS + 1] = 0.0
    weight[3 * CPU_HEAD_COLUMNS + 1, 0] = float("inf")  # -inf for rows 0-2, NaN (0 * inf) for row 3 alone
    logits = h @ weight.T
    targets = torch.tensor([tied[0], tied[1], 5, 5])
    out = _run_sharded(weight, h, targets, tp)
    ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    assert torch.isnan(ref).tolist() == [False, False, False, True]
    for lp, greedy, am, _ in out.values():
        assert greedy.tolist() == [True, False, False, False]
        assert am[0].item() == tied[0] == logits[0].argmax().item()
        torch.testing.assert_close(lp[:3], ref[:3], rtol=1e-5, atol=1e-5)
        assert torch.isnan(lp[3])


@pytest.mark.parametrize("steps", [[("div", 3.0), ("tanh", None), ("mul", 3.0)], [("module", torch.nn.Tanh())]],
                         ids=["softcap-in-pieces", "module-whole-shard"])
def test_pieces_apply_the_models_logit_steps(steps):
    """The model's steps after its head (a soft-cap: scalars, applied piece by piece; a module: the whole shard at
    once) give torch's log-softmax of the transformed logits, at tp 1 and 2."""
    from mpitp.replica.logits import HeadTransform
    from mpitp.replica.scoring import CPU_HEAD_COLUMNS

    vocab, hidden, n = 3 * CPU_HEAD_COLUMNS + 5, 16, 9
    g = torch.Generator().manual_seed(5)
    weight, h = torch.randn(vocab, hidden, generator=g), torch.randn(n, hidden, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    transform = HeadTransform(logits=steps)
    logits = transform.apply_logits(h @ weight.T)
    targets[:3] = logits[:3].argmax(-1)
    ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    for tp in (1, 2):
        group, out = FakeGroup(tp), {}

        def rank_fn(r, lo, hi, group=group, out=out):
            head = VocabParallelHead(weight=weight[lo:hi], offset=lo, vocab_size=vocab, ops=FakeOps(group, r),
                                     transform=transform)
            out[r] = head.score(h, targets)

        threads = [threading.Thread(target=rank_fn, args=(r, lo, hi)) for r, (lo, hi) in enumerate(_shards(vocab, tp))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(out) == list(range(tp))
        for lp, greedy in out.values():
            torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(greedy, logits.argmax(-1) == targets) and bool(greedy[:3].all())
