"""Per-document scores, paired statistics in ``inspect diff``, ``mpitp rescore`` and the weights fingerprint on resume.

One real ``mpiexec -n 2 mpitp eval`` of the demo model on a copy of the demo tasks (no --log-samples: the per-document
scores must be in the file anyway) feeds every test here; the task YAMLs of the copy are then edited to drive
rescoring. The fingerprint test evaluates a copy of ../shared/models/stories260K and rewrites its weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from mpitp.cli.inspect import inspect_command
from mpitp.results.rows import read_metrics
from support import OFFLINE_ENV, REPO
from support.mpi import explain, run_mpi

pytestmark = pytest.mark.mpi  # every test here launches mpiexec

TASKS = ("mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen")


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    from mpitp.tasks.demo import prepare_demo

    model_dir, tasks_dir, _ = prepare_demo()
    d = tmp_path_factory.mktemp("rescore")
    tasks = d / "tasks"
    shutil.copytree(tasks_dir, tasks, ignore=shutil.ignore_patterns("__pycache__"))
    out = d / "run.h5"
    proc = run_mpi(2, ["eval", "--model", model_dir, "--include-path", str(tasks), "--tasks", ",".join(TASKS),
                       "--limit", "10", "--output", str(out)], timeout=600, cwd=str(d))
    assert proc.returncode == 0 and out.exists(), explain(proc)
    os.chmod(out, 0o444)
    return dict(dir=d, tasks=tasks, out=str(out), model=model_dir)


def mpitp(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mpitp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO)})


# ---------------------------------------------------------------------------------------- per-document scores


def test_doc_scores_stored_without_log_samples_and_aggregate_to_the_metrics(demo_run):
    from mpitp.results import stats
    from mpitp.results.docscores import read

    with h5py.File(demo_run["out"]) as f:
        assert "samples" not in f["tasks/mpitp_demo_mc"]
    for task in TASKS:
        ds = read(demo_run["out"], task)
        metrics = read_metrics(demo_run["out"], task)
        assert ds is not None and list(ds.doc_id) == list(range(10))
        for key, col in ds.values.items():
            agg = stats.AGGREGATES[ds.aggregation[key]]
            assert agg(col) == pytest.approx(metrics[key], rel=1e-12), key  # lm-eval's own aggregate
    assert read(demo_run["out"], "mpitp_demo_mc").higher_is_better["acc,none"] is True
    assert read(demo_run["out"], "mpitp_demo_ppl").values["bits_per_byte,none"].shape == (10, 2)


def test_diff_paired_statistics(demo_run, tmp_path):
    a = demo_run["out"]
    b = str(tmp_path / "b.h5")
    shutil.copyfile(a, b)
    os.chmod(b, 0o644)
    with h5py.File(b, "r+") as f:  # B gets 3 more documents right, 1 fewer: McNemar on 3 vs 1 discordant
        col = f["tasks/mpitp_demo_mc/doc_scores/acc,none"]
        x = col[()]
        wrong, right = np.flatnonzero(x == 0), np.flatnonzero(x == 1)
        assert len(wrong) >= 3 and len(right) >= 1
        x[wrong[:3]] = 1
        x[right[:1]] = 0
        col[...] = x
    r = CliRunner().invoke(inspect_command, ["diff", a, b, "--bootstrap-iters", "2000"], prog_name="mpitp inspect")
    assert r.exit_code == 0, r.output  # the requests are the same: statistics do not change the exit status
    row = [line.split() for line in r.output.splitlines() if line.startswith("mpitp_demo_mc ") and " acc " in line
           and "/" in line][0]
    assert row[5] == "+0.2000"  # (3 - 1) / 10
    assert "0.625 (exact, 1/3)" in " ".join(row)  # 2 * P(X <= 1 | n = 4) = 2 * 5/16
    assert ("mpitp_demo_mc acc: B is better than A by +0.2, but not significantly (p = 0.625" in r.output
            and "[McNemar, exact binomial; n=10]" in r.output)
    same = [line for line in r.output.splitlines() if line.startswith("  mpitp_demo_ppl bits_per_byte")]
    assert same == ["  mpitp_demo_ppl bits_per_byte: no difference [paired bootstrap; n=10]"]


# ------------------------------------------------------------------------------------------------- rescore


def test_rescore_equals_original_metrics(demo_run, tmp_path):
    out = tmp_path / "rescored.h5"
    proc = mpitp("rescore", demo_run["out"], "--output", out, cwd=tmp_path)  # the run's task folder, not given
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        f"pass --include-path {demo_run['tasks']} (or other folders)"), explain(proc)
    proc = mpitp("rescore", demo_run["out"], "--include-path", demo_run["tasks"], "--output", out, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "metrics: identical to the stored ones" in proc.stdout
    with h5py.File(demo_run["out"]) as f:
        rows = sum(f[f"tasks/{t}/requests/doc_id"].shape[0] for t in TASKS)
    assert f"rescored from {rows} stored request results ({rows} rows in the file), no model loaded" in proc.stdout
    for task in TASKS:
        assert read_metrics(str(out), task) == read_metrics(demo_run["out"], task)
    with h5py.File(out) as f, h5py.File(demo_run["out"]) as g:
        assert json.loads(f.attrs["results_json"])["results"] == json.loads(g.attrs["results_json"])["results"]
        assert f.attrs["rescored_from"] == os.path.abspath(demo_run["out"])


def test_rescore_from_a_job_folder_runs_none_of_its_files(demo_run, tmp_path):
    """lm-eval's environment record (torch's ``collect_env``: ``python -mpip list``) ran in the working directory
    during a rescore, so a planted pip.py ran as the user (found in session 15: RAN-pip); now it is computed in an
    isolated child, as ``mpitp eval``'s is."""
    (tmp_path / "pip.py").write_text(f"open({str(tmp_path / 'RAN-pip')!r}, 'w').close()\n")
    proc = mpitp("rescore", demo_run["out"], "--include-path", demo_run["tasks"], "--output", tmp_path / "r.h5",
                 cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert not (tmp_path / "RAN-pip").exists()
    assert "fatal:" not in proc.stderr  # git, asked quietly of a folder that is no repository


def test_rescore_after_a_filter_change_and_refusal_after_a_prompt_change(demo_run, tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(demo_run["tasks"], tasks)
    gen = tasks / "mpitp_demo_gen.yaml"
    gen.write_text(gen.read_text().replace("filter_list:\n", "filter_list:\n  - name: raw\n    filter:\n"
                                           "      - function: take_first\n"))
    proc = mpitp("rescore", demo_run["out"], "--include-path", tasks, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert "mpitp_demo_gen exact_match,raw: None -> 0.0" in proc.stdout, proc.stdout

    mc = tasks / "mpitp_demo_mc.yaml"
    mc.write_text(mc.read_text().replace('"Question: {{question}}\\nAnswer:"', '"Q: {{question}}\\nA:"'))
    proc = mpitp("rescore", demo_run["out"], "--include-path", tasks, "--output", tmp_path / "x.h5", cwd=tmp_path)
    assert proc.returncode == 2, explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"mpitp: error: cannot rescore {demo_run['out']}: ") and "Traceback" not in proc.stderr
    assert "loglikelihood requests are not in the file (first: task mpitp_demo_mc" in lines[-1]
    assert not (tmp_path / "x.h5").exists()


# -------------------------------------------------------------------------------------- weights fingerprint


@pytest.mark.slow
def test_rewritten_checkpoint_is_refused_on_resume(shared_dir, tmp_path, demo_run):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(shared_dir / "models" / "stories260K", ckpt)
    out = tmp_path / "r.h5"
    args = ["eval", "--model", ckpt, "--include-path", demo_run["tasks"], "--tasks", "mpitp_demo_mc",
            "--limit", "2", "--output", out]
    proc = run_mpi(1, [str(a) for a in args], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    proc = run_mpi(1, [str(a) for a in args] + ["--resume"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)  # unchanged checkpoint: resumes

    tensors = load_file(ckpt / "model.safetensors")
    for t in tensors.values():
        t.mul_(1.01)  # same names, shapes, dtypes and file size: a training step saved again
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    before = out.read_bytes()
    proc = run_mpi(1, [str(a) for a in args] + ["--resume"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 2, explain(proc)
    msg = [line for line in proc.stderr.splitlines() if line.startswith("mpitp: error:")]
    assert len(msg) == 1 and f"cannot resume {out}: different settings: weights '" in msg[0], proc.stderr
    assert "changed on disk: model.safetensors content differs" in msg[0]
    assert out.read_bytes() == before  # nothing overwritten


def test_rescored_results_keep_the_runs_model():
    """lm-eval rescored with a stand-in LM: the rescored file's results_json said model 'StoredLM', model_args and
    device None, model_dtype gone, and each task's metadata lost pretrained and dtype; they are the run's again, and
    what the file holds that is not a mapping is left out."""
    from mpitp.evaluation.rescore import with_run_identity

    stored = json.dumps({"config": {"model": "hf", "model_args": {"pretrained": "/m", "dtype": "float32"},
                                    "model_dtype": "torch.float32", "device": "cpu", "batch_size": 1, "limit": 9},
                         "configs": {"t": {"metadata": {"version": 1.0, "pretrained": "/m", "dtype": "float32"}},
                                     "u": "not a mapping"}})
    res = {"config": {"model": "StoredLM", "model_args": None, "device": None, "batch_size": None, "limit": 4,
                      "bootstrap_iters": 100},
           "configs": {"t": {"metadata": {"version": 2.0}}, "u": {"metadata": {"version": 1.0}}}}
    out = with_run_identity(res, stored)
    assert out["config"] == {"model": "hf", "model_args": {"pretrained": "/m", "dtype": "float32"}, "device": "cpu",
                             "batch_size": 1, "limit": 4, "bootstrap_iters": 100, "model_dtype": "torch.float32"}
    assert out["configs"] == {"t": {"metadata": {"version": 2.0, "pretrained": "/m", "dtype": "float32"}},
                              "u": {"metadata": {"version": 1.0}}}
    assert with_run_identity({"config": {"model": "StoredLM"}}, "[1, 2]") == {"config": {"model": "StoredLM"}}
