"""One declaration of the evaluation settings (mpitp.evaluation.settings): a job file and the command line mean the
same, reach lm-eval as what they say (lists and dicts included) and keep the resume identity of older files."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import pickle

import pytest

from mpitp.evaluation.lmeval_args import MPITP_DESTS, build_parser, parse_eval_args
from mpitp.evaluation.settings import EvalConfig, cli_options, eval_settings, lm_eval_named
from mpitp.jobs.jobfile import JobFileError, load_job
from mpitp.jobs.jobrun import eval_config

JOB = """\
defaults:
  model: org/m
  tasks: [a, b]
  dtype: float32
  data_dir: /d
  gen_kwargs:
    until: ["\\n\\n", "Question:"]
    max_gen_toks: 5
  model_args: {add_bos_token: true}
  metadata: {max_seq_lengths: [64]}
  system_instruction: Be brief.
runs:
  - {name: fraction, limit: 0.25, output: /o/fraction.h5}
  - {name: one-float, limit: 1.0, output: /o/one-float.h5}
  - {name: count, limit: 3, output: /o/count.h5}
  - {name: whole-float, limit: 3.0, output: /o/whole-float.h5}
  - {name: kv-string, limit: 3, gen_kwargs: "temperature=0,max_gen_toks=5", output: /o/kv.h5}
"""

# The same settings on mpitp eval's command line (lm-eval's flags), per job-file run
CLI = ["--model", "hf", "--model_args", '{"pretrained": "org/m", "add_bos_token": true}', "--tasks", "a,b",
       "--dtype", "float32", "--data-dir", "/d",
       "--gen_kwargs", '{"until": ["\\n\\n", "Question:"], "max_gen_toks": 5}',
       "--metadata", '{"max_seq_lengths": [64]}', "--system_instruction", "Be brief."]
LIMITS = {"fraction": "0.25", "one-float": "1.0", "count": "3", "whole-float": "3.0"}


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    return load_job(path)


def _cli_config(*extra: str) -> EvalConfig:
    return parse_eval_args([*CLI, *extra]).cfg


def _lm_eval_docs(limit, n_docs: int = 10) -> int:
    """How many documents lm-eval evaluates for ``limit`` (its own rule, lm_eval.evaluator_utils)."""
    from lm_eval.evaluator_utils import get_sample_size

    class Task:
        eval_docs = range(n_docs)

    return get_sample_size(Task(), limit)


def test_job_file_reaches_lm_eval_as_written(job):
    """gen_kwargs, model_args and metadata mappings reach lm-eval's arguments as the dicts and lists they are; each
    limit means what lm-eval makes of it (1.0 is one document, as ``lm_eval --limit 1.0``)."""
    runs = {spec.name: spec for spec in pickle.loads(pickle.dumps(job)).runs}  # as every rank receives it
    assert set(runs) == {"fraction", "one-float", "count", "whole-float", "kv-string"}
    docs = {"fraction": 3, "one-float": 1, "count": 3, "whole-float": 3, "kv-string": 3}
    for name, spec in runs.items():
        args = eval_config(spec).lm_eval_arguments()
        assert _lm_eval_docs(args["limit"]) == docs[name], (name, args["limit"])
        assert args["model_args"] == {"pretrained": "org/m", "add_bos_token": True, "dtype": "float32"}  # as --dtype
        assert args["metadata"] == {"pretrained": "org/m", "add_bos_token": True, "dtype": "float32",
                                    "max_seq_lengths": [64]}  # model_args merged in, as lm-eval merges them
        assert args["system_instruction"] == "Be brief."
        if name == "kv-string":  # read as --gen_kwargs reads it, not left to simple_evaluate's k=v reading
            assert args["gen_kwargs"] == {"temperature": 0, "max_gen_toks": 5}
        else:
            assert args["gen_kwargs"] == {"until": ["\n\n", "Question:"], "max_gen_toks": 5}
            assert isinstance(args["gen_kwargs"]["until"], list)
    assert set(args) <= set(inspect.signature(__import__("lm_eval").simple_evaluate).parameters)


def test_task_metadata_holds_the_model_args_whichever_way_they_are_given():
    """lm-eval merges ``--model_args`` into the task metadata, where babilong and RULER read ``pretrained`` (their
    tokenizer); ``mpitp eval --model PATH --dtype float32`` is ``--model_args pretrained=PATH,dtype=float32`` and gave
    tasks no ``pretrained`` at all (those tasks failed: "No tokenizer or pretrained provided"). --metadata wins, and
    the resume identity holds only what --metadata added."""
    short = parse_eval_args(["--model", "org/m", "--tasks", "t", "--dtype", "float32"]).cfg
    long = parse_eval_args(["--model", "hf", "--model_args", "pretrained=org/m,dtype=float32", "--tasks", "t"]).cfg
    assert short.metadata == long.metadata == {"pretrained": "org/m", "dtype": "float32"}
    assert short.lm_eval_arguments()["metadata"] == long.lm_eval_arguments()["metadata"]
    own = parse_eval_args(["--model", "org/m", "--tasks", "t", "--metadata", '{"pretrained": "tok/x", "n": 1}']).cfg
    assert own.metadata == {"pretrained": "tok/x", "n": 1}
    assert short.identity().get("metadata") is None and own.identity()["metadata"] == own.metadata


def test_job_file_and_command_line_mean_the_same(job):
    """The same settings through either door give the same resume identity and the same lm-eval arguments."""
    for spec in job.runs:
        if spec.name not in LIMITS:
            continue
        from_job, from_cli = eval_config(spec), _cli_config("--limit", LIMITS[spec.name])
        assert from_job.identity() == from_cli.identity(), spec.name
        assert from_job.lm_eval_arguments() == from_cli.lm_eval_arguments(), spec.name
        assert _lm_eval_docs(from_job.limit) == _lm_eval_docs(float(LIMITS[spec.name])), spec.name


def test_job_runs_pickle_read_only(job):
    """A job is broadcast to every rank (pickled); its mappings stay read-only for the callee's sake."""
    spec = pickle.loads(pickle.dumps(job.runs[0]))
    assert spec == job.runs[0]
    with pytest.raises(TypeError):
        spec.gen_kwargs["max_gen_toks"] = 1
    with pytest.raises(TypeError):
        spec.lm_eval["model_args"]["add_bos_token"] = False
    kwargs = spec.to_eval_kwargs()
    kwargs["gen_kwargs"]["until"].append("x")  # a plain copy
    assert spec.gen_kwargs["until"] == ("\n\n", "Question:")


