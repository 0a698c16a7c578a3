"""Job-file validation: every mistake must produce one exact, actionable line."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest

from mpitp.jobs.jobfile import DEMO_MODEL, Job, JobFileError, RunSpec, load_job

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def write(tmp_path, monkeypatch):
    """Write ``jobs/x.yaml`` under tmp and cd there, so messages show ``jobs/x.yaml``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs").mkdir()

    def _write(text: str, name: str = "x.yaml") -> str:
        (tmp_path / "jobs" / name).write_text(textwrap.dedent(text))
        return f"jobs/{name}"

    return _write


def _error(write, text: str) -> str:
    with pytest.raises(JobFileError) as info:
        load_job(write(text))
    return str(info.value)


def _refusal(job: Path, text: str) -> str:
    """``text`` written to ``job``: the one line loading it raises."""
    job.write_text(text)
    with pytest.raises(JobFileError) as info:
        load_job(job)
    return str(info.value)


def _one_run(field: str, value: str) -> str:
    """Two runs; the second, named llama-arc, carries the bad field."""
    return f"""
    runs:
      - model: demo
        tasks: [a]
      - name: llama-arc
        model: meta-llama/Llama-3.1-8B
        tasks: [arc_easy]
        {field}: {value}
    """


P = "jobs/x.yaml: run 2 ('llama-arc'): field "

BAD_FIELDS = [
    ("tp", "two", P + "'tp': expected a positive integer, got 'two'"),
    ("tp", "0", P + "'tp': expected a positive integer, got 0"),
    ("tp", "2.0", P + "'tp': expected a positive integer, got 2.0"),
    ("tp", "true", P + "'tp': expected a positive integer, got True"),
    ("tp", "", P + "'tp': expected a positive integer, got an empty value"),
    ("pp", "0", P + "'pp': expected a positive integer, got 0"),
    ("pp", "two", P + "'pp': expected a positive integer, got 'two'"),
    ("dtype", "bf16", P + "'dtype': expected one of 'auto', 'float32', 'bfloat16', 'float16', "
                          "got 'bf16' (did you mean 'bfloat16'?)"),
    ("batch_size", "0", P + "'batch_size': expected a positive integer, 'auto' or 'auto:N', got 0"),
    ("num_fewshot", "-1", P + "'num_fewshot': expected a non-negative integer, got -1"),
    ("limit", "0", P + "'limit': expected a positive integer (examples per task) or a fraction in (0, 1), got 0"),
    ("limit", "1.5", P + "'limit': expected a positive integer (examples per task) or a fraction in (0, 1), got 1.5"),
    ("limit", "'10'", P + "'limit': expected a positive integer (examples per task) or a fraction in (0, 1), got '10'"),
    ("max_length", "-5", P + "'max_length': expected an integer >= 2 (tokens), got -5"),
    ("gen_kwargs", "3", P + "'gen_kwargs': expected a string like 'temperature=0,top_p=1' or a mapping, got 3"),
    ("gen_kwargs", "{a: {b: 1}}", P + "'gen_kwargs': key 'a': expected a number, string, boolean "
                                      "or list of them, got {'b': 1}"),
    ("apply_chat_template", "'yes'", P + "'apply_chat_template': expected true or false, got 'yes'"),
    ("log_samples", "1", P + "'log_samples': expected true or false, got 1"),
    ("seed", "-1", P + "'seed': expected a non-negative integer or a list of four (python, numpy, torch, "
                          "few-shot; null: unseeded), got -1"),
    ("output", "out.txt", P + "'output': expected a path ending in .h5, got 'out.txt'"),
    ("timeout", "0", P + "'timeout': expected a positive number of seconds, got 0"),
    ("ep", "3", P + "'ep': ep=3: the experts are spread over a TP group's ranks, so ep must be 1 or tp (1)"),
    ("timeout", "1h", P + "'timeout': expected a positive number of seconds, got '1h'"),
    ("revision", "1.0", P + "'revision': expected a non-empty string, got 1.0 (quote it in YAML)"),
    ("tokenizer", "''", P + "'tokenizer': expected a non-empty string, got ''"),
    ("device", "[cuda]", P + "'device': expected cpu, cuda, cuda:<index> or auto, got ['cuda']"),
    ("device", "tpu", P + "'device': expected cpu, cuda, cuda:<index> or auto, got 'tpu'"),
    ("verbosity", "LOUD", P + "'verbosity': expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"),
    ("include_path", "$MPITP_SURELY_UNSET/tasks",
     P + "'include_path': environment variable $MPITP_SURELY_UNSET is not set (in '$MPITP_SURELY_UNSET/tasks')"),
    ("batchsize", "8", P + "'batchsize': unknown field (did you mean 'batch_size'?)"),
    ("colour", "red", P + "'colour': unknown field"),
]


