"""Where a run's time went, per task and per DP group (``speed_json``): recorded on rank 0 as chunks land
(:mod:`mpitp.evaluation.requestlog`, through the real :class:`~mpitp.evaluation.dispatch.Dispatcher`), read back
defensively (:mod:`mpitp.results.speed`), printed by ``inspect`` and ``inspect diff``, shown by the report per run and
per sweep checkpoint. No MPI here: tests/test_inspect.py's real run checks the same fields end to end.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from mpitp.cli.inspect import inspect_command
from mpitp.evaluation import requestlog
from mpitp.evaluation.requestlog import RequestLog
from mpitp.results.reader import load
from mpitp.results.speed import LATENCY_KEYS, quantiles, requests_of, speed
from mpitp.results.store import ResultWriter


def invoke(*args):
    return CliRunner().invoke(inspect_command, [str(a) for a in args], prog_name="mpitp inspect")


class Clock:
    """A clock the test moves by hand: latencies are then exact."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


# ------------------------------------------------------------------------------------------------ recording


def test_quantiles_are_nearest_rank():
    assert quantiles([]) == {}
    assert quantiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    assert quantiles(range(100, 0, -1)) == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    q = quantiles([0.1, 0.2, 0.3, 10.0])  # every value shown is one some request had, none interpolated
    assert q == {"p50": 0.2, "p90": 10.0, "p99": 10.0, "max": 10.0}


def test_request_log_per_task_and_group():
    """Chunks of two tasks in two groups: requests and tokens per task, the group's compute seconds split by the
    chunking's weights, latencies from dispatch to landing; rolling windows make one request once all have landed
    (in any group); an item without an owner counts for its group only."""
    clock = Clock()
    log = RequestLog(2, clock=clock)
    a1, a2, b1 = requestlog.whole(["A", "A", "B"])
    log.sent(0, 1)
    clock.t += 1.0
    log.sent(1, 0)
    clock.t += 0.5
    log.landed(1, [b1], [(-1.0, True, 4)], [10])  # rank 0's own: busy = its latency, 0.5 s
    clock.t += 2.0
    log.landed(0, [a1, a2], [(-1.0, True, 2), (-2.0, False, 3)], [30, 10], busy_s=2.0)  # queued 1.5 s of 3.5
    log.sent(2, 1)
    log.landed(2, [None], [(-1.0, True, 7)], [5], busy_s=0.0)  # an item without an owner
    docs = [[([1, 2], 1), ([3, 4], 1)], [([5], 1)]]  # request 0: two windows, request 1: one
    w00, w01, w10 = requestlog.windows(docs, ["P", "P"])
    log.sent(3, 0)
    clock.t += 1.0
    log.sent(4, 1)
    clock.t += 1.0
    log.landed(4, [w01, w10], [(-1.0, True, 1), (-1.0, True, 1)], [2, 1], busy_s=0.3)
    assert "P" in log.tasks and log.tasks["P"].requests == 1  # request 1 done; request 0 waits for its window
    clock.t += 1.0
    log.landed(3, [w00], [(-3.0, True, 1)], [2], busy_s=0.6)
    out = log.summary()
    a, b, p = out["tasks"]["A"], out["tasks"]["B"], out["tasks"]["P"]
    assert (a["requests"], a["tokens"], a["busy_s"]) == (2, 5, 2.0)
    assert a["latency"] == {"p50": 3.5, "p90": 3.5, "p99": 3.5, "max": 3.5}
    assert (b["requests"], b["tokens"], b["busy_s"]) == (1, 4, 0.5) and b["latency"]["max"] == 0.5
    # request 0's latency runs from its first window's dispatch (t=104) to its last landing (t=107): 3 s
    assert p["requests"] == 2 and p["tokens"] == 3 and sorted([1.0, 3.0]) == [p["latency"]["p50"], p["latency"]["max"]]
    assert math.isclose(p["busy_s"], 0.9)
    assert out["latency"] == {"p50": 3.0, "p90": 3.5, "p99": 3.5, "max": 3.5}  # of 0.5 1.0 3.0 3.5 3.5
    g0, g1 = out["groups"]
    assert (g0["chunks"], g0["requests"], g0["tokens"]) == (2, 1.5, 5) and math.isclose(g0["busy_s"], 1.1)
    assert (g1["chunks"], g1["requests"], g1["tokens"]) == (3, 4.5, 14)  # the item without an owner counts here only
    assert sum(t["requests"] for t in out["tasks"].values()) == 5
    json.dumps(out, allow_nan=False)  # what the file keeps is plain JSON