@pytest.mark.parametrize("value,shown", [("1.5", "1.5"), ("0", "0"), ("-1", "-1"), ("'3'", "'3'"), ("true", "True"),
                                         (".inf", "inf")])
def test_job_file_limit_refusals(tmp_path, value, shown):
    """YAML is typed: a count with a fraction, a quoted number or a flag is a slip, refused while reading the file."""
    path = tmp_path / "job.yaml"
    path.write_text(f"runs: [{{model: demo, tasks: t, limit: {value}}}]\n")
    with pytest.raises(JobFileError) as info:
        load_job(path)
    assert str(info.value).endswith("field 'limit': expected a positive integer (examples per task) or a fraction "
                                    f"in (0, 1), got {shown}")


def test_identity_unchanged_for_older_files():
    """config_json as the version before the settings table wrote it: a resumed run must still compare equal."""
    written_before = [
        '{"apply_chat_template": false, "data_dir": "/d", "dtype": "float32", "gen_kwargs": {"max_gen_toks": 5, '
        '"until": ["\\n\\n"]}, "hflm_args": {"add_bos_token": true}, "limit": 3, "max_length": null, "metadata": '
        '{"max_seq_lengths": [64]}, "model": "org/m", "num_fewshot": null, "revision": null, "seed": null, '
        '"system_instruction": "Be brief.", "tasks": ["a", "b"], "tokenizer": null}',
        '{"apply_chat_template": false, "data_dir": null, "dtype": "auto", "gen_kwargs": null, "limit": null, '
        '"max_length": null, "model": "m", "num_fewshot": null, "revision": null, "seed": 7, "tasks": ["a"], '
        '"tokenizer": null}',
    ]
    now = [
        EvalConfig(model="org/m", tasks=["a", "b"], dtype="float32", limit=3, data_dir="/d",
                   gen_kwargs={"until": ["\n\n"], "max_gen_toks": 5}, seed=[0, 1234, 1234, 1234],
                   model_args={"pretrained": "org/m", "add_bos_token": True}, hflm_args={"add_bos_token": True},
                   system_instruction="Be brief.", predict_only=False,
                   metadata={"pretrained": "org/m", "add_bos_token": True, "max_seq_lengths": [64]}),
        EvalConfig(model="m", tasks=["a"], seed=7),
    ]
    for stored, cfg in zip(written_before, now):
        assert json.loads(json.dumps(cfg.identity())) == json.loads(stored)


