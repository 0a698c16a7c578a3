"""DP leaders tokenise the requests they receive: the rows they score are the ones ``lm_eval --model hf`` builds.

No MPI: the leader's side (:meth:`MPITPLM.score_rows_of`) against a plain single-process ``HFLM`` on the same
checkpoint, request by request, including the empty-context prefix rule, trailing spaces moved into the
continuation and left truncation to the model's length; the end-to-end figures are tests/test_parity.py's.
"""

from __future__ import annotations

import pytest

from support import STORIES

PAIRS = [("", " Once upon a time"), ("", "Once"), ("Once upon a time ", "there was a cat."),
         ("The cat sat", " on the mat"), ("Lily liked to play.  ", "\nShe ran."), ("a", "b"),
         ("word " * 700, "end")]  # longer than max_length: left-truncated


@pytest.fixture(scope="module")
def both():
    import transformers
    from lm_eval.models.huggingface import HFLM

    from mpitp.evaluation.lm import MPITPLM

    class Capturing(HFLM):
        def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
            self.seen = [(ctx, cont) for _, ctx, cont in requests]
            return [(0.0, False)] * len(requests)

    ref = Capturing(pretrained=str(STORIES), device="cpu", dtype="float32", max_length=256)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(STORIES), dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(str(STORIES))
    lm = MPITPLM(model, tok, leader=None, max_length=256)
    return ref, lm


def test_leader_rows_are_lm_eval_encodings(both):
    from lm_eval.api.instance import Instance

    ref, lm = both
    ref.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)], disable_tqdm=True)
    rows = lm.score_rows_of(PAIRS)
    assert len(rows) == len(ref.seen) == len(PAIRS)
    for (row, n), (ctx, cont) in zip(rows, ref.seen):
        assert row == (ctx + cont)[-(256 + 1):] and n == len(cont) > 0
    assert rows[0][0][0] == ref.prefix_token_id  # empty context: the prefix token conditions the continuation
    assert len(rows[-1][0]) == 257  # truncated on the left as lm-eval's _loglikelihood_tokens does


def test_encode_cache_memoises_the_leaders_encodings(both):
    _, lm = both
    lm.encode_cache = {}
    try:
        first = lm.score_rows_of(PAIRS[:3])
        filled = len(lm.encode_cache)
        assert filled > 0 and lm.score_rows_of(PAIRS[:3]) == first and len(lm.encode_cache) == filled
    finally:
        lm.encode_cache = None


def test_a_chunks_shared_contexts_are_encoded_once(both):
    """A multiple-choice document's requests share their context: outside a sweep the chunk's encodings are
    memoised for the call (each distinct text encoded once), the rows are lm-eval's, and nothing is kept after."""
    from lm_eval.api.instance import Instance

    ref, lm = both
    ctxs = ["The cat sat", "Lily liked to play. ", "A"]
    pairs = [(c, f" ending {j}") for c in ctxs for j in range(4)]
    ref.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    texts: list[str] = []
    encode = lm.tokenizer.encode
    lm.tokenizer.encode = lambda text, **kw: texts.append(text) or encode(text, **kw)
    try:
        rows = lm.score_rows_of(pairs)
    finally:
        del lm.tokenizer.encode
    assert [row for row, _ in rows] == [ctx + cont for ctx, cont in ref.seen]
    assert len(texts) == len(set(texts)) == len(pairs) + len(ctxs)  # each whole text, each context once
    assert lm.encode_cache is None


def test_templates_compiled_once_render_the_same():
    import lm_eval.utils as lm_utils

    from mpitp.evaluation.templates import compiled_once

    original = lm_utils.apply_template
    docs = [{"q": f"question {i}", "label": i % 4, "xs": ["a", "b"]} for i in range(5)]
    tpl = "{{q | trim}}? {{xs[label % 2]}} {{label}}"
    expected = [original(tpl, d) for d in docs]
    with compiled_once():
        assert lm_utils.apply_template is not original
        assert [lm_utils.apply_template(tpl, d) for d in docs] == expected
    assert lm_utils.apply_template is original