@pytest.mark.parametrize("field,value,message", BAD_FIELDS, ids=[f"{f}={v}" for f, v, _ in BAD_FIELDS])
def test_bad_field_message(write, monkeypatch, field, value, message):
    monkeypatch.delenv("MPITP_SURELY_UNSET", raising=False)
    assert _error(write, _one_run(field, value)) == message


BAD_TASKS = [
    ("[]", "expected at least one task"),
    ("[arc_easy, 3]", "item 2: expected a task name, got 3"),
    ("'arc_easy,,hellaswag'", "empty task name in 'arc_easy,,hellaswag'"),
    ("[arc_easy, hellaswag, arc_easy]", "task 'arc_easy' is listed twice"),
    ("{a: 1}", "expected a list of task names or a comma-separated string, got {'a': 1}"),
]


@pytest.mark.parametrize("value,reason", BAD_TASKS)
def test_bad_tasks(write, value, reason):
    text = f"runs:\n  - name: r\n    model: demo\n    tasks: {value}\n"
    assert _error(write, text) == f"jobs/x.yaml: run 1 ('r'): field 'tasks': {reason}"


@pytest.mark.parametrize("text,message", [
    ("runs:\n  - tasks: [a]\n", "jobs/x.yaml: run 1: field 'model': required field is missing"),
    ("runs:\n  - {modle: demo, tasks: [a]}\n",
     "jobs/x.yaml: run 1: field 'modle': unknown field (did you mean 'model'?)"),
    ("runs:\n  - {model: org/m, tasks: [a], dtyp: auto}\n",
     "jobs/x.yaml: run 1 ('m-a'): field 'dtyp': unknown field (did you mean 'dtype'?)"),
    ("runs:\n  - name: r\n    model: demo\n", "jobs/x.yaml: run 1 ('r'): field 'tasks': required field is missing"),
    ("runs:\n  - name: a b\n    model: demo\n    tasks: [t]\n",
     "jobs/x.yaml: run 1: field 'name': expected a name of letters, digits and ._+- (used in file names), got 'a b'"),
    ("", "jobs/x.yaml: file is empty; expected a mapping with a 'runs:' list"),
    ("- model: demo\n", "jobs/x.yaml: expected a mapping with 'defaults:' and 'runs:', got [{'model': 'demo'}]"),
    ("runs: []\n", "jobs/x.yaml: 'runs:' must be a non-empty list of runs, got []"),
    ("defaults: {tp: 1}\n", "jobs/x.yaml: 'runs:' must be a non-empty list of runs, got an empty value"),
    ("runs:\n  - demo\n", "jobs/x.yaml: run 1: expected a mapping of field: value, got 'demo'"),
    ("run:\n  - model: demo\n",
     "jobs/x.yaml: unknown top-level key 'run'; expected 'defaults' or 'runs' (did you mean 'runs'?)"),
    ("defaults: [tp]\nruns: [{model: demo, tasks: a}]\n",
     "jobs/x.yaml: defaults: expected a mapping of field: value, got ['tp']"),
    ("defaults: {tp: two}\nruns: [{model: demo, tasks: a}]\n",
     "jobs/x.yaml: defaults: field 'tp': expected a positive integer, got 'two'"),
    ("defaults: {name: x}\nruns: [{model: demo, tasks: a}]\n",
     "jobs/x.yaml: defaults: field 'name': must be set per run, not in defaults"),
    ("defaults: {modle: demo}\nruns: [{model: demo, tasks: a}]\n",
     "jobs/x.yaml: defaults: field 'modle': unknown field (did you mean 'model'?)"),
    ("runs:\n  - {name: r, model: demo, tasks: a}\n  - {name: r, model: demo, tasks: b}\n",
     "jobs/x.yaml: run 2 ('r'): field 'name': 'r' is already used by run 1; give each run a unique 'name:'"),
    ("runs:\n  - {name: a, model: demo, tasks: a, output: o.h5}\n"
     "  - {name: b, model: demo, tasks: b, output: ./o.h5}\n",
     "jobs/x.yaml: run 2 ('b'): field 'output': '{jobs}/o.h5' is already used by run 1; "
     "give each run its own 'output:'"),
    ("runs:\n  - {model: demo, tasks: a}\n  - {model: demo, tasks: a, tp: 2}\n",
     "jobs/x.yaml: run 2 ('demo-a'): field 'name': 'demo-a' is already used by run 1; "
     "give each run a unique 'name:'"),
])
def test_structure_errors(write, tmp_path, text, message):
    assert _error(write, text) == message.replace("{jobs}", str(tmp_path / "jobs"))