def test_dispatcher_records_every_chunk_on_its_stats(monkeypatch):
    """The real dispatcher (one group: rank 0 computes every chunk) leaves the run's summary on its stats, which
    rank 0's /stats entry carries to the file (mpitp.evaluation.finish)."""
    import mpitp.evaluation.dispatch as dispatch
    from mpitp.evaluation.dispatch import Dispatcher

    monkeypatch.setattr(dispatch.mpicomm, "try_recv_obj", lambda comm, tag: None)  # no other group: nothing arrives

    stats = SimpleNamespace(mpi_bytes=0, speed=None)
    d = Dispatcher(SimpleNamespace(dp_leader_comm=None, dp=1), timeout=5.0, stats=stats, per_group=3,
                   compute=lambda kind, items, tick: [(-1.0, True, len(c)) for _, c in items])
    items = [("q", "x" * (i + 1)) for i in range(9)]
    tasks = ["A" if i % 3 else "B" for i in range(9)]
    out = d.run("loglikelihood", items, [len(c) for _, c in items], owners=requestlog.whole(tasks))
    assert [n for _, _, n in out] == list(range(1, 10))
    s = stats.speed
    assert s["tasks"]["A"]["requests"] == 6 and s["tasks"]["B"]["requests"] == 3
    assert s["tasks"]["A"]["tokens"] + s["tasks"]["B"]["tokens"] == 45
    assert s["groups"][0]["requests"] == 9 and s["groups"][0]["chunks"] >= 1
    assert list(s["latency"]) == list(LATENCY_KEYS)


def test_a_remote_group_sends_its_compute_seconds(monkeypatch):
    import mpitp.evaluation.dispatch as dispatch

    inbox = [(("work", "loglikelihood", 7, [("q", "a")]), 0, 11), (("stop",), 0, 11)]
    sent = []

    class Pending:
        nbytes = 10

        def wait(self, *a):
            pass

        def done(self):
            return True

    monkeypatch.setattr(dispatch.mpicomm, "recv_obj", lambda *a, **k: inbox.pop(0))
    monkeypatch.setattr(dispatch.mpicomm, "isend_obj", lambda obj, *a: sent.append(obj) or Pending())
    dispatch.serve_remote(SimpleNamespace(dp_leader_comm=None), lambda kind, items, tick: [(-1.0, True, 1)], 5.0)
    (tag, cid, result, busy), = sent
    assert (tag, cid, result) == ("result", 7, [(-1.0, True, 1)]) and 0 <= busy < 5


# ------------------------------------------------------------------------------------------------- reading

LAT = {"p50": 0.5, "p90": 0.9, "p99": 1.25, "max": 1.5}
SPEED = {"latency": LAT,
         "tasks": {"syn_mc": {"requests": 6, "tokens": 18, "busy_s": 2.0, "latency": LAT},
                   "syn_gen": {"requests": 2, "tokens": 10, "busy_s": 0.5,
                               "latency": {"p50": 0.25, "p90": 0.25, "p99": 0.25, "max": 0.25}}},
         "groups": [{"requests": 5, "tokens": 16, "busy_s": 1.5, "chunks": 3, "latency": LAT},
                    {"requests": 3, "tokens": 12, "busy_s": 1.0, "chunks": 1, "latency": LAT}]}


def make_run(path, speed_json=SPEED, wall=10.0, model="synthetic/model") -> str:
    """A finished two-group run through the real writer; ``speed_json`` None: a file from before it existed."""
    w = ResultWriter(str(path), dict(mpitp_version="0.1.0", model=model, tokenizer=model, dtype="float32",
                                     world_size=2, tp=1, dp=2, lm_eval_version="0.4.13"))
    w.append("syn_mc", [dict(doc_id=d, idx=0, kind="loglikelihood", loglikelihood=-1.0, is_greedy=True,
                             generation="", n_tokens=3, args_hash=str(d)) for d in range(6)])
    w.write_task("syn_mc", dict(output_type="multiple_choice", num_fewshot=0, n_docs=6),
                 {"acc,none": 0.5, "acc_stderr,none": 0.2, "sample_len": 6})
    w.write_stats([dict(busy_s=1.5, requests=5, tokens_scored=16), dict(busy_s=1.0, requests=3, tokens_scored=12)])
    if speed_json is not None:
        w.extra_attrs(speed_json=speed_json if isinstance(speed_json, str) else json.dumps(speed_json))
    w.finish({"results": {"syn_mc": {"acc,none": 0.5, "acc_stderr,none": 0.2, "sample_len": 6}}}, wall)
    w.close()
    return str(path)


