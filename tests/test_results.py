"""The HDF5 results file of real ``mpiexec`` runs: the schema of :mod:`mpitp.results.store`, ``inspect --json``, resume,
output protection, HDF5 file locking and dataset storage.

Real runs only (the built-in demo model under the PyPI MPICH ``mpiexec``); files are modified with h5py where a test
needs a state a run would leave behind (an interrupted run).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import mpitp  # noqa: E402
from mpitp.errors import UsageError  # noqa: E402
from mpitp.results.rows import read_metrics, read_requests  # noqa: E402
from mpitp.results.schema import REQUEST_FIELDS, STATS_FIELDS, STR, open_h5  # noqa: E402
from support import OFFLINE_ENV, STORIES  # noqa: E402
from support.mpi import explain, run_mpi  # noqa: E402
from support.parity import compare_requests, mpitp_requests, reference_requests  # noqa: E402

pytestmark = pytest.mark.mpi  # every test here launches mpiexec

DEMO_TASKS = ("mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen")
KIND = {"mpitp_demo_mc": "loglikelihood", "mpitp_demo_ppl": "loglikelihood_rolling",
        "mpitp_demo_gen": "generate_until"}
OUTPUT_TYPE = {"mpitp_demo_mc": "multiple_choice", "mpitp_demo_ppl": "loglikelihood_rolling",
               "mpitp_demo_gen": "generate_until"}
ROOT_ATTRS = ("mpitp_version", "created", "model", "tokenizer", "dtype", "world_size", "tp", "dp", "command",
              "lm_eval_version", "torch_version", "transformers_version", "mpi_version", "status", "config_json",
              "wall_time_s", "results_json")
LM_EVAL_KEYS = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config")
SCHEMA_LIMIT = 4


def mpitp_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    """``python -m mpitp ARGS`` as a plain process (commands that need no MPI world: inspect, tasks)."""
    return subprocess.run([sys.executable, "-m", "mpitp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **OFFLINE_ENV})


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def same(a, b) -> bool:
    """Equality where NaN equals NaN (metrics of a tiny random model can be NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def attrs(path) -> dict:
    with open_h5(path) as f:
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}


@pytest.fixture(scope="module")
def schema_run(tmp_path_factory):
    """``mpiexec -n 2 mpitp eval --demo --limit 4 --log-samples``: dp 2 x tp 1."""
    d = tmp_path_factory.mktemp("schema")
    out = d / "demo.h5"
    proc = run_mpi(2, ["eval", "--demo", "--limit", str(SCHEMA_LIMIT), "--log-samples", "--output", str(out)],
                   timeout=600, cwd=str(d))
    assert proc.returncode == 0 and out.is_file(), explain(proc)
    os.chmod(out, 0o444)  # tests below work on copies
    return out, proc


# ------------------------------------------------------------------------------------------------------ schema


def test_root_attributes(schema_run):
    import importlib.metadata

    import lm_eval

    path, _ = schema_run
    a = attrs(path)
    missing = [k for k in ROOT_ATTRS if k not in a]
    assert not missing, f"root attrs missing: {missing}"
    assert a["status"] == "complete"
    assert a["mpitp_version"] == mpitp.__version__
    assert a["lm_eval_version"] == lm_eval.__version__
    assert a["transformers_version"] == importlib.metadata.version("transformers")
    assert a["torch_version"].split("+")[0] == importlib.metadata.version("torch").split("+")[0]
    assert "MPICH" in a["mpi_version"], a["mpi_version"]
    assert (a["world_size"], a["dp"], a["tp"]) == (2, 2, 1)
    assert a["dtype"] == "auto"
    assert os.path.isfile(os.path.join(a["model"], "config.json")), a["model"]  # the demo model's directory
    assert a["tokenizer"] == a["model"]
    assert "eval" in a["command"] and "--demo" in a["command"] and "--log-samples" in a["command"]
    created = datetime.fromisoformat(a["created"])
    assert created.tzinfo is not None
    assert isinstance(a["wall_time_s"], float) and a["wall_time_s"] > 0
    cfg = json.loads(a["config_json"])
    assert cfg["model"] == a["model"] and cfg["limit"] == SCHEMA_LIMIT
    assert cfg["tasks"] == list(DEMO_TASKS)
    res = json.loads(a["results_json"])
    assert set(res["results"]) == set(DEMO_TASKS)


