"""Checkpoint sweeps and watch mode under a real ``mpiexec``.

Checkpoints are made from ../shared: ``step-1`` is stories260K with perturbed weights, ``step-2`` a tiny random Llama
with the GPT-2 tokenizer (another tokenizer: its own tokenisation), ``step-3`` stories260K perturbed otherwise (the
tokenizer of step-1: its token ids come from the sweep's cache), ``step-10`` stories260K with a truncated safetensors
file (fails to load). Natural order puts step-10 last.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from mpitp.results.rows import read_metrics, read_requests
from support import OFFLINE_ENV
from support.mpi import explain, mpiexec_path, run_mpi

TASKS = "mpitp_demo_mc,mpitp_demo_ppl"


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
    return dst


def perturbed_stories(shared: Path, dst: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    _copy_dir(shared / "models" / "stories260K", dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        t.add_(torch.randn(t.shape, generator=g) * 0.01 * t.float().std())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def gpt2_tiny_llama(shared: Path, dst: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=50257, max_position_embeddings=512, bos_token_id=50256,
                      eos_token_id=50256)
    LlamaForCausalLM(cfg).save_pretrained(dst)
    for f in (shared / "tokenizers" / "gpt2").iterdir():
        if f.name not in ("config.json", "SOURCE.txt"):
            shutil.copyfile(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_dir):
    from mpitp.tasks.demo import demo_tasks_dir

    d = tmp_path_factory.mktemp("sweep")
    ck = d / "ckpts"
    perturbed_stories(shared_dir, ck / "step-1", 0)
    gpt2_tiny_llama(shared_dir, ck / "step-2")
    perturbed_stories(shared_dir, ck / "step-3", 3)
    broken = _copy_dir(shared_dir / "models" / "stories260K", ck / "step-10")
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(4000)
    return dict(dir=d, ckpts=ck, tasks=demo_tasks_dir())


@pytest.mark.slow
@pytest.mark.mpi
def test_sweep_over_checkpoints_with_two_tokenizers_and_a_broken_one(setup):
    d, ck = setup["dir"], setup["ckpts"]
    out = d / "out"
    common = ["--include-path", setup["tasks"], "--tasks", TASKS, "--limit", "4"]
    proc = run_mpi(2, ["eval", "--model", f"{ck}/step-*", *common, "--output", f"{out}/"], timeout=900, cwd=str(d))
    assert proc.returncode == 1, explain(proc)  # one checkpoint failed: the sweep says so, after finishing the rest
    assert "sweep: 3/4 checkpoints ok" in proc.stdout, explain(proc)
    summary = json.loads((out / "sweep-summary.json").read_text())
    rows = summary["checkpoints"]
    assert [r["name"] for r in rows] == ["step-1", "step-2", "step-3", "step-10"]  # natural order
    assert [r["status"] for r in rows] == ["complete", "complete", "complete", "failed"]
    assert "SafetensorError" in rows[3]["error"] and not (out / "step-10.h5").exists()
    for name in ("step-1", "step-2", "step-3"):
        assert f"{ck}/{name}: model released before the next checkpoint" in proc.stderr, explain(proc)
    assert "still referenced" not in proc.stderr
    assert f"{ck}/step-2: tokenizer: tokenised afresh" in proc.stderr  # GPT-2's: nothing to reuse
    assert f"{ck}/step-3: tokenizer: " in proc.stderr and " token encodings reused from earlier" in proc.stderr

    with h5py.File(out / "step-1.h5") as f1, h5py.File(out / "step-2.h5") as f2:
        assert f1.attrs["status"] == f2.attrs["status"] == "complete"
        assert f2.attrs["tokenizer"].endswith("step-2") and f1.attrs["tokenizer"].endswith("step-1")
    r1 = read_requests(str(out / "step-1.h5"), "mpitp_demo_ppl")
    r2 = read_requests(str(out / "step-2.h5"), "mpitp_demo_ppl")
    assert list(r1["args_hash"]) == list(r2["args_hash"])  # the same requests ...
    assert list(r1["n_tokens"]) != list(r2["n_tokens"])  # ... tokenised by each checkpoint's own tokenizer
    comps = summary["comparisons"]
    assert comps and {(c["a"], c["b"]) for c in comps} == {("step-1", "step-2"), ("step-2", "step-3")}
    assert any(c["metric"] == "acc,none" and c["test"].startswith("McNemar") for c in comps)

    # step-3 (loaded tasks and token ids reused from step-1) equals a separate launch, whose {name} pattern names its
    # file as a sweep of one would (it was written as the literal "{name}.h5")
    sep = d / "separate" / "step-3.h5"
    proc = run_mpi(2, ["eval", "--model", str(ck / "step-3"), *common, "--output", f"{d}/separate/{{name}}.h5"],
                   timeout=600, cwd=str(d))
    assert proc.returncode == 0 and sep.exists(), explain(proc)
    for task in TASKS.split(","):
        assert read_metrics(str(sep), task) == read_metrics(str(out / "step-3.h5"), task)
        a, b = read_requests(str(sep), task), read_requests(str(out / "step-3.h5"), task)
        assert list(a["args_hash"]) == list(b["args_hash"])
        assert list(a["loglikelihood"]) == list(b["loglikelihood"])
        assert list(a["n_tokens"]) == list(b["n_tokens"])

    # rerun with --resume: both complete files are skipped without loading, the broken one fails again
    proc = run_mpi(2, ["eval", "--model", f"{ck}/step-1,{ck}/step-2", *common, "--output", f"{out}/", "--resume"],
                   timeout=600, cwd=str(d))
    assert proc.returncode == 0, explain(proc)
    rows = json.loads((out / "sweep-summary.json").read_text())["checkpoints"]
    assert [r["status"] for r in rows] == ["skipped (complete)"] * 2

    # rerun without --resume, or resumed with another limit: one line before any checkpoint, the summary kept (each
    # checkpoint failed on its own, and the summary was rewritten with every row failed and no metrics)
    kept = (out / "sweep-summary.json").read_bytes()
    for extra, line in (([], f"mpitp: error: output {out}/step-1.h5 already exists (2 of the sweep's 2 files do): "
                             "pass --resume to continue the sweep (complete files are skipped) or --overwrite to "
                             "replace them"),
                        (["--resume", "--limit", "5"], f"mpitp: error: cannot resume {out}/step-1.h5: different "
                                                       "settings: limit 4 in the file, 5 now")):
        proc = run_mpi(2, ["eval", "--model", f"{ck}/step-1,{ck}/step-2", *common, "--output", f"{out}/", *extra],
                       timeout=600, cwd=str(d))
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line, explain(proc)
        assert (out / "sweep-summary.json").read_bytes() == kept


@pytest.mark.mpi
def test_sweep_bad_output_is_one_line(setup):
    proc = run_mpi(2, ["eval", "--model", f"{setup['ckpts']}/step-*", "--tasks", "mpitp_demo_mc", "--include-path",
                       setup["tasks"], "--output", "one.h5"], timeout=120, cwd=str(setup["dir"]))
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines()[-1] == (
        "mpitp: error: --output one.h5: a sweep writes one file per checkpoint: give a directory or a pattern with "
        "{name} (e.g. results/{name}.h5)")
    proc = run_mpi(2, ["eval", "--model", f"{setup['ckpts']}/nothing-*", "--tasks", "mpitp_demo_mc"], timeout=120,
                   cwd=str(setup["dir"]))
    assert proc.returncode == 2 and "matches no directory" in proc.stderr.strip().splitlines()[-1], explain(proc)


def _wait_for(pred, timeout: float, proc=None) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return pred()
        time.sleep(0.5)
    return False


def _complete(path: Path) -> bool:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("status") == "complete"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.mpi
def test_watch_picks_up_a_checkpoint_written_during_the_run(setup, shared_dir):
    d = setup["dir"]
    watched = d / "watched"
    watched.mkdir()
    perturbed_stories(shared_dir, watched / "a", 1)
    out = d / "watch-out"
    args = [mpiexec_path(), "-n", "1", sys.executable, "-m", "mpitp", "eval", "--watch", str(watched),
            "--watch-idle", "12", "--include-path", setup["tasks"], "--tasks", "mpitp_demo_mc", "--limit", "3",
            "--output", f"{out}/{{name}}.h5"]
    env = {**os.environ, **OFFLINE_ENV}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(d))
    try:
        assert _wait_for(lambda: _complete(out / "a.h5"), 400, proc), proc.communicate(timeout=5)
        # a training job writes step b: weights first, in two parts with a pause, config.json last
        src = shared_dir / "models" / "stories260K"
        b = watched / "b"
        b.mkdir()
        data = (src / "model.safetensors").read_bytes()
        with open(b / "model.safetensors", "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            time.sleep(3)
            f.write(data[len(data) // 2:])
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                     "config.json"):
            shutil.copyfile(src / name, b / name)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    rows = json.loads((out / "sweep-summary.json").read_text())["checkpoints"]
    assert [(r["name"], r["status"]) for r in rows] == [("a", "complete"), ("b", "complete")]
    with h5py.File(out / "b.h5") as f:  # evaluated from the finished files: its fingerprint is the final one
        from mpitp.evaluation.fingerprint import detail

        stored = json.loads(f.attrs["fingerprint_json"])
        assert {k: stored[k] for k in ("model_files", "tokenizer_files")} == detail(str(b))

    # a restarted watch skips what is done
    again = [a if a != "12" else "3" for a in args[args.index("eval"):]]  # --watch-idle 3
    proc = run_mpi(1, again, timeout=300, cwd=str(d))
    assert proc.returncode == 0, explain(proc)
    rows = json.loads((out / "sweep-summary.json").read_text())["checkpoints"]
    assert [(r["name"], r["status"]) for r in rows] == [("a", "skipped (complete)"), ("b", "skipped (complete)")]


def test_job_file_models_field(tmp_path):
    from mpitp.jobs.jobfile import JobFileError, load_job

    job = tmp_path / "job.yaml"
    job.write_text("runs:\n  - name: curve\n    models: ['ckpts/step-*', ./final]\n    tasks: [mpitp_demo_mc]\n")
    (tmp_path / "final").mkdir()
    spec = load_job(job).runs[0]
    assert spec.model == f"{tmp_path}/ckpts/step-*,{tmp_path}/final"  # resolved against the job file's folder
    assert spec.output == f"{tmp_path}/results/curve/{{name}}.h5"
    job.write_text("runs:\n  - models: a,b\n    model: c\n    tasks: [t]\n")
    with pytest.raises(JobFileError, match="give either 'model' or 'models', not both"):
        load_job(job)
    job.write_text("defaults:\n  model: demo\n  models: [a, b]\n  tasks: [t]\nruns:\n  - name: x\n")
    with pytest.raises(JobFileError, match="give either 'model' or 'models', not both"):
        load_job(job)
    # a run's own models replace a default model (refused as "both" before), and a run's model default models
    job.write_text("defaults:\n  model: demo\n  tasks: [t]\nruns:\n  - name: one\n  - name: s\n    models: [a, b]\n"
                   "  - name: s2\n    model: null\n    models: [c]\n")
    assert [r.model for r in load_job(job).runs] == ["demo", "a,b", "c"]  # no such folders: hub names
    job.write_text("defaults:\n  models: [a, b]\n  tasks: [t]\nruns:\n  - name: s\n  - name: one\n    model: demo\n")
    assert [(r.model, r.output) for r in load_job(job).runs] == [
        ("a,b", f"{tmp_path}/results/s/{{name}}.h5"), ("demo", f"{tmp_path}/results/one.h5")]
    job.write_text("runs:\n  - name: s\n    models: [a, b]\n    tasks: [t]\n    output: one.h5\n")
    with pytest.raises(JobFileError, match=r"field 'output': a sweep \('models'\) writes one file per checkpoint"):
        load_job(job)


def test_inspect_sweep_summary_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from click.testing import CliRunner

    from mpitp.cli.inspect import inspect_command
    from mpitp.results.sweepsummary import Row, plot_summary, write_summary

    rows = [Row(f"ck/step-{i}", f"step-{i}", str(tmp_path / f"step-{i}.h5"), "complete", wall_s=1.0,
                metrics={"t": {"acc,none": 0.5 + 0.1 * i, "acc_stderr,none": 0.05, "sample_len": 10}})
            for i in (1, 2, 3)] + [Row("ck/bad", "bad", str(tmp_path / "bad.h5"), "failed", error="boom")]
    path = tmp_path / "sweep-summary.json"
    write_summary(str(path), rows, 3.0)
    r = CliRunner().invoke(inspect_command, [str(path), "--plot", str(tmp_path / "s.png")], prog_name="mpitp inspect")
    assert r.exit_code == 0, r.output
    assert "sweep: 3/4 checkpoints ok" in r.output and "bad: boom" in r.output
    assert (tmp_path / "s.png").stat().st_size > 1000

    class Recording:  # the real drawing above; here what was drawn
        def __init__(self, **kw):
            from matplotlib.figure import Figure

            self.fig = Figure(**kw)
            self.calls = []

        def subplots(self, *a, **kw):
            axes = self.fig.subplots(*a, **kw)
            for ax in axes.ravel():
                ax.errorbar = self._recorded(ax.errorbar)
            return axes

        def _recorded(self, errorbar):
            def call(x, y, yerr=None, **kw):
                self.calls.append((x, y, yerr))
                return errorbar(x, y, yerr=yerr, **kw)

            return call

        def __getattr__(self, name):
            return getattr(self.fig, name)

    made = []
    assert plot_summary(str(path), str(tmp_path / "t.png"), lambda **kw: made.append(Recording(**kw)) or made[-1]) == 1
    (xs, ys, errs), = made[0].calls
    assert xs == [0, 1, 2] and ys == pytest.approx([0.6, 0.7, 0.8]) and errs == [0.05] * 3


def test_two_sweeps_in_one_folder_keep_a_summary_each(tmp_path):
    """Patterns with more than the name (``{name}-arc.h5``, ``{name}-piqa.h5``) get a summary each, and the report
    of the folder finds both: the second sweep's summary replaced the first's."""
    from mpitp.results.report import expand
    from mpitp.results.sweepsummary import Row, summary_path

    def rows(pattern: str) -> list[Row]:
        return [Row(f"ck/{n}", n, str(tmp_path / pattern.format(name=n)), "complete") for n in ("step-1", "step-2")]

    paths = {tag: summary_path(rows(f"{{name}}-{tag}.h5")) for tag in ("arc", "piqa")}
    assert paths == {tag: str(tmp_path / f"sweep-summary-{tag}.json") for tag in ("arc", "piqa")}
    assert summary_path(rows("{name}.h5")) == str(tmp_path / "sweep-summary.json")
    for p in paths.values():
        open(p, "w").write("{}")
    (tmp_path / "step-1-arc.h5").write_bytes(b"")
    files, summaries = expand([str(tmp_path)])
    assert files == [str(tmp_path / "step-1-arc.h5")] and summaries == sorted(paths.values())


def test_checkpoints_whose_names_clean_to_one_get_a_file_each():
    """``ck/s+1`` and ``ck/s_1`` were both named ``s_1``: the second wrote ``s_1.h5`` again (with ``--overwrite``
    replacing the first's results, the summary listing both as complete in one file; without, failing as existing)."""
    from mpitp.jobs.sweep import checkpoint_names

    for models in (["ck/s+1", "ck/s_1"], ["a/s+1", "b/s_1"], ["m", "m_2", "m+2", "m 2"]):
        names = checkpoint_names(models)
        assert len(set(names)) == len(names), (models, names)
    assert checkpoint_names(["ck/step-1", "ck/step-2", "ck/step-10"]) == ["step-1", "step-2", "step-10"]
    assert checkpoint_names(["a/s+1", "b/s_1"]) == ["a-s_1", "b-s_1"]
    assert checkpoint_names(["a/x", "b/x"]) == ["a-x", "b-x"]


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["watch", "glob"])
def test_a_checkpoint_folder_named_with_control_characters_is_shown_escaped(how, tmp_path, shared_dir):
    """A training job's folder ``s<ESC>]0;PWN<BEL><newline>x``: its name went raw to the terminal (retitling it, and
    a newline that starts a line of its choosing) in five log lines, and a watch put it in the results file's name.
    A watch and a sweep of the folder name its file alike (the watch's was ``s_]0;PWN__x.h5``: a sweep --resume over
    a watched folder found none of its files)."""
    from mpitp.tasks.demo import demo_tasks_dir

    name = "s\x1b]0;PWN\x07\nx"
    _copy_dir(shared_dir / "models" / "stories260K", tmp_path / "ck" / name)
    source = ["--watch", "ck", "--watch-idle", "2"] if how == "watch" else ["--model", "ck/*"]
    proc = run_mpi(1, ["eval", *source, "--include-path", demo_tasks_dir(), "--tasks", "mpitp_demo_mc", "--limit",
                       "2", "--output", "out/{name}.h5"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    assert "\x1b" not in proc.stdout + proc.stderr and "\x07" not in proc.stdout + proc.stderr, explain(proc)
    assert "=== checkpoint 1/1: ck/s\\x1b]0;PWN\\x07\\nx -> out/" in proc.stderr, explain(proc)
    [h5] = [f for f in os.listdir(tmp_path / "out") if f.endswith(".h5")]
    assert h5 == "s_0_PWN_x.h5", h5


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["a-file", "a-dangling-link"])
def test_a_sweep_whose_outputs_cannot_be_written_is_one_line_before_the_first_checkpoint(where, tmp_path, shared_dir):
    """``--output 'notes.txt/{name}.h5'``: every checkpoint failed in turn, then writing the summary raised
    FileExistsError: a traceback and MPI_Abort (exit 1)."""
    from mpitp.tasks.demo import demo_tasks_dir

    for step in ("step-1", "step-2"):
        _copy_dir(shared_dir / "models" / "stories260K", tmp_path / "ck" / step)
    bad = tmp_path / "notes"
    if where == "a-file":
        bad.write_text("notes\n")
    else:
        bad.symlink_to(tmp_path / "nowhere")
    proc = run_mpi(2, ["eval", "--model", "ck/*", "--include-path", demo_tasks_dir(), "--tasks", "mpitp_demo_mc",
                       "--limit", "2", "--output", "notes/{name}.h5"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr and "=== checkpoint" not in proc.stderr, explain(proc)
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"mpitp: error: cannot write output notes/step-1.h5: {bad} is not a directory"), explain(proc)


@pytest.mark.mpi
def test_a_watch_whose_outputs_cannot_be_written_is_one_line_before_it_watches(tmp_path):
    """``--watch DIR --output 'notes/{name}.h5'`` with ``notes`` a file: the checkpoints failed, then the summary's
    makedirs raised FileExistsError at the end of the watch: a traceback and MPI_Abort (exit 1)."""
    from mpitp.tasks.demo import demo_tasks_dir

    (tmp_path / "watched").mkdir()
    (tmp_path / "notes").write_text("notes\n")
    proc = run_mpi(2, ["eval", "--watch", "watched", "--watch-idle", "1", "--include-path", demo_tasks_dir(),
                       "--tasks", "mpitp_demo_mc", "--output", "notes/{name}.h5"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.strip().splitlines()[-1] == (f"mpitp: error: cannot write output notes/{{name}}.h5: "
                                                    f"{tmp_path / 'notes'} is not a directory"), explain(proc)


def test_a_checkpoint_folder_named_like_a_pattern_is_that_folder(tmp_path, monkeypatch):
    """The probe (session 29): ``--model mods/m[1]`` with that folder present was read as the glob matching
    ``mods/m1`` (a sweep of the wrong checkpoint) or "the pattern matches no directory". A name that is an existing
    folder is that folder, in ``--model``, a comma list and a job file's ``models:``; a pattern is still a pattern."""
    from mpitp.jobs.jobfile import load_job
    from mpitp.jobs.sweep import expand_models, is_sweep

    monkeypatch.chdir(tmp_path)
    for name in ("m[1]", "m1", "m2"):
        (tmp_path / "mods" / name).mkdir(parents=True)
    assert not is_sweep("mods/m[1]") and is_sweep("mods/m[12]") and is_sweep("mods/m[1],mods/m2")
    assert expand_models("mods/m[1],mods/m2") == ["mods/m[1]", "mods/m2"]
    assert expand_models("mods/m[12]") == ["mods/m1", "mods/m2"]
    job = tmp_path / "job.yaml"
    job.write_text("runs:\n  - {models: ['mods/m[1]', 'mods/m2'], tasks: arc_easy, output: 'r/{name}.h5'}\n"
                   "  - {model: 'mods/m[1]', tasks: arc_easy}\n")
    sweep, single = load_job(job).runs
    assert sweep.model == f"{tmp_path}/mods/m[1],{tmp_path}/mods/m2" and not is_sweep(single.model), single.model


def test_a_glob_match_another_user_planted_is_skipped(tmp_path, monkeypatch, caplog):
    """``--model 'ckpts/step-*'`` over a folder others may write: a ``step-99`` that uid 4242 made was swept as a
    checkpoint of the run (and with --trust_remote_code its own Python ran as this user). Now a match made by
    another user than this one, root or the folder's owner is skipped with one warning; a name given outright is
    not a match and stays."""
    from mpitp.jobs.sweep import expand_models

    monkeypatch.chdir(tmp_path)
    for name in ("step-1", "step-2", "step-99"):
        (tmp_path / "ckpts" / name).mkdir(parents=True)
    real = os.lstat

    def lstat(path, *args, **kwargs):  # step-99 as another user made it (no chown needed to run as anyone)
        st = real(path, *args, **kwargs)
        return os.stat_result((*st[:4], 4242, *st[5:])) if os.fspath(path).endswith("step-99") else st

    monkeypatch.setattr(os, "lstat", lstat)
    with caplog.at_level("WARNING", logger="mpitp"):
        assert expand_models("ckpts/step-*") == ["ckpts/step-1", "ckpts/step-2"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("--model ckpts/step-*: skipped ckpts/step-99: made by uid 4242"), said
    assert expand_models("ckpts/step-1,ckpts/step-99") == ["ckpts/step-1", "ckpts/step-99"]


def test_a_checkpoints_phases_hold_its_checks_and_load(monkeypatch):
    """A sweep's file lists rank 0's checks and load seconds, as a single run's does: before, its phases left them
    out while its wall time held them (17.0 s wall, phases 0.8 s, for the first checkpoint of a sweep)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import mpitp.parallel.runtime as runtime
    from mpitp.jobs import sweep

    seen = {}

    class _Model:  # weakly referenceable, as a model is
        pass

    def slow(seconds, value):
        time.sleep(seconds)
        return value

    monkeypatch.setattr(sweep, "check_item", lambda *a: slow(0.2, nullcontext()))
    monkeypatch.setattr(sweep, "_load_everywhere", lambda *a: slow(0.3, _Model()))
    monkeypatch.setattr(runtime, "barrier_after_load", lambda rt: None)
    monkeypatch.setattr(sweep, "start_prefetch", lambda *a: None)
    monkeypatch.setattr(sweep, "evaluate_item", lambda *a, phases=None, **kw: seen.update(phases or {}))
    cfg = SimpleNamespace(model="ckpts/step-1")
    rt = SimpleNamespace(world=SimpleNamespace(rank=0, local_rank=0), device="cpu")
    sweep.run_checkpoint(cfg, rt, sweep.SweepState())
    assert 0.2 <= seen["checks"] < 0.3 + 1, seen
    assert 0.3 <= seen["load"] < 0.3 + 1, seen


def test_each_item_of_a_sweep_names_itself_in_lm_evals_task_metadata():
    """``--model_args pretrained='ck/step-[12]'``: lm-eval merges model_args into every task's metadata, and each
    checkpoint's results JSON (and the HDF5 file's) said ``metadata.pretrained: 'ck/step-[12]'`` where ``lm_eval`` on
    that checkpoint says ``ck/step-1`` (the tasks, loaded once for the sweep, kept the first item's otherwise). A
    ``--metadata pretrained=...`` of the user's own is left as given."""
    from mpitp.evaluation.outputs import as_lm_eval_ran
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.jobs.sweep import item_config

    cfg = EvalConfig(model="ck/step-[12]", tasks=["t"], model_args={"pretrained": "ck/step-[12]", "dtype": "float32"},
                     metadata={"pretrained": "ck/step-[12]", "dtype": "float32"})
    first, second = (item_config(cfg, "model", f"ck/step-{i}", f"o{i}.h5") for i in (1, 2))
    assert first.metadata == {"pretrained": "ck/step-1", "dtype": "float32"}
    assert cfg.metadata["pretrained"] == "ck/step-[12]"  # the sweep's own settings unchanged
    res = {"configs": {"t": {"metadata": {"version": 1.0, "pretrained": "ck/step-1", "dtype": "float32"}}}}
    as_lm_eval_ran(res, second, num_parameters=None, device="cpu", loggers=None)
    assert res["configs"]["t"]["metadata"] == {"version": 1.0, "pretrained": "ck/step-2", "dtype": "float32"}
    peft = EvalConfig(model="base", peft="ad/*", tasks=["t"], model_args={"pretrained": "base", "peft": "ad/*"},
                      metadata={"pretrained": "base", "peft": "ad/*"})
    assert item_config(peft, "peft", "ad/a1", "o.h5").metadata == {"pretrained": "base", "peft": "ad/a1"}
    own = EvalConfig(model="ck/*", tasks=["t"], model_args={"pretrained": "ck/*"}, metadata={"pretrained": "mine"})
    assert item_config(own, "model", "ck/a", "o.h5").metadata == {"pretrained": "mine"}


def test_resume_of_a_sweep_without_output_is_refused(tmp_path, monkeypatch):
    """``mpitp eval --model 'ck/step-*' --resume`` without ``--output``: each launch named a new folder
    (results/sweep-<time>/), so the resume evaluated every checkpoint again into it, exit 0. One line now; with
    ``--output`` the resume goes on as before."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.jobs.sweep import _refuse_existing, default_sweep_dir, output_for

    monkeypatch.chdir(tmp_path)
    cfg = EvalConfig(model="ck/step-*", tasks=["t"], resume=True)
    outputs = [output_for(None, n, default_sweep_dir()) for n in ("step-1", "step-2")]
    with pytest.raises(UsageError, match=r"--resume: a sweep without --output writes into a new folder each launch "
                                         r"\(results/sweep-\d{8}-\d{6}\): give the --output"):
        _refuse_existing(cfg, "model", ["ck/step-1", "ck/step-2"], outputs)
    assert not (tmp_path / "results").exists()
    cfg.output = "out/{name}.h5"
    _refuse_existing(cfg, "model", ["ck/step-1", "ck/step-2"], ["out/step-1.h5", "out/step-2.h5"])


def test_inspect_sweep_summary_refuses_what_it_cannot_answer(tmp_path):
    """A sweep summary with --json, --csv or --requests printed the summary table, exit 0, the mode ignored; with
    --task nope the table came first and the error after it (and only under --plot). Now one line, exit 2, and no
    table."""
    from click.testing import CliRunner

    from mpitp.cli.inspect import inspect_command
    from mpitp.results.sweepsummary import Row, write_summary

    rows = [Row(f"ck/step-{i}", f"step-{i}", str(tmp_path / f"step-{i}.h5"), "complete", wall_s=1.0,
                metrics={"t": {"acc,none": 0.5, "acc_stderr,none": 0.05}}) for i in (1, 2)]
    path = str(tmp_path / "sweep-summary.json")
    write_summary(path, rows, 2.0)
    for args, line in (
            (["--json"], "--json reads a results file (.h5), not a sweep summary (which takes --task and --plot); "
                         "inspect one checkpoint's file"),
            (["--task", "t", "--requests"], "--requests reads a results file (.h5), not a sweep summary"),
            (["--task", "nope"], f"{path} has no task 'nope' (tasks: t)")):
        r = CliRunner().invoke(inspect_command, [path, *args], prog_name="mpitp inspect")
        assert r.exit_code == 2 and r.stdout == "", (args, r.output)
        assert r.stderr.startswith(f"mpitp: error: {line}") and r.stderr.count("\n") == 1, (args, r.stderr)