def test_inspect_prints_tasks_groups_and_quantiles(tmp_path):
    r = invoke(make_run(tmp_path / "a.h5"))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "latency     p50 0.5 s, p90 0.9 s, p99 1.25 s, max 1.5 s (per request, dispatch to result on rank 0)" in out
    assert "group 0     5 requests, 16 tokens, busy 1.50 s, 3 chunks, chunk latency p50 0.5 s" in out
    assert "group 1     3 requests, 12 tokens, busy 1.00 s, 1 chunk, chunk latency" in out
    table = out.split("speed per task", 1)[1].splitlines()
    assert table[1].split() == ["task", "requests", "tokens", "busy", "s", "req/s", "tok/s", "p50", "s", "p90", "s",
                                "p99", "s", "max", "s"]
    assert table[3].split() == ["syn_gen", "2", "10", "0.50", "4.00", "20.0", "0.25", "0.25", "0.25", "0.25"]
    assert table[4].split() == ["syn_mc", "6", "18", "2.00", "3.00", "9.0", "0.5", "0.9", "1.25", "1.5"]


def test_inspect_task_shows_that_tasks_speed_only(tmp_path):
    """``--task T`` ("Only this task") showed T's metrics above every task's speed row."""
    r = invoke(make_run(tmp_path / "a.h5"), "--task", "syn_mc")
    assert r.exit_code == 0, r.output
    table = r.stdout.split("speed per task", 1)[1].splitlines()
    assert [row.split()[0] for row in table[3:] if row.strip()] == ["syn_mc"], r.stdout
    assert "group 0     5 requests" in r.stdout  # the run's own lines stay


def test_an_older_file_reads_and_shows_none_of_it(tmp_path):
    r = invoke(make_run(tmp_path / "old.h5", speed_json=None))
    assert r.exit_code == 0, r.output
    assert "latency" not in r.stdout and "group 0" not in r.stdout and "speed per task" not in r.stdout
    assert "cost        " in r.stdout  # what older files have is still shown


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "{" * 200 + "}" * 200, json.dumps({"tasks": "x" * 3_000_000}),
                                  json.dumps({"latency": 5, "tasks": [1], "groups": {"0": {}}})])
def test_malformed_speed_json_is_ignored(tmp_path, text):
    r = invoke(make_run(tmp_path / "bad.h5", speed_json=text))
    assert r.exit_code == 0, r.output
    assert "latency" not in r.stdout and "speed per task" not in r.stdout


def test_hostile_entries_are_dropped_or_escaped(tmp_path):
    """An edited file: a NaN, a negative, a string or a bool where counts go drops that task; quantiles out of order
    drop the latency; one bad group drops the groups (their positions are the DP ranks); names are escaped."""
    hostile = {"latency": {"p50": 2.0, "p90": 1.0, "p99": 3.0, "max": 4.0},
               "tasks": {"nan": {"requests": float("nan"), "tokens": 1, "busy_s": 1.0},
                         "neg": {"requests": -1, "tokens": 1, "busy_s": 1.0},
                         "str": {"requests": "5", "tokens": 1, "busy_s": 1.0},
                         "bool": {"requests": True, "tokens": 1, "busy_s": 1.0},
                         "inf": {"requests": 1, "tokens": 1, "busy_s": 1e999},
                         "\x1b[2Jevil\nname": {"requests": 1, "tokens": 2, "busy_s": 0.0,
                                               "latency": {"p50": 1, "p90": "x", "p99": 1, "max": 1}}},
               "groups": [{"requests": 1, "tokens": 1, "busy_s": 1.0}, {"requests": 1, "tokens": -5, "busy_s": 1.0}]}
    path = make_run(tmp_path / "hostile.h5", speed_json=json.dumps(hostile))
    latency, tasks, groups = requests_of(load(path).attrs)
    assert latency is None and groups == ()
    assert [t.name for t in tasks] == ["\x1b[2Jevil\nname"] and tasks[0].latency is None
    assert tasks[0].rate(1.0) is None  # no busy seconds: no rate, not a division by zero
    out = invoke(path).stdout
    assert "\x1b" not in out and "\\x1b[2Jevil\\nname" in out
    assert "nan" not in out.split("speed per task", 1)[1] and "inf" not in out.split("speed per task", 1)[1]


