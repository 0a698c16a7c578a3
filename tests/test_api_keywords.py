"""``mpitp.evaluate``'s keywords and what a training script hands it, in one process (an MPI world of one,
``comm=MPI.COMM_SELF``): the run itself is stubbed, these tests are about what reaches it, what is refused before it
and what the caller gets back.

- ``data_dir`` (``mpitp eval --data-dir``): offline stock tasks. It went on to ``lm_eval.simple_evaluate``, which has no
  such parameter: a TypeError on rank 0 after the other ranks had started serving; the task YAMLs it writes are
  removed after the call, as ``mpitp eval`` removes them.
- a keyword neither ``mpitp.evaluate`` nor ``simple_evaluate`` takes (``limt=5``): a TypeError raised inside lm-eval
  on rank 0 alone, the other ranks left serving until the deadline (an hour by default) when the caller caught it;
  now a UsageError on every rank before any work, with the likely spelling.
- a PEFT model (LoRA training): scored as the model it wraps at tp=1, refused with adapter layers at tp > 1;
  a DistributedDataParallel model: scored as its module.
- the caller's random generators, which lm-eval reseeds, are as they were after the call.
- ``use_cache``: lm-eval's response cache, keyed by the request, gave a trained model its earlier scores: refused.
- an ``output`` or ``gen_kwargs`` that ``mpitp eval`` refuses up front (a directory, a FIFO; ``max_gen_toks=abc``):
  refused alike, before any work; so are values out of range (``max_length=1``, ``num_fewshot=-1``), ``limit`` with
  ``samples``, a tokenizer that does not load or has no chat template to apply; ``limit="2"`` is 2.
- ``tasks="a,b"`` is two tasks, as ``--tasks a,b`` is (it was looked up as one name).
"""

from __future__ import annotations

import os

import pytest

from support import REPO, STORIES


@pytest.fixture(scope="module")
def stories():
    import mpitp

    return mpitp.load_model(str(STORIES), 1, "cpu", "float32")


def _stub_run(monkeypatch) -> list:
    """``evaluate_loaded`` replaced by one that records what it was given (and whether the task YAMLs existed)."""
    from mpitp.evaluation import runner

    seen = []

    def fake(model, tokenizer, cfg, rt, *, out, task_manager=None, extra_lm_eval=None, **_):
        include = list(task_manager.include_path or []) if task_manager is not None else []
        seen.append(dict(cfg=cfg, extra=dict(extra_lm_eval or {}), include=include,
                         existed=[os.path.isdir(p) for p in include]))
        return {"results": {}}

    monkeypatch.setattr(runner, "evaluate_loaded", fake)
    return seen


def test_data_dir_serves_stock_tasks_and_its_yamls_are_removed(shared_dir, stories, monkeypatch):
    from mpi4py import MPI

    import mpitp

    seen = _stub_run(monkeypatch)
    res = mpitp.evaluate(stories, str(STORIES), ["arc_easy"], comm=MPI.COMM_SELF, limit=2,
                         data_dir=str(shared_dir / "data"), bootstrap_iters=0)
    assert res == {"results": {}}
    (got,) = seen
    assert got["cfg"].data_dir == str(shared_dir / "data") and "data_dir" not in got["extra"], got
    generated = [p for p in got["include"] if os.path.basename(p).startswith("mpitp-tasks-")]
    assert generated and all(got["existed"]), got
    assert not any(os.path.exists(p) for p in generated), f"left behind: {generated}"


def test_a_keyword_nobody_takes_is_refused_before_any_work(stories, monkeypatch):
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    with pytest.raises(UsageError) as err:
        mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, limt=5)
    assert str(err.value) == ("mpitp.evaluate: unknown keyword argument 'limt' (did you mean 'limit'?): neither "
                              "mpitp.evaluate's own nor one of lm_eval.simple_evaluate's")
    assert err.value.collective and seen == []