def test_every_lm_eval_setting_is_declared():
    """lm-eval's EvaluatorConfig fields all have a setting (a new lm-eval field shows up here, not as a silent gap),
    and every setting a job file reads has its reader."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    declared = {f.name for f in eval_settings()}
    lm_eval_fields = {f.name for f in dataclasses.fields(EvaluatorConfig)}
    assert lm_eval_fields - {"config"} <= declared
    assert {f.name for f in lm_eval_named()} <= lm_eval_fields  # mpitp eval copies these from lm-eval's parse
    for f in eval_settings():
        assert not (f.metadata["job"] and f.metadata["lm_eval"]), f.name
        assert f.metadata["identity"] in (None, "always", "if_set"), f.name


def test_command_line_options_come_from_the_declaration():
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for dest, spec in cli_options():
        assert dest in MPITP_DESTS and dest in by_dest
        assert set(spec["flags"]) <= set(by_dest[dest].option_strings)
    assert by_dest["dtype"].choices == ("auto", "float32", "bfloat16", "float16")
    assert not math.isnan(by_dest["timeout"].default) and by_dest["timeout"].default > 0
    usage = parser.format_help()
    for flag in ("--tp", "--pp", "--output", "--resume", "--skip-head-check", "--watch-idle", "--max-length"):
        assert flag in usage


@pytest.mark.parametrize("value,docs", [("0.25", 3), ("1.0", 1), ("1", 1), ("3.0", 3), ("2.5", 2)])
def test_command_line_limit_is_lm_evals(value, docs):
    assert _lm_eval_docs(_cli_config("--limit", value).limit) == _lm_eval_docs(float(value)) == docs


@pytest.mark.parametrize("value,message", [("0", "--limit: must be > 0, got 0"), ("x", "--limit: expected a number, "
                                           "got 'x'"), ("inf", "--limit: must be a finite number, got inf")])
def test_command_line_limit_refusals(value, message):
    from mpitp.errors import UsageError

    with pytest.raises(UsageError) as info:
        _cli_config("--limit", value)
    assert str(info.value) == message


def test_every_setting_is_described_in_help():
    """Every setting has a one-line description, and ``mpitp eval --help`` shows it: as the help of mpitp's own
    option or of lm-eval's flag of that name, or in the epilog for the few that no option sets by itself. A new
    setting without one fails here (and ``setting()`` refuses to declare one without ``doc``)."""
    from mpitp.evaluation.lmeval_args import help_text
    from mpitp.evaluation.settings import RUNTIME, setting_docs

    described = [(f.name, f.metadata["doc"]) for f in eval_settings()] + [(s.name, s.doc) for s in RUNTIME]
    for name, doc in described:
        assert isinstance(doc, str) and doc.strip() and "\n" not in doc and len(doc) <= 300, (name, doc)
    assert {name for name, _ in described} == set(setting_docs())
    squeeze = "".join  # argparse rewraps help text (and breaks lines after hyphens): compare without whitespace
    shown = squeeze(help_text().split())
    missing = [name for name, doc in setting_docs().items() if squeeze(doc.rstrip(".").split()) not in shown]
    assert not missing, missing


def test_data_dir_help_names_the_layout_it_serves():
    """``--data-dir`` serves any lm-eval task from ``DIR/<dataset_path>/...`` (:mod:`mpitp.tasks.layout`), as ``mpitp
    tasks``/``check`` and the README say; its ``mpitp eval --help`` line said only the six stock tasks'
    ``DIR/<task>/<split>.jsonl``, so a user reading it would not lay out mmlu's files or expect it served."""
    from mpitp.evaluation.lmeval_args import help_text
    from mpitp.evaluation.settings import setting_docs

    layout = "DIR/<dataset_path>/[<dataset_name>/]<split>.<jsonl|parquet>"
    assert layout in setting_docs()["data_dir"]
    assert "".join(layout.split()) in "".join(help_text().split())


def test_job_file_readers_follow_the_declared_types():
    """lm-eval-named settings are read by their real types (``bool | None`` a flag that may stay unset, ``int |
    None`` a count, ``dict | None`` a mapping), not by matching the annotation's text."""
    from mpitp.evaluation.setting_values import BadValue, yaml_bool, yaml_mapping, yaml_string, yaml_verbosity
    from mpitp.evaluation.settings import from_evaluator_config, lm_eval_job_fields

    readers = lm_eval_job_fields()
    assert readers["fewshot_as_multiturn"] is yaml_bool and readers["predict_only"] is yaml_bool
    assert readers["metadata"] is yaml_mapping and readers["model_args"] is yaml_mapping
    assert readers["verbosity"] is yaml_verbosity and readers["output_path"] is yaml_string
    assert readers["max_batch_size"](4) == 4
    with pytest.raises(BadValue):
        readers["max_batch_size"](0)
    by_name = {f.name: f for f in lm_eval_named()}
    assert from_evaluator_config(by_name["trust_remote_code"], 0) is False
    assert from_evaluator_config(by_name["fewshot_as_multiturn"], None) is None
    assert from_evaluator_config(by_name["metadata"], {}) is None


