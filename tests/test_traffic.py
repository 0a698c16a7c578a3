"""What scoring sends and computes, from deterministic counters (issue 31: a change that sends or computes more fails).

Timing a run on a shared machine tells little; these count. The unit tests drive the real replica leader (batching,
packing, the real forwards of a tiny random Llama, vocab-parallel scoring) in one process: its control channel is the
production one with the transport stubbed, and the scoring reductions are counted as a TP group of two sends them
(the other rank holding no vocabulary, so the values are those of the whole head). Pinned, per fixed request set:

- the bytes the leader broadcasts per forward (``b x t`` ids + scored positions + targets, int64; a tree's tables)
  and the 16 B per scored token of the scoring reductions, as exact numbers;
- the attention each batch takes: rolling windows (right padding under the causal mask suffices) reach
  ``scaled_dot_product_attention`` with ``is_causal`` and no mask, as at 56e0b3f; rows sharing a long context go
  through the tree, whose work :func:`mpitp.replica.prefix.batch_cost` states exactly (checked against the calls);
- the number of forwards;
- the start-up checks: the head check combines 24 B per probe position and gathers nothing, and neither check
  leaves bytes or forwards in the run's counters.

``test_tp2_run_counters`` checks the same on a real ``mpiexec -n 2 ... --tp 2`` run's ``/stats``.
"""

from __future__ import annotations

import random
import types

import h5py
import pytest
import torch

from mpitp.replica import headcheck, prefix, prefix_probe
from mpitp.replica.leader import ReplicaLeader
from mpitp.replica.scoring import TPOps
from mpitp.replica.shard import ReplicaShard
from support import STORIES
from support.mpi import explain, run_mpi

VOCAB, MAX_LEN, EOT, LAYERS = 512, 32, 2, 2


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * MAX_LEN,
                      eos_token_id=EOT, bos_token_id=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


class TwoRankOps(TPOps):
    """The scoring reductions of a TP group of two whose other rank holds no vocabulary: counted as tp=2 sends
    them, returned as they are (this rank's head is the whole head, so the values are the true ones)."""

    def __init__(self, stats):
        super().__init__(size=2, counter=stats.tp, reduce_counter=stats.tp_score)

    def _reduce(self, t, op):
        self.counter.add(t)
        self.reduce_counter.add(t)
        return t

    def gather(self, t):  # the other rank's part would add nothing: its shard is empty
        return self._reduce(t, None).unsqueeze(0)


def _shard(model, share: bool = True) -> ReplicaShard:
    from mpi4py import MPI  # a real communicator: a deadline's phase names its other ranks (none here)

    layout = types.SimpleNamespace(tp=1, pp=1, replica_size=2, last_stage=True, first_stage=True, rank=0,
                                   is_leader=True, replica_comm=MPI.COMM_SELF)
    shard = ReplicaShard(model, layout, "cpu")
    shard.ops = shard.head.ops = TwoRankOps(shard.stats)
    assert prefix_probe.check_sharing(shard, enabled=share) == (None if share else "off (--no-prefix-sharing)")
    return shard