def test_an_output_mpitp_eval_refuses_is_refused_before_any_work(stories, monkeypatch, tmp_path):
    """A directory (or a FIFO) as ``output``: an IsADirectoryError from the results writer on rank 0 once every request
    was computed, its peers left serving; now ``mpitp eval``'s own refusal, on every rank, before any work."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name, why in (("adir", "is a directory"),
                      ("fifo", "is not a regular file (a device, FIFO or socket): choose another --output")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, output=str(tmp_path / name))
        assert str(err.value) == f"output {tmp_path / name} {why}" and err.value.collective
    assert seen == []


def test_gen_kwargs_mpitp_eval_refuses_are_refused_before_any_work(stories, monkeypatch):
    """``max_gen_toks=abc`` was a ValueError and ``use_cache=False`` a TypeError from ``generate``, each raised on the
    DP leader alone once the requests were built; now ``mpitp eval``'s refusals, on every rank, before any work."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    for gen_kwargs, why in (
            ("max_gen_toks=abc", "--gen_kwargs max_gen_toks=abc: max_gen_toks must be a positive integer"),
            ("use_cache=False", "--gen-kwargs use_cache is not supported: ")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_gen"], comm=MPI.COMM_SELF, gen_kwargs=gen_kwargs)
        assert str(err.value).startswith(why) and err.value.collective, str(err.value)
    assert seen == []


def test_values_mpitp_eval_refuses_are_refused_before_any_work(stories, monkeypatch):
    """``max_length=1`` was a UsageError on rank 0 alone once the first request did not fit (its TP peer left
    serving: the 2-rank launch ran into its 60 s timeout) and ``num_fewshot=-1`` ran; ``mpitp eval`` and job files
    refuse both. Now refused on every rank before any work, as ``limit=0`` is."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    for kw, why in ((dict(max_length=1), "max_length=1: expected an integer >= 2 (tokens), got 1"),
                    (dict(num_fewshot=-1), "num_fewshot=-1: expected an integer >= 0, got -1"),
                    (dict(bootstrap_iters=-5), "bootstrap_iters=-5: expected an integer >= 0, got -5")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, **kw)
        assert str(err.value) == f"mpitp.evaluate: {why}" and err.value.collective
    assert seen == []


def test_use_cache_is_refused_its_scores_would_be_stale(stories, monkeypatch):
    """``use_cache`` went to ``simple_evaluate``, whose sqlite cache of responses is keyed by the request: after the
    weights were halved, a second call gave the first call's word perplexity (2797.18) instead of the model's own
    (2862476.17). Refused now, on every rank before any work."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    with pytest.raises(UsageError) as err:
        mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, use_cache="/tmp/cache")
    assert str(err.value).startswith("mpitp.evaluate: use_cache='/tmp/cache' is refused: lm-eval's cache of model "
                                     "responses is keyed by the request, not the weights") and err.value.collective
    assert seen == []


def test_tasks_given_as_one_comma_separated_string_are_each_a_task(stories, monkeypatch):
    """``tasks="mpitp_demo_mc,mpitp_demo_ppl"``, as ``--tasks`` and a job file's ``tasks:`` take them, was looked up as
    one task of that name and refused as unknown; an empty or repeated name is refused as a job file's is."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen, demo = _stub_run(monkeypatch), str(REPO / "mpitp" / "tasks" / "demo" / "tasks")
    mpitp.evaluate(stories, str(STORIES), "mpitp_demo_mc, mpitp_demo_ppl", comm=MPI.COMM_SELF, limit=2,
                   include_path=demo)
    assert [got["cfg"].tasks for got in seen] == [["mpitp_demo_mc", "mpitp_demo_ppl"]], seen
    for tasks, why in (("mpitp_demo_mc,", "tasks=['mpitp_demo_mc', '']: empty task name in ''"),
                       (["mpitp_demo_mc", "mpitp_demo_mc"], "task 'mpitp_demo_mc' is listed twice")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), tasks, comm=MPI.COMM_SELF, include_path=demo)
        assert str(err.value).endswith(why) and err.value.collective, str(err.value)
    assert len(seen) == 1


def test_a_peft_model_is_scored_as_the_model_it_wraps_and_refused_under_tp(stories, monkeypatch):
    """A model being LoRA-trained (``get_peft_model``) failed on rank 0 alone: "'CausalLMOutputWithPast' object has no
    attribute 'last_hidden_state'" (the wrapper's ``model`` is the whole causal LM). Now the transformers model it
    wraps, adapter layers in place, is what runs (tp=1: the same ll as the merged model, 6.9e-7 relative, on the demo
    tasks); at tp > 1 adapter layers around the shards are refused, on every rank alike."""
    import torch
    from mpi4py import MPI
    from peft import LoraConfig, get_peft_model

    import mpitp
    from mpitp.errors import UsageError
    from mpitp.evaluation.api import _refuse_adapters_under_tp

    seen = []
    from mpitp.evaluation import runner

    monkeypatch.setattr(runner, "evaluate_loaded", lambda model, *a, **k: seen.append(model) or {"results": {}})
    torch.manual_seed(0)
    own = mpitp.load_model(str(STORIES), 1, "cpu", "float32")  # get_peft_model freezes the base: not the shared one
    peft_model = get_peft_model(own, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    mpitp.evaluate(peft_model, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF,
                   include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"))
    assert seen == [peft_model.get_base_model()] and type(seen[0]).__name__ == "LlamaForCausalLM"
    with pytest.raises(UsageError) as err:
        _refuse_adapters_under_tp(peft_model.get_base_model(), 2)
    assert str(err.value).startswith("mpitp.evaluate: the model has PEFT adapter layers (model.layers.0.self_attn."
                                     "q_proj, ...) around its tp=2 shards") and err.value.collective


def test_a_ddp_model_is_scored_as_its_module(stories, monkeypatch, gloo_world):
    """``DistributedDataParallel(model)``, the usual training wrapper, failed on every rank with
    "'DistributedDataParallel' object has no attribute 'config'"; now its ``module`` is what runs."""
    import torch
    from mpi4py import MPI

    import mpitp
    from mpitp.evaluation import runner

    seen = []
    monkeypatch.setattr(runner, "evaluate_loaded", lambda model, *a, **k: seen.append(model) or {"results": {}})
    ddp = torch.nn.parallel.DistributedDataParallel(stories)
    mpitp.evaluate(ddp, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF,
                   include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"))
    assert seen == [stories]


def test_the_callers_random_streams_are_kept(stories, monkeypatch):
    """lm-eval's ``simple_evaluate`` reseeds Python's, NumPy's and torch's generators (0, 1234, 1234): a training loop
    had its shuffles and dropout masks restarted from those seeds after every call. The run is stubbed by one that
    reseeds as lm-eval does; the caller's next draws must be the ones it would have had without the call."""
    import random

    import numpy as np
    import torch
    from mpi4py import MPI

    import mpitp
    from mpitp.evaluation import runner

    def reseeding(*a, **k):
        random.seed(0), np.random.seed(1234), torch.manual_seed(1234)
        return {"results": {}}

    monkeypatch.setattr(runner, "evaluate_loaded", reseeding)

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    want = draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF,
                   include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"))
    assert draws() == want


