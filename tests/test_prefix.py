"""Prefix sharing (mpitp.replica.prefix) without MPI: packing, the probe's verdict per architecture, tree == plain.

The MPI path (leader, workers, TP) is compared with lm-eval request by request in test_parity.py and
test_architectures.py, whose multiple-choice tasks go through the trees wherever the probe lets them.
"""

from __future__ import annotations

import pytest
import torch

from mpitp.evaluation.dispatch import make_chunks
from mpitp.evaluation.lm import shared_context_weights
from mpitp.replica import prefix, prefix_probe
from mpitp.replica.shard import ReplicaShard
from support import arch as A

SHARED_ON = ("llama", "gpt2", "opt", "cohere", "granite", "qwen2", "gpt_neox")
SHARED_OFF = {"mistral": "sliding-window", "gemma2": "layer types sliding_attention",
              "bamba": "layer types", "falcon": "the tree reached 0 of 2 layers"}


def _shard(model_type: str) -> ReplicaShard:
    return A.tiny_shard(model_type)


def _batch():
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, 512, (n,), generator=g).tolist()

    return [prefix.Group(ids(20), [0, 1, 2, 3], [ids(7), ids(1), ids(12), ids(3)]),
            prefix.Group(ids(8), [4], [ids(9)]), prefix.Group(ids(30), [5, 6], [ids(2), ids(5)]),
            prefix.Group(ids(6), [7, 8, 9], [ids(1), ids(1), ids(1)])]


@pytest.mark.parametrize("model_type", SHARED_ON)
def test_tree_equals_plain_rows(model_type):
    """Where the probe turns sharing on, a batch of trees (4 continuations, a row alone, single-token continuations)
    scores every row as that row alone does, within the parity rule, in every layer (calls counted)."""
    shard = _shard(model_type)
    assert prefix_probe.check_sharing(shard) is None
    assert shard.share and shard.attention_layers == 2
    groups = _batch()
    plain = [prefix.Group(g.ctx, [r], [c]) for g in groups for r, c in zip(g.rows, g.conts)]
    ref, _ = prefix_probe._probe_scores(shard, plain)
    got, calls = prefix_probe._probe_scores(shard, groups, tree=True)
    assert calls == 2
    d = (got - ref).abs()
    assert bool((d <= 1e-5 * ref.abs().clamp(min=1.0)).all()), (model_type, float(d.max()))
    assert float(ref.abs().min()) > 0.5  # real log-likelihoods, not a degenerate model


@pytest.mark.parametrize("model_type", sorted(SHARED_OFF))
def test_models_the_tree_cannot_serve_stay_plain(model_type):
    """Sliding windows, mixed layer types (state-space layers carry state along the sequence) and forwards that do
    not hand attention keywords down are refused, each with its reason, and the shard keeps scoring plain rows."""
    shard = _shard(model_type)
    why = prefix_probe.check_sharing(shard)
    assert why is not None and SHARED_OFF[model_type] in why, why
    assert not shard.share


def _as_one_row(module, query, key, value, spec, dropout=0.0, scaling=None, **kwargs):
    """An attention that counts the tree's calls but reads the packed sequence as one causal row."""
    spec.calls += 1
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None


def test_probe_refuses_an_attention_that_ignores_the_tree(monkeypatch):
    """The probe decides from numbers: an attention that reads the packed sequence as one causal row (what a model
    whose layers drop the tree would compute) is caught by the comparison."""
    shard = _shard("llama")

    monkeypatch.setattr(prefix, "tree_attention", _as_one_row)
    why = prefix_probe.check_sharing(shard)
    assert why is not None and "differ" in why, why
    assert not shard.share


def test_switched_off():
    shard = _shard("llama")
    assert prefix_probe.check_sharing(shard, enabled=False) == "off (--no-prefix-sharing)"
    assert not shard.share


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_stages_probe_their_own_layers(stage, monkeypatch):
    """With stages each probes its own layers (stage 0 from ids, a later one from stand-in activations) and the
    replica agrees on the verdict; an attention that ignores the tree is caught there too, naming the stage."""
    shard = A.tiny_shard("llama", stage=stage)
    assert prefix_probe.check_sharing(shard, timeout=30) is None
    assert shard.share and shard.attention_layers == 2

    monkeypatch.setattr(prefix, "tree_attention", _as_one_row)
    why = prefix_probe.check_sharing(shard, timeout=30)
    assert why is not None and "differ" in why and f"stage {stage}" in why, why
    assert not shard.share


