"""``--batch_size auto`` sizing (mpitp/batchsize.py): pure arithmetic on a real model config; the collective budget
and the sized batches under a real TP group run in the drop-in corpus (tests/test_lmeval_dropin.py, line
``auto-batch``)."""

from __future__ import annotations

from conftest import STORIES


def _config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(STORIES)


def test_longer_rows_get_smaller_batches_within_the_cap():
    from mpitp.batchsize import AutoBatch, row_bytes

    cfg = _config()
    one = row_bytes(cfg, 1, 1, 4, 1024)
    auto = AutoBatch(budget=int(one * 2 * 10.5), config=cfg, tp=1, pp=1, dtype_bytes=4, max_batch_size=64)
    assert auto.size(1000) == 10  # 10 rows of the 1024-token bucket fit (estimate x 2 safety)
    assert auto.size(3) == 64  # short rows: the cap
    sizes = [auto.size(n) for n in (16, 64, 256, 1024, 4096)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] >= 1
    assert AutoBatch(budget=1, config=cfg, tp=1, pp=1, dtype_bytes=4).size(4096) == 1  # never below 1


def test_tp_shards_the_estimate():
    from mpitp.batchsize import row_bytes

    cfg = _config()
    assert row_bytes(cfg, 2, 1, 4, 512) < row_bytes(cfg, 1, 1, 4, 512)
    assert row_bytes(cfg, 1, 1, 4, 512, new_tokens=64) > row_bytes(cfg, 1, 1, 4, 512)  # the KV cache


def test_groups_partition_by_length_bucket():
    from mpitp.batchsize import AutoBatch, bucket

    assert [bucket(n) for n in (1, 2, 3, 64, 65, 1025)] == [1, 2, 4, 64, 128, 2048]
    auto = AutoBatch(budget=10**12, config=_config(), tp=1, pp=1, dtype_bytes=4, max_batch_size=8)
    lengths = [5, 70, 6, 130, 7]
    groups = auto.groups(lengths)
    assert [sorted(ix) for _, ix in groups] == [[3], [1], [0, 2, 4]]  # longest bucket first
    assert all(size == 8 for size, _ in groups)
    assert set(auto.chosen.values()) == {8}  # recorded as lm-eval's batch_sizes


def test_local_budget_on_cpu_is_a_share_of_available_memory():
    from mpitp.batchsize import _mem_available, local_budget

    total = _mem_available()
    assert 0 < local_budget("cpu", 4) <= total / 4