def test_yaml_syntax_error_names_line(write):
    text = "runs:\n  - model: demo\n    tasks: [a, b\n    tp: 2\n"
    msg = _error(write, text)
    assert msg.startswith("jobs/x.yaml: line ") and "invalid YAML" in msg
    assert msg == "jobs/x.yaml: line 4, column 7: invalid YAML: expected ',' or ']', but got ':'"


def test_duplicate_key_is_an_error(write):
    text = "runs:\n  - model: demo\n    tasks: [a]\n    tp: 1\n    tp: 2\n"
    assert _error(write, text) == "jobs/x.yaml: line 5, column 5: invalid YAML: duplicate key 'tp'"


def test_yaml_merge_keys_still_work(write):
    text = """
    runs:
      - &first {name: one, model: demo, tasks: [a], tp: 1}
      - {<<: *first, name: two, tp: 2}
    """
    job = load_job(write(text))
    assert [(r.name, r.tp) for r in job.runs] == [("one", 1), ("two", 2)]


def test_missing_file():
    with pytest.raises(JobFileError, match=r"^nope/x\.yaml: cannot read job file: No such file"):
        load_job("nope/x.yaml")


def test_error_attributes(write):
    with pytest.raises(JobFileError) as info:
        load_job(write(_one_run("tp", "two")))
    err = info.value
    assert (err.path, err.run, err.run_name, err.field) == ("jobs/x.yaml", 2, "llama-arc", "tp")
    assert isinstance(err, ValueError)


def test_defaults_and_overrides(write, tmp_path):
    job = load_job(write("""
    defaults:
      tasks: arc_easy, hellaswag
      dtype: bfloat16
      batch_size: 8
      limit: 100
    runs:
      - model: meta-llama/Llama-3.1-8B
      - model: Qwen/Qwen2.5-7B
        tasks: [gsm8k]
        batch_size: 2
        limit: null
        gen_kwargs: {temperature: 0, until: ["\\n\\n"]}
    """))
    first, second = job.runs
    assert first.name == "Llama-3.1-8B-arc_easy+hellaswag"
    assert first.tasks == ("arc_easy", "hellaswag")
    assert (first.dtype, first.batch_size, first.limit, first.tp) == ("bfloat16", 8, 100, 1)
    assert second.name == "Qwen2.5-7B-gsm8k"
    assert (second.tasks, second.dtype, second.batch_size, second.limit) == (("gsm8k",), "bfloat16", 2, None)
    assert first.output == str(tmp_path / "jobs/results/Llama-3.1-8B-arc_easy+hellaswag.h5")
    assert job.path == tmp_path / "jobs/x.yaml" and job.name == "x"

    kwargs = second.to_eval_kwargs()
    assert set(kwargs) == {f.name for f in dataclasses.fields(RunSpec)}
    assert kwargs["tasks"] == ["gsm8k"]
    assert kwargs["gen_kwargs"] == {"temperature": 0, "until": ["\n\n"]}
    kwargs["tasks"].append("x")
    kwargs["gen_kwargs"]["temperature"] = 1
    assert second.tasks == ("gsm8k",) and second.gen_kwargs["temperature"] == 0
    hash(second)  # frozen specs can be used as dict keys / set members
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.tp = 4


def test_limit_follows_lm_eval(write):
    """lm-eval reads a limit < 1 as a fraction and one >= 1 as a count, so 1.0 is one document (as ``--limit 1.0``)."""
    runs = load_job(write("runs: [{name: a, model: demo, tasks: t, limit: 1.0},"
                          " {name: b, model: demo, tasks: t, limit: 1},"
                          " {name: c, model: demo, tasks: t, limit: 0.25}]\n")).runs
    assert [r.limit for r in runs] == [1, 1, 0.25]


def test_many_tasks_keep_derived_name_short(write):
    job = load_job(write("runs: [{model: org/m, tasks: [a, b, c, d, e]}]\n"))
    assert job.runs[0].name == "m-a+4more"


