"""``--batch_size auto`` sizing (mpitp/replica/batchsize.py): pure arithmetic on a real model config; the collective
budget and the sized batches under a real TP group run in the drop-in corpus (tests/test_lmeval_dropin.py, line
``auto-batch``)."""

from __future__ import annotations

from support import STORIES


def _config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(STORIES)


def test_longer_rows_get_smaller_batches_within_the_cap():
    from mpitp.replica.batchsize import AutoBatch, row_bytes

    cfg = _config()
    one = row_bytes(cfg, 1, 1, 4, 1024)
    auto = AutoBatch(budget=int(one * 2 * 10.5), config=cfg, tp=1, pp=1, dtype_bytes=4, max_batch_size=64)
    assert auto.size(1000) == 10  # 10 rows of the 1024-token bucket fit (estimate x 2 safety)
    assert auto.size(3) == 64  # short rows: the cap
    sizes = [auto.size(n) for n in (16, 64, 256, 1024, 4096)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] >= 1
    assert AutoBatch(budget=1, config=cfg, tp=1, pp=1, dtype_bytes=4).size(4096) == 1  # never below 1


def test_tp_shards_the_estimate():
    from mpitp.replica.batchsize import row_bytes

    cfg = _config()
    assert row_bytes(cfg, 2, 1, 4, 512) < row_bytes(cfg, 1, 1, 4, 512)
    assert row_bytes(cfg, 1, 1, 4, 512, new_tokens=64) > row_bytes(cfg, 1, 1, 4, 512)  # the KV cache


def test_batches_longest_first_each_as_large_as_its_longest_row_allows():
    from mpitp.replica.batchsize import AutoBatch, row_bytes

    cfg = _config()
    auto = AutoBatch(budget=int(row_bytes(cfg, 1, 1, 4, 192) * 2 * 2.5), config=cfg, tp=1, pp=1, dtype_bytes=4,
                     max_batch_size=8)
    lengths = [5, 70, 6, 130, 7, 180, 9, 3, 4, 8, 10, 11, 12]
    groups = auto.groups(lengths)
    assert sorted(i for _, ix in groups for i in ix) == list(range(len(lengths)))  # every row once
    first_size, first = groups[0]
    assert first == [5, 3] and first_size == 2  # the two longest: the budget holds two 192-token rows
    for size, ix in groups:
        assert len(ix) <= size <= 8 and size == auto.size(max(lengths[i] for i in ix))
    assert set(auto.chosen.values()) >= {2, 8}  # recorded as lm-eval's batch_sizes


def test_local_budget_on_cpu_is_a_share_of_available_memory():
    from mpitp.replica.batchsize import _mem_available, local_budget

    total = _mem_available()
    assert 0 < local_budget("cpu", 4) <= total / 4
