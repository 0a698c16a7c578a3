"""``mpitp check`` and ``mpitp submit``'s check (:mod:`mpitp.jobs.readiness`): the network blocked, every
task built and scored on stand-ins, the model's config and tokenizer from local files; what is missing named with
the command that fetches it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from mpitp.errors import UsageError
from mpitp.jobs.readiness import CheckSpec, block_network, check
from support import OFFLINE_ENV, STORIES
from support.offline_data import mmlu_dir, small_tasks_dir

REMOVED = "virology"


@pytest.fixture(scope="module")
def full_data(tmp_path_factory) -> Path:
    return small_tasks_dir(mmlu_dir(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def gap_data(full_data, tmp_path_factory) -> Path:
    """``full_data`` less one MMLU subject and BoolQ (symlinks to the rest)."""
    root = tmp_path_factory.mktemp("gap")
    (root / "cais/mmlu").mkdir(parents=True)
    for subject in (full_data / "cais/mmlu").iterdir():
        if subject.name != REMOVED:
            (root / "cais/mmlu" / subject.name).symlink_to(subject)
    (root / "allenai").symlink_to(full_data / "allenai")
    return root


def mpitp(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpitp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **OFFLINE_ENV})


def test_check_ready_builds_and_scores_every_subtask(full_data):
    report = check(CheckSpec(tasks=("mmlu", "boolq", "copa", "arc_challenge"), data_dir=str(full_data),
                             model=str(STORIES)))
    assert report.ready, [p.line() for p in report.problems]
    assert len(report.tasks) == 60 and {"mmlu_virology", "boolq", "copa", "arc_challenge"} <= set(report.tasks)
    assert socket.getaddrinfo.__module__ == "socket"  # the guard is gone after the check


@pytest.mark.mpi  # a `python -m mpitp` process
def test_check_refuses_a_missing_subject_and_names_the_fetch(gap_data):
    p = mpitp("check", "--tasks", "mmlu,boolq", "--data-dir", gap_data, "--model", STORIES, "--num_fewshot", "1")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    assert lines[0] == "mpitp check: not ready offline: 3 problem(s)", p.stderr
    for line, split in zip(lines[1:3], ("test", "dev")):  # dev: the 1-shot examples come from it
        assert line == (f"  dataset: task mmlu_{REMOVED} needs its {split} split: {gap_data}/cais/mmlu/{REMOVED}/"
                        f"{split}.jsonl (or .parquet) is missing; fetch it: mpitp prefetch --tasks mmlu_{REMOVED} "
                        f"--data-dir {gap_data}"), p.stderr
    # BoolQ has no folder in DATA: lm-eval would go to the Hub, which the blocked network (offline mode) refuses
    assert lines[3].startswith("  task boolq: dataset aps/super_glue/boolq not available offline ("), p.stderr
    assert lines[3].endswith(f"; fetch it: mpitp prefetch --tasks boolq --data-dir {gap_data}"), p.stderr


def test_network_guard_refuses_remote_hosts_only():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    accepted = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
    accepted.start()
    tried: list[str] = []
    with block_network(tried):
        assert os.environ["HF_HUB_OFFLINE"] == "1"
        with pytest.raises(OSError, match="network blocked"):
            socket.create_connection(("example.org", 443), timeout=2)
        with pytest.raises(OSError, match="network blocked"):
            socket.socket().connect(("192.0.2.1", 80))  # an address, no name to resolve
        socket.create_connection(server.getsockname(), timeout=5).close()  # loopback still works
    accepted.join(timeout=10)
    server.close()
    assert tried == ["example.org:443", "192.0.2.1:80"]


def fake_sbatch(folder: Path, monkeypatch) -> None:
    """An ``sbatch`` first on PATH that touches ``folder/queued`` and answers as SLURM does."""
    (folder / "bin").mkdir()
    sbatch = folder / "bin/sbatch"
    sbatch.write_text(f'#!/bin/sh\ntouch {folder}/queued\necho "Submitted batch job 42"\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.mpi  # submit starts `python -m mpitp check`
def test_submit_refuses_a_job_that_cannot_run_offline(gap_data, tmp_path, monkeypatch):
    from mpitp.cli.submit import submit_command

    fake_sbatch(tmp_path, monkeypatch)
    job = tmp_path / "job.yaml"
    job.write_text(f"runs:\n  - name: gap\n    model: {STORIES}\n    tasks: [mmlu_{REMOVED}, mmlu_anatomy]\n"
                   f"    data_dir: {gap_data}\n")
    args = [str(job), "--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "1", "--time", "00:10:00"]
    refused = CliRunner().invoke(submit_command, args)
    assert refused.exit_code == 2 and not (tmp_path / "queued").exists(), refused.output
    assert f"run gap: dataset: task mmlu_{REMOVED} needs its test split" in refused.output
    assert "nothing queued (mpitp submit --no-check queues it anyway)" in refused.output
    assert "anatomy" not in refused.output  # the subjects DATA has pass
    queued = CliRunner().invoke(submit_command, [*args, "--no-check"])
    assert queued.exit_code == 0 and (tmp_path / "queued").exists(), queued.output
    assert "--no-check: not checked whether the job runs offline" in queued.output


def test_check_names_a_metric_module_missing_from_the_cache():
    """humaneval scores with the `evaluate` module code_eval, which `evaluate.load` would download at run time."""
    report = check(CheckSpec(tasks=("humaneval",)))
    assert [p.line() for p in report.problems if "humaneval" in p.what] == [
        "task humaneval: the evaluate metric module code_eval is not in the HF cache (HF_HOME's modules); fetch it: "
        "mpitp prefetch --tasks humaneval --data-dir DATA"]
    assert [p.metric for p in report.problems if p.metric] == ["code_eval"]  # what prefetch reads to fetch it


def test_check_names_a_metric_lm_eval_could_not_load_from_evaluate(tmp_path):
    """kobest_boolq's f1 is `hf_evaluate: true`: lm-eval logs evaluate.load's failure and keeps None, so the run would
    fail scoring without naming it; the check names it for prefetch."""
    from support.offline_data import write_jsonl

    rows = [{"paragraph": f"paragraph {i}", "question": f"question {i}", "label": i % 2} for i in range(3)]
    write_jsonl(tmp_path / "skt/kobest_v1/boolq/test.jsonl", rows)
    report = check(CheckSpec(tasks=("kobest_boolq",), data_dir=str(tmp_path)))
    assert [(p.line(), p.metric) for p in report.problems] == [
        ("task kobest_boolq: the evaluate metric module f1 is not in the HF cache (HF_HOME's modules); fetch it: "
         f"mpitp prefetch --tasks kobest_boolq --data-dir {tmp_path}", "f1")]


def test_model_is_checked_beside_the_tasks_and_reported_first(gap_data, tmp_path):
    """On two cores the model's config and tokenizer are checked in a child interpreter while the tasks are built
    (what brings `mpitp check --tasks mmlu` under 5 s): its problems come back first, as in line, and the tasks'
    problems are not lost. With a chat template the tasks need the tokenizer, so the model is checked first, here."""
    code = ("import json, sys; from mpitp.jobs.readiness import CheckSpec, check\n"
            f"spec = CheckSpec(tasks=('mmlu_{REMOVED}', 'mmlu_anatomy'), data_dir={str(gap_data)!r}, "
            f"model={str(tmp_path / 'no-model')!r}, apply_chat_template=sys.argv[1] == 'chat')\n"
            "r = check(spec)\n"
            "print(json.dumps([r.model_beside, [p.what for p in r.problems], r.tasks]))\n")
    for mode, beside in (("plain", len(os.sched_getaffinity(0)) >= 2), ("chat", False)):
        p = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **OFFLINE_ENV})
        assert p.returncode == 0, p.stderr
        model_beside, problems, tasks = json.loads(p.stdout.splitlines()[-1])
        assert model_beside is beside, mode
        assert problems[0].startswith(f"model {tmp_path / 'no-model'}: config not available offline ("), problems
        if mode == "plain":  # the chat case stops at the model: no tokenizer, no prompts to build
            assert [w.split(":")[1] for w in problems[1:]] == [f" task mmlu_{REMOVED} needs its test split"], problems
            assert tasks == ["mmlu_anatomy"]


@pytest.mark.mpi  # a `python -m mpitp` process
def test_check_says_a_missing_metric_once_and_writes_it_for_prefetch(tmp_path):
    """The command's whole stderr is its verdict and the problem: lm-eval's own "f1 not found in the evaluate
    library!" log line (which it prints while building kobest_boolq) is not shown beside it; --json-out carries the
    metric field prefetch reads."""
    from support.offline_data import write_jsonl

    rows = [{"paragraph": f"paragraph {i}", "question": f"question {i}", "label": i % 2} for i in range(3)]
    write_jsonl(tmp_path / "skt/kobest_v1/boolq/test.jsonl", rows)
    p = mpitp("check", "--tasks", "kobest_boolq", "--data-dir", tmp_path, "--json-out", tmp_path / "check.json")
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [
        "mpitp check: not ready offline: 1 problem(s)",
        "  task kobest_boolq: the evaluate metric module f1 is not in the HF cache (HF_HOME's modules); fetch it: "
        f"mpitp prefetch --tasks kobest_boolq --data-dir {tmp_path}"], p.stderr
    found = json.loads((tmp_path / "check.json").read_text())
    assert not found["ready"] and [q["metric"] for q in found["problems"]] == ["f1"]


def test_check_refuses_a_layout_the_model_cannot_take(tmp_path):
    """A job file's run at a tp, pp or ep its model type cannot be split by is refused by `mpitp check` (so `submit`
    refuses it before the queue), with the line `mpitp eval` would print before loading; a layout that fits is not."""
    from transformers import AutoConfig

    from mpitp.jobs.jobfile import JobFileError
    from mpitp.jobs.readiness import job_specs
    from mpitp.jobs.readiness_model import check_layout
    from mpitp.jobs.readiness_spec import Report

    config = AutoConfig.from_pretrained(str(STORIES))  # Llama, 8 attention heads, 5 layers, no experts
    job = tmp_path / "job.yaml"
    runs = "".join(f"  - {{name: {n}, tp: {tp}, pp: {pp}, ep: {ep}, output: {tmp_path / n}.h5}}\n"
                   for n, tp, pp, ep in (("fits", 2, 1, 1), ("tp3", 3, 1, 1), ("pp6", 1, 6, 1), ("ep2", 2, 1, 2)))
    job.write_text(f"defaults: {{model: {STORIES}, tasks: [arc_easy_local]}}\nruns:\n{runs}")
    found = {}
    for spec in job_specs(job):
        report = Report()
        check_layout(spec, config, report)
        found[spec.label] = [p.what for p in report.problems]
    assert found == {
        "fits": [],
        "tp3": ["tp=3 does not divide the model's 8 attention heads"],
        "pp6": ["pp=6 exceeds the model's 5 decoder layers (each stage needs at least one)"],
        "ep2": ["model type 'llama' has no expert-parallel plan in transformers; run it without --ep (its experts "
                "are then split by --tp)"],
    }, found
    # an ep that is neither 1 nor the run's tp, whatever the model: the job file itself is refused (e51b23a)
    job.write_text(f"defaults: {{model: {STORIES}, tasks: [arc_easy_local]}}\nruns:\n  - {{name: ep4, tp: 2, ep: 4}}\n")
    with pytest.raises(JobFileError, match=r"run 1 \('ep4'\): field 'ep': ep=4: the experts are spread over a TP "
                                           r"group's ranks, so ep must be 1 or tp \(2\)"):
        job_specs(job)


def test_a_ready_model_is_not_checked_again_until_a_folder_it_read_changes(tmp_path, monkeypatch, caplog):
    """The model half of a check (a child importing torch and transformers: 3.5-4 s) is kept as "ready" and skipped
    while every folder it read is unchanged (issue 41: `mpitp check` of a job checked before, 4.0 -> 1.5 s); a
    verdict file others could write is not believed, a changed config is checked again, and a problem is never kept."""
    import shutil

    from support.offline_data import arc_rows, write_jsonl

    monkeypatch.setenv("MPITP_CHECK_CACHE", str(tmp_path / "verdicts"))
    monkeypatch.setenv("MPITP_IMPORT_CACHE", str(tmp_path / "scans"))  # transformers' kept scan (importpolicy)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # two cores: the child starts
    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    write_jsonl(tmp_path / "DATA" / "arc_easy" / "test.jsonl", arc_rows(3, "kept"))
    spec = CheckSpec(tasks=("arc_easy",), data_dir=str(tmp_path / "DATA"), model=str(model), tp=2)

    def run() -> tuple[bool, bool, list[str]]:
        report = check(spec)
        assert report.tasks == ["arc_easy"]
        return report.model_beside, report.model_kept, [p.what for p in report.problems]

    assert run() == (True, False, [])  # checked in the child, kept
    (kept,) = (tmp_path / "verdicts").iterdir()
    assert run() == (False, True, [])  # not checked again
    assert [p.suffix for p in (tmp_path / "scans").iterdir()] == [".json"]  # the child read or kept the scan there
    (tmp_path / "scans" / "another-installation.json").write_text("{}")  # not an input of this check
    assert run() == (False, True, [])
    from mpitp.cli.check import run_checks

    assert run_checks([spec]) == ([], {str(model)}, {})  # and the ready line says so
    kept.chmod(0o664)  # group-writable: anyone in the group could have written "ready"
    with caplog.at_level("WARNING", logger="mpitp"):
        assert run() == (True, False, [])
    assert "model check verdict file" in caplog.text and "writable by its group" in caplog.text, caplog.text
    assert run() == (False, True, [])  # rewritten this user's alone
    written = kept.stat().st_mtime_ns
    (model / "config.json").write_text("{")
    beside, again, problems = run()
    assert (beside, again) == (True, False) and len(problems) == 1, problems
    assert problems[0].startswith(f"model {model}: config not available offline"), problems
    assert kept.stat().st_mtime_ns == written  # the problem was not kept


# ------------------------------------------------------------------------------------------------------- sweeps
# A sweep's --model (a job file's models:) is a glob or a comma list: `mpitp check` took it for one Hub repo id and
# refused every sweep, so `mpitp submit` queued none without --no-check (an outside tester's report).


@pytest.fixture
def sweep(tmp_path, monkeypatch) -> Path:
    """Checkpoints step-1, step-2, step-10 (stories260K's files), a data folder, verdicts kept in ``tmp_path``."""
    import shutil

    from support.offline_data import arc_rows, write_jsonl

    monkeypatch.setenv("MPITP_CHECK_CACHE", str(tmp_path / "verdicts"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # two cores: the child starts
    for step in (1, 2, 10):
        shutil.copytree(STORIES, tmp_path / "ckpts" / f"step-{step}")
    write_jsonl(tmp_path / "DATA" / "arc_easy" / "test.jsonl", arc_rows(3, "sweep"))
    return tmp_path


def check_job(folder: Path, runs: str) -> tuple[int, list[str]]:
    """``mpitp check JOB`` in this process: its exit status and its own lines (not the libraries' progress bars,
    which a test before this one may have turned on)."""
    from mpitp.cli.check import check_command

    job = folder / "job.yaml"
    job.write_text(f"defaults: {{tasks: [arc_easy], data_dir: {folder / 'DATA'}}}\nruns:\n{runs}")
    done = CliRunner().invoke(check_command, [str(job)])
    assert "Traceback" not in done.output, done.output
    said = done.stdout.splitlines() + done.stderr.splitlines()  # the ready line on stdout, problems on stderr
    return done.exit_code, [line for line in said if line.startswith(("mpitp ", "  run "))]


def test_a_sweep_is_checked_checkpoint_by_checkpoint(sweep):
    """A glob and a list are expanded as the sweep expands them; each checkpoint's config, tokenizer and layout are
    checked, so one checkpoint without its files is named alone."""
    ckpts = sweep / "ckpts"
    runs = (f"  - {{name: globbed, models: ['{ckpts}/step-*'], output: 'g/{{name}}.h5'}}\n"
            f"  - {{name: listed, models: [{ckpts}/step-10, {ckpts}/step-2], output: 'l/{{name}}.h5'}}\n")
    status, lines = check_job(sweep, runs)
    assert status == 0 and lines == [  # the first run's check kept both checkpoints of the second as ready
        f"mpitp check: ready offline: arc_easy; model {ckpts}/step-* (3 checkpoints), {ckpts}/step-10,{ckpts}/step-2 "
        "(2 checkpoints; ready kept from an earlier check: every folder it read is unchanged)"], lines
    (ckpts / "step-2" / "config.json").unlink()
    status, lines = check_job(sweep, runs)
    assert status == 2 and len(lines) == 3 and lines[0] == "mpitp check: not ready offline: 2 problem(s)", lines
    for line, run in zip(lines[1:], ("globbed", "listed")):  # step-1 and step-10 are ready: only step-2 is named
        assert line.startswith(f"  run {run}: model {ckpts}/step-2: config not available offline ("), lines
        assert "Repo id" not in line and "step-1" not in line, line


def test_a_sweep_glob_that_matches_nothing_is_refused_as_the_sweep_refuses_it(sweep):
    from mpitp.jobs.sweep import expand_models

    pattern = f"{sweep}/ckpts/none-*"
    status, lines = check_job(sweep, f"  - {{name: none, models: ['{pattern}'], output: 'n/{{name}}.h5'}}\n")
    with pytest.raises(UsageError) as refused:  # the sweep's own line
        expand_models(pattern)
    assert status == 2 and lines[1:] == [f"  run none: {refused.value}"], lines
    assert str(refused.value) == f"--model {pattern}: the pattern matches no directory"


def test_checkpoints_with_the_same_config_and_tokenizer_share_one_check(sweep):
    """Three checkpoints of one architecture are one model check: a layout the model cannot take is said once,
    naming them all; a checkpoint whose config differs is checked on its own."""
    from mpitp.jobs.readiness_spec import Report
    from mpitp.jobs.readiness_sweep import model_groups

    ckpts = sweep / "ckpts"
    spec = CheckSpec(tasks=("arc_easy",), model=f"{ckpts}/step-*", tp=3)
    assert [[m.model for m in g] for g in model_groups(spec, Report())] == [
        [f"{ckpts}/step-1", f"{ckpts}/step-2", f"{ckpts}/step-10"]]
    run = f"  - {{name: tp3, tp: 3, models: ['{ckpts}/step-*'], output: 't/{{name}}.h5'}}\n"
    status, lines = check_job(sweep, run)
    assert status == 2 and lines[1:] == [
        f"  run tp3: model {ckpts}/step-1: tp=3 does not divide the model's 8 attention heads (the same for "
        f"{ckpts}/step-2, {ckpts}/step-10: the same config and tokenizer files)"], lines
    config = json.loads((ckpts / "step-10" / "config.json").read_text())
    (ckpts / "step-10" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 6}))
    assert [[m.model for m in g] for g in model_groups(spec, Report())] == [
        [f"{ckpts}/step-1", f"{ckpts}/step-2"], [f"{ckpts}/step-10"]]


def test_a_ready_verdict_is_kept_for_every_checkpoint_that_shared_it(sweep):
    """The checkpoints checked as one are each kept as ready: a later check of any of them is not done again."""
    ckpts = sweep / "ckpts"
    spec = CheckSpec(tasks=("arc_easy",), data_dir=str(sweep / "DATA"), model=f"{ckpts}/step-*")
    report = check(spec)
    assert report.ready and report.model_beside and report.swept == 3, [p.line() for p in report.problems]
    for step in ("step-10", "step-2"):  # never checked by itself
        again = check(CheckSpec(tasks=("arc_easy",), data_dir=str(sweep / "DATA"), model=f"{ckpts}/{step}"))
        assert again.ready and again.model_kept and not again.model_beside
    assert check(spec).model_kept


def test_an_adapter_sweep_checks_the_base_once_and_each_adapter(sweep):
    def adapter(name: str, kind: str = "LORA") -> Path:
        folder = sweep / "adapters" / name
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": kind, "r": 2, "lora_alpha": 4}))
        (folder / "adapter_model.safetensors").write_bytes(b"")
        return folder

    adapter("step-1"), adapter("step-2")
    run = f"  - {{name: ad, model: {STORIES}, peft: ['{sweep}/adapters/step-*'], output: 'a/{{name}}.h5'}}\n"
    assert check_job(sweep, run) == (0, [f"mpitp check: ready offline: arc_easy; model {STORIES} (2 adapters)"])
    bad = adapter("step-3", "IA3")
    status, lines = check_job(sweep, run)
    assert status == 2 and lines[1:] == [
        f"  run ad: --model_args peft={bad}: peft_type IA3 is not supported (LoRA adapters only)"], lines


@pytest.mark.mpi  # submit starts `python -m mpitp check`
def test_submit_queues_a_sweep_that_is_ready_and_refuses_one_that_matches_nothing(sweep, monkeypatch):
    from mpitp.cli.submit import submit_command

    fake_sbatch(sweep, monkeypatch)
    job = sweep / "job.yaml"
    args = [str(job), "--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "2", "--time", "00:10:00"]
    for pattern, queued in (("step-*", True), ("none-*", False)):
        (sweep / "queued").unlink(missing_ok=True)
        job.write_text(f"defaults: {{tasks: [arc_easy], data_dir: {sweep / 'DATA'}}}\nruns:\n"
                       f"  - {{name: sw, models: ['ckpts/{pattern}'], output: 'r/{{name}}.h5'}}\n")
        done = CliRunner().invoke(submit_command, args)
        assert (done.exit_code == 0) is queued and (sweep / "queued").exists() is queued, done.output
    assert f"run sw: --model {sweep}/ckpts/none-*: the pattern matches no directory" in done.output
    assert "nothing queued (mpitp submit --no-check queues it anyway)" in done.output


def test_a_json_out_that_cannot_be_written_is_refused_before_the_checks(tmp_path, monkeypatch):
    """``--json-out`` in a missing folder was a FileNotFoundError traceback (exit 1) after every check ran."""
    from mpitp.cli import check as check_cli

    monkeypatch.setattr(check_cli, "run_checks", lambda specs: pytest.fail("checked before the path was"))
    out = tmp_path / "no" / "check.json"
    res = CliRunner().invoke(check_cli.check_command, ["--tasks", "arc_easy", "--json-out", str(out)])
    assert res.exit_code == 2, res.output
    assert f"--json-out {out}: no such directory" in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit), res.output


def test_a_job_of_demo_runs_is_ready_and_says_why(tmp_path):
    """``mpitp check jobs/demo.yaml`` said "ready offline: no tasks": its runs are the built-in demo, left out of the
    check on purpose (their model and tasks ship with mpitp), which the line did not say."""
    from mpitp.cli.check import check_command
    from support import REPO

    res = CliRunner().invoke(check_command, [str(REPO / "jobs" / "demo.yaml")])
    line = "mpitp check: ready offline: every run is the built-in demo (its model and tasks ship with mpitp)"
    assert (res.exit_code, res.output.strip()) == (0, line), res.output