def test_limit_as_text_samples_with_limit_and_a_missing_tokenizer(stories, monkeypatch, tmp_path):
    """Each was an exception on rank 0 alone once the run had begun, its TP peer left serving (2 ranks at tp=2: the
    launch ran into its 100 s timeout): ``limit="2"`` (lm-eval's ``'<' not supported between 'str' and 'float'``),
    ``limit`` with ``samples`` (lm-eval's ValueError), a tokenizer path that does not exist (an OSError). Now
    ``limit="2"`` is 2, as on the command line, and the other two are refused on every rank before any work."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    demo = str(REPO / "mpitp" / "tasks" / "demo" / "tasks")
    mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, include_path=demo, limit="2")
    assert seen[0]["cfg"].limit == 2
    for tok, kw, why in (
            (str(STORIES), dict(limit=2, samples={"mpitp_demo_mc": [0, 1]}),
             "mpitp.evaluate: limit and samples exclude each other"),
            (str(tmp_path / "no-tokenizer"), {}, f"mpitp.evaluate: tokenizer '{tmp_path / 'no-tokenizer'}' cannot be "
                                                 "loaded: ")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, tok, ["mpitp_demo_mc"], comm=MPI.COMM_SELF, include_path=demo, **kw)
        assert str(err.value).startswith(why) and err.value.collective, str(err.value)
    assert len(seen) == 1


def test_apply_chat_template_without_a_template_is_refused_before_any_work(stories, monkeypatch):
    """``apply_chat_template=True`` with a tokenizer that has no chat template was a UsageError on rank 0 alone, from
    the run's own check, after its TP peer had begun to serve (2 ranks: the launch ran into its 100 s timeout); a
    template's name (``apply_chat_template="default"``) was not checked first at all: its peer waited for ever."""
    from mpi4py import MPI
    from transformers import AutoTokenizer

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    for tok, chat in ((str(STORIES), True), (AutoTokenizer.from_pretrained(str(STORIES)), True),
                      (str(STORIES), "default")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, tok, ["mpitp_demo_mc"], comm=MPI.COMM_SELF, apply_chat_template=chat,
                           include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"))
        assert str(err.value) == (f"mpitp.evaluate: apply_chat_template={chat!r}, but the tokenizer has no chat "
                                  f"template ({STORIES})") and err.value.collective
    assert seen == []


def test_seeds_are_checked_first_and_sample_as_mpitp_eval_samples(stories, monkeypatch):
    """``seed=(1, 2, 3)`` was an IndexError and ``seed=-1`` NumPy's ValueError, on rank 0 alone once the run had begun
    (a training script's peers left serving). And a sampled generation's seed was hashed from ``seed`` as given, so
    the same setting sampled other texts through each path: ``mpitp eval``'s default ``[0, 1234, 1234, 1234]`` and
    ``mpitp.evaluate``'s ``None`` (gsm8k, ``do_sample=True``: ``'"Charlail on'`` against ``'\\n"Can you mad'``), as did
    ``--seed 42`` and ``seed=42``."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError
    from mpitp.evaluation.lmeval_args import parse_eval_args
    from mpitp.evaluation.settings import EvalConfig

    seen = _stub_run(monkeypatch)
    what = "expected one integer from 0 to 4294967295 or a list of four (None: that generator left unseeded)"
    for seed in ((1, 2, 3), -1, "a", [0, None, 8, 2**32], True):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, seed=seed)
        assert str(err.value).startswith(f"mpitp.evaluate: seed={seed!r}: {what}") and err.value.collective
    assert seen == []
    mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, seed=(42, 42, 42, 42),
                   include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"))

    def cli(*argv):
        return parse_eval_args(["--model", str(STORIES), "--tasks", "mpitp_demo_gen", *argv]).cfg.sampling_seed()

    assert seen[0]["cfg"].sampling_seed() == EvalConfig(seed=42).sampling_seed() == cli("--seed", "42")
    assert EvalConfig().sampling_seed() == cli() == [0, 1234, 1234, 1234]
    assert EvalConfig(seed=(0, None, 8, 52)).sampling_seed() == cli("--seed", "0,None,8,52")


def test_keywords_of_the_wrong_type_are_refused_by_name_before_any_work(stories, monkeypatch):
    """Each was an exception other than UsageError, so a script's ``except mpitp.UsageError`` missed it and the job
    ended: ``tasks=None`` and ``tasks=123`` a TypeError on every rank; ``gen_kwargs=123`` and ``output=123`` one on
    rank 0 alone inside the checks (its peers left waiting for the verdict); ``device="gpu"`` torch's RuntimeError on
    every rank once the checks had passed, ``device="cuda"`` for a model on the CPU torch's AssertionError on every
    rank in the head check; ``timeout=-1`` failed the first wait it bounded; ``system_instruction=123``,
    ``write_out="x"`` and ``max_batch_size=0`` went on to lm-eval unread. Flags given a string were read as true:
    ``skip_head_check="no"`` skipped the head check, ``overwrite="no"`` replaced the file."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    for kw, why in ((dict(tasks=None), "tasks=None: expected a list of task names or a comma-separated string, got "
                                       "an empty value"),
                    (dict(tasks=123), "tasks=123: expected a list of task names or a comma-separated string, got 123"),
                    (dict(gen_kwargs=123), "gen_kwargs=123: expected a string like 'temperature=0,top_p=1' or a "
                                           "mapping, got 123"),
                    (dict(output=123), "output=123: expected a non-empty string, got 123"),
                    (dict(skip_head_check="no"), "skip_head_check='no': expected True or False, got 'no'"),
                    (dict(overwrite="no"), "overwrite='no': expected True or False, got 'no'"),
                    (dict(log_samples=1), "log_samples=1: expected True or False, got 1"),
                    (dict(apply_chat_template=1), "apply_chat_template=1: expected True, False or a chat template's "
                                                  "name, got 1"),
                    (dict(timeout=-1), "timeout=-1: expected a positive number of seconds, got -1"),
                    (dict(timeout="60"), "timeout='60': expected a positive number of seconds, got '60'"),
                    (dict(device="gpu"), "device='gpu': Expected one of cpu, cuda, "),
                    (dict(device="cuda"), "device='cuda', but the model's parameters are on cpu: move the model there "
                                          "first (model.to(...)) or leave device out"),
                    (dict(system_instruction=123), "system_instruction=123: expected a non-empty string, got 123"),
                    (dict(write_out="x"), "write_out='x': expected True or False, got 'x'"),
                    (dict(max_batch_size=0), "max_batch_size=0: expected an integer >= 1, got 0")):
        args = {"tasks": ["mpitp_demo_mc"], **kw}
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), comm=MPI.COMM_SELF, **args)
        assert str(err.value).startswith(f"mpitp.evaluate: {why}") and err.value.collective, str(err.value)
    assert seen == []
    demo = str(REPO / "mpitp" / "tasks" / "demo" / "tasks")
    mpitp.evaluate(stories, str(STORIES), ("mpitp_demo_mc",), comm=MPI.COMM_SELF, include_path=demo, timeout=None)
    assert seen[0]["cfg"].tasks == ["mpitp_demo_mc"]


