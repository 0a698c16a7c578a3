"""lm-eval drop-in: real ``lm_eval`` command lines run unchanged as ``mpiexec -n 2 mpitp eval <line> --tp 2``.

The corpus (tests/support/dropin_corpus.py, 23 lines in lm-eval's documentation style) runs once through lm-eval's own
CLI code (one process, tests/dropin_ref_driver.py) and once through ``mpitp eval`` (one ``mpiexec -n 2`` launch,
tests/dropin_mpitp_driver.py; every line goes through mpitp's whole parse-check-load-evaluate path with tp=2, or pp=2
for two lines), side by side. Then, line by line: the same output files under ``--output_path`` (names, timestamps
aside), every key present in both, every value equal (numbers within 1e-5 relative: fp32 parity), dates, durations and
host details aside; and the HDF5 file beside them.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from support import OFFLINE_ENV, REPO, STORIES
from support.dropin import compare_output_dirs
from support.dropin_corpus import CORPUS, command_lines, layout
from support.mpi import explain, mpiexec_path

CORPUS_TIMEOUT = 1500
corpus_timeout = pytest.mark.timeout(CORPUS_TIMEOUT + 300)  # both sides of the whole corpus, in the first test


@pytest.fixture(scope="module")
def corpus_runs(tmp_path_factory, test_tasks):
    """Both sides of the whole corpus, run concurrently: ``(work dir, lm-eval process, mpitp process)``."""
    work = tmp_path_factory.mktemp("dropin")
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO), "LM_HARNESS_CACHE_PATH": str(work / "lm-cache")}
    procs = {}
    for side in ("ref", "mpitp"):
        lines = work / f"{side}.json"
        lines.write_text(json.dumps([[n, [str(a) for a in argv]]
                                     for n, argv in command_lines(STORIES, test_tasks, work, side)]))
        if side == "ref":
            cmd = [sys.executable, str(REPO / "tests" / "dropin_ref_driver.py"), str(lines)]
        else:
            cmd = [mpiexec_path(), "-n", "2", sys.executable, str(REPO / "tests" / "dropin_mpitp_driver.py"),
                   str(lines)]
        log = open(work / f"{side}.log", "w")
        procs[side] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=work), log)
    done = {}
    for side, (proc, log) in procs.items():
        proc.wait(timeout=CORPUS_TIMEOUT)
        log.close()
        done[side] = subprocess.CompletedProcess(proc.args, proc.returncode, (work / f"{side}.log").read_text(), "")
    return work, done["ref"], done["mpitp"]


def test_corpus_size():
    assert len(CORPUS) >= 15
    assert len({name for name, _ in CORPUS}) == len(CORPUS)


@pytest.mark.slow
@pytest.mark.mpi
@corpus_timeout
def test_both_sides_ran_every_line(corpus_runs):
    _, ref, mine = corpus_runs
    assert ref.returncode == 0, explain(ref)
    assert mine.returncode == 0, explain(mine)
    for name, _ in CORPUS:
        assert f"=== mpitp {name}:" in mine.stdout
        assert f"=== lm-eval {name}:" in ref.stdout


@pytest.mark.slow
@pytest.mark.mpi
@corpus_timeout
@pytest.mark.parametrize("name", [n for n, _ in CORPUS])
def test_same_output_files(corpus_runs, name):
    """lm-eval's files, key by key; the metrics (and per-sample log-likelihoods) within 1e-5."""
    work, _, _ = corpus_runs
    mine, ref = work / "mpitp" / name, work / "ref" / name
    results = sorted(ref.rglob("results_*.json"))
    assert results, f"lm-eval wrote no results for {name}"
    diffs = compare_output_dirs(mine, ref, aliases=(str(work / "mpitp"), str(work / "ref")))  # e.g. --use_cache
    assert not diffs, f"{name}: " + "\n".join(diffs[:30])
    if name == "use-cache":  # --use_cache is mpitp's request store: <path>.h5, not beside the JSON
        h5 = [work / "mpitp" / "use-cache-cache.h5"]
        assert h5[0].exists() and not list(mine.rglob("*.h5"))
    else:
        h5 = sorted(mine.rglob("*.h5"))
        assert len(h5) == 1 and h5[0].parent == sorted(mine.rglob("results_*.json"))[0].parent
    lm_results = json.loads(results[0].read_text())["results"]
    from mpitp.results.schema import open_h5

    with open_h5(str(h5[0])) as f:
        assert f.attrs["status"] == "complete"
        stored = json.loads(f.attrs["results_json"])["results"]
    assert set(stored) == set(lm_results)


