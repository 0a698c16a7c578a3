"""``--stage-dir``: the copy one rank per node makes before loading (:mod:`mpitp.replica.staging`), without MPI.

The launch across nodes (each node stages once, results equal to an unstaged run) is the ``mpi`` test at the end.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from mpitp.replica import staging
from support import STORIES


def _model(tmp_path, name="ckpt"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(256)) * 64)
    (d / "pytorch_model.bin").write_bytes(b"not loaded when safetensors exist")
    (d / "tokenizer.json").write_text("{}")
    (d / "generation_config.json").write_text("{}")
    (d / "optimizer.pt").write_bytes(b"x" * 100)
    (d / ".hidden.json").write_text("{}")
    return d


def test_plan_picks_loaded_files_and_keys_on_content(tmp_path):
    src = _model(tmp_path)
    plan = staging.plan_stage(str(src))
    assert [f for f, _ in plan.files] == ["config.json", "generation_config.json", "model.safetensors",
                                         "tokenizer.json"]
    assert re.fullmatch(r"ckpt-[0-9a-f]{12}", plan.folder) and plan.folder.endswith(plan.key)
    assert staging.plan_stage(str(src)).key == plan.key  # same files: same key
    (src / "config.json").write_text('{"model_type": "gpt2"}')  # same size, new content
    assert staging.plan_stage(str(src)).key != plan.key
    assert staging.plan_stage(str(tmp_path / "nowhere")) is None
    assert staging.plan_stage(str(src), subfolder="../elsewhere") is None


def test_stage_copies_then_reuses(tmp_path):
    src = _model(tmp_path)
    plan = staging.plan_stage(str(src))
    root = tmp_path / "stage"
    path, copied = staging.stage(plan, str(root))
    assert path == str(root / plan.folder) and copied == plan.nbytes
    for rel, _ in plan.files:
        assert (root / plan.folder / rel).read_bytes() == (src / rel).read_bytes()
    marker = json.loads((root / plan.folder / staging.MARKER).read_text())
    assert marker["key"] == plan.key
    assert sorted(os.listdir(root / plan.folder)) == sorted([staging.MARKER] + [f for f, _ in plan.files])
    assert staging.stage(plan, str(root)) == (path, 0)  # complete with the same key: reused, nothing copied


def test_incomplete_stage_is_redone(tmp_path):
    """A stage killed before its marker (or with a file cut short) is never loaded from: the next one copies again,
    and temp files left by a dead copy are removed."""
    src = _model(tmp_path)
    plan = staging.plan_stage(str(src))
    root = tmp_path / "stage"
    path, _ = staging.stage(plan, str(root))
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.truncate(10)
    stale = os.path.join(path, staging.TEMP_PREFIX + "1-dead-model.safetensors")
    open(stale, "wb").close()
    os.utime(stale, (0, 0))
    assert staging.stage(plan, str(root))[1] == plan.nbytes
    assert not os.path.exists(stale)
    os.unlink(os.path.join(path, staging.MARKER))
    assert staging.stage(plan, str(root))[1] == plan.nbytes
    assert (root / plan.folder / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_failed_copy_leaves_no_partial_file(tmp_path, monkeypatch):
    src = _model(tmp_path)
    plan = staging.plan_stage(str(src))
    root = tmp_path / "stage"

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        staging.stage(plan, str(root))
    monkeypatch.undo()
    assert os.listdir(root / plan.folder) == []  # no temp file, no marker: nothing a rank would load


def test_symlinks_in_the_stage_dir_are_not_followed(tmp_path):
    src = _model(tmp_path)
    plan = staging.plan_stage(str(src))
    root, elsewhere = tmp_path / "stage", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / plan.folder).symlink_to(elsewhere)
    notes = []
    path, copied = staging.stage(plan, str(root), notes)  # passed over (one note), staged beside it
    assert os.listdir(elsewhere) == [] and copied == plan.nbytes
    assert path == str(root / f"{plan.folder}-u{os.geteuid()}")
    assert notes[0] == f"{root / plan.folder} is a symlink: not used as a stage"
    # a symlink in place of a staged file is replaced, never written through
    (root / plan.folder).unlink()
    path, _ = staging.stage(plan, str(root))
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.unlink(os.path.join(path, "config.json"))
    os.symlink(victim, os.path.join(path, "config.json"))
    assert staging.stage(plan, str(root))[1] == plan.nbytes  # not complete: a symlink is not a staged file
    assert victim.read_text() == "keep" and not os.path.islink(os.path.join(path, "config.json"))


def test_expand_dir_per_node(monkeypatch):
    monkeypatch.setenv("SCRATCH_T", "/scratch/job7")
    assert staging.expand_dir("$SCRATCH_T/stage-{node}", "nodeb") == "/scratch/job7/stage-nodeb"


def test_stage_dir_is_a_setting_everywhere():
    """One declaration: the ``mpitp eval`` option, the job-file field (and ``MPITP_STAGE_DIR`` in ``start``)."""
    from mpitp.evaluation import settings
    from mpitp.jobs.jobfile import RunSpec

    assert "stage_dir" in settings.job_fields()
    assert "stage_dir" in settings.cli_runtime_dests()
    assert "stage_dir" in {f for f in RunSpec.__dataclass_fields__}


# ------------------------------------------------------------------------------------ across the emulated nodes

JOB = """\
defaults:
  model: {model}
  tasks: [arc_easy_local, wikitext_local]
  include_path: {tasks}
  dtype: float32
  limit: 2
  tp: 2
  timeout: 120
