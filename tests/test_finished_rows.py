"""Greedy decode steps over the rows still generating (mpitp.replica.finished_rows): HF ``generate`` with an EOS that
stops the rows at different steps gives the same tokens as transformers alone, and each step computes only the rows
not yet finished. One process, a tiny random Llama, the greedy head's report of its picks (``note_ids``) played by
the test's forward; with the real vocab-parallel head under TP, ``tests/test_parity.py``'s zero-shot gsm8k (stops at
a sentence's end) holds the generations to lm-eval's."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from mpitp.replica.generation import GenerationState, GrowingCache
from mpitp.replica.scoring import CommCounter
from mpitp.testing import RAGGED_ROWS
from support import tiny_llama

NEW = 12


def _batch():
    torch.manual_seed(5)
    ids = torch.randint(3, 97, (4, 7))
    mask = torch.ones_like(ids)
    ids[2, :2], mask[2, :2] = 0, 0  # one row left-padded: the prefill goes row by row first
    return ids, mask


def _reference(model, eos):
    ids, mask = _batch()
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, eos_token_id=eos).clone()


def _generate(model, eos):
    """``generate`` through GenerationState.forward (greedy), as the leader's mirrored forward calls it; returns the
    sequences and the rows each forward computed."""
    ids, mask = _batch()
    shard = SimpleNamespace(model=model, ops=SimpleNamespace(reduce_counter=CommCounter()), pipeline=False,
                            device=torch.device("cpu"), layout=SimpleNamespace(replica_comm=None))
    gen = GenerationState(shard)
    gen.begin(greedy=False, reserve=NEW)
    gen.greedy = True  # the greedy head itself is not swapped in here: the forward below tells its picks
    original, rows = model.forward, []

    def picking(**kw):  # what GreedyHead does on every rank: tell the state the argmax of the last position
        out = original(**kw)
        gen.note_ids(out.logits[:, -1, :].argmax(-1))
        return out

    @functools.wraps(original)
    def forward(**kwargs):
        out = gen.forward(picking, kwargs)
        rows.append(getattr(out, RAGGED_ROWS, None))
        return out

    model.forward = forward
    try:
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0, eos_token_id=eos, cache=GrowingCache(model.config, NEW))
    finally:
        del model.forward
        gen.end()
    return seqs, rows


def test_finished_rows_leave_the_forwards_and_the_tokens_stay_transformers():
    model = tiny_llama(2)
    free = _reference(model, eos=None)[:, 7:]

    def stops(seqs, eos):  # per row, the step that appended EOS (None: never)
        return [int((r == eos).nonzero()[0]) if bool((r == eos).any()) else None for r in seqs]

    # EOS: a token at least two rows pick, at different steps before the last, so rows leave at different steps
    eos = next(t for t in free.unique().tolist() if len({s for s in stops(free, t) if s is not None and s < NEW - 2})
               >= 2)
    ref = _reference(model, eos)
    stop = stops(ref[:, 7:], eos)
    got, rows = _generate(model, eos)
    assert torch.equal(got, ref)
    decode = [r[0][0] if r else 4 for r in rows[1:]]  # rows computed per decode step (None: the whole batch)
    # a row leaves two forwards after the one whose pick was its EOS: the next forward reads the EOS itself, and
    # generate pads the row from then on, which the forward after sees
    left = [sum(1 for s in stop if s is not None and i >= s + 1) for i in range(len(decode))]
    assert decode == [4 - n for n in left] and len(set(decode)) >= 3, (decode, stop)


def test_without_an_eos_every_row_stays():
    """Where ``generate`` does not pad a finished row (no EOS id), nothing tells it: every step computes every row."""
    model = tiny_llama(2)
    got, rows = _generate(model, eos=None)
    assert torch.equal(got, _reference(model, eos=None))
    assert all(r is None for r in rows[1:]), rows
