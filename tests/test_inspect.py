"""``mpitp inspect``: the table, --json, --csv, --requests, --samples, --plot and ``inspect diff``.

Two kinds of input: small synthetic files written through the real :class:`mpitp.results.store.ResultWriter` (fast,
every field known), and one real demo evaluation under ``mpiexec`` (session-scoped, shared by every test that needs it).
Modified copies of the real file drive the ``diff`` tests.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mpitp.cli.inspect import inspect_command  # noqa: E402
from mpitp.results.plot import plot_run  # noqa: E402
from mpitp.results.reader import load  # noqa: E402
from mpitp.results.schema import open_h5  # noqa: E402
from mpitp.results.store import ResultWriter  # noqa: E402

DEMO_TASKS = ("mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen")
LM_EVAL_KEYS = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config")


def invoke(*args):
    return CliRunner().invoke(inspect_command, [str(a) for a in args], prog_name="mpitp inspect")


# ------------------------------------------------------------------------------------------- synthetic files

META = dict(mpitp_version="0.1.0", model="synthetic/model", tokenizer="synthetic/model", dtype="float32",
            world_size=4, tp=2, dp=2, command="mpitp eval --model synthetic/model", lm_eval_version="0.4.13",
            config_json=json.dumps({"model": "synthetic/model", "tasks": ["syn_mc", "syn_gen"], "limit": 3}))
MC_METRICS = {"name": "syn_mc", "sample_len": 3, "acc,none": 2 / 3, "acc_stderr,none": 0.3333,
              "acc_norm,none": 1 / 3, "acc_norm_stderr,none": 0.25}
GEN_METRICS = {"name": "syn_gen", "sample_len": 2, "exact_match,strict-match": 0.5,
               "exact_match_stderr,strict-match": "N/A"}
STATS = [dict(busy_s=2.0, requests=4, tokens_scored=100, tokens_generated=10, forwards=4, tp_bytes=0, mpi_bytes=0),
         dict(busy_s=1.0, requests=5, tokens_scored=50, tokens_generated=20, forwards=5, tp_bytes=0, mpi_bytes=0)]

#: rank 0's seconds per phase as the runner stores them (finish.write_results), totals included
PHASES = {"checks": 1.5, "load": 0.5, "requests": 0.25, "dispatch": 6.0, "metrics": 0.75, "writing": 0.1,
          "head_check": 0.07, "wall": 10.0, "max_group_busy": 2.0, "final_snapshot": 0.02}


def _mc_rows():
    return [dict(doc_id=d, idx=i, kind="loglikelihood", loglikelihood=-1.0 - d - 0.125 * i, is_greedy=(i == 0),
                 generation="", n_tokens=3 + i, args_hash=f"mc-{d}-{i}") for d in range(3) for i in range(2)]


def _gen_rows():
    return [dict(doc_id=d, idx=0, kind="generate_until", loglikelihood=float("nan"), is_greedy=False,
                 generation=f"answer {d}\nsecond line", n_tokens=5, args_hash=f"gen-{d}") for d in range(2)]


def make_file(path, complete=True, samples=True):
    """A two-task run through the real writer; rows appended out of (doc_id, idx) order as chunks would land."""
    w = ResultWriter(str(path), META)
    rows = _mc_rows()
    w.append("syn_mc", rows[3:])
    w.append("syn_gen", _gen_rows())
    w.append("syn_mc", rows[:3])
    if complete:
        mc_samples = [{"doc_id": d, "doc": {"q": f"question {d}"}, "target": 0, "acc": float(d < 2)}
                      for d in range(3)]
        w.write_task("syn_mc", dict(output_type="multiple_choice", num_fewshot=0, n_docs=3), MC_METRICS,
                     samples=mc_samples if samples else None)
        w.write_task("syn_gen", dict(output_type="generate_until", num_fewshot=2, n_docs=2), GEN_METRICS)
        w.write_stats(STATS)
        w.extra_attrs(phases_json=json.dumps(PHASES))
        w.finish({"results": {"syn_mc": {"alias": "syn_mc", **MC_METRICS},
                              "syn_gen": {"alias": "syn_gen", **GEN_METRICS}},
                  "configs": {"syn_mc": {"task": "syn_mc"}, "syn_gen": {"task": "syn_gen"}},
                  "versions": {"syn_mc": 1.0, "syn_gen": 2.0}, "n-shot": {"syn_mc": 0, "syn_gen": 2},
                  "higher_is_better": {"syn_mc": {"acc": True, "acc_norm": True}, "syn_gen": {"exact_match": True}},
                  "n-samples": {"syn_mc": {"original": 10, "effective": 3}, "syn_gen": {"original": 9, "effective": 2}},
                  "config": {"model": "synthetic/model", "limit": 3}}, wall_time_s=10.0)
    w.close()
    return str(path)


@pytest.fixture
def syn(tmp_path):
    return make_file(tmp_path / "syn.h5")


@pytest.fixture
def syn_running(tmp_path):
    return make_file(tmp_path / "running.h5", complete=False)


# --------------------------------------------------------------------------------------------- the real run
# demo_file (tests/conftest.py): one real mpiexec demo evaluation, shared with test_report.py


def _copy(src, tmp_path, name="copy.h5"):
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    return str(dst)


# ------------------------------------------------------------------------------------------------- the table


def test_table_synthetic_header_and_metrics(syn):
    r = invoke(syn)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "status      complete" in out
    assert "synthetic/model" in out and "dtype float32" in out
    assert "world 4 = dp 2 x tp 2" in out
    assert "wall time   10.0 s" in out
    # 9 requests and 180 tokens over 10 s; busy 2.0 and 1.0 s: max/mean 1.33
    assert "0.90 requests/s" in out and "18.0 tokens/s" in out
    assert "max/mean 1.33" in out
    # where the time went: rank 0's phases in the run's order, what rank 0 spent with no group busy, device-seconds
    assert "phases      checks 1.5 s, load 0.5 s, requests 0.2 s, dispatch 6.0 s, metrics 0.8 s, writing 0.1 s " \
           "(rank 0)" in out
    assert "cost        rank 0 alone 8.0 s (wall - busiest group), 40.0 device-seconds (4 ranks x 10.0 s)" in out
    lines = {tuple(line.split()[:3]): line for line in out.splitlines() if line.startswith("syn_")}
    assert ("syn_mc", "acc", "none") in lines and ("syn_mc", "acc_norm", "none") in lines
    acc = lines[("syn_mc", "acc", "none")].split()
    assert acc[3:] == ["0.6667", "±", "0.3333", "3"]
    gen = lines[("syn_gen", "exact_match", "strict-match")].split()
    assert gen[3:] == ["0.5000", "N/A", "2"]
    assert not any("sample_len" in line or "_stderr" in line for line in lines.values())


def test_table_task_filter(syn):
    r = invoke(syn, "--task", "syn_gen")
    assert r.exit_code == 0, r.output
    assert "exact_match" in r.stdout and "syn_mc" not in r.stdout


@pytest.mark.mpi
def test_table_real_run(demo_file):
    r = invoke(demo_file)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "status      complete" in out and "world 2 = dp 2 x tp 1" in out
    assert "requests/s" in out and "tokens/s" in out and "DP groups   2" in out
    with open_h5(demo_file) as f:
        res = json.loads(f.attrs["results_json"])["results"]
    for task in DEMO_TASKS:
        for key, value in res[task].items():
            if "," in key and "_stderr" not in key:
                metric, filt = key.split(",")
                row = [line.split() for line in out.splitlines() if line.split()[:3] == [task, metric, filt]]
                assert len(row) == 1, (task, key, out)
                assert math.isclose(float(row[0][3]), value, rel_tol=1e-3, abs_tol=1e-4), (row, value)
    _check_speed(demo_file, out)
    # the demo's model (built, or found in the cache) is rank 0's first phase, inside the run's wall time
    from mpitp.results.speed import PHASE_ORDER, phases_of

    phases = phases_of(load(demo_file).attrs)
    assert phases["demo"] >= 0 and "\nphases      demo " in out, (phases, out)
    serial = sum(phases[k] for k in PHASE_ORDER if k in phases and k != "writing")  # writing: a thread beside them
    assert phases["demo"] + phases["checks"] + phases["load"] <= serial <= phases["wall"] + 0.01, phases


def _check_speed(path: str, out: str) -> None:
    """Where the real run's time went (speed_json, tests/test_speed.py for each field): every task and both DP groups,
    quantiles in order, per-task requests those the file stores, the groups' shares those /stats counts."""
    from mpitp.results.speed import requests_of

    run = load(path)
    latency, tasks, groups = requests_of(run.attrs)
    assert latency is not None and 0 < latency.p50 <= latency.p90 <= latency.p99 <= latency.max, latency
    assert {t.name for t in tasks} == set(DEMO_TASKS), tasks
    for t in tasks:  # no resume: every stored row was computed in this run, and timed
        assert t.requests == run.tasks[t.name].n_rows and t.tokens > 0 and t.busy_s > 0, t
        assert t.latency is not None and t.latency.p50 <= t.latency.p90 <= t.latency.p99 <= t.latency.max <= \
            latency.max, t
    assert len(groups) == int(run.attrs["dp"]) == 2
    assert math.isclose(sum(g.requests for g in groups), sum(t.requests for t in tasks), rel_tol=1e-9)
    for g, want, busy in zip(groups, run.stats["requests"], run.stats["busy_s"]):
        assert math.isclose(g.requests, want, rel_tol=1e-6) and g.chunks >= 1, (g, want)
        assert g.busy_s <= busy * 1.05 + 0.5, (g, busy)  # rank 0 times a chunk from outside the group's clock
    assert math.isclose(sum(t.busy_s for t in tasks), sum(g.busy_s for g in groups), rel_tol=1e-3)
    assert "latency     p50 " in out and "group 1     " in out
    table = out.split("speed per task", 1)[1]
    assert all(f"\n{task} " in table for task in DEMO_TASKS), table


