"""Issue 27, the writing side: nothing mpitp writes goes through a link planted in a shared directory, no code runs
from a results file, and the batch script neither leaks (mode) nor carries injected lines.

Each test plays the attack as a user of a shared folder would: a symbolic link at a name mpitp uses (the old ones
were predictable: ``.NAME.claim``, ``NAME.tmp<pid>``, the script's), a results bundle whose tasks folder runs code,
a job folder with a newline in its name. Real code paths (ResultWriter, the claim, write_rescored, write_summary,
submit with a stand-in sbatch, ``mpitp rescore`` as a process); the victim file must come out unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import h5py
import pytest

from mpitp.errors import UsageError
from mpitp.results.claim import claim_output, claim_path
from mpitp.results.store import ResultWriter
from support import OFFLINE_ENV, REPO

VICTIM = b"the user's own file\n"
META = {"model": "m", "config_json": json.dumps({"model": "m", "tasks": ["t"]})}


def _victim(tmp_path: Path, mode: int = 0o600) -> Path:
    victim = tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(VICTIM)
    victim.chmod(mode)
    return victim


def _unchanged(victim: Path, mode: int = 0o600) -> None:
    assert victim.read_bytes() == VICTIM
    assert stat.S_IMODE(victim.stat().st_mode) == mode


def _row(doc_id: int) -> dict:
    return dict(doc_id=doc_id, idx=0, kind="loglikelihood", loglikelihood=-1.5, is_greedy=False, generation="",
                n_tokens=3, args_hash="h", repeat=0)


# ------------------------------------------------------------------------------------------------ claim (item 2)


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_claim_refuses_a_planted_link(tmp_path, link):
    out = tmp_path / "shared" / "run.h5"
    out.parent.mkdir()
    victim = _victim(tmp_path)
    (os.symlink if link == "symlink" else os.link)(victim, claim_path(str(out)))
    with pytest.raises(UsageError) as info:
        claim_output(str(out))
    assert f"cannot claim output {out}: {claim_path(str(out))}" in str(info.value) and "\n" not in str(info.value)
    _unchanged(victim)


def test_stale_claim_is_taken_over(tmp_path):
    out = str(tmp_path / "run.h5")
    Path(claim_path(out)).write_text("pid 1 on gone\n")  # a killed run's (its lock died with it)
    claim = claim_output(out)
    assert Path(claim_path(out)).read_text().startswith(f"pid {os.getpid()} on ")
    claim.release()
    assert not os.path.lexists(claim_path(out))


# ----------------------------------------------------------------------- snapshot and journal (items 2 and 12)


def test_snapshot_and_journal_never_write_through_planted_links(tmp_path):
    out = tmp_path / "shared" / "run.h5"
    out.parent.mkdir()
    victim = _victim(tmp_path)
    w = ResultWriter(str(out), META)
    # The names the old code used, which the world-readable claim file (its pid) made predictable.
    for name in (f"{out}.tmp{os.getpid()}", f"{out}.journal.tmp{os.getpid()}"):
        os.symlink(victim, name)
    w.append("t", [_row(0), _row(1)])
    w.save()  # a snapshot and a new journal
    w.append("t", [_row(2)])
    w.finish({"results": {}}, 1.0)
    _unchanged(victim)
    with h5py.File(out) as f:
        assert f.attrs["status"] == "complete" and list(f["tasks/t/requests/doc_id"][()]) == [0, 1, 2]


def test_start_removes_only_its_own_stale_temporaries(tmp_path):
    out = tmp_path / "run.h5"
    others = [tmp_path / "run.h5.tmpl", tmp_path / "run.h5.tmp123", tmp_path / "run.h5.journal.tmp9"]
    for p in others:
        p.write_text("not mpitp's to delete")
    ours = tmp_path / ".run.h5.k3j9x_q1.tmp"  # a temporary of this version a killed run left (mkstemp pattern)
    ours.write_bytes(b"torn")
    link = tmp_path / ".run.h5.journal.abcdef12.tmp"
    os.symlink(_victim(tmp_path), link)  # our pattern, but a link: not provably ours either
    ResultWriter(str(out), META).finish({"results": {}}, 1.0)
    assert all(p.read_text() == "not mpitp's to delete" for p in others)
    assert not ours.exists() and os.path.islink(link)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in others] + [link.name, "run.h5", "elsewhere"])  # no temporary of this run left behind


def test_resume_and_snapshots_keep_the_outputs_mode(tmp_path):
    out = tmp_path / "run.h5"
    w = ResultWriter(str(out), META)
    w.append("t", [_row(0)])
    w.close()  # a stopped run: snapshot + journal
    out.chmod(0o600)  # the user keeps the results private
    w = ResultWriter(str(out), META, resume=True)
    assert stat.S_IMODE(os.stat(f"{out}.journal").st_mode) == 0o600  # the journal holds the same rows
    w.append("t", [_row(1)])
    w.save()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    w.finish({"results": {}}, 1.0)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


# ---------------------------------------------------------------------------------- rescore's copy (items 2, 12)


def test_rescore_output_never_written_through_a_planted_link_and_in_place_keeps_the_mode(tmp_path):
    from mpitp.evaluation.rescore import write_rescored

    src = tmp_path / "run.h5"
    w = ResultWriter(str(src), META)
    w.append("t", [_row(0)])
    w.finish({"results": {}}, 1.0)
    dst = tmp_path / "new.h5"
    victim = _victim(tmp_path)
    os.symlink(victim, f"{dst}.tmp{os.getpid()}")
    res = {"results": {"t": {"acc,none": 0.5}}, "configs": {"t": {"output_type": "loglikelihood"}}}
    write_rescored(str(src), str(dst), res, {})
    _unchanged(victim)
    with h5py.File(dst) as f:
        assert f["tasks/t/metrics"].attrs["acc,none"] == 0.5
    src.chmod(0o600)
    os.symlink(victim, f"{src}.tmp{os.getpid()}")
    write_rescored(str(src), str(src), res, {})  # --in-place
    assert stat.S_IMODE(src.stat().st_mode) == 0o600
    _unchanged(victim)


# ------------------------------------------------------------------------------------- sweep summary (item 2)


def test_sweep_summary_never_written_through_a_planted_link(tmp_path):
    from mpitp.jobs.sweep import write_summary

    path = tmp_path / "sweep-summary.json"
    victim = _victim(tmp_path)
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    write_summary(str(path), [], 2.5)
    _unchanged(victim)
    assert json.loads(path.read_text())["wall_time_s"] == 2.5


# --------------------------------------------------------------------------------- batch script (items 2, 3, 6, 12)

SUBMIT = dict(nodes=1, ranks_per_node=2, time="00:10:00", srun_mpi="pmi2")


@pytest.fixture
def job(tmp_path, monkeypatch):
    """The demo job under tmp, and a stand-in sbatch first on PATH (answers like the real one, submits nothing)."""
    (tmp_path / "jobs").mkdir()
    shutil.copy(REPO / "jobs/demo.yaml", tmp_path / "jobs/demo.yaml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 7'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "jobs/demo.yaml"


def test_batch_script_mode_follows_the_umask(job, tmp_path):
    from mpitp.jobs.submit import submit

    old = os.umask(0o077)
    try:
        assert submit("slurm", job, script_dir=tmp_path / "scripts", **SUBMIT) == "7"
    finally:
        os.umask(old)
    script = tmp_path / "scripts/mpitp-demo.slurm.sh"
    assert stat.S_IMODE(script.stat().st_mode) == 0o700  # never 0755: --env-setup may carry tokens


def test_batch_script_refuses_a_planted_link(job, tmp_path):
    from mpitp.jobs.submit import SubmitError, submit

    victim = _victim(tmp_path)
    script = tmp_path / "scripts/mpitp-demo.slurm.sh"
    script.parent.mkdir()
    os.symlink(victim, script)
    with pytest.raises(SubmitError, match="exists and is not a plain file"):
        submit("slurm", job, script_dir=tmp_path / "scripts", **SUBMIT)
    _unchanged(victim)


def test_job_path_with_a_newline_is_refused(tmp_path):
    from click.testing import CliRunner

    from mpitp.cli.submit import submit_command
    from mpitp.jobs.submit import SubmitUsageError, render_script

    folder = tmp_path / "x\nrm -rf ~\n#"
    folder.mkdir()
    job = folder / "demo.yaml"
    shutil.copy(REPO / "jobs/demo.yaml", job)
    with pytest.raises(SubmitUsageError, match=r"its path contains control characters \('\\n'\)"):
        render_script("slurm", job, **SUBMIT)
    r = CliRunner().invoke(submit_command, [str(job), "--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "2",
                                            "--time", "00:10:00", "--dry-run"])
    assert r.exit_code == 2 and "its path contains control characters ('\\n')" in r.output, r.output
    assert "#SBATCH" not in r.output  # no script printed


def test_no_empty_path_entry_without_an_mpitp(tmp_path, monkeypatch):
    from mpitp.jobs.submit import render_script

    (tmp_path / "python").touch()  # an interpreter folder without the mpitp command, and none on PATH
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    text = render_script("slurm", REPO / "jobs/demo.yaml", **SUBMIT)
    assert "export PATH=" not in text and "# (none given)" in text


# --------------------------------------------------------------------------------------- rescore's tasks (item 1)


@pytest.mark.mpi  # `mpitp rescore` as a process (conftest's rule for every mpitp launch)
def test_rescore_runs_no_code_named_by_the_file(tmp_path):
    """A bundle: results.h5 naming ``tasks/`` (relative) as its include path, and a tasks folder whose Python writes a
    marker when imported. ``mpitp rescore results.h5`` must refuse, one line naming the path and the flag."""
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.tasks.demo import prepare_demo

    _, demo_tasks, _ = prepare_demo()
    bundle = tmp_path / "bundle"
    shutil.copytree(demo_tasks, bundle / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "MARKER"
    with open(bundle / "tasks/demo_data.py", "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('ran the bundle author\\'s code')\n")
    cfg = EvalConfig(model="hf", tasks=["mpitp_demo_mc"], include_path="tasks", limit=1)
    meta = dict(META, config_json=json.dumps(cfg.identity()), eval_config_json=json.dumps(asdict(cfg), default=str))
    w = ResultWriter(str(bundle / "results.h5"), meta)
    w.append("mpitp_demo_mc", [_row(0)])
    w.finish({"results": {}}, 1.0)
    proc = subprocess.run([sys.executable, "-m", "mpitp", "rescore", "results.h5"], capture_output=True, text=True,
                          timeout=300, cwd=bundle, env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO)})
    assert not marker.exists(), "rescore imported the task folder the results file named"
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["mpitp: error: cannot rescore results.h5: the file names the task folders or data its run used "
                     "(--include-path tasks); task folders are code (a YAML's !function imports their Python), so "
                     "rescore takes them only from you: pass --include-path tasks (or other folders)"], proc.stderr