def test_diff_prints_ratios_b_over_a(tmp_path):
    a = make_run(tmp_path / "a.h5")
    slower = json.loads(json.dumps(SPEED))
    slower["latency"] = {k: 2 * v for k, v in LAT.items()}
    slower["tasks"]["syn_mc"]["busy_s"] = 4.0
    b = make_run(tmp_path / "b.h5", speed_json=slower, wall=20.0)
    out = invoke("diff", a, b).stdout
    assert "latency     p50 0.5 s -> 1 s (2.00x), p90 0.9 s -> 1.8 s (2.00x), p99 1.25 s -> 2.5 s (2.00x), " \
           "max 1.5 s -> 3 s (2.00x)" in out
    assert "task syn_mc: busy 2.00 s -> 4.00 s (2.00x), tok/s 9.0 -> 4.5 (0.50x)" in out
    assert "group 0:    busy 1.50 s -> 1.50 s (1.00x)" in out
    old = make_run(tmp_path / "old.h5", speed_json=None)
    out = invoke("diff", old, b).stdout  # one side without speed_json: its lines are left out, the rest stays
    assert "speed       wall 10.0 s -> 20.0 s (2.00x)" in out and "latency " not in out and "task syn_mc:" not in out


# ------------------------------------------------------------------------------------------------ the report


def test_report_shows_speed_per_run_and_per_checkpoint(tmp_path):
    from mpitp.results.report import build
    from mpitp.results.report_html import render
    from mpitp.results.speed import task_rows

    hostile = json.loads(json.dumps(SPEED))
    hostile["tasks"]["<b>x</b>"] = hostile["tasks"].pop("syn_gen")
    paths = [make_run(tmp_path / f"{i}.h5", speed_json=hostile if i == 1 else SPEED, wall=10.0 * (i + 1),
                      model=f"ck/step-{i}") for i in (2, 1)]
    paths.append(make_run(tmp_path / "old.h5", speed_json=None, model="ck/step-3"))
    report = build(paths, diff_iters=0)
    r1 = report.runs[0]
    assert r1.model == "ck/step-1"
    assert r1.speed.endswith("latency p50 0.5 s, p99 1.25 s") and r1.speed_latency.startswith("p50 0.5 s")
    assert r1.speed_tasks == task_rows(speed(load(paths[1]), None))  # the same rows inspect prints
    assert r1.speed_groups[0].startswith("group 0: 5 requests, 16 tokens")
    assert report.runs[2].speed_tasks == [] and "latency" not in report.runs[2].speed
    (table,) = report.sweep_speed
    assert table.title == "ck" and [row[0] for row in table.rows] == ["step-1", "step-2", "step-3"]
    assert table.rows[0][1:] == ["20.0", "0.40", "1.4", "0.5", "1.25", "18.5"]
    assert table.rows[2][4:6] == ["-", "-"]  # an older file: no latency
    page = render(report)
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert page.count('class="speed-tasks"') == 2 and 'class="sweep-speed"' in page


def test_sweep_summary_text_shows_speed_from_files_beside_it(tmp_path):
    from mpitp.results.sweepsummary import Row, render_summary, write_summary

    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"  # outside the summary's folder (below it is read)
    elsewhere.mkdir()
    outputs = [make_run(tmp_path / "step-1.h5"), str(tmp_path / "step-2.h5"), make_run(elsewhere / "step-3.h5")]
    rows = [Row(f"m/step-{i}", f"step-{i}", out, "complete", wall_s=1.0 * i,
                metrics={"syn_mc": {"acc,none": 0.5, "sample_len": 6}}) for i, out in enumerate(outputs, 1)]
    path = tmp_path / "sweep-summary.json"
    write_summary(str(path), rows, 3.0)
    text = render_summary(rows, str(path))
    block = text.split("speed per checkpoint", 1)[1].splitlines()
    assert block[3].split() == ["step-1", "10.0", "0.80", "2.8", "0.5", "1.25", "8.5"]
    assert block[4].split() == ["step-2", "2.0", "-", "-", "-", "-", "-"]  # no file: the summary's wall only
    assert block[5].split()[2:] == ["-"] * 5  # not beside the summary: not opened
    rows[0] = Row("m/step-1", "step-1", str(tmp_path / "nothing.h5"), "complete")
    assert "speed per checkpoint" not in render_summary(rows[:2], str(path))


def test_sweep_charts_plot_only_metrics_with_bars_inside_the_axis():
    from mpitp.results.report_sweep import panels

    checkpoints = [(f"s{i}", {"t": {"acc,none": v, "acc_stderr,none": e, "sample_len": 100, "alias": "t",
                                    "bits_per_byte,none": 0.5, "bits_per_byte_stderr,none": "N/A"}})
                   for i, (v, e) in enumerate([(0.9, 0.3), (0.5, 0.01), (0.02, 2.0)])]
    got = panels(checkpoints, "")
    assert [p.title for p in got] == ["t: acc,none", "t: bits_per_byte,none"]
    for p in got:
        for q in p.svg_points:
            assert 20 <= q["y1"] <= q["y"] <= q["y0"] <= 190, q