def test_task_groups_and_metrics(schema_run):
    path, _ = schema_run
    res = json.loads(attrs(path)["results_json"])
    with open_h5(path) as f:
        assert set(f["tasks"]) == set(DEMO_TASKS)
        for task in DEMO_TASKS:
            g = f[f"tasks/{task}"]
            assert g.attrs["output_type"] == OUTPUT_TYPE[task]
            assert int(g.attrs["num_fewshot"]) == 0
            assert int(g.attrs["n_docs"]) == SCHEMA_LIMIT
    mc = read_metrics(path, "mpitp_demo_mc")
    for key in ("acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"):
        assert isinstance(mc[key], float) and 0 <= mc[key] <= 1, (key, mc.get(key))
    ppl = read_metrics(path, "mpitp_demo_ppl")
    assert ppl["word_perplexity,none"] > 1 and ppl["word_perplexity_stderr,none"] == "N/A"
    assert "exact_match,remove_whitespace" in read_metrics(path, "mpitp_demo_gen")
    for task in DEMO_TASKS:  # the metrics attrs are lm-eval's results entry, less its alias
        m = read_metrics(path, task)
        want = {k: v for k, v in res["results"][task].items() if k != "alias"}
        assert set(m) == set(want), task
        for k in want:
            assert same(m[k], want[k]), (task, k, m[k], want[k])


def test_requests_columns(schema_run):
    path, _ = schema_run
    total = 0
    with open_h5(path) as f:
        for task in DEMO_TASKS:
            g = f[f"tasks/{task}/requests"]
            assert set(g) == set(REQUEST_FIELDS)
            lengths = {name: g[name].shape for name in REQUEST_FIELDS}
            assert len(set(lengths.values())) == 1 and g["doc_id"].ndim == 1, lengths
            for name, dt in REQUEST_FIELDS.items():
                if dt is STR:
                    assert h5py.check_string_dtype(g[name].dtype) is not None, (task, name, g[name].dtype)
                else:
                    assert g[name].dtype == np.dtype(dt), (task, name, g[name].dtype)
            total += g["doc_id"].shape[0]
    for task in DEMO_TASKS:
        cols = read_requests(path, task)
        n = len(cols["doc_id"])
        assert n >= SCHEMA_LIMIT
        assert set(cols["kind"]) == {KIND[task]}
        assert sorted(set(cols["doc_id"].tolist())) == list(range(SCHEMA_LIMIT))
        assert len({(d, i) for d, i in zip(cols["doc_id"], cols["idx"])}) == n  # (doc_id, idx) unique
        assert len(set(cols["args_hash"])) == n and all(len(h) > 0 for h in cols["args_hash"])
        ll = cols["loglikelihood"]
        if KIND[task] == "generate_until":
            assert np.isnan(ll).all() and not cols["is_greedy"].any()
            assert all(isinstance(s, str) for s in cols["generation"])
            assert (cols["n_tokens"] >= 0).all()
        else:
            assert np.isfinite(ll).all() and (ll <= 0).all()
            assert (cols["n_tokens"] > 0).all() and all(s == "" for s in cols["generation"])
    with open_h5(path) as f:  # one row per DP group; every request was served by some group
        st = f["stats"]
        assert set(st) == {"dp_rank", *STATS_FIELDS}
        assert st["dp_rank"][()].tolist() == [0, 1]
        for name in STATS_FIELDS:
            assert st[name].shape == (2,), name
        assert int(st["requests"][()].sum()) == total
        assert (st["requests"][()] > 0).all()  # dynamic dispatch kept both groups busy