def test_lm_eval_settings_are_the_runs_recorded_as_mpitp_eval_records_them(stories, monkeypatch):
    """``system_instruction``, ``max_batch_size``, ``predict_only``, ... went on to ``simple_evaluate`` and not into
    the run's settings: the results file's config had no system instruction (``mpitp eval --system_instruction``'s
    has, and resume compares it), and ``batch_size="auto", max_batch_size=2`` picked batches of 64 (``--max_batch_size
    2``: 2), the run's own setting being what bounds them. ``predict_only`` logs the samples, as on the command
    line."""
    from mpi4py import MPI

    import mpitp

    seen = _stub_run(monkeypatch)
    mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, batch_size="auto",
                   include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"), system_instruction="Answer.",
                   max_batch_size=2, predict_only=True, write_out=True, fewshot_as_multiturn=False)
    (got,) = seen
    cfg = got["cfg"]
    assert (cfg.system_instruction, cfg.max_batch_size, cfg.predict_only, cfg.log_samples, cfg.write_out,
            cfg.fewshot_as_multiturn) == ("Answer.", 2, True, True, True, False), cfg
    assert got["extra"] == {} and cfg.identity()["system_instruction"] == "Answer."


def test_settings_are_recorded_as_mpitp_eval_records_them_so_it_resumes_the_file(stories, monkeypatch):
    """A ``gen_kwargs`` string was recorded as given and the model's own tokenizer by its path, where ``mpitp eval``
    records lm-eval's parsed mapping and no tokenizer: ``mpitp eval --resume`` with the very settings refused the
    file ("different settings: gen_kwargs 'max_gen_toks=8' in the file, {'max_gen_toks': 8} now; tokenizer '...' in
    the file, None now")."""
    from mpi4py import MPI

    import mpitp
    from mpitp.evaluation.lmeval_args import parse_eval_args

    seen = _stub_run(monkeypatch)
    for gen_kwargs in ("max_gen_toks=8,until=['\\n\\n']", '{"max_gen_toks": 8, "until": ["\\n\\n"]}'):
        mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_gen"], comm=MPI.COMM_SELF, gen_kwargs=gen_kwargs,
                       include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks"))
        cli = parse_eval_args(["--model", str(STORIES), "--tasks", "mpitp_demo_gen", "--gen_kwargs", gen_kwargs]).cfg
        got = seen.pop()["cfg"]
        assert (got.gen_kwargs, got.tokenizer) == (cli.gen_kwargs, cli.tokenizer) == ({"max_gen_toks": 8,
                                                                                       "until": ["\n\n"]}, None)
        assert {k: got.identity()[k] for k in ("gen_kwargs", "tokenizer", "model")} == \
            {k: cli.identity()[k] for k in ("gen_kwargs", "tokenizer", "model")}


