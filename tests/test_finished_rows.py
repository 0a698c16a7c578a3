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


def _stops_tokenizer():
    """stories260K's tokenizer with its '.' token marked special (as ``<|im_end|>`` is in a chat model whose EOS is
    another token): lm-eval's final decode drops it, its stop-sequence tracker sees it."""
    from transformers import AddedToken, AutoTokenizer

    from support import STORIES

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(".", special=True, normalized=False)]})
    return tok


def test_stop_sequence_seen_only_with_special_tokens_keeps_the_row():
    """With '.' special and ``until: ['.']``, lm-eval's row goes on past the '.' (its text has none to cut at) while
    another row of its batch has not met one; mpitp finished the row at the '.': stories260K's g_dot task gave
    'was a big, red ball' where lm-eval gave 'was a big, red ball She loved to play ...' (7 of 12 rows). A row
    leaves only once lm-eval's text of it is cut (``MPITPLM._text_cut``); every row's tracker done ends all."""
    from lm_eval.models.utils_hf import stop_sequences_criteria

    from mpitp.evaluation.lm import MPITPLM
    from mpitp.replica.finished_rows import PerRowStops

    tok = _stops_tokenizer()
    lm = MPITPLM.__new__(MPITPLM)
    lm.tokenizer, lm.think_end_token = tok, None
    ctx = tok.encode("Once upon", add_special_tokens=False)

    def batch(*texts):
        rows = [ctx + tok.encode(t, add_special_tokens=False) for t in texts]
        width = max(map(len, rows))
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])  # right-filled: the last tokens matter alone

    def done(until, *texts):
        ids = batch(*texts)
        stops = PerRowStops(stop_sequences_criteria(tok, until, len(ctx), ids.shape[0]), lm._text_cut(until),
                            len(ctx))
        return stops(ids, None).tolist()

    assert done(["."], "a big, red ball.", "a big, red ball and") == [False, False]  # '.' dropped from the text
    assert done(["ball"], "a big, red ball.", "a big, red dog and") == [True, False]  # cut: the row leaves
    assert done(["."], "a red ball.", "a big dog.") == [True, True]  # lm-eval's verdict: all met '.', all stop
    lm.think_end_token = "</think>"  # the text kept is after the last one, which may still come: no row alone
    assert done(["ball"], "a big, red ball.", "a big, red dog and") == [False, False]
