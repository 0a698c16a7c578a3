"""mpitp.testing, the one seam for MPITP_TEST_* hooks: parsed once, off when unset, each hook doing what it says.
The hooks' effect on real runs is covered under mpiexec by the fault drills (test_faults*.py, test_head_check.py)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from mpitp import testing
from mpitp.testing import Hooks

HOOK_VARS = ["MPITP_TEST_STALL", "MPITP_TEST_CHUNK_SEED", "MPITP_TEST_OOM_ABOVE", "MPITP_TEST_RAISE",
             "MPITP_TEST_RAISE_IN_FORWARD", "MPITP_TEST_ALTER_HEAD", "MPITP_TEST_FORWARD_LOG"]


@pytest.fixture
def hooks_from(monkeypatch):
    def use(env: dict) -> Hooks:
        for k in HOOK_VARS:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        testing.hooks.cache_clear()
        return testing.hooks()

    yield use
    testing.hooks.cache_clear()


def test_unset_hooks_are_no_ops(hooks_from, monkeypatch):
    assert hooks_from({}) == Hooks()
    monkeypatch.setattr(testing.time, "sleep", lambda s: pytest.fail("stalled without MPITP_TEST_STALL"))
    testing.stall("between_chunks")
    assert testing.chunks_per_group("loglikelihood", 10, 4) == 4
    testing.check_oom(10**6)
    testing.check_raise(0, 10**6)
    layer = torch.nn.Linear(2, 2)
    testing.install_forward_fault([layer], 0, lambda: 10**6)
    layer(torch.zeros(1, 2))  # no hook installed
    head = type("Head", (), {"weight": torch.ones(2)})()
    testing.alter_head(head)
    assert torch.equal(head.weight, torch.ones(2))


def test_hooks_parse_and_fire(hooks_from, monkeypatch):
    h = hooks_from({"MPITP_TEST_STALL": "metrics:0.25", "MPITP_TEST_CHUNK_SEED": "7", "MPITP_TEST_OOM_ABOVE": "3",
                    "MPITP_TEST_RAISE": "2:5", "MPITP_TEST_RAISE_IN_FORWARD": "1:2:oom",
                    "MPITP_TEST_ALTER_HEAD": "1.5"})
    assert h == Hooks(stall=("metrics", 0.25), chunk_seed="7", oom_above=3, raise_at=(2, 5),
                      raise_in_forward=(1, 2, True), alter_head=1.5)
    slept = []
    monkeypatch.setattr(testing.time, "sleep", slept.append)
    testing.stall("between_chunks")
    testing.stall("metrics")
    assert slept == [0.25]
    sizes = {testing.chunks_per_group("loglikelihood", n, 4) for n in range(40)}
    assert sizes <= set(range(1, 17)) and len(sizes) > 1
    assert testing.chunks_per_group("loglikelihood", 5, 4) == testing.chunks_per_group("loglikelihood", 5, 4)
    testing.check_oom(3)
    with pytest.raises(torch.OutOfMemoryError, match="simulated out of memory for 4 rows"):
        testing.check_oom(4)
    testing.check_raise(2, 4)
    testing.check_raise(1, 5)
    with pytest.raises(RuntimeError, match="injected failure on rank 2 after 5 forwards"):
        testing.check_raise(2, 5)
    forwards = [0]
    other, mine = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    testing.install_forward_fault([other], 0, lambda: forwards[0])  # another rank: nothing installed
    testing.install_forward_fault([other, mine], 1, lambda: forwards[0])  # the last layer only
    forwards[0] = 3
    other(torch.zeros(1, 2))
    with pytest.raises(torch.OutOfMemoryError, match="inside a forward on rank 1 after 2 forwards"):
        mine(torch.zeros(1, 2))
    head = type("Head", (), {"weight": torch.ones(2)})()
    testing.alter_head(head)
    assert torch.equal(head.weight, torch.full((2,), 1.5))


def test_raise_in_forward_without_oom_and_nan_head(hooks_from):
    hooks_from({"MPITP_TEST_RAISE_IN_FORWARD": "0:0", "MPITP_TEST_ALTER_HEAD": "nan"})
    layer = torch.nn.Linear(2, 2)
    testing.install_forward_fault([layer], 0, lambda: 1)
    with pytest.raises(RuntimeError, match="injected failure inside a forward on rank 0 after 0 forwards"):
        layer(torch.zeros(1, 2))
    head = type("Head", (), {"weight": torch.ones(2)})()
    testing.alter_head(head)
    assert bool(torch.isnan(head.weight).all())


def _tiny_shard(dp_rank: int = 0, leader: bool = True):
    """A 2-layer Llama as a one-rank replica's shard (no MPI): what the forward log sees in a real run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mpitp.replica.shard import ReplicaShard

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    layout = types.SimpleNamespace(tp=1, pp=1, first_stage=True, last_stage=True, rank=dp_rank,
                                   is_leader=leader, dp_rank=dp_rank)
    return ReplicaShard(model, layout, "cpu")


def test_forward_log_is_off_by_default(hooks_from, monkeypatch):
    """Unset, the forward log neither opens a file nor hooks the model: a run pays nothing for it."""
    assert hooks_from({}).forward_log is None
    monkeypatch.setattr(testing, "_log_fd", lambda path: pytest.fail("opened a forward log while it is off"))
    leader = types.SimpleNamespace(is_leader=True, dp_rank=0)
    testing.log_forward(leader, "score", batch=1, seq=2)
    model = torch.nn.Linear(2, 2)
    testing.install_generate_log(model, leader)
    assert not model._forward_pre_hooks  # no hook: the model's calls take torch's fast path as before


def test_forward_log_lines(hooks_from, tmp_path):
    """One JSON line per forward of the run on the DP leader: the scored batch as fed (a tree's packed sequences),
    each ``generate`` step with its cache length; the start-up probe, the head check's cache-less forward and a
    worker's forwards write nothing."""
    from mpitp.replica import prefix, prefix_probe

    path = tmp_path / "forwards.jsonl"
    assert hooks_from({"MPITP_TEST_FORWARD_LOG": str(path)}).forward_log == str(path)
    shard = _tiny_shard(dp_rank=1)
    assert prefix_probe.check_sharing(shard) is None and shard.share  # probe forwards: not the run's
    assert not path.exists()
    groups = [prefix.Group([5, 6, 7, 8], [0, 1], [[9, 10, 11], [12, 13]]), prefix.Group([20, 21], [2], [[22]])]
    flat, size, _ = prefix.pack(groups)
    shard.score(flat, **size)
    shard.model(input_ids=torch.ones((1, 4), dtype=torch.long), use_cache=False)  # the head check's kind
    shard.model.generate(torch.ones((2, 5), dtype=torch.long), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    worker = _tiny_shard(leader=False)
    testing.log_forward(worker.layout, "score", batch=1, seq=1)
    worker.model.generate(torch.ones((1, 2), dtype=torch.long), max_new_tokens=2, do_sample=False)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [
        {"kind": "score", "dp": 1, "batch": 2, "seq": 7, "tokens": 14, "scored": 6, "branches": 2},
        {"kind": "generate", "dp": 1, "batch": 2, "seq": 5, "past": 0, "tokens": 10},
        {"kind": "generate", "dp": 1, "batch": 2, "seq": 1, "past": 5, "tokens": 2},
        {"kind": "generate", "dp": 1, "batch": 2, "seq": 1, "past": 6, "tokens": 2},
    ]