def test_task_folders_of_the_wrong_type_are_refused_by_name_before_any_work(stories, monkeypatch):
    """``include_path=123`` and ``data_dir=123`` were a TypeError on rank 0 alone inside the shared checks ('int'
    object is not iterable; expected str, bytes or os.PathLike object), its peers left waiting for the verdict.
    ``samples="s.json"`` was refused as "expected a JSON object ... or a JSON file": a file is --samples' alone."""
    from mpi4py import MPI

    import mpitp
    from mpitp.errors import UsageError

    seen = _stub_run(monkeypatch)
    for kw, why in ((dict(include_path=123), "include_path=123: expected a folder or a list of folders, got 123"),
                    (dict(include_path=[None]), "include_path=[None]: expected a folder or a list of folders, got "
                                                "[None]"),
                    (dict(data_dir=123), "data_dir=123: expected a non-empty string, got 123"),
                    (dict(samples="s.json", include_path=str(REPO / "mpitp" / "tasks" / "demo" / "tasks")),
                     "samples 's.json': expected a mapping of task names to lists of document indices (a JSON file "
                     "is --samples' alone)")):
        with pytest.raises(UsageError) as err:
            mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF, **kw)
        assert str(err.value) == f"mpitp.evaluate: {why}" and err.value.collective, str(err.value)
    assert seen == []
    mpitp.evaluate(stories, str(STORIES), ["mpitp_demo_mc"], comm=MPI.COMM_SELF,
                   include_path=[str(REPO / "mpitp" / "tasks" / "demo" / "tasks")])
    assert len(seen) == 1
