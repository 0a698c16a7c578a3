"""lm-eval's ``samples`` (``--samples '{"task": [7, 3]}'``, ``mpitp.evaluate(samples=...)``).

A ``--samples`` run stored its request rows and per-document scores under lm-eval's renumbering of the documents it
kept (0, 1, ...), while its logged samples said 7 and 3, and said 7 for document 3 (lm-eval labels document i
``indices[i]``, right only for an ascending list): ``inspect diff`` against a full run compared other documents. Bad
lists failed inside lm-eval after the model load (tracebacks) or were misread (1.5 as document 1, a task the run does
not score ignored). See :mod:`mpitp.evaluation.picked`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support import STORIES
from support.mpi import explain, run_mpi

TASK = "mpitp_demo_mc"


def test_picked_documents_are_lm_evals_walk():
    from mpitp.evaluation.lm import request_keys
    from mpitp.evaluation.picked import picked_docs

    assert picked_docs({"a": [7, 3, 3], "b": [], "c": (2,)}) == {"a": (3, 7), "c": (2,)}
    assert picked_docs(None) == {}

    class Inst:
        def __init__(self, task, doc, idx):
            self.task_name, self.doc_id, self.idx, self.args = task, doc, idx, ("ctx", f" {idx}")

    keys = request_keys([Inst("a", 0, 0), Inst("a", 1, 0), Inst("b", 1, 0)], {"a": (3, 7)})
    assert [k[:3] for k in keys] == [("a", 3, 0), ("a", 7, 0), ("b", 1, 0)]  # a task without a list: as numbered


@pytest.mark.parametrize("value, says", [
    ([1], "expected a JSON object"),
    ({TASK: 3}, "is not a list of document indices"),
    ({TASK: [1.5]}, "is not a list of document indices"),
    ({TASK: [-1]}, "is not a list of document indices"),
    ({TASK: [True]}, "is not a list of document indices"),
    ({"nope": [1]}, "'nope', which is not a task lm-eval knows"),
    ({"mpitp_demo_gen": [1]}, "'mpitp_demo_gen', which is not among the tasks this run scores"),
])
def test_bad_samples_are_one_line(value, says):
    from mpitp.errors import UsageError
    from mpitp.evaluation.picked import check_samples

    with pytest.raises(UsageError, match=says):
        check_samples(value, [TASK], [TASK, "mpitp_demo_gen"])
    check_samples({TASK: [0, 5]}, [TASK], [TASK])
    check_samples(None, [TASK], [TASK], cached=True)


def test_samples_with_lm_evals_request_cache_is_refused():
    """lm-eval's request cache (``--cache_requests true``) is keyed without the samples: after a full run it handed
    every document's requests to a ``--samples`` run (IndexError once mpitp mapped their numbers, scored as other
    documents before), and a ``--samples`` run left only its documents there for the next full run."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.picked import check_samples

    with pytest.raises(UsageError, match="--samples with --cache_requests: lm-eval's request cache is keyed"):
        check_samples({TASK: [1]}, [TASK], [TASK], cached=True)


@pytest.fixture(scope="module")
def stories():
    import mpitp

    return mpitp.load_model(str(STORIES), 1, "cpu", "float32")


def _run(stories, path, **kw) -> None:
    from mpi4py import MPI

    import mpitp
    from mpitp.tasks.demo import demo_tasks_dir

    mpitp.evaluate(stories, str(STORIES), [TASK], comm=MPI.COMM_SELF, output=str(path), log_samples=True,
                   bootstrap_iters=0, include_path=demo_tasks_dir(), **kw)


def test_a_samples_run_is_keyed_by_the_documents_it_names(stories, tmp_path):
    """Documents 7 and 3 (and 3 again): rows, per-document scores and logged samples say 3 and 7, and hold what a
    run of the first 8 documents holds for those two."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.rescore import rescore
    from mpitp.results.docscores import read as read_scores
    from mpitp.results.reader import load_samples
    from mpitp.results.rows import read_requests
    from mpitp.tasks.demo import demo_tasks_dir

    _run(stories, tmp_path / "full.h5", limit=8)
    _run(stories, tmp_path / "picked.h5", samples={TASK: [7, 3, 3]})

    def rows(name):
        cols = read_requests(str(tmp_path / name), TASK)
        return {(int(d), int(i)): float(ll) for d, i, ll in zip(cols["doc_id"], cols["idx"], cols["loglikelihood"])}

    full, picked = rows("full.h5"), rows("picked.h5")
    assert sorted({d for d, _ in picked}) == [3, 7] and len(picked) > 4
    for key, ll in picked.items():
        assert abs(ll - full[key]) <= 1e-5 * max(1.0, abs(ll)), key

    def samples(name):
        return {s["doc_id"]: s for s in map(json.loads, load_samples(str(tmp_path / name), TASK))}

    full_s, picked_s = samples("full.h5"), samples("picked.h5")
    assert sorted(picked_s) == [3, 7]
    assert all(picked_s[d]["doc"] == full_s[d]["doc"] for d in (3, 7))  # lm-eval alone logged document 3 as 7

    full_d, picked_d = read_scores(str(tmp_path / "full.h5"), TASK), read_scores(str(tmp_path / "picked.h5"), TASK)
    assert picked_d.doc_id.tolist() == [3, 7]
    for key, col in picked_d.values.items():
        assert np.array_equal(col, full_d.values[key][[3, 7]]), key

    # the file records the samples (they went to lm-eval unrecorded): rescore rebuilds the same two documents' requests
    _, rescored, served, _ = rescore(str(tmp_path / "picked.h5"), include_path=demo_tasks_dir(), bootstrap_iters=0)
    assert served == len(picked) and rescored[TASK].doc_id.tolist() == [3, 7]

    with pytest.raises(UsageError, match=f"{TASK}: document 30 does not exist: the task has 30 documents"):
        _run(stories, tmp_path / "past.h5", samples={TASK: [2, 30]})
    assert not (tmp_path / "past.h5").exists()  # refused before any request: no 'running' file for the rerun to meet
    with pytest.raises(UsageError, match="samples names 'mpitp_demo_gen', which is not among the tasks"):
        _run(stories, tmp_path / "other.h5", samples={"mpitp_demo_gen": [1]})


@pytest.mark.mpi
def test_an_index_past_the_end_ends_every_rank_alike(tmp_path):
    """``mpiexec -n 2 mpitp eval --demo`` (two DP groups): rank 0 meets the index once lm-eval builds the requests,
    the other group waits for work. One line, exit 2 on every rank by itself: no traceback, no MPI_Abort."""
    proc = run_mpi(2, ["eval", "--demo", "--samples", '{"mpitp_demo_mc": [4, 99]}', "--output", "out.h5"],
                   timeout=120, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    line = "mpitp: error: --samples mpitp_demo_mc: document 99 does not exist: the task has 30 documents"
    assert proc.returncode == 2, explain(proc)
    assert out.count(line) == 1 and "Traceback" not in out and "Abort" not in out, explain(proc)