def test_samples_match_requests(schema_run):
    path, _ = schema_run
    samples = {}
    with open_h5(path) as f:
        for task in DEMO_TASKS:
            ds = f[f"tasks/{task}/samples"]
            assert h5py.check_string_dtype(ds.dtype) is not None
            docs = [json.loads(x) for x in ds.asstr()[()]]
            assert len(docs) == SCHEMA_LIMIT
            assert sorted(d["doc_id"] for d in docs) == list(range(SCHEMA_LIMIT))
            for d in docs:
                assert {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps"} <= set(d), set(d)
            samples[task] = docs
    # each logged response is the stored request row (same loglikelihood, is_greedy, generation)
    ref = reference_requests(samples)
    worst, problems = compare_requests(ref, mpitp_requests(str(path), DEMO_TASKS))
    assert not problems, problems[:5]
    assert worst == 0.0


def test_datasets_chunked_and_compressed(schema_run):
    path, _ = schema_run
    with open_h5(path) as f:
        for task in DEMO_TASKS:
            for name, ds in f[f"tasks/{task}/requests"].items():
                assert ds.chunks is not None and ds.chunks[0] >= 1, (task, name, ds.chunks)
                assert ds.compression == "gzip", (task, name, ds.compression)
                assert ds.maxshape == (None,), (task, name, ds.maxshape)


# ---------------------------------------------------------------------------------------------- inspect --json


def test_inspect_json_is_lm_eval_results(schema_run):
    from lm_eval.utils import make_table

    path, proc = schema_run
    r = mpitp_cli("inspect", path, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for key in LM_EVAL_KEYS:
        assert key in got, key
    stored = json.loads(attrs(path)["results_json"])
    assert got == stored
    for task in DEMO_TASKS:
        assert got["results"][task]["alias"] == task
        m = read_metrics(path, task)
        assert all(same(got["results"][task][k], v) for k, v in m.items()), task
        assert got["n-shot"][task] == 0 and got["n-samples"][task]["effective"] == SCHEMA_LIMIT
        assert got["configs"][task]["task"] == task
    # lm-eval has no results-file reader; its own consumer of a results dict is make_table (what lm_eval prints):
    # the JSON must render the very table the run printed from lm-eval's in-memory results.
    table = make_table(got)
    assert table.strip() and table.strip() in proc.stdout, table


# ----------------------------------------------------------------------------------------------------- resume


def _interrupt(path: Path, drop_every: int = 3) -> dict[str, int]:
    """Make a complete file look like a run killed mid-way: drop every ``drop_every``-th request row (rewriting
    the datasets as the writer does) and remove everything written at the end. Returns rows kept per task."""
    kept = {}
    with h5py.File(path, "r+", locking=False) as f:
        for task, g in f["tasks"].items():
            req = g["requests"]
            cols = {name: req[name][()] for name in req}
            n = len(cols["doc_id"])
            keep = np.array([i % drop_every != 1 for i in range(n)])
            assert keep.any() and not keep.all(), (task, n)
            kept[task] = int(keep.sum())
            for name, data in cols.items():
                old = req[name]
                dtype, chunks, opts = old.dtype, old.chunks, old.compression_opts
                del req[name]
                req.create_dataset(name, data=data[keep], dtype=dtype, maxshape=(None,),
                                   chunks=(max(1, min(kept[task], chunks[0])),), compression="gzip",
                                   compression_opts=opts)
            for k in list(g.attrs):
                del g.attrs[k]
            for k in list(g["metrics"].attrs):
                del g["metrics"].attrs[k]
            if "samples" in g:
                del g["samples"]
        if "stats" in f:
            del f["stats"]
        for k in ("results_json", "wall_time_s"):
            if k in f.attrs:
                del f.attrs[k]
        f.attrs["status"] = "running"
    return kept


@pytest.mark.slow
def test_resume_with_another_layout_equals_uninterrupted(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    common = ["eval", "--demo", "--limit", "6", "--seed", "1234"]
    pa = run_mpi(4, [*common, "--tp", "2", "--output", str(a)], timeout=600, cwd=str(tmp_path))
    assert pa.returncode == 0, explain(pa)
    assert (attrs(a)["tp"], attrs(a)["dp"]) == (2, 2)
    totals = {t: len(read_requests(str(a), t)["doc_id"]) for t in DEMO_TASKS}

    shutil.copyfile(a, b)
    kept = _interrupt(b)
    assert attrs(b)["status"] == "running"
    partial = tmp_path / "partial.h5"
    shutil.copyfile(b, partial)
    r = mpitp_cli("inspect", b)  # the interrupted file reads as a running run
    assert r.returncode == 0 and "running" in r.stdout, r.stdout + r.stderr

    pb = run_mpi(4, [*common, "--tp", "1", "--output", str(b), "--resume"], timeout=600, cwd=str(tmp_path))
    assert pb.returncode == 0, explain(pb)
    reused = {m.group(3): (int(m.group(1)), int(m.group(2)))
              for m in re.finditer(r"resume: reusing (\d+) of (\d+) (\w+) results", pb.stderr)}
    assert reused == {KIND[t]: (kept[t], totals[t]) for t in DEMO_TASKS}, pb.stderr[-3000:]

    ab = attrs(b)
    assert ab["status"] == "complete" and (ab["world_size"], ab["tp"], ab["dp"]) == (4, 1, 4)
    assert ab["created"] == attrs(a)["created"]  # the run's start, not the resume's
    with open_h5(b) as f:  # only the dropped rows were computed again
        assert round(f["stats/requests"][()].sum()) == sum(totals.values()) - sum(kept.values())
    for t in DEMO_TASKS:
        assert len(read_requests(str(b), t)["doc_id"]) == totals[t]
    d = mpitp_cli("inspect", "diff", a, b)
    assert d.returncode == 0, d.stdout + d.stderr
    assert "same within" in d.stdout

    # the same file cannot be continued with another model: refused before anything is loaded, file untouched
    before = digest(partial)
    pm = run_mpi(1, [*common, "--model", str(STORIES), "--output", str(partial), "--resume"], timeout=300,
                 cwd=str(tmp_path))
    assert pm.returncode == 2, explain(pm)
    assert "cannot resume" in pm.stderr and "model" in pm.stderr and str(STORIES) in pm.stderr, pm.stderr
    assert digest(partial) == before

    # ... nor with another --limit (the check itself, with the settings the file was made with)
    from mpitp.evaluation.checks import check_resumable
    from mpitp.evaluation.settings import EvalConfig

    stored = json.loads(attrs(partial)["config_json"])
    check_resumable(str(partial), EvalConfig(**stored))  # identical settings: accepted
    with pytest.raises(UsageError, match=r"limit 6 in the file, 5 now"):
        check_resumable(str(partial), EvalConfig(**{**stored, "limit": 5}))


# ---------------------------------------------------------------------------------------------- output guards


def test_existing_output_refused_then_overwritten(schema_run, tmp_path):
    src, _ = schema_run
    out = tmp_path / "existing.h5"
    shutil.copyfile(src, out)
    before = digest(out)
    args = ["eval", "--demo", "--limit", "2", "--output", str(out)]
    p = run_mpi(1, args, timeout=300, cwd=str(tmp_path))
    assert p.returncode == 2, explain(p)
    assert f"output {out} already exists: pass --resume to continue it or --overwrite to replace it" in p.stderr
    assert digest(out) == before

    p = run_mpi(1, [*args, "--overwrite"], timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0, explain(p)
    a = attrs(out)
    assert a["status"] == "complete" and a["world_size"] == 1
    assert json.loads(a["config_json"])["limit"] == 2
    with open_h5(out) as f:
        for task in DEMO_TASKS:
            assert int(f[f"tasks/{task}"].attrs["n_docs"]) == 2
            assert "samples" not in f[f"tasks/{task}"]  # replaced, not merged with the old file
    assert not list(tmp_path.glob("existing.h5.tmp*")) + list(tmp_path.glob(".existing.h5.*.tmp"))


# ---------------------------------------------------------------------------------------------- file locking


def test_reader_ignores_a_writers_lock_by_default(schema_run, tmp_path, monkeypatch):
    """A process holding the file for writing with HDF5 locking on would lock out any locking reader; mpitp's
    reader (locking off unless ``MPITP_HDF5_LOCKING``) still opens it."""
    from mpitp.cli.inspect import inspect_command

    src, _ = schema_run
    path = tmp_path / "held.h5"
    shutil.copyfile(src, path)
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)  # would override h5py's locking argument
    monkeypatch.delenv("MPITP_HDF5_LOCKING", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import h5py, sys\nf = h5py.File(sys.argv[1], 'r+', locking=True)\n"
                               "print('held', flush=True)\nsys.stdin.read()\nf.close()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        try:
            h5py.File(path, "r", locking=True).close()
        except OSError:
            pass
        else:
            pytest.skip("this file system does not enforce HDF5 file locks")
        with open_h5(str(path)) as f:
            assert f.attrs["status"] == "complete"
        assert len(read_requests(str(path), "mpitp_demo_mc")["doc_id"]) > 0
        r = CliRunner().invoke(inspect_command, [str(path)])
        assert r.exit_code == 0 and "mpitp_demo_mc" in r.output, r.output
        monkeypatch.setenv("MPITP_HDF5_LOCKING", "1")  # the switch back on: now the lock bites
        with pytest.raises(OSError):
            open_h5(str(path)).close()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
