"""lm-eval's request cache under mpitp (:mod:`mpitp.evaluation.requestcache`): keyed by what shapes requests, reused by
a second full run with the same results, off with ``--limit``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpitp.evaluation.checks import task_manager
from mpitp.evaluation.requestcache import enable, request_key
from mpitp.evaluation.settings import EvalConfig
from support import OFFLINE_ENV
from support.mpi import explain, run_mpi


def test_key_follows_what_shapes_requests(test_tasks, tmp_path):
    """Same settings, same key (also from another copy of the YAMLs: ``--data-dir`` writes them to a new temporary
    folder every run); another few-shot count, seed, tokenizer, task YAML or data file, another key."""
    cfg = EvalConfig(tasks=["arc_easy_local"], num_fewshot=0, seed=1)
    tm = task_manager(cfg.tasks, [test_tasks])
    base = request_key(cfg, tm, "tok")
    assert base == request_key(cfg, tm, "tok")
    copy = tmp_path / "copy"
    shutil.copytree(test_tasks, copy)
    assert request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok") == base
    assert request_key(EvalConfig(tasks=["arc_easy_local"], num_fewshot=1, seed=1), tm, "tok") != base
    assert request_key(EvalConfig(tasks=["arc_easy_local"], num_fewshot=0, seed=2), tm, "tok") != base
    assert request_key(cfg, tm, "other-tok") != base
    yaml = copy / "arc_easy_local.yaml"
    yaml.write_text(yaml.read_text() + "\n# edited\n")
    assert request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok") != base
    data = tmp_path / "data.jsonl"  # a local data file named in the config: its size and mtime count
    data.write_text("{}\n")
    text = yaml.read_text()
    yaml.write_text(text + f"\n# {data}\n")
    entry_cfg = task_manager(cfg.tasks, [str(copy)]).task_index["arc_easy_local"].cfg
    if str(data) in str(entry_cfg):  # only when the YAML parser keeps the path (comments are dropped)
        k1 = request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok")
        data.write_text("{}\n{}\n")
        assert request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok") != k1
    assert enable(EvalConfig(tasks=["arc_easy_local"], limit=5), tm, "tok") == {}  # --limit: off


@pytest.mark.slow
@pytest.mark.mpi
def test_second_full_run_reuses_built_requests(tmp_path):
    """Two full runs of the demo's multiple-choice task with one cache folder: the first writes lm-eval's cache
    file, the second reads it (the file is not rewritten) and gives the same results."""
    cache = tmp_path / "cache"
    env = {"MPITP_REQUEST_CACHE": str(cache)}
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}.h5"
        proc = run_mpi(2, ["eval", "--demo", "--tasks", "mpitp_demo_mc", "--bootstrap-iters", "0", "--output",
                           str(out)], env=env, timeout=600)
        assert proc.returncode == 0, explain(proc)
        assert "request cache: " in proc.stderr, proc.stderr[-2000:]
        files = sorted(cache.rglob("*.pickle"))
        assert len(files) == 1, files
        if i == 0:
            stamp = files[0].stat().st_mtime_ns
        else:
            assert files[0].stat().st_mtime_ns == stamp  # read, not built and written again
        outs.append(out)
    diff = subprocess.run([sys.executable, "-m", "mpitp", "inspect", "diff", str(outs[0]), str(outs[1])],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE_ENV})
    assert diff.returncode == 0, diff.stdout + diff.stderr
    print(f"request cache file {files[0].name} ({files[0].stat().st_size} B) reused by the second run; same results")
    assert Path(files[0]).parent.parent == cache
