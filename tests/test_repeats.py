"""lm-eval ``repeats`` (pass@k, self-consistency): each of a request's k clones has its own row, resume key and
sampling seed, so a run resumed from a partial file (another layout) gives the uninterrupted run's answers."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from mpitp.results.rows import read_requests
from mpitp.results.store import ResultWriter
from support import STORIES
from support.launch import file_rows, inspect_diff
from support.mpi import explain, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # every test here launches mpiexec

SLOW_TASKS = str(Path(__file__).parent / "slow_tasks")
TASK = "mpitp_repeats_gen"
K, DOCS = 3, 4
ARGS = ["eval", "--model", str(STORIES), "--include-path", SLOW_TASKS, "--tasks", TASK, "--limit", str(DOCS),
        "--bootstrap-iters", "0", "--seed", "7", "--batch-size", "2"]


def test_repeats_resumed_from_a_partial_file(shared_dir, tmp_path):
    full = tmp_path / "full.h5"
    proc = run_mpi(2, ARGS + ["--output", str(full)], timeout=600)
    assert proc.returncode == 0, explain(proc)
    rows = read_requests(str(full), TASK)
    keys = list(zip(rows["doc_id"].tolist(), rows["idx"].tolist(), rows["repeat"].tolist()))
    assert len(keys) == len(set(keys)) == K * DOCS, keys  # one row per clone, none duplicated
    assert Counter(d for d, _, _ in keys) == {d: K for d in range(DOCS)}
    assert sorted({r for _, _, r in keys}) == list(range(K))
    answers = {k: g for k, g in zip(keys, rows["generation"].tolist())}
    differ = sum(len({answers[(d, 0, r)] for r in range(K)}) > 1 for d in range(DOCS))
    assert differ > 0, answers  # the clones really sampled (else the test could not tell them apart)

    # A partial file: every doc's first clone, and doc 1's second; the rest must be computed, not copied.
    partial = tmp_path / "partial.h5"
    partial.write_bytes(full.read_bytes())
    w = ResultWriter(str(partial), {}, resume=True)
    cols = w.tasks[TASK]["rows"]
    keep = [i for i in range(len(cols["doc_id"])) if cols["repeat"][i] == 0 or (cols["doc_id"][i], cols["repeat"][i])
            == (1, 1)]
    for name in cols:
        cols[name] = [cols[name][i] for i in keep]
    w.save()
    assert file_rows(partial) == ("running", DOCS + 1)

    proc = run_mpi(1, ARGS + ["--output", str(partial), "--resume"], timeout=600)  # another layout: dp=1
    assert proc.returncode == 0, explain(proc)
    reused = sum(int(m) for m in re.findall(r"resume: reusing (\d+) of", proc.stderr))
    assert reused == DOCS + 1, proc.stderr[-3000:]
    assert file_rows(partial) == ("complete", K * DOCS)
    diff = inspect_diff(partial, full)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    print(f"repeats={K}, {DOCS} docs: {K * DOCS} rows, unique (doc_id, idx, repeat); clones differ on {differ} docs; "
          f"resumed at dp=1 from {DOCS + 1} rows (made at dp=2): same answers (inspect diff exit 0)")