@pytest.mark.slow
@pytest.mark.mpi
@corpus_timeout
def test_wandb_offline_run_holds_the_metrics(corpus_runs):
    """--wandb_args: rank 0 logged through lm-eval's WandbLogger; the offline run's results table has the metrics."""
    work, _, _ = corpus_runs
    results = json.loads(sorted((work / "mpitp" / "wandb-offline").rglob("results_*.json"))[0].read_text())
    tables = sorted((work / "mpitp" / "wandb-offline-wandb").rglob("eval_results_*.table.json"))
    assert len(tables) == 1, "expected one offline W&B run with its evaluation table"
    rows = json.loads(tables[0].read_text())["data"]
    logged = {(r[0], r[4]): float(r[5]) for r in rows if r[4] in ("acc", "acc_norm")}
    want = results["results"]["arc_easy_local"]
    assert logged == {("arc_easy_local", "acc"): want["acc,none"],
                      ("arc_easy_local", "acc_norm"): want["acc_norm,none"]}


# ------------------------------------------------------------------ parsing, in-process (no launch)


def _lm_eval_config(argv):
    from lm_eval._cli import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    cli = HarnessCLI()
    ns = cli._parser.parse_args(["run", *argv])
    return EvaluatorConfig.from_cli(ns)


@pytest.mark.parametrize("name", [n for n, _ in CORPUS])
def test_parsed_as_lm_eval_parses(name, tmp_path, test_tasks):
    """Each corpus line means to mpitp what it means to lm-eval: same tasks, model_args, few-shot, limit, seeds, ..."""
    from mpitp.evaluation.lmeval_args import parse_eval_args

    argv = dict(command_lines(STORIES, test_tasks, tmp_path, "p"))[name]
    ec = _lm_eval_config(argv)
    parsed = parse_eval_args([*argv, *layout(name)])
    cfg, opts = parsed.cfg, parsed.runtime
    assert opts.tp * opts.pp == 2
    assert cfg.model_args == ec.model_args and cfg.model == str(ec.model_args["pretrained"])
    assert cfg.tasks == ec.tasks
    for key in ("num_fewshot", "gen_kwargs", "system_instruction", "fewshot_as_multiturn", "apply_chat_template",
                "predict_only", "log_samples", "samples", "output_path", "seed", "metadata", "write_out",
                "show_config", "confirm_run_unsafe_code", "trust_remote_code"):
        assert (getattr(cfg, key) or None) == (getattr(ec, key) or None), key
    assert (cfg.limit is None and ec.limit is None) or float(cfg.limit) == float(ec.limit)
    assert str(cfg.batch_size) == str(ec.batch_size)


def test_dash_and_underscore_spellings_agree(test_tasks):
    from mpitp.evaluation.lmeval_args import parse_eval_args

    under = shlex.split(f"--model hf --model_args pretrained={STORIES} --tasks arc_easy_local --num_fewshot 2 "
                        f"--batch_size auto:2 --max_batch_size 8 --include_path {test_tasks} --log_samples "
                        "--output_path o --apply_chat_template --fewshot_as_multiturn --gen_kwargs max_gen_toks=4")
    dash = [a.replace("_", "-") if a.startswith("--") else a for a in under]
    assert dash != under
    a, b = parse_eval_args(under).cfg, parse_eval_args(dash).cfg
    assert a == b and a.batch_size == "auto:2" and a.max_batch_size == 8