@pytest.fixture
def replica(model, monkeypatch):
    """(leader, messages sent, attention calls): the production leader and control channel, MPI and torch's
    broadcast stubbed; every ``scaled_dot_product_attention`` call recorded (masked or causal, shapes)."""
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mpitp.compat import TREE_ATTENTION
    from mpitp.replica import protocol

    sent, calls, layer_calls = [], [], []
    monkeypatch.setattr(protocol.mpicomm, "bcast_obj", lambda obj, *a, **k: sent.append(obj) or obj)
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group=None: None)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append(dict(b=q.shape[0], q=q.shape[-2], k=k.shape[-2], mask=attn_mask is not None, causal=is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    shard = _shard(model)  # runs the model under mpitp's own attention function (compat.TREE_ATTENTION)
    calls.clear()  # the probe's
    inner = ALL_ATTENTION_FUNCTIONS[TREE_ATTENTION]

    def recording_layer(module, query, key, value, attention_mask, **kwargs):  # what each layer hands attention
        layer_calls.append(dict(mask=attention_mask is not None, tree=prefix.SPEC_KW in kwargs))
        return inner(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(type(ALL_ATTENTION_FUNCTIONS)._global_mapping, TREE_ATTENTION, recording_layer)
    leader = ReplicaLeader(shard, timeout=60.0)
    assert leader.has_workers
    return types.SimpleNamespace(leader=leader, stats=shard.stats, sent=sent, calls=calls, layer_calls=layer_calls)


def _rolling_rows() -> list[tuple[list[int], int]]:
    """lm-eval's disjoint rolling windows (its own helpers, context_len=1, EOT prefix) of three documents, as
    :meth:`mpitp.evaluation.lm.MPITPLM.rolling_rows` makes them: every window's context is the one token before it,
    and all first windows share the EOT."""
    from lm_eval import utils as lm_utils

    g = random.Random(31)
    rows = []
    for n in (75, 40, 90):
        toks = [g.randrange(3, VOCAB) for _ in range(n)]
        for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=toks, prefix_token=EOT, max_seq_len=MAX_LEN, context_len=1)):
            rows.append(((ctx + cont)[-(MAX_LEN + 1):], len(cont)))
    return rows


def _choice_rows() -> list[tuple[list[int], int]]:
    """Three multiple-choice documents: a context of 20-24 tokens and four endings of 2-5 tokens each."""
    g = random.Random(17)
    rows = []
    for d in range(3):
        ctx = [g.randrange(3, VOCAB) for _ in range(20 + 2 * d)]
        for e in range(4):
            cont = [g.randrange(3, VOCAB) for _ in range(2 + (e + d) % 4)]
            rows.append((ctx + cont, len(cont)))
    return rows


def _plain_ints(rows, batch_size: int) -> int:
    """What 56e0b3f's leader broadcast for these rows: longest first, ``batch_size`` per forward, [ids | sel | tgt]."""
    order = sorted(rows, key=lambda r: -len(r[0]))
    total = 0
    for s in range(0, len(order), batch_size):
        batch = order[s : s + batch_size]
        total += len(batch) * max(len(r[0]) - 1 for r in batch) + 2 * sum(n for _, n in batch)
    return total


def _entries(calls) -> int:
    """Query-key pairs the recorded attention calls computed, per layer."""
    pairs = sum(c["b"] * (c["q"] * (c["q"] + 1) // 2 if c["causal"] else c["q"] * c["k"]) for c in calls)
    assert pairs % LAYERS == 0
    return pairs // LAYERS


def test_rolling_windows_send_and_compute_what_plain_rows_do(replica):
    """Rolling windows share only the token before each window: a tree would save one position per window and pad
    the batch to the tree's length, mask its attention and send its tables (the issue-31 regression: 3.46 MB of TP
    traffic for 0.90 MB). They go as plain rows, exactly as at 56e0b3f."""
    rows = _rolling_rows()
    scored = sum(n for _, n in rows)
    assert (len(rows), scored) == (8, 205)  # windows scoring 32, 32, 11 | 32, 8 | 32, 32, 26 tokens, each 32 long
    replica.leader.score_rows(rows, batch_size=4)
    sizes = [(m["meta"]["b"], m["meta"]["t"], m["meta"]["n"], m["meta"]["r"]) for m in replica.sent]
    assert sizes == [(4, 32, 107, 0), (4, 32, 98, 0)]
    assert _plain_ints(rows, 4) == 4 * 32 + 2 * 107 + 4 * 32 + 2 * 98 == 666
    assert replica.stats.tp_score.bytes == 16 * scored == 3280  # [max, sum-exp, target, first argmax] 4 B each
    assert replica.stats.tp_score.calls == 2  # one gather per forward (one block each), not three reductions
    assert replica.stats.tp.bytes == 8 * 666 + 3280 == 8608  # per forward: 2736 + 1712 B and 2592 + 1568 B
    assert replica.stats.forwards == 2
    assert replica.stats.tokens_read == replica.stats.row_tokens == 8 * 32  # no context read once for two rows
    # the attention: no explicit mask anywhere, SDPA's causal path in every layer
    assert replica.layer_calls == [dict(mask=False, tree=False)] * (2 * LAYERS)
    assert all(c["causal"] and not c["mask"] for c in replica.calls), replica.calls
    assert len(replica.calls) == 2 * LAYERS
    cost = prefix.plan_cost(prefix.plan(rows, 4, True, replica.leader.shard.flop_weights), 4)
    assert cost == prefix.Cost(ints=666, positions=256, entries=_entries(replica.calls), forwards=2)


def test_shared_contexts_are_read_once_and_cost_less(replica):
    """Multiple-choice rows sharing a 20-token context: one tree per document, fewer ids sent and fewer positions
    computed than plain rows, the continuations attended with the tree's mask."""
    rows = _choice_rows()
    replica.leader.score_rows(rows, batch_size=8)
    sizes = [(m["meta"]["b"], m["meta"]["t"], m["meta"]["n"], m["meta"]["r"]) for m in replica.sent]
    assert sizes == [(2, 34, 28, 8), (1, 30, 14, 4)]
    ints = 2 * 34 + 2 * 28 + 2 + 3 * 8 + 30 + 2 * 14 + 1 + 3 * 4  # ids, sel, tgt, ctx_len, 3 per branch
    assert ints == 221 < _plain_ints(rows, 8) == 400
    assert replica.stats.tp.bytes == 8 * ints + 16 * 42 == 2440
    assert replica.stats.forwards == 2
    assert (replica.stats.tokens_read, replica.stats.row_tokens) == (30 + 34 + 32, 294)
    # every layer takes the tree (transformers also hands it a packed-sequence mask, which the tree never reads)
    assert all(c["tree"] for c in replica.layer_calls), replica.layer_calls
    assert len(replica.layer_calls) == 2 * LAYERS
    assert any(c["mask"] for c in replica.calls)  # the continuations' parts
    cost = prefix.plan_cost(prefix.plan(rows, 8, True, replica.leader.shard.flop_weights), 8)
    assert cost == prefix.Cost(ints=221, positions=98, entries=_entries(replica.calls), forwards=2)
    plain = prefix.plan_cost(prefix.plan(rows, 8, False), 8)
    assert plain == prefix.Cost(ints=400, positions=8 * 28 + 4 * 23, entries=plain.entries, forwards=2)


def test_a_plan_never_costs_more_than_plain_rows():
    """Whatever the rows (rolling windows, shared contexts short or long, mixed), the plan sends no more ints and
    computes no more than the plain rows of 56e0b3f, and :func:`batch_cost` describes :func:`pack`'s layout."""
    g = random.Random(5)
    weights = prefix.flop_weights(types.SimpleNamespace(hidden_size=512, intermediate_size=1376))
    for trial in range(300):
        rows = []
        for _ in range(g.randint(1, 12)):
            ctx = [g.randrange(3, 50) for _ in range(g.choice([1, 1, 2, 5, 30, 100]))]
            for _ in range(g.randint(1, 5)):
                n = g.choice([1, 2, 6, 40, 200])
                rows.append((ctx + [g.randrange(3, 50) for _ in range(n)], n))
        bs = g.choice([1, 2, 4, 8, 16])
        plan, plain = prefix.plan(rows, bs, True, weights), prefix.plan(rows, bs, False)
        got, ref = prefix.plan_cost(plan, bs), prefix.plan_cost(plain, bs)
        assert got.ints <= ref.ints and got.flops(weights) <= ref.flops(weights), (trial, got, ref)
        assert ref.ints == _plain_ints(rows, bs)
        assert sorted(r for gr in plan for r in gr.rows) == list(range(len(rows)))
        flat, size, _ = prefix.pack(plan[:bs])
        c = prefix.batch_cost(plan[:bs])
        assert (c.ints, c.positions) == (flat.numel(), size["b"] * size["t"])


def test_start_up_checks_send_little_and_count_nothing(model, monkeypatch):
    """The head check compares each rank's columns of the log-softmax rows with the normaliser from two
    reductions: 24 B per probe position (max 4, sum-exp 4, scoring's one gather of its per-row summary 16), no
    logits gathered (an all-gather of the logits was 4 B per position and vocabulary entry: 2.4 MB per run with
    GPT-2's vocabulary). Neither check leaves bytes or forwards in the run's counters."""
    import torch.distributed as dist

    gathered = []

    def all_gather(out, t, group=None):  # the other rank of the group holds no vocabulary
        gathered.append(t.numel() * t.element_size())
        out[0].copy_(t)
        for o in out[1:]:
            o.fill_(0 if t.dtype == torch.long else float("-inf"))

    monkeypatch.setattr(dist, "all_gather", all_gather)
    shard = _shard(model)
    assert (shard.stats.tp.bytes, shard.stats.tp_score.bytes, shard.stats.forwards) == (0, 0, 0)
    worst, ratio, _ = headcheck._local_check(shard)
    assert ratio <= 1.0, worst
    positions = headcheck.PROBE_SHAPE[0] * headcheck.PROBE_SHAPE[1]
    assert gathered == []  # bytes of each all-gather of logits
    assert shard.stats.tp.bytes == 24 * positions == 576
    with shard.stats.uncounted():
        headcheck._local_check(shard)
    assert shard.stats.tp.bytes == 576 and shard.stats.tp.calls == 3  # max, sum, the scoring gather


@pytest.mark.mpi
def test_tp2_run_counters(test_tasks, tmp_path):
    """One real tp=2 run (stories260K, rolling wikitext and hellaswag): the group's /stats hold exactly the bytes
    the leader's broadcasts and the scoring reductions make, 16 B per scored token, and the forwards."""
    out = tmp_path / "out.h5"
    proc = run_mpi(2, ["eval", "--model", str(STORIES), "--tasks", "wikitext_local,hellaswag_local",
                       "--include-path", test_tasks, "--limit", "2", "--batch-size", "4", "--dtype", "float32",
                       "--tp", "2", "--threads", "1", "--output", str(out)], timeout=300)
    assert proc.returncode == 0, explain(proc)
    with h5py.File(out, "r") as f:
        st = {k: f["stats"][k][()].tolist()[0] for k in f["stats"].keys()}
    assert st["tp_score_bytes"] == 16 * st["tokens_scored"], st
    # 56e0b3f sent 725,600 B here (hellaswag's shared contexts as plain rows); 80a139b 773,976 B (the head check's
    # gathered logits, the probes, rolling windows as trees)
    assert (st["tokens_scored"], st["forwards"], st["tp_bytes"]) == (17939, 11, 723528), st
