"""Which generate mode mpitp believes lm-eval's HFLM runs for a request's generation kwargs, against lm-eval's own rule
(``normalize_gen_kwargs``): a sampled request is seeded and generated alone (its text the same in every batch and
layout), and its sampling settings are checked as transformers' sampling will read them."""

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