def test_runtime_options_are_the_runtime_settings():
    """``mpitp eval``'s launch options reach the runtime typed (``RuntimeOptions``), one field per declared runtime
    setting with its default: a setting added to ``RUNTIME`` without a field (or the reverse) fails here."""
    from dataclasses import fields

    from mpitp.evaluation.settings import RUNTIME, RuntimeOptions

    assert [(f.name, f.default) for f in fields(RuntimeOptions)] == [(s.name, s.default) for s in RUNTIME]
    opts = parse_eval_args([*CLI, "--tp", "2", "--pp", "2", "--timeout", "30", "--stage-dir", "/tmp/x"]).runtime
    assert (opts.tp, opts.pp, opts.timeout, opts.stage_dir, opts.watch) == (2, 2, 30.0, "/tmp/x", None)


def test_seconds_refuse_a_deadline_that_never_comes():
    """``--timeout inf`` (and ``--watch-idle inf``) passed the "> 0" rule: every wait would be unbounded."""
    import argparse

    from mpitp.evaluation.setting_values import cli_positive_float

    assert cli_positive_float("1e6") == 1e6
    for bad, said in (("inf", "must be a finite number of seconds, got 'inf'"), ("nan", "must be > 0, got 'nan'"),
                      ("0", "must be > 0, got '0'")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            cli_positive_float(bad)


@pytest.mark.parametrize("yaml_seed,cli_seed", [("[1, null, 3, 4]", "1,None,3,4"), ("[5, 6, 7, 8]", "5,6,7,8"),
                                                ("9", "9")])
def test_job_file_seeds_mean_the_flag(tmp_path, yaml_seed, cli_seed):
    """``seed:`` takes ``--seed``'s four values (null: that generator unseeded) as well as one integer; the list was
    refused ('expected a non-negative integer') though the setting's description offers it."""
    path = tmp_path / "job.yaml"
    path.write_text(JOB.split("runs:")[0] + f"runs:\n  - {{name: s, limit: 3, seed: {yaml_seed}, output: /o/s.h5}}\n")
    from_job, from_cli = eval_config(load_job(path).runs[0]), _cli_config("--limit", "3", "--seed", cli_seed)
    assert from_job.identity() == from_cli.identity()
    assert from_job.lm_eval_arguments() == from_cli.lm_eval_arguments()
    path.write_text(JOB.split("runs:")[0] + "runs:\n  - {name: s, seed: [1, 2, 3], output: /o/s.h5}\n")
    with pytest.raises(JobFileError, match=r"field 'seed': expected a non-negative integer or a list of four"):
        load_job(path)


@pytest.mark.parametrize("field,yaml_value,flag", [
    ("gen_kwargs", "'temperature=0,until=[\"x\"]'", 'temperature=0,until=["x"]'),
    ("gen_kwargs", "'{\"until\": [\"x\"], \"max_gen_toks\": 5}'", '{"until": ["x"], "max_gen_toks": 5}'),
    ("metadata", "'{\"max_seq_lengths\": [64]}'", '{"max_seq_lengths": [64]}'),
    ("model_args", "'{\"pretrained\": \"org/m\", \"add_bos_token\": true}'",
     '{"pretrained": "org/m", "add_bos_token": true}'),
    ("samples", "'{\"a\": [1, 3]}'", '{"a": [1, 3]}'),
    ("samples", "picked.json", "{dir}/picked.json"),
], ids=["gen-kv-list", "gen-json", "metadata-json", "model-args-json", "samples-json", "samples-file"])
def test_job_file_strings_read_as_the_flags(tmp_path, field, yaml_value, flag):
    """A string for one of lm-eval's mapping settings means what the flag's text means (lm-eval's MergeDictAction:
    a JSON object, else key=value pairs; --samples: JSON, else a JSON file's path, here relative to the job file).
    Read as key=value pairs by lm-eval's simple_parse_args_string, until=["x"] was the one stop string '["x"]' and
    the JSON metadata the key '{"max_seq_lengths": [64]}'; a JSON model_args was refused, a samples string not read."""
    (tmp_path / "picked.json").write_text('{"a": [1, 3]}')
    path = tmp_path / "job.yaml"
    path.write_text(f"runs:\n  - {{name: r, model: org/m, tasks: [a, b], {field}: {yaml_value}, output: /o/r.h5}}\n")
    from_job = eval_config(load_job(path).runs[0])
    flag = flag.replace("{dir}", str(tmp_path))
    from_cli = parse_eval_args(["--model", "org/m", "--tasks", "a,b", f"--{field}", flag]).cfg
    assert getattr(from_job, field) == getattr(from_cli, field)
    assert from_job.identity() == from_cli.identity()
