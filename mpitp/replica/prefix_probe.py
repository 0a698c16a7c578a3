"""Whether a replica may score shared contexts as trees (:mod:`mpitp.replica.prefix`): decided from numbers once
after loading, every rank of the replica running the same probe, not from a list of model types.

The probe scores a few rows one per sequence and again packed as trees; sharing is on only where the two agree and the
tree reached every layer's attention. With pipeline stages each stage probes its own layers, from :func:`stage_inputs`
(the ids on stage 0, stand-in activations on a later stage, which never sees ids), and the replica agrees on one
verdict: a stage that packs trees needs every other stage to read them as trees. :mod:`mpitp.replica.stage_chunks`
probes its chunks of positions from the same inputs.
"""

from __future__ import annotations

import torch

from mpitp import compat
from mpitp.replica.prefix import Group, TreeSpec, install, pack, uninstall

#: Token ids a later pipeline stage's probe draws from: they only key its stand-in activations (one random vector
#: each), so a small table serves; the model's vocabulary (``vocab x hidden`` random floats: 4 GB at 128k x 8192)
#: would be allocated for nothing.
STAND_IN_VOCAB = 64


def probe_vocab(shard) -> int:
    """The ids a probe of this rank's layers may draw from: the model's vocabulary where the layers start from ids
    (no stages, or stage 0), else :data:`STAND_IN_VOCAB`."""
    if getattr(shard, "pipeline", False) and not shard.layout.first_stage:
        return STAND_IN_VOCAB
    return int(shard.model.config.get_text_config().vocab_size)


def stage_inputs(shard, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What this stage's layers take for probe ids ``ids`` (drawn below :func:`probe_vocab`): the ids themselves on
    stage 0; on a later stage stand-in activations, one seeded random vector per id (the same id, the same vector,
    whichever way the rows are packed), in the model's dtype."""
    if shard.layout.first_stage:
        return {"input_ids": ids}
    hidden = int(shard.model.config.get_text_config().hidden_size)
    table = torch.randn(STAND_IN_VOCAB, hidden, generator=torch.Generator().manual_seed(1618))
    return {"inputs_embeds": table.to(shard.device, next(shard.model.parameters()).dtype)[ids]}


def refusal(model, what: str, exc: BaseException) -> str:
    """The summary's phrase for a probe whose forward raised: the model's class, what it was given, the error's first
    line."""
    first = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"off: {type(model).__name__}'s forward does not take {what} ({type(exc).__name__}: {first})"


def attention_layers(shard) -> int:
    """How many attention calls one forward of this rank's layers makes when every layer is an attention layer."""
    layers = getattr(shard.base, "layers", None)
    if layers is not None:
        return len(layers)
    return int(getattr(shard.model.config.get_text_config(), "num_hidden_layers", -1))


def attention_kind(text) -> str | None:
    """What, in the config alone, rules the tree out: the probe is short and would not see a window."""
    other = sorted(set(getattr(text, "layer_types", None) or ()) - {"full_attention"})
    if other:
        return f"layer types {', '.join(other)}"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) is not False:
        return "sliding-window attention"
    if getattr(text, "attention_chunk_size", None):
        return "chunked attention"
    return None


def _probe_groups(vocab: int) -> list[Group]:
    """The same probe on every rank without a message: two contexts with continuations of 1 to 6 tokens, and a row
    alone (batched with trees, it is causal throughout)."""
    g = torch.Generator().manual_seed(4321)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [Group(ids(9), [0, 1, 2], [ids(4), ids(1), ids(6)]), Group(ids(5), [3, 4], [ids(3), ids(2)]),
            Group(ids(4), [5], [ids(5)])]


@torch.no_grad()
def check_sharing(shard, enabled: bool = True, timeout: float | None = None) -> str | None:
    """None when this replica scores shared contexts as trees (``shard.share`` set), else why not (a phrase for
    the run's summary).

    Every rank of the replica runs the same probe forwards (transformers' TP collectives need all of them): the
    probe's rows scored one per sequence, then as trees; the run shares prefixes only when the log-probs agree within
    the head check's tolerance and the attention saw the tree in every layer. With pipeline stages each stage probes
    its own layers (:func:`_check_stage_probe`) and the replica agrees on one verdict (collective over it, under
    ``timeout``): a stage that packs trees needs every other stage to read them as trees.
    """
    why = _local_verdict(shard, enabled)
    if shard.pipeline:
        from mpitp.parallel import comm as mpicomm

        why = mpicomm.first_objection(why, shard.layout.replica_comm, timeout, phase="prefix sharing check")
    if why:
        uninstall(shard.model)
    shard.share = why is None
    return why


