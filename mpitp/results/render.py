"""The text renderers of ``mpitp inspect``: the summary (header lines and the metrics table), CSV, lm-eval's results
JSON and the request rows of one task, all from a :class:`mpitp.results.reader.RunFile`."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re

from mpitp.results.reader import RunFile, as_number, load_requests, metric_rows, task_n_docs
from mpitp.results.speed import speed, speed_lines, task_table
from mpitp.results.texttable import text_table


def fmt_value(v: object) -> str:
    x = as_number(v)
    if x is None:
        return "" if v is None else str(v)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return f"{x:.4f}" if abs(x) < 1e7 else f"{x:.6g}"


def stats_totals(run: RunFile) -> dict | None:
    import numpy as np

    from mpitp.results.schema import STATS_FIELDS

    if not run.stats or "busy_s" not in run.stats:
        return None
    s = run.stats
    tot = {k: float(np.sum(s[k])) for k in STATS_FIELDS if k in s}
    busy = np.asarray(s["busy_s"], dtype=float)
    tot["groups"] = int(busy.shape[0])
    tot["busy_min"] = float(busy.min()) if busy.size else 0.0
    tot["busy_max"] = float(busy.max()) if busy.size else 0.0
    mean = float(busy.mean()) if busy.size else 0.0
    tot["imbalance"] = tot["busy_max"] / mean if mean > 0 else float("nan")
    return tot


def _config(run: RunFile) -> dict:
    """The run's recorded settings (``config_json``); {} when absent or not a JSON object."""
    from mpitp.results.untrusted import load_json

    try:
        config = load_json(run.attrs["config_json"], "config_json") if isinstance(run.attrs.get("config_json"),
                                                                                   str) else {}
    except ValueError:  # BadInput included: not JSON, too large or too deep
        config = {}
    return config if isinstance(config, dict) else {}


def layout_line(attrs: dict) -> str:
    pp = as_number(attrs.get("pp", 1))
    pp = int(pp) if pp is not None and math.isfinite(pp) and pp >= 1 else 1
    stages = f" x pp {pp}" if pp > 1 else ""
    nodes = str(attrs.get("nodes") or "")
    where = f" on {nodes.count(',') + 1} node(s) ({nodes})" if nodes else ""
    return (f"world {attrs.get('world_size', '?')} = dp {attrs.get('dp', '?')}{stages} x tp {attrs.get('tp', '?')}"
            f"{where}")


def header_lines(run: RunFile) -> list[str]:
    a = run.attrs
    lines = [f"file        {run.path}"]
    status = run.status
    if status == "running":
        rows = sum(t.n_rows for t in run.tasks.values())
        status += f" (no metrics yet; {rows} request rows stored so far)"
    lines.append(f"status      {status}")
    lines.append(f"model       {a.get('model', '?')}   dtype {a.get('dtype', '?')}")
    lines.append(f"layout      {layout_line(a)}")
    versions = "  ".join(f"{k.replace('_version', '')} {a[k]}" for k in
                         ("mpitp_version", "lm_eval_version", "torch_version", "transformers_version") if k in a)
    if "created" in a:
        lines.append(f"created     {a['created']}")
    if versions:
        lines.append(f"versions    {versions}")
    if _config(run).get("trust_remote_code") is True:
        lines.append("remote code trust_remote_code: the model's own Python code from its repository ran")
    if a.get("test_hooks"):
        lines.append(f"test hooks  {a['test_hooks']} (a test run: results altered or steered on purpose)")
    wall = as_number(a.get("wall_time_s"))
    lines.append(f"wall time   {wall:.1f} s" if wall is not None else "wall time   n/a (run not finished)")
    tot = stats_totals(run)
    if tot is not None:
        tokens = tot.get("tokens_scored", 0.0) + tot.get("tokens_generated", 0.0)
        if wall and wall > 0:
            lines.append(f"throughput  {tot.get('requests', 0) / wall:.2f} requests/s, {tokens / wall:.1f} tokens/s "
                         f"({tot.get('requests', 0):.0f} requests, {tokens:.0f} tokens)")
        lines.append(f"DP groups   {tot['groups']}: busy {tot['busy_min']:.2f} .. {tot['busy_max']:.2f} s "
                     f"(max/mean {tot['imbalance']:.2f})")
    s = speed(run, tot)
    if s is not None:
        lines += speed_lines(s)
    return lines


def render_summary(run: RunFile, task: str | None) -> str:
    rows = []
    for r in metric_rows(run, task):
        err = as_number(r.stderr)
        rows.append([r.task, r.metric, r.filter, fmt_value(r.value), "±" if err is not None else "",
                     fmt_value(r.stderr) if r.stderr is not None else "", "" if r.n is None else str(r.n)])
    with_metrics = {r[0] for r in rows}
    for name, t in run.tasks.items():  # tasks with no metrics yet (a running or interrupted run)
        if (task is None or name == task) and name not in with_metrics:
            n = task_n_docs(run, t)
            rows.append([name, f"({t.n_rows} requests stored)", "", "-", "", "", "" if n is None else str(n)])
    out = "\n".join(header_lines(run)) + "\n\n"
    if rows:
        out += text_table(["task", "metric", "filter", "value", "", "stderr", "n"], rows, right={3, 6})
    else:
        out += "(no tasks)"
    s = speed(run, stats_totals(run))
    if s is not None and task is not None:  # --task T: T's speed row only, as its metrics (the run's lines stay)
        s = dataclasses.replace(s, tasks=tuple(t for t in s.tasks if t.name == task))
    per_task = task_table(s) if s is not None else ""
    return out + ("\n\n" + per_task if per_task else "")


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)")