def test_a_trees_rows_run_as_micro_batches():
    """A pipeline cuts a batch of trees into micro-batches of whole trees, each with its part of the spec
    (:meth:`TreeSpec.rows`): the pieces' hidden states are the whole batch's; a piece without continuations of its
    own runs as plain rows."""
    shard = _shard("llama")
    assert prefix_probe.check_sharing(shard) is None
    flat, size, _ = prefix.pack(_batch())
    b, t = size["b"], size["t"]
    ids = flat[: b * t].view(b, t)
    spec = prefix.TreeSpec.from_packed(flat, **size)
    with torch.no_grad():
        whole = shard.base(input_ids=ids, use_cache=False, **spec.forward_kwargs()).last_hidden_state
        parts = []
        for r0, r1 in ((0, 1), (1, 3), (3, 4)):
            sub = spec.rows(r0, r1)
            kw = {} if sub is None else sub.forward_kwargs()
            parts.append(shard.base(input_ids=ids[r0:r1], use_cache=False, **kw).last_hidden_state)
    assert spec.rows(1, 2) is None  # the row alone: causal throughout
    assert spec.rows(3, 4) is None  # single-token continuations: the context alone
    real = ids != 0  # padding past a sequence's end is computed and never read
    d = (torch.cat(parts) - whole).abs()[real]
    assert float(d.max()) <= 1e-5 * max(1.0, float(whole.abs().max())), float(d.max())


def test_a_tree_forward_builds_no_transformers_mask():
    """A tree's forward arguments (:meth:`TreeSpec.forward_kwargs`) let transformers skip its ``[b, 1, t, t]`` mask,
    which :func:`tree_attention` never reads: with the restarting position ids alone transformers builds one for
    packed sequences (several ms a forward at hellaswag's lengths, bench/README "Session 23")."""
    from transformers.masking_utils import create_causal_mask

    shard = _shard("llama")
    assert prefix_probe.check_sharing(shard) is None
    flat, size, _ = prefix.pack(_batch())
    kw = prefix.TreeSpec.from_packed(flat, **size).forward_kwargs()
    assert kw[prefix.SPEC_KW].b == size["b"] and kw["attention_mask"].shape == (size["b"], size["t"])
    embeds = torch.zeros((size["b"], size["t"], shard.model.config.hidden_size))

    def mask(**given):
        return create_causal_mask(config=shard.model.config, inputs_embeds=embeds, cache=None,
                                  position_ids=kw["position_ids"], **given)

    assert mask(attention_mask=None).dim() == 4  # the packed-sequence mask the spec's arguments avoid
    assert mask(attention_mask=kw["attention_mask"]) is None


def test_group_rows_and_pack_layout():
    rows = [([5, 6, 7, 8, 9], 2), ([5, 6, 7, 1], 1), ([4, 4, 2, 2], 3), ([5, 6, 7, 3, 3, 3], 3)]
    groups = prefix.group_rows(rows, share=True)
    assert [g.rows for g in groups] == [[0, 1, 3], [2]] or [g.rows for g in groups] == [[2], [0, 1, 3]]
    shared = next(g for g in groups if len(g.rows) == 3)
    assert shared.ctx == [5, 6, 7] and shared.conts == [[8, 9], [1], [3, 3, 3]]
    assert shared.packed_len == 3 + 1 + 0 + 2
    assert [g.rows for g in prefix.group_rows(rows, share=False)] == [[3], [0], [1], [2]]  # longest first
    flat, size, owner = prefix.pack([shared])
    b, t, n, r = size["b"], size["t"], size["n"], size["r"]
    assert (b, t, n, r) == (1, 6, 6, 2)
    assert flat[: b * t].tolist() == [5, 6, 7, 8, 3, 3]
    assert flat[b * t : b * t + n].tolist() == [2, 3, 2, 2, 4, 5]  # each row's first target from the context's end
    assert flat[b * t + n : b * t + 2 * n].tolist() == [8, 9, 1, 3, 3, 3]
    assert owner == [0, 0, 1, 2, 2, 2]
    spec = prefix.TreeSpec.from_packed(flat, b, t, n, r)
    assert spec.position_ids.tolist() == [[0, 1, 2, 3, 3, 4]]
    assert flat.numel() == prefix.packed_size(b, t, n, r)
    first, rest = shared.split(2)
    assert first.rows == [0, 1] and rest.rows == [3] and rest.ctx == shared.ctx


def test_a_documents_requests_stay_together_in_chunks():
    """Equal weights per context: the chunking (sorted by weight) keeps a document's choices adjacent."""
    pairs = [("short q", " a"), ("short q", " bbbbbbbbbbbb"), ("a much longer question", " x"),
             ("a much longer question", " yy"), ("a much longer question", " zzzzzzzzz"), ("short q", " c")]
    weights = shared_context_weights(pairs)
    assert weights[0] == weights[1] == weights[5] and weights[2] == weights[3] == weights[4]
    assert abs(sum(weights) - sum(len(a) + len(b) for a, b in pairs)) <= len(pairs)
    chunks = make_chunks("loglikelihood", pairs, weights, n_groups=1, per_group=2, min_items=1)
    order = [i for c in chunks for i in c.indices]
    assert order == [2, 3, 4, 0, 1, 5]