def test_log_axis_error_bars_stop_at_the_axis_floor():
    np = pytest.importorskip("numpy")
    from mpitp.results.plot import error_bars

    vals, errs = np.array([10.0, 2000.0, 5e5]), np.array([20.0, 100.0, 1e5])
    (lower, upper), (lo, hi) = error_bars(vals, errs, True)
    assert (vals - lower > 0).all() and (vals - lower >= lo).all() and (vals + upper <= hi).all()
    assert list(upper) == list(errs) and lower[1] == 100.0  # only the bar that would leave the axis is cut
    same, limits = error_bars(vals, errs, False)
    assert same is errs and limits is None


def test_group_request_counts_add_up_to_the_run():
    """Rolling windows split over DP groups give groups fractional request counts (win.h5: 2, 1.595, 0.762, 0.643 of
    5 requests): rounded they read 2 + 2 + 1 + 1 = 6; whole counts stay whole."""
    from mpitp.results.speed import Share, group_text

    lines = [group_text(Share(str(g), x, 100, 0.1)) for g, x in enumerate([2.0, 1.5952381, 0.76190476, 0.64285714])]
    shown = [line.split(" requests")[0] for line in lines]
    assert shown == ["2", "1.60", "0.76", "0.64"], lines
    assert math.isclose(sum(float(x) for x in shown), 5.0)
    assert group_text(Share("0", 77.0, 1935, 10.56)).startswith("77 requests, 1935 tokens")


def test_sweep_summary_names_its_files_from_any_directory(tmp_path, monkeypatch):
    """A sweep launched with a relative ``--output 'sw/{name}.h5'`` wrote ``sw/step-1.h5`` into its summary:
    ``mpitp inspect`` and ``mpitp report`` run from another directory resolved it against their own and showed no
    speed per checkpoint. The summary names each file absolute."""
    from mpitp.results.report import build
    from mpitp.results.sweepsummary import Row, write_summary

    (tmp_path / "sw").mkdir()
    make_run(tmp_path / "sw" / "step-1.h5")
    monkeypatch.chdir(tmp_path)
    rows = [Row("ck/step-1", "step-1", "sw/step-1.h5", "complete", wall_s=2.0,
                metrics={"syn_mc": {"acc,none": 0.5, "sample_len": 6}})]
    write_summary("sw/sweep-summary.json", rows, 3.0)
    summary = tmp_path / "sw" / "sweep-summary.json"
    assert json.loads(summary.read_text())["checkpoints"][0]["output"] == str(tmp_path / "sw" / "step-1.h5")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = CliRunner().invoke(inspect_command, [str(summary)])
    assert got.exit_code == 0, got.output
    block = got.output.split("speed per checkpoint", 1)[1].splitlines()
    assert block[3].split()[:3] == ["step-1", "10.0", "0.80"]  # read from the file
    report = build([str(tmp_path / "sw")], diff_iters=0)
    assert [t.rows[0][0] for t in report.sweep_speed] == ["step-1"]


def test_sweep_with_a_folder_per_checkpoint_keeps_its_summary_above_them(tmp_path):
    """``--output 'nest/{name}/r.h5'``: the summary went into the first checkpoint's folder
    (``nest/step-1/sweep-summary-r.json``) and the second checkpoint's speed row was all dashes (its file was not
    "beside" the summary). The summary is the folder's that holds them all, ``nest/sweep-summary-r.json``, and every
    checkpoint's speed is read."""
    from mpitp.results.sweepsummary import Row, render_summary, summary_path, write_summary

    rows = []
    for i in (1, 2):
        (tmp_path / "nest" / f"step-{i}").mkdir(parents=True)
        rows.append(Row(f"ck/step-{i}", f"step-{i}", make_run(tmp_path / "nest" / f"step-{i}" / "r.h5"), "complete",
                        wall_s=1.0, metrics={"syn_mc": {"acc,none": 0.5, "sample_len": 6}}))
    path = summary_path(rows)
    assert path == str(tmp_path / "nest" / "sweep-summary-r.json")
    write_summary(path, rows, 3.0)
    block = render_summary(rows, path).split("speed per checkpoint", 1)[1].splitlines()
    assert [line.split()[:3] for line in block[3:5]] == [["step-1", "10.0", "0.80"], ["step-2", "10.0", "0.80"]]
    assert summary_path(rows[:1]) == str(tmp_path / "nest" / "step-1" / "sweep-summary-r.json")  # one: its own