def csv_cell(v: object) -> str:
    """``v`` as a CSV cell that a spreadsheet cannot run: text from a file (a task, metric or filter name, a value
    stored as text) that starts with ``= + - @``, a tab or a carriage return gets a leading ``'`` (OWASP's advice
    against CSV injection: ``=HYPERLINK(...)``, ``=cmd|' /C calc'!A0``). Numbers stay numbers: ``-0.5`` is left as
    it is, text or not."""
    text = str(v)
    if text.startswith(_FORMULA_START) and not _PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


def render_csv(run: RunFile, task: str | None) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "metric", "filter", "value", "stderr", "n"])
    for r in metric_rows(run, task):
        v, e = as_number(r.value), as_number(r.stderr)
        w.writerow([csv_cell(c) for c in (r.task, r.metric, r.filter, repr(v) if v is not None else r.value,
                                          repr(e) if e is not None else "", "" if r.n is None else r.n)])
    return buf.getvalue()


def lm_eval_json(run: RunFile, task: str | None) -> tuple[dict, bool]:
    """(lm-eval results dict, complete?). A running file gives what is known so far."""
    if run.results_json is not None:
        res = dict(run.results_json)
        if task is not None:
            for k, v in res.items():
                if k != "config" and isinstance(v, dict):
                    res[k] = {name: x for name, x in v.items() if name == task}
        return res, True
    names = [n for n in run.tasks if task is None or n == task]
    config = _config(run)
    res = {
        "results": {n: {"alias": n, **run.tasks[n].metrics} for n in names if run.tasks[n].metrics},
        "configs": {},
        "versions": {},
        "n-shot": {n: run.tasks[n].attrs["num_fewshot"] for n in names if "num_fewshot" in run.tasks[n].attrs},
        "higher_is_better": {},
        "n-samples": {n: {"effective": task_n_docs(run, run.tasks[n])} for n in names
                      if task_n_docs(run, run.tasks[n]) is not None},
        "config": {"model": run.attrs.get("model"), **config},
    }
    return res, False


def lm_eval_sample(s: dict) -> dict:
    """A stored sample as lm-eval's ``samples_<task>_<time>.jsonl`` holds it (its ``EvaluationTracker`` writes
    ``arguments`` as ``{gen_args_i: {arg_j: ...}}``, every leaf of ``resps`` and ``filtered_resps`` as text, and
    ``target`` as text). The results file keeps lm-eval's record as it was in memory; ``inspect --samples`` printed
    that, so its output and lm-eval's file of the same run differed in those four keys (``"target": 0`` against
    ``"0"``, ``[-141.07, false]`` against ``["-141.07", "False"]``)."""
    def texts(v: object) -> object:  # lm_eval.utils.sanitize_list on what came back from JSON
        return [texts(x) for x in v] if isinstance(v, list) else str(v)

    out = dict(s)
    args = s.get("arguments")
    if isinstance(args, list) and all(isinstance(a, list) for a in args):
        out["arguments"] = {f"gen_args_{i}": {f"arg_{j}": x for j, x in enumerate(a)} for i, a in enumerate(args)}
    for key in ("resps", "filtered_resps"):
        if key in s:
            out[key] = texts(s[key])
    if "target" in s:
        out["target"] = str(s["target"])
    return out


def short_text(s: str, width: int = 40) -> str:
    """``s`` on one line, at most ``width`` characters: newlines, tabs and control characters escaped as JSON
    escapes them, and a long text cut between two escapes, never inside one (``\\u001`` then "…" was shown)."""
    full = json.dumps(s, ensure_ascii=False)[1:-1]
    if len(full) <= width:
        return full
    out, used = [], 0
    for ch in s:
        piece = json.dumps(ch, ensure_ascii=False)[1:-1]
        if used + len(piece) > width - 1:
            break
        out.append(piece)
        used += len(piece)
    return "".join(out) + "…"


def render_requests(path: str, task: str, limit: int | None) -> str:
    cols = load_requests(path, task)
    n = len(cols["doc_id"])
    shown = n if limit is None else min(n, limit)
    rows = []
    for i in range(shown):
        ll = float(cols["loglikelihood"][i])
        rows.append([str(int(cols["doc_id"][i])), str(int(cols["idx"][i])), str(cols["kind"][i]),
                     "-" if math.isnan(ll) else f"{ll:.6f}", "yes" if bool(cols["is_greedy"][i]) else "no",
                     str(int(cols["n_tokens"][i])), short_text(str(cols["generation"][i]))])
    head = f"task {task}: {n} request rows, sorted by (doc_id, idx)"
    if shown < n:
        head += f"; first {shown} shown"
    table = text_table(["doc_id", "idx", "kind", "loglikelihood", "is_greedy", "n_tokens", "generation"], rows,
                       right={0, 1, 3, 5})
    return head + "\n" + table