@pytest.mark.parametrize("argv,message", [
    ("--model vllm --model_args pretrained=x --tasks t", "--model vllm: mpitp runs Hugging Face transformers models "
                                                         "only"),
    ("--model hf --model_args pretrained=x,parallelize=True --tasks t", "--model_args parallelize: mpitp places"),
    ("--model hf --model_args pretrained=x,device_map=auto --tasks t", "--model_args device_map: mpitp places"),
    ("--model hf --model_args pretrained=x,delta=d --tasks t", "--model_args delta: delta weights"),
    ("--model hf --model_args pretrained=x,softmax_dtype=bfloat16 --tasks t", "softmax_dtype=bfloat16"),
    ("--model hf --model_args pretrained=x,no_such_arg=1 --tasks t", "--model_args no_such_arg: not an HFLM"),
    ("--model hf --model_args pretrained=x --tasks t --hf_hub_log_args push_results_to_hub=True",
     "push_results_to_hub: pushing to the Hugging Face Hub needs the network"),
    ("--model hf --model_args pretrained=x --tasks t --limit 2 --samples '{\"t\": [1]}'", "--limit must be None"),
    ("--model hf --model_args pretrained=x --tasks t --batch_size auto:0", "auto:N with N a positive integer"),
    ("--model hf --model_args pretrained=x --tasks t --batch_size 0", "must be >= 1, got 0"),
    ("--model hf --model_args pretrained=x --tasks t --fewshot_as_multiturn", "`apply_chat_template` must be set"),
    ("--model hf --model_args pretrained=x,dtype=float16 --tasks t --dtype float32", "--dtype float32 and "
                                                                                     "--model_args dtype=float16"),
    ("--config /no/such.yaml", "--config /no/such.yaml: Config file not found"),
    ("--model hf --model_args pretrained=x --tasks t --no_such_flag", "unrecognized arguments: --no_such_flag"),
    ("--model hf --model_args pretrained=x --tasks a,,b", "--tasks: empty task name in 'a,,b'"),
    ("--model hf --model_args pretrained=x --tasks t --metadata {bad", "--metadata: Invalid JSON: {bad."),
    ("--model hf --model_args {bad --tasks t", "--model_args: Invalid JSON: {bad."),
    ("--model hf --model_args pretrained=x --tasks t --seed a,b", "--seed: invalid value: 'a,b'"),
    ("--model hf --model_args pretrained=x,add_bos_token=maybe --tasks t",
     "--model_args add_bos_token: expected true or false, got 'maybe'"),
    ("--model hf --model_args pretrained=x,max_length=-5 --tasks t",
     "--model_args max_length: expected an integer >= 2 (tokens), as --max-length, got -5.0"),
    ("--model hf --model_args pretrained=x --tasks 'a, b,a'", "--tasks: task 'a' is listed twice"),
])
def test_refusals_name_the_flag(argv, message):
    from mpitp.errors import UsageError
    from mpitp.evaluation.lmeval_args import parse_eval_args

    with pytest.raises(UsageError) as exc:
        parse_eval_args(shlex.split(argv))
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_samples_without_output_path_go_to_the_hdf5_file():
    """lm-eval demands --output_path with --log_samples (nowhere else to put them); mpitp's HDF5 file holds them."""
    from mpitp.evaluation.lmeval_args import parse_eval_args

    cfg = parse_eval_args(shlex.split("--model hf --model_args pretrained=x --tasks t --log-samples --output r.h5")).cfg
    assert cfg.log_samples and cfg.output_path is None and cfg.output == "r.h5"
    cfg = parse_eval_args(shlex.split("--model hf --model_args pretrained=x --tasks t --predict_only")).cfg
    assert cfg.predict_only and cfg.log_samples and cfg.output_path is None


def test_help_lists_every_lm_eval_flag():
    """``mpitp eval --help`` names each of lm-eval's run flags (its own parser's list) in both spellings."""
    from lm_eval._cli import HarnessCLI

    from mpitp.evaluation.lmeval_args import help_text

    text = help_text()
    run = HarnessCLI()._subparsers.choices["run"]
    flags = [o for a in run._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert len(flags) >= 31
    for flag in flags:
        assert flag in text, flag
        assert flag.replace("_", "-") in text, flag
    for ours in ("--tp", "--pp", "--output", "--resume", "--data-dir", "--timeout"):
        assert ours in text
    shown = subprocess.run([sys.executable, "-m", "mpitp", "eval", "--help"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO)})
    assert shown.returncode == 0 and all(flag in shown.stdout for flag in flags), explain(shown)