def test_relative_paths_resolve_against_job_dir(write, tmp_path, monkeypatch):
    (tmp_path / "jobs" / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "jobs" / "demo").mkdir()  # must not turn the demo model into a path
    path = write("""
    defaults:
      data_dir: ../data
    runs:
      - name: local
        model: models/tiny
        tokenizer: ./tok
        tasks: [a]
        include_path: tasks
        output: out/local.h5
      - name: hub
        model: org/not-here
        tasks: [a]
        data_dir: /abs/data
        include_path: ~/tasks
        output: $MPITP_TEST_OUT/hub.h5
      - name: demo
        model: demo
        tasks: [a]
    """)
    monkeypatch.setenv("MPITP_TEST_OUT", "/scratch/out")
    monkeypatch.setenv("HOME", "/home/u")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    local, hub, demo = load_job(tmp_path / path).runs
    jobs = tmp_path / "jobs"
    assert local.model == str(jobs / "models/tiny")
    assert local.tokenizer == str(jobs / "tok")
    assert local.include_path == str(jobs / "tasks")
    assert local.data_dir == str(tmp_path / "data")
    assert local.output == str(jobs / "out/local.h5")
    assert hub.model == "org/not-here"
    assert (hub.data_dir, hub.include_path, hub.output) == ("/abs/data", "/home/u/tasks", "/scratch/out/hub.h5")
    assert demo.model == DEMO_MODEL
    assert demo.output == str(jobs / "results/demo.h5")


@pytest.mark.parametrize("name", ["demo.yaml", "example-llama.yaml"])
def test_shipped_job_files_load(name):
    job = load_job(REPO / "jobs" / name)
    assert isinstance(job, Job) and job.runs
    assert all(isinstance(r, RunSpec) and r.output.endswith(".h5") for r in job.runs)


def test_demo_job_shape():
    runs = load_job(REPO / "jobs/demo.yaml").runs
    assert len(runs) == 3
    assert all(r.model == DEMO_MODEL for r in runs)
    assert all(r.tasks == ("mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen") for r in runs)
    assert sorted(r.tp for r in runs) == [1, 2, 2]
    assert any(r.limit == 10 and r.batch_size != runs[0].batch_size for r in runs)
    assert all(Path(r.output).parent == REPO / "results/demo" for r in runs)


def test_example_job_shape():
    runs = load_job(REPO / "jobs/example-llama.yaml").runs
    assert {r.model for r in runs} >= {"meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"}
    assert {t for r in runs for t in r.tasks} == {"arc_easy", "hellaswag", "gsm8k"}
    assert {r.tp for r in runs} == {4, 8}
    assert all(r.dtype == "bfloat16" and r.data_dir for r in runs)


def test_message_uses_path_as_given(write, tmp_path):
    path = write(_one_run("tp", "two"))
    with pytest.raises(JobFileError, match=f"^{os.path.join(str(tmp_path), path)}: run 2"):
        load_job(tmp_path / path)


def test_lm_eval_fields_in_job_files(tmp_path):
    """Fields named as lm-eval's EvaluatorConfig fields are accepted (from its declaration, not a copy) and mean
    what the flags mean; model_args that cannot apply under TP are refused while reading the file."""
    from mpitp.jobs.jobrun import eval_config

    job = tmp_path / "job.yaml"
    job.write_text("defaults:\n  system_instruction: Be brief.\nruns:\n  - model: demo\n    tasks: [mpitp_demo_mc]\n"
                   "    batch_size: auto:2\n    model_args: add_bos_token=True,dtype=float32\n"
                   "    predict_only: true\n    fewshot_as_multiturn: false\n    metadata: {max_seq_lengths: [64]}\n")
    spec = load_job(job).runs[0]
    assert spec.batch_size == "auto:2"
    cfg = eval_config(spec)
    assert cfg.system_instruction == "Be brief." and cfg.predict_only and cfg.log_samples
    assert cfg.hflm_args == {"add_bos_token": True} and cfg.dtype == "float32"
    assert cfg.fewshot_as_multiturn is False and cfg.metadata["max_seq_lengths"] == [64]
    assert cfg.identity()["system_instruction"] == "Be brief."
    job.write_text("runs:\n  - model: demo\n    tasks: [mpitp_demo_mc]\n    model_args: {device_map: auto}\n")
    with pytest.raises(JobFileError, match="model_args device_map: mpitp places the model itself"):
        load_job(job)
    job.write_text("runs:\n  - model: demo\n    tasks: [mpitp_demo_mc]\n    system_instructions: x\n")
    with pytest.raises(JobFileError, match="did you mean 'system_instruction'"):
        load_job(job)


