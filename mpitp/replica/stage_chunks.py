"""Position chunks through pipeline stages: a batch with too few rows to fill the stages is cut along its positions.

Micro-batches of rows (:func:`mpitp.replica.pipeline.micro_batches`) keep every stage busy once a batch has rows to
spare. A batch of one row -- a rolling-perplexity window scored alone, a long prompt at ``--batch-size 1``, a task's
last rows -- was one piece, and the stages ran one after the other on it: at pp=2 the replica's busy time was 2.15x
the forwards alone on rolling windows (bench/README, ``bench_forward_limit.py``). Such a batch now goes through in
chunks of positions: each stage runs chunk i with the keys and values of chunks 0..i-1 in a KV cache of its own, so
stage 0 computes chunk i+1 while stage 1 computes chunk i. Causal attention over a cache gives every position the
keys and values the whole sequence gives it, so the log-probs agree up to rounding. Whether a model's forward really
does -- positions taken from the cache, a mask built for a query chunk after cached keys, nothing carried along the
sequence outside the cache -- is decided from numbers once after loading (:func:`check_chunking`, every stage on its
own layers, the replica agreeing on one verdict), as prefix sharing decides trees, not from a list of model types;
configurations whose attention the short probe could not see (a sliding window, chunked attention, layers other
than full attention) keep whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpitp.parallel import comm as mpicomm
from mpitp.parallel.layout import split_layers
from mpitp.replica.pipeline import micro_batches

#: Positions per chunk, at least: a shorter chunk costs more in per-call overhead (every layer's kernels, the mask,
#: the cache's growth) than the overlap wins back.
MIN_CHUNK = 64
PROBE_LEN = 24  # the probe's positions, run whole and in PROBE_CHUNKS chunks
PROBE_CHUNKS = 3


@dataclass(frozen=True)
class Piece:
    """One forward of one stage: ``rows`` x ``cols`` of the batch."""

    rows: slice
    cols: slice


def position_chunks(t: int, pp: int, min_chunk: int = MIN_CHUNK) -> list[slice]:
    """``t`` positions as up to ``2 * pp`` consecutive chunks of at least ``min_chunk`` (one when too short)."""
    k = max(1, min(2 * pp, t // max(1, min_chunk)))
    return [slice(s0, s1) for s0, s1 in split_layers(t, k)]


def pieces(b: int, t: int, pp: int, chunked: bool, min_chunk: int = MIN_CHUNK) -> tuple[list[Piece], bool]:
    """The pieces a ``b`` x ``t`` batch goes through ``pp`` stages in, and whether they are chunks of positions (each
    after the ones before it, through a KV cache) rather than micro-batches of rows. Rows while there are at least
    two per stage; fewer rows are cut into up to ``2 * pp`` chunks of at least ``min_chunk`` positions, where the
    model's forward was found to take them (``chunked``)."""
    rows = micro_batches(b, pp)
    if chunked and len(rows) < 2 * pp:
        cols = position_chunks(t, pp, min_chunk)
        if len(cols) > 1:
            return [Piece(slice(0, b), c) for c in cols], True
    return [Piece(slice(r0, r1), slice(0, t)) for r0, r1 in rows], False


def prefill_chunks(kw: dict, pp: int, min_chunk: int = MIN_CHUNK) -> list[dict]:
    """A generation forward's keyword arguments as the forwards of its chunks of positions: a prefill (a prompt,
    nothing cached yet: its attention mask as long as its ids) is run chunk after chunk, the cache carrying the chunks
    before, so the stages overlap on it; every row at once, as generation keeps its batch whole. Each chunk gets its
    ids and position ids and the mask of every position up to its end (the padding of a left-padded prompt included).
    ``[kw]`` for a decode step, a prompt shorter than two chunks, or arguments of other shapes (another tensor input,
    3-D positions) that this does not know how to cut."""
    ids, mask, pos = kw.get("input_ids"), kw.get("attention_mask"), kw.get("position_ids")
    if ids is None or ids.dim() != 2 or kw.get("use_cache") is not True:  # the chunks before live in the cache
        return [kw]
    t = ids.shape[1]
    if any(torch.is_tensor(v) for k, v in kw.items() if k not in ("input_ids", "attention_mask", "position_ids")):
        return [kw]
    if (mask is not None and tuple(mask.shape) != tuple(ids.shape)) or (pos is not None and pos.dim() != 2):
        return [kw]
    cols = position_chunks(t, pp, min_chunk)
    if len(cols) < 2:
        return [kw]
    out = []
    for c in cols:
        part = dict(kw, input_ids=ids[:, c])
        if mask is not None:
            part["attention_mask"] = mask[:, : c.stop]
        if pos is not None:
            part["position_ids"] = pos[:, c]
        out.append(part)
    return out


def check_chunking(shard, timeout: float | None) -> str | None:
    """None when this replica cuts few-row batches into chunks of positions (``shard.chunked`` set), else why not (a
    phrase for the run's summary). ``shard``: this rank's :class:`~mpitp.replica.shard.ReplicaShard` (not imported:
    the shard imports this module). Collective over the replica: every stage probes its own layers (its TP ranks
    together, as their collectives need), and one stage's no is every stage's, since a stage that sends chunks needs
    a next stage that takes them."""
    from mpitp.testing import stage_chunk

    lay = shard.layout
    hook = stage_chunk()
    shard.min_chunk = hook or MIN_CHUNK
    why = _probe(shard) if hook != 0 else "off (test hook)"
    why = mpicomm.first_objection(why, lay.replica_comm, timeout, phase="pipeline chunk check")
    shard.chunked = why is None
    return why


@torch.no_grad()
def _probe(shard) -> str | None:
    """Why this stage's layers do not give a chunked probe what they give it whole (None: they do)."""
    from mpitp.replica.headcheck import hidden_mismatch
    from mpitp.replica.prefix_probe import attention_kind, probe_vocab, refusal, stage_inputs

    why = attention_kind(shard.model.config.get_text_config())
    if why:
        return f"off: {why}"
    base = shard.base
    ids = torch.randint(0, probe_vocab(shard), (2, PROBE_LEN), generator=torch.Generator().manual_seed(2718))
    inputs = stage_inputs(shard, ids.to(shard.device))
    try:
        with shard.stats.uncounted():
            whole = base(**inputs, use_cache=False).last_hidden_state
            cache, parts = None, []
            for s0, s1 in split_layers(PROBE_LEN, PROBE_CHUNKS):
                out = base(**{k: v[:, s0:s1] for k, v in inputs.items()}, cache=cache, use_cache=True)
                cache = out.cache
                parts.append(out.last_hidden_state)
    except Exception as exc:  # noqa: BLE001 - whatever the forward does with a cache, whole rows stay right
        return refusal(base, "chunks over a cache", exc)
    apart = hidden_mismatch(torch.cat(parts, dim=1), whole, next(shard.model.parameters()).dtype)
    return f"off: chunks and whole rows differ {apart} on stage {shard.layout.pp_rank}" if apart else None
