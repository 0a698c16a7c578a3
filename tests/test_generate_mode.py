"""Rank 0's reading of lm-eval's generation settings: which generate mode lm-eval's HFLM runs for a request's
generation kwargs, against lm-eval's own rule (``normalize_gen_kwargs``: a sampled request is seeded and generated
alone, its text the same in every batch and layout), its sampling settings checked as transformers' sampling will
read them, and ``--apply_chat_template`` against the tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lm_eval.models.utils import normalize_gen_kwargs

from mpitp.evaluation.lm import MPITPLM

KWARGS = [{}, {"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "do_sample": False},
          {"do_sample": True}, {"do_sample": False}, {"temperature": 0.0, "do_sample": True},
          {"until": ["\n"], "temperature": 1.0, "top_k": 5}]


@pytest.mark.parametrize("config_samples", [False, True])
@pytest.mark.parametrize("kw", KWARGS)
def test_samples_follows_lm_eval(kw, config_samples):
    """``temperature: 0.8`` without ``do_sample`` samples under lm-eval 0.4.13 whatever the model's generation config
    says; mpitp read it from the config (greedy for stories260K), so such requests were generated in batches,
    unseeded, and the same request sampled 'was a walk in ' at --batch_size 3 and 'was a food. He had ...' at 1."""
    lm = SimpleNamespace(max_gen_toks=256, model=SimpleNamespace(
        generation_config=SimpleNamespace(do_sample=config_samples)))
    assert MPITPLM._samples(lm, kw) == normalize_gen_kwargs(kw, 256)["do_sample"]


def _bare_lm(max_length: int = 512) -> MPITPLM:
    """An MPITPLM with only what ``generate_until`` reads on rank 0 before dispatch (no model)."""
    lm = MPITPLM.__new__(MPITPLM)
    lm._max_length, lm._max_gen_toks, lm.seed, lm.clock, lm.picked = max_length, 256, 1234, None, {}

    def serve(kind, items, weights, requests):
        return [("", 0) for _ in items]

    lm.serve_requests = serve
    return lm


def _request(kw: dict) -> SimpleNamespace:
    return SimpleNamespace(args=("Once upon a time", kw), task_name="gen_task", doc_id=0, idx=0)


def test_sampling_setting_refused_before_generation():
    """``--gen_kwargs temperature=0.9,top_k=-1`` on a task without ``do_sample``: lm-eval samples, so transformers
    builds TopKLogitsWarper(-1), which raised on the DP leader after the load: a traceback and MPI_Abort (rc 1).
    Now rank 0 refuses it in one line before any request is dispatched."""
    from mpitp.errors import UsageError

    lm = _bare_lm()
    with pytest.raises(UsageError, match=r"^task gen_task's generation kwargs .*top_k=-1.*strictly positive"):
        lm.generate_until([_request({"until": ["\n"], "temperature": 0.9, "top_k": -1})])
    # greedy (do_sample false: lm-eval drops the temperature, transformers builds no warper) is not refused
    assert lm.generate_until([_request({"until": ["\n"], "temperature": 0.9, "top_k": -1, "do_sample": False}),
                              _request({"until": ["\n"], "temperature": 0.0})]) == ["", ""]


def test_apply_chat_template_without_a_template_is_one_line():
    """``--apply_chat_template`` with stories260K (no chat template): transformers' ValueError came as a traceback
    from lm-eval's request building, rc 1; now rank 0 refuses it in one line before any request is built."""
    from transformers import AutoTokenizer

    from mpitp.errors import UsageError
    from support import STORIES

    lm = _bare_lm()
    lm.tokenizer, lm.chat_template_args = AutoTokenizer.from_pretrained(str(STORIES)), {}
    lm.check_chat_template(False)  # off: nothing asked of the tokenizer
    with pytest.raises(UsageError, match=r"^--apply_chat_template: the tokenizer cannot apply a chat template: "):
        lm.check_chat_template(True)
    lm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    lm.check_chat_template(True)