def test_integration_messages_hidden_unless_debug(capsys):
    """lm-eval's warnings about a pre-built model describe mpitp, not the user's run: hidden; DEBUG shows them."""
    import logging

    from mpitp.evaluation.quiet import quiet_integration

    log = logging.getLogger("lm_eval.models.huggingface")
    try:
        quiet_integration(None, True)
        log.warning("`pretrained` model kwarg is not of type `str`. Many other model arguments may be ignored.")
        log.warning("Left truncation applied. Original sequence length was 2183")
        hint = ": Custom kwargs can be passed to `--metadata` in console (as json string) or to the TaskManager."
        logging.getLogger("lm_eval.api.task").warning("mpitp_demo_mc" + hint)  # the demo's: says nothing to a user
        logging.getLogger("lm_eval.api.task").warning("ruler_niah" + hint)  # a user's task: kept
        quiet_integration("DEBUG", True)
        log.warning("Passed an already-initialized model through `pretrained`, assuming single-process call")
    finally:
        quiet_integration("INFO", True)
    err = capsys.readouterr().err
    assert "Left truncation applied" in err and "ruler_niah: Custom kwargs" in err
    assert "kwarg is not of type" not in err and "mpitp_demo_mc: Custom" not in err
    assert "already-initialized model" in err


def test_integration_messages_hidden_for_an_api_call_only():
    """``mpitp.evaluate`` in a training script, whose logging is its own (lm-eval's loggers hold no handler to
    filter): every rank printed the two warnings on each call; hidden during the call, the loggers as before after.
    Records are caught by a handler on the loggers themselves: an earlier test's lm-eval logging setup may stop
    them from reaching the root logger."""
    import logging

    from mpitp.evaluation.quiet import integration_hidden

    class Caught(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.said: list[str] = []

        def emit(self, record):
            self.said.append(record.getMessage())

    pre_built = "Passed an already-initialized model through `pretrained`, assuming single-process call"
    loggers = [logging.getLogger(n) for n in ("lm_eval.models.huggingface", "lm_eval.evaluator")]
    before = [(list(lg.filters), lg.level) for lg in loggers]
    caught = Caught()
    for lg in loggers:
        lg.addHandler(caught)
        lg.setLevel(logging.INFO)
    try:
        with integration_hidden():
            loggers[0].warning(pre_built)
            loggers[1].info("Using pre-initialized model")
            loggers[0].warning("Left truncation applied. Original sequence length was 2183")
        assert caught.said == ["Left truncation applied. Original sequence length was 2183"]
        assert [list(lg.filters) for lg in loggers] == [f for f, _ in before]
        loggers[0].warning(pre_built)
        assert caught.said[-1] == pre_built
    finally:
        for lg, (_, level) in zip(loggers, before):
            lg.removeHandler(caught)
            lg.setLevel(level)


@pytest.mark.parametrize("model", ["ckpts/step-1,ckpts/step-2", "ckpts/step-*"])
def test_a_sweep_hides_the_integration_warnings_and_takes_verbosity(monkeypatch, model):
    """``mpitp eval --model 'ckpts/step-*'`` (and --watch) printed lm-eval's two warnings about a pre-built model for
    every checkpoint, and ``--verbosity WARNING`` left lm-eval's INFO lines on: only a single run's checks installed
    the filter and the level. Every kind of run now gets them before its checks."""
    import logging
    from types import SimpleNamespace

    import mpitp.jobs.sweep
    from mpitp.evaluation.lmeval_args import parse_eval_args
    from mpitp.evaluation.quiet import _FILTER, quiet_integration
    from mpitp.jobs.orchestrate import prepare

    monkeypatch.setattr(mpitp.jobs.sweep, "prepare_sweep", lambda cfg, launch: "sweep")
    cfg = parse_eval_args(["--model", model, "--tasks", "arc_easy", "--verbosity", "WARNING"]).cfg
    lm_eval_log = logging.getLogger("lm_eval")
    try:
        quiet_integration("DEBUG", True)  # as a fresh process: no filter, lm-eval's own level
        assert prepare(cfg, SimpleNamespace(world=SimpleNamespace(rank=0))) == "sweep"
        assert _FILTER in lm_eval_log.filters and all(_FILTER in h.filters for h in lm_eval_log.handlers)
        assert lm_eval_log.level == logging.WARNING
    finally:
        quiet_integration("INFO", True)


def test_resume_refuses_other_lm_eval_settings(tmp_path):
    """Settings that change results enter the resume identity; lm-eval's defaults do not (older files resume)."""
    import h5py

    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import check_resumable
    from mpitp.evaluation.lmeval_args import parse_eval_args

    base = ["--model", "hf", "--model_args", f"pretrained={STORIES}", "--tasks", "arc_easy_local"]
    cfg = parse_eval_args(base).cfg
    old_style = {k: v for k, v in cfg.identity().items()}  # what files written before these settings hold
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as f:
        f.attrs["config_json"] = json.dumps(old_style, sort_keys=True)
    check_resumable(str(path), cfg)  # lm-eval's default seeds, no metadata beyond model_args: the same identity
    check_resumable(str(path), parse_eval_args([*base, "--seed", "0,1234,1234,1234"]).cfg)
    for extra, named in ((["--system_instruction", "Be brief."], "system_instruction"),
                         (["--seed", "7"], "seed"), (["--metadata", "max_seq_lengths=[64]"], "metadata"),
                         (["--model_args", "add_bos_token=True"], "hflm_args"),
                         (["--samples", '{"arc_easy_local": [1]}'], "samples"),
                         (["--gen_kwargs", "max_gen_toks=4"], "gen_kwargs")):
        with pytest.raises(UsageError, match=f"different settings: {named}"):
            check_resumable(str(path), parse_eval_args([*base, *extra]).cfg)


def test_tasks_read_alike_by_eval_check_and_tasks():
    """``--tasks`` of ``mpitp eval``, ``mpitp check`` / ``prefetch`` and ``mpitp tasks`` read as a job file's
    ``tasks:``: ``"a, b"`` is a and b (``mpitp check`` looked up ``' b'``, an unknown task); an empty or repeated name
    is refused (``mpitp eval`` dropped it)."""
    import click

    from mpitp.cli.options import task_names
    from mpitp.evaluation.lmeval_args import parse_eval_args

    assert parse_eval_args(shlex.split("--model hf --model_args pretrained=x --tasks ' a, b'")).cfg.tasks == ["a", "b"]
    assert task_names(None, None, " a, b") == ("a", "b") and task_names(None, None, None) is None
    for bad, says in (("a,,b", "empty task name"), ("a,a", "listed twice")):
        with pytest.raises(click.BadParameter, match=says):
            task_names(None, None, bad)


def test_check_integrity_without_lm_evals_tests_is_one_line():
    """``--check_integrity`` runs lm-eval's own test suite, which an installed lm-eval lacks: rank 0 failed after the
    model load with a FileNotFoundError traceback; refused with the checks now (as lm-eval's own search finds it)."""
    import lm_eval.evaluator_utils as eu

    from mpitp.errors import UsageError
    from mpitp.evaluation.lmeval_args import check_lm_eval_settings, parse_eval_args

    try:
        eu.find_test_root(pathlib.Path(eu.__file__))
        pytest.skip("this lm-eval is a source checkout: its tests are there")
    except FileNotFoundError:
        pass
    cfg = parse_eval_args(shlex.split("--model hf --model_args pretrained=x --tasks t --check_integrity")).cfg
    with pytest.raises(UsageError, match="--check_integrity runs lm-eval's own test suite"):
        check_lm_eval_settings(cfg)
    check_lm_eval_settings(parse_eval_args(shlex.split("--model hf --model_args pretrained=x --tasks t")).cfg)