def test_running_file(syn_running):
    r = invoke(syn_running)
    assert r.exit_code == 0, r.output
    assert "status      running" in r.stdout and "8 request rows stored so far" in r.stdout
    assert "(6 requests stored)" in r.stdout and "n/a (run not finished)" in r.stdout

    r = invoke(syn_running, "--json")
    assert r.exit_code == 1
    partial = json.loads(r.stdout)
    assert set(LM_EVAL_KEYS) <= set(partial) and partial["results"] == {}
    assert partial["config"]["model"] == "synthetic/model"
    assert "running" in r.stderr and "not written yet" in r.stderr and r.stderr.count("\n") == 1

    r = invoke(syn_running, "--csv")
    assert r.exit_code == 0
    assert list(csv.reader(io.StringIO(r.stdout))) == [["task", "metric", "filter", "value", "stderr", "n"]]


# ------------------------------------------------------------------------------------------------ json / csv


@pytest.mark.mpi
def test_json_matches_results_json(demo_file):
    r = invoke(demo_file, "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    for key in LM_EVAL_KEYS:
        assert key in got, key
    with open_h5(demo_file) as f:
        assert got == json.loads(f.attrs["results_json"])
    assert set(got["results"]) == set(DEMO_TASKS)


def test_json_task_filter(syn):
    r = invoke(syn, "--json", "--task", "syn_gen")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert list(got["results"]) == ["syn_gen"] and list(got["n-shot"]) == ["syn_gen"]
    assert got["config"] == {"model": "synthetic/model", "limit": 3}


def _csv_rows(text):
    return list(csv.DictReader(io.StringIO(text)))


def test_csv_synthetic(syn):
    r = invoke(syn, "--csv")
    assert r.exit_code == 0, r.output
    rows = {(x["task"], x["metric"], x["filter"]): x for x in _csv_rows(r.stdout)}
    assert set(rows) == {("syn_mc", "acc", "none"), ("syn_mc", "acc_norm", "none"),
                         ("syn_gen", "exact_match", "strict-match")}
    assert float(rows[("syn_mc", "acc", "none")]["value"]) == 2 / 3  # full precision
    assert float(rows[("syn_mc", "acc", "none")]["stderr"]) == 0.3333
    assert rows[("syn_gen", "exact_match", "strict-match")]["stderr"] == ""  # "N/A"
    assert rows[("syn_mc", "acc", "none")]["n"] == "3"


@pytest.mark.mpi
def test_csv_real_run(demo_file):
    r = invoke(demo_file, "--csv")
    assert r.exit_code == 0, r.output
    rows = _csv_rows(r.stdout)
    with open_h5(demo_file) as f:
        res = json.loads(f.attrs["results_json"])["results"]
    assert len(rows) == sum(1 for t in DEMO_TASKS for k in res[t] if "," in k and "_stderr" not in k)
    for row in rows:
        assert float(row["value"]) == res[row["task"]][f"{row['metric']},{row['filter']}"]


# ---------------------------------------------------------------------------------------- requests / samples


def test_requests_sorted_and_limited(syn):
    r = invoke(syn, "--task", "syn_mc", "--requests")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("task syn_mc: 6 request rows")
    assert lines[1].split() == ["doc_id", "idx", "kind", "loglikelihood", "is_greedy", "n_tokens", "generation"]
    body = [line.split() for line in lines[3:]]
    assert [(int(b[0]), int(b[1])) for b in body] == [(d, i) for d in range(3) for i in range(2)]
    assert body[1][3] == "-1.125000" and body[0][4] == "yes" and body[1][4] == "no"

    r = invoke(syn, "--task", "syn_mc", "--requests", "--limit", "2")
    assert r.exit_code == 0 and "first 2 shown" in r.stdout and len(r.stdout.splitlines()) == 3 + 2


def test_requests_generation_truncated_and_escaped(syn):
    r = invoke(syn, "--task", "syn_gen", "--requests")
    assert r.exit_code == 0, r.output
    assert "answer 0\\nsecond line" in r.stdout and " - " in r.stdout  # NaN loglikelihood shown as "-"


def _json_stream(text):
    """The JSON documents printed one after another (pretty, so spanning lines)."""
    dec, pos, docs = json.JSONDecoder(), 0, []
    while text[pos:].strip():
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        obj, pos = dec.raw_decode(text, pos)
        docs.append(obj)
    return docs


@pytest.mark.mpi
def test_samples(syn, demo_file):
    r = invoke(syn, "--task", "syn_mc", "--samples", "--limit", "2")
    assert r.exit_code == 0, r.output
    docs = _json_stream(r.stdout)
    assert [d["doc_id"] for d in docs] == [0, 1] and docs[1]["doc"] == {"q": "question 1"}
    assert "2 of 3 samples" in r.stderr

    r = invoke(syn, "--task", "syn_gen", "--samples")
    assert r.exit_code == 1 and r.stdout == ""
    assert "no samples stored for task syn_gen" in r.stderr and "--log-samples" in r.stderr
    assert r.stderr.count("\n") == 1

    r = invoke(demo_file, "--task", "mpitp_demo_mc", "--samples")
    assert r.exit_code == 0, r.output
    docs = _json_stream(r.stdout)
    assert len(docs) == 5 and all("doc" in d and "resps" in d for d in docs)
    assert sorted(d["doc_id"] for d in docs) == list(range(5))


def test_option_errors_are_one_line_exit_2(syn):
    for args, words in ((["--requests"], "--requests needs --task"),
                        (["--json", "--csv"], "cannot be combined"),
                        (["--limit", "3"], "--limit applies"),
                        (["--task", "nope"], "has no task 'nope' (tasks: syn_gen, syn_mc)")):
        r = invoke(syn, *args)
        assert r.exit_code == 2, (args, r.output)
        assert words in r.stderr and r.stderr.count("\n") == 1 and r.stdout == "", (args, r.stderr)


# ------------------------------------------------------------------------------------------------- bad input


def test_non_hdf5_file(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_text("this is not HDF5\n")
    r = invoke(bad)
    assert r.exit_code == 2
    assert r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"mpitp: error: {bad} is not an mpitp results file (")


def test_other_bad_inputs(tmp_path, syn):
    import h5py

    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = [1, 2]
    trunc = tmp_path / "trunc.h5"
    trunc.write_bytes(open(syn, "rb").read()[:4000])
    for path, words in ((tmp_path / "missing.h5", "no such file"), (plain, "no /tasks group"),
                        (trunc, "is not an mpitp results file"), (tmp_path, "it is a directory")):
        r = invoke(path)
        assert r.exit_code == 2, (path, r.output)
        assert words in r.stderr and r.stderr.count("\n") == 1, (path, r.stderr)
    r = invoke("diff", syn, tmp_path / "bad.h5")
    assert r.exit_code == 2 and "no such file" in r.stderr and r.stderr.count("\n") == 1


# ------------------------------------------------------------------------------------------------ both forms


def test_help_shows_both_forms(syn):
    r = invoke("--help")
    assert r.exit_code == 0
    assert "mpitp inspect [OPTIONS] FILE" in r.stdout and "mpitp inspect diff [OPTIONS] A.h5 B.h5" in r.stdout
    r = invoke("diff", "--help")
    assert r.exit_code == 0 and "Usage: mpitp inspect diff [OPTIONS] A.h5 B.h5" in r.stdout and "--atol" in r.stdout
    r = invoke()
    assert r.exit_code == 2 and "missing FILE" in r.output
    # options may come before FILE
    r = invoke("--csv", syn)
    assert r.exit_code == 0 and r.stdout.startswith("task,metric,filter")


# ------------------------------------------------------------------------------------------------------ diff


def _edit(path, fn):
    with open_h5(path, "r+") as f:
        fn(f)


def test_diff_compares_speed_and_hostile_phases_are_ignored(syn, tmp_path):
    """``inspect diff`` says how much slower B ran (a regression between two versions or clusters, from the files
    alone); a ``phases_json`` someone edited (not numbers, NaN, a name with a newline) is ignored or escaped."""
    b = _copy(syn, tmp_path)

    def slower(f):
        f.attrs["wall_time_s"] = 20.0
        f.attrs["phases_json"] = json.dumps({**PHASES, "checks": 3.0, "max_group_busy": 4.0, "load": "fast",
                                             "metrics": float("nan"), "bad\nname": -1, "note\nx": 2.0})

    _edit(b, slower)
    r = invoke("diff", syn, b)
    assert r.exit_code == 0, r.output  # the same numbers: speed is reported, not judged
    assert ("speed       wall 10.0 s -> 20.0 s (2.00x), rank 0 alone 8.0 s -> 16.0 s (2.00x), device-seconds 40.0 "
            "-> 80.0 (2.00x), tokens/s 18.0 -> 9.0 (0.50x)") in r.stdout
    assert "phases      checks 1.5 s -> 3.0 s (2.00x), requests 0.2 s -> 0.2 s (1.00x), dispatch 6.0 s" in r.stdout
    assert "load" not in r.stdout.split("phases", 1)[1].split("\n")[0]  # a phase only one side has as a number
    out = invoke(b).stdout
    assert "note\\nx 2.0 s" in out and "bad" not in out and "fast" not in out and "nan" not in out.lower()


@pytest.mark.mpi
def test_diff_self_is_clean(demo_file):
    r = invoke("diff", demo_file, demo_file)
    assert r.exit_code == 0, r.output
    assert "same within atol=1e-06 rtol=1e-05" in r.stdout
    for task in DEMO_TASKS:
        assert task in r.stdout


@pytest.mark.mpi
def test_diff_perturbed_loglikelihood(demo_file, tmp_path):
    b = _copy(demo_file, tmp_path)
    where = {}

    def bump(f):
        g = f["tasks/mpitp_demo_mc/requests"]
        i = g["doc_id"].shape[0] // 2
        where.update(doc_id=int(g["doc_id"][i]), idx=int(g["idx"][i]))
        g["loglikelihood"][i] = g["loglikelihood"][i] + 1e-3

    _edit(b, bump)
    r = invoke("diff", demo_file, b)
    assert r.exit_code == 1, r.output
    assert f"mpitp_demo_mc doc_id={where['doc_id']} idx={where['idx']}: loglikelihood" in r.stdout
    row = [line.split() for line in r.stdout.splitlines() if line.startswith("mpitp_demo_mc ")][0]
    assert row[3] == "1" and math.isclose(float(row[2]), 1e-3, rel_tol=1e-3)
    assert "1 request(s), 0 metric(s), 0 task(s)" in r.stdout and "differ" in r.stderr
    # the same change within a looser tolerance is not a difference
    assert invoke("diff", demo_file, b, "--atol", "2e-3").exit_code == 0


@pytest.mark.mpi
def test_diff_tiny_perturbation_within_tolerance(demo_file, tmp_path):
    b = _copy(demo_file, tmp_path)
    _edit(b, lambda f: f["tasks/mpitp_demo_ppl/requests/loglikelihood"].__setitem__(
        0, f["tasks/mpitp_demo_ppl/requests/loglikelihood"][0] + 1e-9))
    r = invoke("diff", demo_file, b)
    assert r.exit_code == 0, r.output


@pytest.mark.mpi
def test_diff_shuffled_rows_are_same(demo_file, tmp_path):
    b = _copy(demo_file, tmp_path)
    rng = np.random.default_rng(0)

    def shuffle(f):
        for task in DEMO_TASKS:
            g = f[f"tasks/{task}/requests"]
            n = g["doc_id"].shape[0]
            perm = rng.permutation(n)
            while n > 1 and (perm == np.arange(n)).all():
                perm = rng.permutation(n)
            for name in g:
                g[name][...] = g[name][()][perm]

    _edit(b, shuffle)
    with open_h5(demo_file) as fa, open_h5(b) as fb:
        assert not np.array_equal(fa["tasks/mpitp_demo_mc/requests/doc_id"][()] * 100 +
                                  fa["tasks/mpitp_demo_mc/requests/idx"][()],
                                  fb["tasks/mpitp_demo_mc/requests/doc_id"][()] * 100 +
                                  fb["tasks/mpitp_demo_mc/requests/idx"][()])
    r = invoke("diff", demo_file, b)
    assert r.exit_code == 0, r.output


@pytest.mark.mpi
def test_diff_missing_task(demo_file, tmp_path):
    b = _copy(demo_file, tmp_path)
    _edit(b, lambda f: f.__delitem__("tasks/mpitp_demo_gen"))
    r = invoke("diff", demo_file, b)
    assert r.exit_code == 1, r.output
    assert "task mpitp_demo_gen: only in A" in r.stdout
    r = invoke("diff", b, demo_file)
    assert r.exit_code == 1 and "task mpitp_demo_gen: only in B" in r.stdout


def test_diff_missing_row_generation_greedy_and_metric(syn, tmp_path):
    def drop_last(f):
        for _name, ds in f["tasks/syn_mc/requests"].items():
            ds.resize((ds.shape[0] - 1,))

    cases = {
        "drop": (drop_last, "only in A"),
        "gen": (lambda f: f["tasks/syn_gen/requests/generation"].__setitem__(1, "other"), 'generation "answer 1'),
        "greedy": (lambda f: f["tasks/syn_mc/requests/is_greedy"].__setitem__(0, True), "is_greedy"),
        "metric": (lambda f: f["tasks/syn_mc/metrics"].attrs.__setitem__("acc,none", 0.5), "metric acc,none"),
    }
    for name, (fn, words) in cases.items():
        b = _copy(syn, tmp_path, f"{name}.h5")
        _edit(b, fn)
        r = invoke("diff", syn, b)
        assert r.exit_code == 1, (name, r.output)
        assert words in r.stdout, (name, r.stdout)


def test_diff_synthetic_self_and_nan_generations(syn, tmp_path):
    b = make_file(tmp_path / "again.h5")
    r = invoke("diff", syn, b)
    assert r.exit_code == 0, r.output
    assert "same within" in r.stdout and "8 requests in 2 task(s)" in r.stdout


# ------------------------------------------------------------------------------------------------------ plot


def test_plot_without_matplotlib(syn, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = tmp_path / "p.png"
    r = invoke(syn, "--plot", out)
    assert r.exit_code == 2
    assert "install mpitp[plot] for --plot" in r.stderr and r.stderr.count("\n") == 1
    assert r.stdout == "" and not out.exists()


class _Recorder:
    """Stands in for matplotlib's Figure/Axes: records calls so plot_run's own logic runs without matplotlib."""

    def __init__(self, log, name):
        self._log, self._name = log, name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def call(*args, **kwargs):
            self._log.append((self._name, attr, args, kwargs))
            if attr == "subplots":
                nrows, ncols = args
                return np.array([[_Recorder(self._log, f"ax{r * ncols + c}") for c in range(ncols)]
                                 for r in range(nrows)], dtype=object)
            return _Recorder(self._log, f"{self._name}.{attr}")
        return call


def test_plot_logic_with_recording_figure(syn, syn_running, tmp_path):
    log = []

    def Figure(**kwargs):
        log.append(("fig", "__init__", (), kwargs))
        return _Recorder(log, "fig")

    out = str(tmp_path / "p.png")
    plot_run(load(syn), out, Figure=Figure)
    calls = {(who, what): (a, k) for who, what, a, k in log}
    assert calls[("fig", "__init__")][1]["layout"] == "constrained"
    assert calls[("fig", "subplots")][0] == (2, 3) and calls[("fig", "subplots")][1] == {"squeeze": False}
    assert calls[("fig", "savefig")][0] == (out,)
    # three metric panels (tasks and metric attributes come back from HDF5 in name order) and the DP busy panel
    titles = [a[0] for who, what, a, k in log if what == "set_title"]
    assert titles[:3] == ["exact_match [strict-match]", "acc", "acc_norm"]
    assert titles[3] == "busy per DP group (max/mean 1.33)"
    errorbars = [(who, a, k) for who, what, a, k in log if what == "errorbar"]
    assert [e[0] for e in errorbars] == ["ax1", "ax2"]  # exact_match's stderr is N/A: no error bar
    assert [a[0].splitlines()[1:] for who, what, a, k in log if what == "suptitle"] == [
        ["error bars: +/- 1 standard error (lm-eval's stderr)"]]  # what the bars are (the report's are 95% intervals)
    assert errorbars[0][2]["yerr"].tolist() == [0.3333] and errorbars[0][2]["fmt"] == "none"
    assert [a[1] for who, what, a, k in log if who == "ax1" and what == "set_xticks"] == [["syn_mc"]]
    busy = [a for who, what, a, k in log if who == "ax3" and what == "bar"][0]
    assert busy[1].tolist() == [2.0, 1.0]
    assert [a for who, what, a, k in log if who == "ax3" and what == "axhline"][0] == (1.5,)
    assert [who for who, what, a, k in log if what == "set_axis_off"] == ["ax4", "ax5"]  # unused grid cells

    log.clear()
    plot_run(load(syn_running), out, Figure=Figure)  # no metrics, no /stats: one panel with a note
    assert [(who, what) for who, what, a, k in log if what in ("text", "set_axis_off")] == \
        [("ax0", "text"), ("ax0", "set_axis_off")]


@pytest.mark.mpi
def test_plot_with_matplotlib(syn, demo_file, tmp_path):
    pytest.importorskip("matplotlib")
    for src in (syn, demo_file):
        out = tmp_path / f"{os.path.basename(src)}.png"
        r = invoke(src, "--plot", out)
        assert r.exit_code == 0, r.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "wrote" in r.stderr


@pytest.mark.mpi  # it starts `python -m mpitp` (the guard cannot know that MPI is the thing it checks is absent)
def test_commands_that_need_no_mpi_do_not_initialise_it(syn, tmp_path):
    """Importing mpi4py.MPI initialises MPI (a singleton world: 0.1-1 s, a daemon under some MPIs). ``inspect``,
    ``report`` and ``--help`` never use it, so they never import it (issue 41: a launch that costs seconds)."""
    import subprocess
    import sys

    for args in (["inspect", syn], ["report", syn, "-o", str(tmp_path / "r.html")], ["--help"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mpitp", *args], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "import time" in line}
        assert "click" in imported and "mpi4py.MPI" not in imported, (args, sorted(imported)[:50])


def test_every_command_is_listed_and_a_broken_import_fails_loudly(monkeypatch):
    """``mpitp``'s group lists every command and imports each when it is asked for (the command of that name); a
    command module that cannot be imported is an ImportError when asked for (``mpitp --help`` asks for all), not a
    command that silently vanishes from ``mpitp --help`` (as ``inspect`` used to)."""
    import sys

    import click

    from mpitp.cli import cli

    ctx = click.Context(cli)
    names = cli.list_commands(ctx)
    assert names == ["check", "eval", "info", "inspect", "prefetch", "report", "rescore", "run", "submit", "tasks"]
    assert [cli.get_command(ctx, n).name for n in names] == names and cli.get_command(ctx, "nope") is None
    monkeypatch.setitem(sys.modules, "mpitp.cli.inspect", None)  # importing it now raises ImportError
    with pytest.raises(ImportError):
        cli.get_command(ctx, "inspect")


def test_a_long_generation_is_cut_between_escapes_never_inside_one():
    """The probe (session 29): ``inspect --requests`` cut a long generation inside an escape (``\\u001…``)."""
    from mpitp.results.render import short_text

    for pad in range(30, 40):
        text = short_text("a" * pad + "\x1b" + "b" * 10)
        assert len(text) <= 40 and text.endswith("…"), text
        body = text[:-1]
        assert body in {"a" * pad + "\\u001b" + "b" * k for k in range(11)} | {"a" * pad}, text
    assert short_text("ab\ncd") == "ab\\ncd" and short_text("x" * 40) == "x" * 40


def test_samples_of_an_unfinished_run(tmp_path):
    """A run killed before its first snapshot held a task: its rows in the journal only. --samples said the file
    "is not an mpitp results file (samples of task syn_mc: Unable to synchronously open object ...)", exit 2; now
    exit 1 with a line that says the samples are written when the run finishes."""
    path = str(tmp_path / "killed.h5")
    w = ResultWriter(path, META)
    w.flush()  # the first snapshot: no task yet
    w.append("syn_mc", _mc_rows())
    w.close()  # killed: the rows are in the journal
    with open_h5(path) as f:
        assert list(f["tasks"]) == []
    r = invoke(path, "--task", "syn_mc", "--samples")
    assert r.exit_code == 1 and r.stdout == "", r.output
    assert r.stderr == (f"mpitp: {path}: no samples stored for task syn_mc yet: status is 'running' (logged samples "
                        "are written when the run finishes)\n")


def test_rescore_reads_rows_of_the_journal(tmp_path):
    """mpitp rescore of a run killed before its first snapshot held a task read the snapshot's tasks only: 'cannot
    rescore F: no request rows stored' for a file with 6 rows in its journal (inspect --requests listed them); it
    now sees them, so a run stopped short is told which requests are missing and to --resume it."""
    from mpitp.evaluation.rescore import _stored_rows

    path = str(tmp_path / "killed.h5")
    w = ResultWriter(path, META)
    w.flush()
    w.append("syn_mc", _mc_rows())
    w.close()
    rows = _stored_rows(path)
    assert sorted(k[:3] for k in rows) == [("syn_mc", d, i) for d in range(3) for i in range(2)]
    assert rows[("syn_mc", 2, 1, "mc-2-1", 0)]["loglikelihood"] == -3.125


def test_diff_of_an_unfinished_run_says_why_it_has_no_scores(syn, syn_running):
    """inspect diff (and the report's Diff view) of a finished run against one still running blamed the file's age:
    'no per-document scores in B (file written before doc_scores existed, without --log-samples)'; a run writes them
    when it finishes, and the note now says so."""
    r = invoke("diff", syn, syn_running, "--bootstrap-iters", "10")
    assert "syn_mc: no per-document scores in A and B (a run writes them when it finishes; a file from before " \
           "doc_scores existed has them only with --log-samples)" in r.stdout, r.output


def test_samples_print_as_lm_evals_samples_file(tmp_path):
    """--samples printed the record as lm-eval held it in memory (``"target": 0``, ``"arguments": [[ctx, cont]]``,
    ``"resps": [[[-1.5, true]]]``); lm-eval's samples_<task>_<time>.jsonl of the same run has ``"0"``,
    ``{"gen_args_0": {"arg_0": ctx, "arg_1": cont}}`` and ``[[["-1.5", "True"]]]``. Now the same keys, order and
    values as that file, built here the way lm-eval's EvaluationTracker builds it."""
    from lm_eval.utils import sanitize_list

    sample = {"doc_id": 0, "doc": {"q": "x"}, "target": 0, "arguments": [["ctx", " a"], ["ctx", " b"]],
              "resps": [[[-1.5, True]], [[-2.25, False]]], "filtered_resps": [[-1.5, True], [-2.25, False]],
              "filter": "none", "metrics": ["acc"], "acc": 1.0}
    path = str(tmp_path / "s.h5")
    w = ResultWriter(path, META)
    w.append("syn_mc", _mc_rows())
    w.write_task("syn_mc", dict(output_type="multiple_choice", num_fewshot=0, n_docs=3), MC_METRICS,
                 samples=[sample])
    w.finish({"results": {"syn_mc": {"alias": "syn_mc", **MC_METRICS}}}, wall_time_s=1.0)
    w.close()
    expected = dict(sample, target="0", resps=sanitize_list(sample["resps"]),
                    filtered_resps=sanitize_list(sample["filtered_resps"]),
                    arguments={f"gen_args_{i}": {f"arg_{j}": x for j, x in enumerate(a)}
                               for i, a in enumerate(sample["arguments"])})
    r = invoke(path, "--task", "syn_mc", "--samples")
    assert r.exit_code == 0, r.output
    [got] = _json_stream(r.stdout)
    assert got == expected and list(got) == list(expected), got


def test_task_may_name_a_group(tmp_path):
    """The table lists an lm-eval group's aggregate as a row, but --task GROUP was 'has no task' (exit 2) for the
    table, --json and --csv alike. Now they show the group's aggregate; --requests and --samples, which read rows
    only tasks have, say it is a group and name its tasks; an unknown name lists the groups too."""
    path = make_file(tmp_path / "g.h5")
    with h5py.File(path, "a") as f:
        res = json.loads(f.attrs["results_json"])
        res["results"]["grp"] = {"alias": "grp", "acc,none": 0.5, "acc_stderr,none": 0.25}
        res["group_subtasks"] = {"grp": ["syn_mc", "syn_gen"]}
        f.attrs["results_json"] = json.dumps(res)
    r = invoke(path, "--task", "grp")
    assert r.exit_code == 0, r.output
    assert [line.split()[:3] for line in r.stdout.splitlines() if line.startswith(("grp", "syn"))] == [
        ["grp", "acc", "none"]]
    r = invoke(path, "--task", "grp", "--csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["grp,acc,none,0.5,0.25,"], r.output
    r = invoke(path, "--task", "grp", "--json")
    assert r.exit_code == 0 and list(json.loads(r.stdout)["results"]) == ["grp"], r.output
    r = invoke(path, "--task", "grp", "--requests")
    assert r.exit_code == 2 and r.stderr == (f"mpitp: error: {path}: 'grp' is a group, whose rows and samples are "
                                             "its tasks' (tasks: syn_gen, syn_mc)\n"), r.output
    r = invoke(path, "--task", "nope")
    assert "has no task 'nope' (tasks: syn_gen, syn_mc; groups: grp)" in r.stderr, r.output