runs:
  - name: in-place
    output: {out}/in-place.h5
  - name: staged
    stage_dir: {stage}/{{node}}
    output: {out}/staged.h5
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.multinode
def test_each_node_stages_once(tmp_path, test_tasks):
    """dp=2 x tp=2 over nodea:2,nodeb:2 in one launch (a job file): the run with ``stage_dir`` leaves one complete
    stage per node, copied once per node (rank 0's total is twice the model), and its results equal the run that
    read the model in place, request by request. On nodeb (a sticky shared ``DIR``) another user's folder already has
    the stage's name (as root: uid 65534): nodeb's leader stages beside it, every rank of nodeb loads from there, and
    rank 0 logs nodeb's warning line naming the planted folder."""
    from support.launch import inspect_diff
    from support.mpi import explain, run_mpi
    from support.nodes import launcher, require_nodes

    require_nodes()
    stage = tmp_path / "stage"
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(model=STORIES, tasks=test_tasks, out=tmp_path, stage=stage))
    plan = staging.plan_stage(str(STORIES))
    uid, planted = os.geteuid(), stage / "nodeb" / plan.folder
    folders = {"nodea": [plan.folder], "nodeb": [plan.folder]}
    if uid == 0:
        planted.mkdir(parents=True)
        planted.parent.chmod(0o1777)
        planted.chmod(0o777)
        (planted / staging.MARKER).write_text(json.dumps({"key": plan.key, "files": [list(f) for f in plan.files]}))
        for p in (planted, planted / staging.MARKER):
            os.chown(p, 65534, 65534)
        folders["nodeb"] = [plan.folder, f"{plan.folder}-u{uid}"]
    proc = run_mpi(4, ["run", str(job)], launcher=launcher({"nodea": 2, "nodeb": 2}), timeout=600)
    assert proc.returncode == 0, explain(proc)
    assert sorted(os.listdir(stage)) == ["nodea", "nodeb"]
    for node in ("nodea", "nodeb"):
        assert sorted(os.listdir(stage / node)) == folders[node]
        used = stage / node / folders[node][-1]
        assert json.loads((used / staging.MARKER).read_text())["key"] == plan.key
        assert os.stat(used).st_mode & 0o777 == 0o700
    if uid == 0:
        assert (f"--stage-dir: node nodeb: {planted} belongs to uid 65534, not to you (uid 0): not used as a stage"
                in proc.stderr), proc.stderr[-3000:]
        assert os.listdir(planted) == [staging.MARKER]
    copied = re.search(r"stage: .* ([\d.]+) MB copied in all", proc.stderr)
    assert copied and float(copied[1]) == pytest.approx(2 * plan.nbytes / 1e6, abs=0.051), proc.stderr[-3000:]
    d = inspect_diff(tmp_path / "in-place.h5", tmp_path / "staged.h5")
    assert d.returncode == 0, d.stdout + d.stderr