def _local_verdict(shard, enabled: bool) -> str | None:
    """This rank's part of :func:`check_sharing` (every rank of a stage the same)."""
    if not enabled:
        return "off (--no-prefix-sharing)"
    why = attention_kind(shard.model.config.get_text_config())
    if why:
        return f"off: {why}"
    impl = compat.attention_implementation(shard.model.config)
    if impl not in ("sdpa", compat.TREE_ATTENTION):  # TREE_ATTENTION: probed before (and runs sdpa inside)
        return f"off: attention implementation {impl!r} (sharing runs on 'sdpa')"
    if not install(shard.model):
        return "off: transformers has no attention interface to register tree attention with"
    return _check_stage_probe(shard) if shard.pipeline else _check_probe(shard)


def _probe_both(shard, vocab: int, score) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The probe's rows scored one per sequence and as trees by ``score(groups, tree) -> (per-row values, attention
    calls that saw the tree)``: (plain, tree), or why not (a forward that raised, a tree that missed a layer)."""
    groups = _probe_groups(vocab)
    plain = [a for g in groups for a in g.alone()]
    try:
        with shard.stats.uncounted():
            ref, _ = score(plain, False)
            got, calls = score(groups, True)
    except Exception as exc:  # noqa: BLE001 - whatever the model's forward does with a tree, it stays plain
        return refusal(shard.model, "a packed tree", exc)
    expected = attention_layers(shard)
    if calls != expected:
        where = f" on stage {shard.layout.pp_rank}" if shard.pipeline else ""
        return f"off: the tree reached {calls} of {expected} layers' attention{where}"
    shard.attention_layers = expected
    return ref, got


def _check_probe(shard) -> str | None:
    """Why the probe's tree and plain scores disagree (None when they agree and the tree reached every layer)."""
    from mpitp.replica.headcheck import tolerance

    both = _probe_both(shard, int(shard.head.vocab_size), lambda groups, tree: _probe_scores(shard, groups, tree))
    if isinstance(both, str):
        return both
    ref, got = both
    tol = tolerance(ref, ref.unsqueeze(1), next(shard.model.parameters()).dtype)
    if not bool(((got - ref).abs() <= tol).all()):
        return f"off: tree and plain rows differ by up to {float((got - ref).abs().max()):.3g} on the probe"
    return None


def _check_stage_probe(shard) -> str | None:
    """:func:`_check_probe` for one pipeline stage's layers alone, so that no stage waits on another's probe: the
    probe's rows and its trees through this stage (:func:`stage_inputs`), each row's hidden states at its scored
    positions summed, plain against tree."""
    from mpitp.replica.headcheck import hidden_mismatch

    dtype = next(shard.model.parameters()).dtype

    def sums(batch: list[Group], tree: bool):
        flat, size, owner = pack(batch)
        flat = flat.to(shard.device)
        b, t, n = size["b"], size["t"], size["n"]
        ids, sel = flat[: b * t].view(b, t), flat[b * t : b * t + n]
        kw = stage_inputs(shard, ids)
        spec = TreeSpec.from_packed(flat, **size) if tree else None
        if spec is not None:
            kw.update(spec.forward_kwargs())
        h = shard.base(**kw, use_cache=False).last_hidden_state
        hs = h.reshape(b * t, -1).index_select(0, sel).float()
        out = torch.zeros((max(owner) + 1, hs.shape[-1]), device=hs.device)
        out.index_add_(0, torch.tensor(owner, device=hs.device), hs)
        return out, spec.calls if spec is not None else 0

    both = _probe_both(shard, probe_vocab(shard), sums)
    if isinstance(both, str):
        return both
    apart = hidden_mismatch(both[1], both[0], dtype)
    return f"off: tree and plain rows differ {apart} on stage {shard.layout.pp_rank}" if apart else None


def _probe_scores(shard, groups: list[Group], tree: bool = False):
    flat, size, owner = pack(groups)
    flat = flat.to(shard.device)
    spec = TreeSpec.from_packed(flat, **size) if tree else None
    shard.stats.forwards -= 1  # score() counts one: the probe is none of the run's forwards (nor a test hook's)
    lp, _ = shard.score(flat, spec=spec, probe=True, **size)
    sums = torch.zeros(len(groups) and max(owner) + 1, dtype=torch.float64, device=lp.device)
    sums.index_add_(0, torch.tensor(owner, device=lp.device), lp.double())
    return sums.cpu(), spec.calls if spec is not None else 0