def test_no_prefix_sharing_in_job_files(tmp_path):
    """``--no-prefix-sharing`` has its job-file field (one declaration in settings.py): it reaches the run's config."""
    from mpitp.jobs.jobrun import eval_config

    job = tmp_path / "job.yaml"
    job.write_text("defaults:\n  no_prefix_sharing: true\nruns:\n  - model: demo\n    tasks: [mpitp_demo_mc]\n"
                   "  - model: demo\n    name: shared\n    tasks: [mpitp_demo_mc]\n    no_prefix_sharing: false\n")
    first, second = load_job(job).runs
    assert eval_config(first).no_prefix_sharing is True and eval_config(second).no_prefix_sharing is False
    job.write_text("runs:\n  - model: demo\n    tasks: [mpitp_demo_mc]\n    no_prefix_sharing: 1\n")
    with pytest.raises(JobFileError, match="'no_prefix_sharing': expected true or false, got 1"):
        load_job(job)


def test_run_spec_fields_follow_the_declarations():
    """``RunSpec`` is written out with real types, so a setting added to mpitp.evaluation.settings must be added to
    it too: same names, order, defaults, and mappings left out of the hash."""
    from mpitp.jobs.jobfile import RunSpec, declared_run_fields

    have = [(f.name, f.default, f.hash is not False) for f in dataclasses.fields(RunSpec)]
    assert have == declared_run_fields()
    assert all(f.type != "Any" for f in dataclasses.fields(RunSpec))


@pytest.mark.parametrize("value,parsed", [("true", {"cache_requests": True, "rewrite_requests_cache": False,
                                                    "delete_requests_cache": False}),
                                          ("refresh", {"cache_requests": True, "rewrite_requests_cache": True,
                                                       "delete_requests_cache": False}),
                                          ("false", None)])
def test_cache_requests_read_as_the_flag(tmp_path, value, parsed):
    """``cache_requests:`` takes what ``--cache_requests`` takes (``true`` was refused as not a mapping); a value
    lm-eval's parser refuses is the file's error, not its ArgumentTypeError traceback once the run began."""
    from mpitp.jobs.jobrun import eval_config

    job = tmp_path / "job.yaml"
    job.write_text(f"runs:\n  - name: r\n    model: demo\n    tasks: [mpitp_demo_mc]\n    cache_requests: {value}\n")
    assert eval_config(load_job(job).runs[0]).cache_requests == parsed
    text = "runs:\n  - name: r\n    model: demo\n    tasks: [mpitp_demo_mc]\n    cache_requests: maybe\n"
    assert _refusal(job, text) == (f"{job}: run 1 ('r'): field 'cache_requests': expected true, 'refresh' or 'delete' "
                               "(lm-eval's --cache_requests), got 'maybe'")


def test_samples_with_limit_refused(tmp_path):
    """``samples`` with ``limit`` (a default's too) is the file's error, as ``--samples`` with ``--limit`` is the
    command line's: it passed the file's checks and lm-eval's ValueError was a traceback after the model load."""
    job = tmp_path / "job.yaml"
    text = "defaults:\n  limit: 3\nruns:\n  - name: r\n    model: demo\n    tasks: [mpitp_demo_mc]\n" \
           "    samples: {mpitp_demo_mc: [1]}\n"
    assert _refusal(job, text) == (f"{job}: run 1 ('r'): field 'samples': limit: 3 and samples exclude each other "
                               "(lm-eval scores either each task's first documents or the listed ones): give one of "
                               "them")
    job.write_text("defaults:\n  limit: 3\nruns:\n  - name: r\n    model: demo\n    tasks: [mpitp_demo_mc]\n"
                   "    samples: {mpitp_demo_mc: [1]}\n    limit: null\n")
    assert load_job(job).runs[0].limit is None


def test_model_args_pretrained_is_the_run_model(tmp_path):
    """``model_args: {pretrained: B}`` beside ``model: A`` is refused, as ``--model A --model_args pretrained=B``
    is (it was recorded as the model while A was loaded); the same model, relative to the job file, is accepted."""
    from mpitp.jobs.jobrun import eval_config

    (tmp_path / "m").mkdir()
    job = tmp_path / "job.yaml"
    text = "runs:\n  - name: r\n    model: m\n    tasks: [arc_easy]\n    model_args: pretrained=/other,dtype=float32\n"
    assert _refusal(job, text) == (f"{job}: run 1 ('r'): field 'model_args': pretrained=/other and model: {tmp_path}/m "
                               "name different models: give the model once, as 'model:'")
    job.write_text("runs:\n  - name: r\n    model: m\n    tasks: [arc_easy]\n    model_args: {pretrained: ./m}\n")
    cfg = eval_config(load_job(job).runs[0])
    assert cfg.model == str(tmp_path / "m") and cfg.model_args["pretrained"] == cfg.model


def test_every_path_relative_to_the_job_file(tmp_path, monkeypatch):
    """hf_assets, output_path and use_cache resolve against the job file's folder, as data_dir and output do: they
    were left as written, so lm-eval's files, the response store and a DCP checkpoint's config were looked for in
    whatever directory the scheduler started the job in."""
    (tmp_path / "jobs").mkdir()
    job = tmp_path / "jobs" / "job.yaml"
    job.write_text("runs:\n  - {name: r, model: demo, tasks: [a], hf_assets: assets, output_path: lm-out,\n"
                   "     use_cache: cache/c, data_dir: data}\n")
    monkeypatch.chdir(tmp_path)
    spec = load_job("jobs/job.yaml").runs[0]
    here = tmp_path / "jobs"
    assert (spec.hf_assets, spec.data_dir) == (str(here / "assets"), str(here / "data"))
    assert dict(spec.lm_eval) == {"output_path": str(here / "lm-out"), "use_cache": str(here / "cache/c")}


def test_fewshot_as_multiturn_needs_the_chat_template(tmp_path):
    """``fewshot_as_multiturn: true`` without ``apply_chat_template: true`` is refused as lm-eval refuses the flags
    (mpitp eval: 'When fewshot_as_multiturn is True, apply_chat_template must be set'); the job ran it to complete."""
    job = tmp_path / "job.yaml"
    text = "runs:\n  - {name: r, model: demo, tasks: [mpitp_demo_mc], fewshot_as_multiturn: true}\n"
    assert _refusal(job, text) == (f"{job}: run 1 ('r'): field 'fewshot_as_multiturn': true needs apply_chat_template: "
                                   "true (few-shot examples as turns of a chat), as lm-eval refuses "
                                   "--fewshot_as_multiturn without --apply_chat_template")
    job.write_text(text.replace("true}", "true, apply_chat_template: true}"))
    assert load_job(job).runs[0].apply_chat_template is True


def test_aliases_and_nesting_bounded(tmp_path):
    """Nine aliases of nine (a 'billion laughs') under metadata loaded in 0.04 s and were copied out by each run:
    7 levels took 5 s and 28 MB of JSON, 9 levels would be 387 million strings; [[[...]]] 3000 deep was PyYAML's
    RecursionError traceback. Both are one line now; anchors within the bound still work."""
    job = tmp_path / "job.yaml"
    laughs = "defaults:\n  metadata:\n    l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))
    run = "runs:\n  - {name: r, model: demo, tasks: [mpitp_demo_mc]}\n"
    assert _refusal(job, laughs + run) == (f"{job}: holds 490329078 values with its aliases (*name) copied out, more "
                                           "than the 1000000 a job file may: each run's settings are copied out that "
                                           "far")
    deep = "runs:\n  - {name: r, model: demo, tasks: [mpitp_demo_mc], metadata: {x: " + "[" * 3000 + "]" * 3000 + "}}\n"
    assert _refusal(job, deep).startswith(f"{job}: invalid YAML: nested deeper than ")
    job.write_text("defaults: &d {model: demo, tasks: [mpitp_demo_mc]}\nruns:\n  - {<<: *d, name: a}\n"
                   "  - {<<: *d, name: b, limit: 2}\n")
    assert [r.limit for r in load_job(job).runs] == [None, 2]


def test_model_args_shorthand_disagreeing_refused_while_reading(tmp_path):
    """``dtype: float32`` with ``model_args: {dtype: bfloat16}`` passed mpitp check and submit, and failed the run at
    its turn ('dtype: float32 and model_args dtype=bfloat16 disagree', exit 1); the same value given twice is fine."""
    job = tmp_path / "job.yaml"
    text = "runs:\n  - {name: r, model: demo, tasks: [a], dtype: float32, model_args: 'dtype=bfloat16'}\n"
    assert _refusal(job, text) == (f"{job}: run 1 ('r'): field 'model_args': dtype=bfloat16 and dtype: float32 "
                                   "disagree: give it once")
    job.write_text(text.replace("bfloat16", "float32"))
    assert load_job(job).runs[0].dtype == "float32"
