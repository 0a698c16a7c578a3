"""``mpitp report``: one self-contained HTML page (runs, leaderboard, samples, sweep plot) for files on disk.

Why one file with everything inline: an HPC user has results on a cluster and a laptop with a browser, often with no
server they may run; the page must open from disk and ask no host for anything (no CDN, no font, no image URL).

Every file is read through :func:`mpitp.results.reader.load` (which checks untrusted files) and everything a file
says reaches the page either through jinja2's autoescape (HTML text) or through :func:`script_json` (data for the
page's script), never by string concatenation into markup.

Each file is read once: a task's logged samples are parsed once and its per-document scores read once, for the
Samples view and for every pair the Diff view compares (:func:`read_task`, :func:`paired`); writing is linear in the
documents (plus one paired bootstrap per pair, task and metric, as ``inspect diff``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import re
import stat
from dataclasses import asdict, dataclass, field

from mpitp.results import docscores
from mpitp.results.diff import paired_comparisons, statistics_text
from mpitp.results.docscores import DocScores
from mpitp.results.reader import BadInput, RunFile, as_number, load, load_requests, load_samples, metric_rows
from mpitp.results.render import fmt_value, layout_line
from mpitp.results.sweepsummary import read_summary
from mpitp.results.untrusted import kind, load_json, shown

log = logging.getLogger("mpitp")

SAMPLE_CAP = 200_000  # sample rows embedded per report; past it a task's rows are left out (and the page says so)
TEXT_BUDGET = 40_000_000  # characters of document and target text per report; past it rows keep scores, not text
DIFF_ITERS = 10000  # bootstrap resamples of the paired tests, as ``mpitp inspect diff``'s default
DOC_CHARS, TARGET_CHARS = 2000, 500  # one document's text and target are cut there
SUMMARY_NAME = "sweep-summary.json"
CORRECTNESS = ("acc", "exact_match")  # the per-document score shown in Samples when the task has one of these
PAIR_BOUND = 12  # runs: up to this many every pair's paired tests are on the page (66 pairs), past it neighbours'
Z95 = 1.96  # the sweep plot's bars: value ± 1.96 · stderr, a 95% confidence interval under the normal approximation
# a model path's last part that names a checkpoint (see family()): step-100, checkpoint_2000, global_step5, 300
CHECKPOINT = re.compile(r"(?i)^(?:(?:checkpoint|ckpt|step|global_step|iter|iteration|epoch)[-_]?)?\d+$")


@dataclass
class RunView:
    label: str
    path: str
    model: str
    fingerprint: str
    layout: str
    created: str
    wall_time: str  # the run's wall time; empty while it has not finished
    status: str
    versions: str


@dataclass
class Cell:
    value: float | None
    stderr: float | None
    text: str
    best: bool = False
    err_text: str = ""  # the stderr as inspect prints it


@dataclass
class LeaderRow:
    task: str
    metric: str
    filter: str
    cells: list[Cell]
    parent: str = ""  # the lm-eval group this task belongs to (its row is folded under the group's)
    depth: int = 0
    has_children: bool = False


@dataclass
class SweepPanel:
    """One metric against checkpoint: (name, value, stderr) per checkpoint, as inline SVG."""

    title: str
    points: list[tuple[str, float, float]]
    svg_points: list[dict] = field(default_factory=list)
    y_labels: list[dict] = field(default_factory=list)  # the axis' lowest and highest value, where they are drawn


@dataclass
class DiffView:
    """The paired tests of run ``b`` against run ``a`` per task, the text ``mpitp inspect diff A B`` prints (the page
    holds each pair once, ``a`` the earlier run)."""

    a: str
    b: str
    text: str


@dataclass
class Report:
    runs: list[RunView]
    leaderboard: list[LeaderRow]
    samples: dict  # task -> {"runs": [labels], "rows": [[doc_id, prompt, target, [score], [ll], [answer]]]}
    left_out: list[str]
    sweeps: list[SweepPanel]
    sweep_tests: list[str] = field(default_factory=list)  # the summary's paired tests between neighbours
    diffs: list[DiffView] = field(default_factory=list)  # every pair (a first) up to diff_bound runs, else neighbours
    diff_bound: int = PAIR_BOUND
    diff_iters: int = DIFF_ITERS  # 0: no paired tests (as inspect diff)


def expand(inputs: list[str], warn=None) -> tuple[list[str], list[str]]:
    """Result files and sweep summaries named by ``inputs`` (a directory contributes its ``*.h5`` and summary).

    A directory may be shared: what is found there under those names but is not a regular file (a FIFO, whose open
    would wait forever; a device; a socket) is skipped, each with one line to ``warn``. A file named on the command
    line is read as given (a FIFO there is refused by the reader, one line)."""
    files, summaries = [], []
    for p in inputs:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.h5")))
            summary = os.path.join(p, SUMMARY_NAME)
            found += [summary] if os.path.lexists(summary) else []
            for f in found:
                try:
                    mode = os.stat(f).st_mode
                except OSError as exc:  # a dangling link
                    mode, why = None, exc.strerror or str(exc)
                if mode is not None and stat.S_ISREG(mode):
                    (summaries if f == summary else files).append(f)
                else:
                    why = kind(mode) if mode is not None else why
                    (warn or log.warning)(f"skipped {shown(f)}: {why}, not a regular file")
        elif p.endswith(".json"):
            summaries.append(p)
        else:
            files.append(p)
    if not files and not summaries:
        raise BadInput(f"no results files in {', '.join(inputs)}")
    return files, summaries


def _num(v) -> float | None:
    x = as_number(v)
    return x if x is not None and math.isfinite(x) else None


def _wall(v) -> str:
    x = _num(v)
    return f"{x:.1f} s" if x is not None else ""


def run_view(label: str, run: RunFile) -> RunView:
    a = run.attrs
    fp = a.get("fingerprint_json")
    versions = "  ".join(f"{k.replace('_version', '')} {a[k]}" for k in ("mpitp_version", "lm_eval_version") if k in a)
    return RunView(label=label, path=run.path, model=str(a.get("model", "?")),
                   fingerprint=hashlib.sha256(fp.encode()).hexdigest()[:12] if isinstance(fp, str) else "",
                   layout=layout_line(a), created=str(a.get("created", "")), wall_time=_wall(a.get("wall_time_s")),
                   status=run.status, versions=versions)


def _parents(runs: list[RunFile]) -> dict[str, str]:
    """subtask -> its lm-eval group, from ``group_subtasks`` of the runs' results (the first run that says wins)."""
    out: dict[str, str] = {}
    for run in runs:
        groups = (run.results_json or {}).get("group_subtasks")
        for group, subtasks in (groups.items() if isinstance(groups, dict) else ()):
            for sub in subtasks if isinstance(subtasks, list) else ():
                if isinstance(sub, str) and sub != group:
                    out.setdefault(sub, str(group))
    return out


def _tree_order(rows: list[LeaderRow], parents: dict[str, str]) -> list[LeaderRow]:
    """Each group's row followed by its subtasks' rows (depth first); a cycle in a damaged file is cut."""
    tasks = {r.task for r in rows}
    by_parent: dict[str, list[LeaderRow]] = {}
    for r in rows:
        parent = parents.get(r.task, "")
        r.parent = parent if parent in tasks else ""
        by_parent.setdefault(r.parent, []).append(r)
    out: list[LeaderRow] = []
    seen: set[str] = set()

    def add(parent: str, depth: int) -> None:
        for r in by_parent.get(parent, []):
            r.depth, r.has_children = depth, r.task in by_parent
            out.append(r)
            if r.task not in seen:
                seen.add(r.task)
                add(r.task, depth + 1)

    add("", 0)
    if len(out) != len(rows):  # a cycle (a damaged file): no folding rather than rows that never show
        for r in rows:
            r.parent, r.depth, r.has_children = "", 0, False
        return rows
    return out


def leaderboard(runs: list[RunFile], higher: dict[str, bool]) -> list[LeaderRow]:
    """Tasks x runs; the best value of a row (by lm-eval's higher_is_better, else higher) is marked; a group's
    subtasks follow its row (folded on the page)."""
    table: dict[tuple[str, str, str], list[Cell]] = {}
    for i, run in enumerate(runs):
        for r in metric_rows(run):
            cells = table.setdefault((r.task, r.metric, r.filter), [Cell(None, None, "") for _ in runs])
            # the text ``mpitp inspect`` prints: the leaderboard must show the same
            cells[i] = Cell(_num(r.value), _num(r.stderr), fmt_value(r.value), err_text=fmt_value(r.stderr))
    rows = []
    for (task, metric, filt), cells in table.items():
        vals = [c.value for c in cells if c.value is not None]
        if len(vals) > 1:
            best = (max if higher.get(f"{task}/{metric}", True) else min)(vals)
            for c in cells:
                c.best = c.value == best
        rows.append(LeaderRow(task, metric, filt, cells))
    return _tree_order(rows, _parents(runs))


def _higher(runs: list[RunFile]) -> dict[str, bool]:
    out = {}
    for run in runs:
        for task, m in ((run.results_json or {}).get("higher_is_better") or {}).items():
            for metric, hib in m.items():
                if isinstance(hib, bool):
                    out[f"{task}/{metric}"] = hib
    return out


def _prompt(s: dict) -> str:
    """The first request's context, as lm-eval logs ``arguments`` (a list of argument tuples, or a dict of
    ``gen_args_i`` holding ``arg_0``...); the document itself when there is none."""
    args = s.get("arguments")
    first = next(iter(args.values()), None) if isinstance(args, dict) else args[0] if isinstance(args, list) and args \
        else None
    ctx = first.get("arg_0") if isinstance(first, dict) else first[0] if isinstance(first, list) and first else None
    if isinstance(ctx, str):
        return ctx
    doc = s.get("doc")
    return doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)


def _answer(s: dict) -> str:
    """The run's answer: the generated text, or for a choice among continuations the index of the likeliest."""
    resps = s.get("filtered_resps")
    if not isinstance(resps, list) or not resps:
        return ""
    while isinstance(resps, list) and len(resps) == 1 and isinstance(resps[0], list) and \
            not (len(resps[0]) == 2 and isinstance(resps[0][0], (int, float))):
        resps = resps[0]  # [["4"]] -> ["4"]
    if all(isinstance(r, list) and r and isinstance(r[0], (int, float)) for r in resps):
        lls = [float(r[0]) for r in resps]
        return f"choice {lls.index(max(lls))}"
    return str(resps[0]) if isinstance(resps[0], str) else json.dumps(resps[0])


@dataclass
class TaskData:
    """One run's one task as the page needs it, read once (the samples' JSON parsed once, the per-document scores
    read once), whatever number of views and pairs use it."""

    texts: dict[int, tuple[str, str]]  # doc_id -> (prompt, target), from logged samples
    answers: dict[int, str]  # doc_id -> the run's answer
    scores: DocScores | None  # per-document metric values (doc_scores, else the logged samples')
    lls: dict[int, float | None]  # doc_id -> log-likelihood of the first request


def read_task(run: RunFile, task: str) -> TaskData:
    """Everything the page shows of ``task`` in ``run``. The samples (written by write_task with the task's attrs:
    a journal-only task has neither) are parsed once here and handed to :func:`docscores.read`, which would otherwise
    parse them again for files without ``doc_scores``."""
    logged = None
    if run.tasks[task].attrs:
        stored = load_samples(run.path, task)
        logged = None if stored is None else docscores.parse_samples(stored)
    texts, answers = {}, {}
    for s in logged or []:
        if isinstance(s.get("doc_id"), int):
            texts[s["doc_id"]] = (_prompt(s)[:DOC_CHARS], str(s.get("target", ""))[:TARGET_CHARS])
            answers[s["doc_id"]] = _answer(s)[:TARGET_CHARS]
    return TaskData(texts, answers, docscores.read(run.path, task, samples=logged), _lls(run.path, task))


def _scores(ds: DocScores | None) -> dict[int, float | None]:
    """doc_id -> the task's first per-document metric (correctness for accuracy-like tasks)."""
    if ds is None:
        return {}
    numeric = [k for k, col in ds.values.items() if col.dtype != object and col.ndim == 1]
    preferred = [k for k in numeric if k.split(",")[0] in CORRECTNESS] + numeric
    return {int(d): _num(v) for d, v in zip(ds.doc_id, ds.values[preferred[0]])} if preferred else {}


def _lls(path: str, task: str) -> dict[int, float | None]:
    """doc_id -> the log-likelihood of the document's first request (its first choice or its continuation)."""
    cols = load_requests(path, task)
    out: dict[int, float | None] = {}
    for d, ll in zip(cols.get("doc_id", []), cols.get("loglikelihood", [])):
        out.setdefault(int(d), _num(ll))
    return out


def samples(runs: list[RunFile], labels: list[str], data: dict[tuple[int, str], TaskData], cap: int = SAMPLE_CAP,
            text_budget: int = TEXT_BUDGET) -> tuple[dict, list[str]]:
    """Per task, one row per document: its text and target (from the first run that logged samples) and each run's
    score and log-likelihood. The page's size is bounded: at most ``cap`` rows and ``text_budget`` characters of
    text in all; what is left out past either is listed (shown on the page)."""
    out, left_out, total, chars = {}, [], 0, 0
    tasks = sorted({t for run in runs for t in run.tasks})
    for task in tasks:
        have = [(label, data[i, task]) for i, (label, run) in enumerate(zip(labels, runs)) if task in run.tasks]
        texts = next((td.texts for _, td in have if td.texts), {})
        answers = [td.answers for _, td in have]
        scores = [_scores(td.scores) for _, td in have]
        lls = [td.lls for _, td in have]
        docs = sorted(set(texts).union(*scores, *lls))
        if total + len(docs) > cap:
            left_out.append(f"{task}: {len(docs)} documents left out (the report embeds at most {cap} sample rows)")
            continue
        total += len(docs)
        size = sum(len(a) + len(b) for a, b in texts.values()) + sum(len(x) for a in answers for x in a.values())
        if chars + size > text_budget:
            left_out.append(f"{task}: document texts left out ({size} characters; the report embeds at most "
                            f"{text_budget} in all), scores kept")
            texts, answers = {}, [{} for _ in answers]
        else:
            chars += size
        out[task] = {"runs": [label for label, _ in have],
                     "rows": [[d, *texts.get(d, ("", "")), [s.get(d) for s in scores], [ll.get(d) for ll in lls],
                               [a.get(d, "") for a in answers]]
                              for d in docs]}
    return out, left_out


def sweep_tests(path: str) -> list[str]:
    """The paired tests between neighbouring checkpoints that the sweep wrote into its summary, one line each."""
    doc = read_summary(path)
    comparisons = doc.get("comparisons", []) if isinstance(doc, dict) else []
    out = []
    for c in comparisons if isinstance(comparisons, list) else []:
        if isinstance(c, dict):
            line = c.get("sentence") or (f"{c.get('b')} against {c.get('a')}: {c['error']}" if "error" in c else "")
            if line:
                out.append(f"{c.get('b', '?')} vs {c.get('a', '?')}: {line}")
    return out


def sweep_panels(path: str, width: int = 520, height: int = 220) -> list[SweepPanel]:
    """One panel per (task, metric) of a sweep summary, points scaled into an SVG box (one point per checkpoint)."""
    try:
        rows = [r for r in read_summary(path)["checkpoints"] if isinstance(r, dict) and r.get("metrics")]
        checkpoints = [(str(r.get("name", "?")), dict(r["metrics"])) for r in rows]
    except BadInput:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path}: not a sweep summary ({exc})") from None
    return panels(checkpoints, "", width, height)


def panels(checkpoints: list[tuple[str, dict]], prefix: str, width: int = 520, height: int = 220) -> list[SweepPanel]:
    """One panel per (task, metric) over ``checkpoints`` (name, {task: {metric key: value}}, in sweep order), each
    point with its 95% confidence interval: value ± 1.96 · stderr (lm-eval's stderr of the metric; neither a sweep
    summary nor a results file holds a per-checkpoint bootstrap interval), no bar where there is no stderr."""
    found: dict[tuple[str, str], SweepPanel] = {}
    for name, metrics in checkpoints:
        for task, m in metrics.items():
            for key, v in (m.items() if isinstance(m, dict) else ()):
                metric, _, filt = key.partition(",")
                if "_stderr" in metric or _num(v) is None:
                    continue
                err = _num(m.get(f"{metric}_stderr,{filt}")) or 0.0
                found.setdefault((task, key), SweepPanel(f"{prefix}{task}: {key}", [])).points.append(
                    (name, float(v), err))
    for p in found.values():
        lo = min(v - Z95 * e for _, v, e in p.points)
        hi = max(v + Z95 * e for _, v, e in p.points)
        span = (hi - lo) or 1.0
        n = len(p.points)
        for i, (name, v, e) in enumerate(p.points):
            x = 50 + (width - 100) * (i / (n - 1) if n > 1 else 0.5)  # room for the names under the first/last

            def y(val):
                return height - 30 - (height - 50) * (val - lo) / span

            ci = f"95% CI [{fmt_value(v - Z95 * e)}, {fmt_value(v + Z95 * e)}]" if e else "no stderr"
            p.svg_points.append(dict(x=round(x, 1), y=round(y(v), 1), y0=round(y(v - Z95 * e), 1),
                                     y1=round(y(v + Z95 * e), 1), name=name, value=fmt_value(v), stderr=fmt_value(e),
                                     ci=ci))
        p.y_labels = [dict(y=round(height - 30, 1), text=fmt_value(lo)), dict(y=20.0, text=fmt_value(hi))]
    return list(found.values())


def _revision(run: RunFile) -> str:
    try:
        rev = load_json(run.attrs.get("config_json") or "{}", "config_json").get("revision")
    except (ValueError, AttributeError):
        return ""
    return rev if isinstance(rev, str) else ""


def family(run: RunFile) -> tuple[str, str] | None:
    """(family, checkpoint name) of a run, or None. The rule: the model's last path part is checkpoint-like
    (:data:`CHECKPOINT`: ``step-100``, ``checkpoint_2000``, ``global_step5``, ``300``) and the family is the path
    before it; else the run names a ``--revision`` and the family is the model. Nothing else is guessed."""
    model = str(run.attrs.get("model", "")).rstrip("/")
    base, _, last = model.rpartition("/")
    if base and CHECKPOINT.match(last):
        return base, last
    rev = _revision(run)
    return (model, rev) if rev and model else None


def families(runs: list[RunFile]) -> list[tuple[str, list[int]]]:
    """Families of at least two runs (by :func:`family`), each's runs ordered naturally by checkpoint name
    (``step-2`` before ``step-10``, :func:`mpitp.results.sweepsummary.natural_key`: a sweep's glob order)."""
    from mpitp.results.sweepsummary import natural_key

    groups: dict[str, list[int]] = {}
    for i, run in enumerate(runs):
        f = family(run)
        if f:
            groups.setdefault(f[0], []).append(i)
    return [(name, sorted(idx, key=lambda i: natural_key(family(runs[i])[1])))
            for name, idx in groups.items() if len(idx) > 1]


def family_order(runs: list[RunFile]) -> list[int]:
    """The runs' order on the page: as given, except that a family's runs stand together in checkpoint order where
    its first run was (so a family's neighbours are neighbouring runs, R3 and R4, compared in the Diff view)."""
    fams = {i: idx for _, idx in families(runs) for i in idx}
    out: list[int] = []
    for i in range(len(runs)):
        if i not in out:
            out += fams.get(i, [i])
    return out


def pairs(n: int) -> list[tuple[int, int]]:
    """The pairs whose paired tests are on the page: every pair (i < j) up to :data:`PAIR_BOUND` runs (66 pairs),
    past it only neighbours (each pair is a bootstrap per task and metric: the writing time grows with pairs x
    documents x ``--bootstrap-iters``)."""
    if n <= PAIR_BOUND:
        return [(i, j) for i in range(n) for j in range(i + 1, n)]
    return [(i, i + 1) for i in range(n - 1)]


def paired(runs: list[RunFile], data: dict[tuple[int, str], TaskData], iters: int = DIFF_ITERS,
           seed: int = 1234) -> dict[tuple[int, int], list]:
    """The paired tests of run j against run i for each of :func:`pairs`, by the code ``mpitp inspect diff A B``
    prints them with (:func:`mpitp.results.diff.paired_comparisons`, its defaults), from the scores read once.

    Why precomputed in Python rather than computed by the page's script: the page is static, and the numbers must be
    those ``inspect diff`` prints; its paired bootstrap draws from numpy's generator (a script could not repeat the
    draws), and one implementation of the statistics is one to keep right. The bound on pairs keeps the cost known."""
    by_path = {(runs[i].path, task): td.scores for (i, task), td in data.items()}

    def scores(path: str, task: str):
        return by_path[path, task]

    if iters <= 0:  # as inspect diff: no paired tests at --bootstrap-iters 0
        return {}
    return {(i, j): paired_comparisons(runs[i], runs[j], [t for t in runs[i].tasks if t in runs[j].tasks], iters, seed,
                                       scores=scores)
            for i, j in pairs(len(runs))}


def _metrics_of(run: RunFile) -> dict:
    """{task: {"acc,none": value, "acc_stderr,none": stderr}} of a results file, the shape of a sweep summary's."""
    out: dict = {}
    for r in metric_rows(run):
        out.setdefault(r.task, {})[f"{r.metric},{r.filter}"] = r.value
        out[r.task][f"{r.metric}_stderr,{r.filter}"] = r.stderr
    return out


def build(inputs: list[str], cap: int = SAMPLE_CAP, text_budget: int = TEXT_BUDGET,
          diff_iters: int = DIFF_ITERS, warn=None) -> Report:
    files, summaries = expand(inputs, warn)
    runs = [load(p) for p in files]
    if not summaries:  # files of one model family are a sweep (a summary, when given, is the sweep instead)
        runs = [runs[i] for i in family_order(runs)]
    labels = [f"R{i + 1}" for i in range(len(runs))]
    data = {(i, task): read_task(run, task) for i, run in enumerate(runs) for task in run.tasks}
    sample_data, left_out = samples(runs, labels, data, cap, text_budget)
    comps = paired(runs, data, diff_iters)
    report = Report(runs=[run_view(label, run) for label, run in zip(labels, runs)],
                    leaderboard=leaderboard(runs, _higher(runs)), samples=sample_data, left_out=left_out,
                    sweeps=[p for s in summaries for p in sweep_panels(s)],
                    sweep_tests=[t for s in summaries for t in sweep_tests(s)],
                    diffs=[DiffView(labels[i], labels[j], statistics_text(c)) for (i, j), c in comps.items()],
                    diff_bound=PAIR_BOUND, diff_iters=diff_iters)
    for name, idx in ([] if summaries else families(runs)):
        names = [family(runs[i])[1] for i in idx]
        report.sweeps += panels([(n, _metrics_of(runs[i])) for n, i in zip(names, idx)], f"{name}: ")
        for (i, a), (j, b) in zip(zip(idx, names), zip(idx[1:], names[1:])):
            for tc in comps.get((i, j), []):
                report.sweep_tests += [f"{b} vs {a}: {m.sentence()}" for m in tc.metrics]
                report.sweep_tests += [f"{b} vs {a}: {tc.task}: {tc.note}"] if tc.note else []
    return report


def script_json(data) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` (so no ``</script>`` and no
    ``<!--``), and no NaN (not JSON)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(report: Report) -> str:
    import jinja2
    from markupsafe import Markup

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["script_json"] = lambda d: Markup(script_json(d))
    diff_data = {"runs": [r.label for r in report.runs], "paths": [r.path for r in report.runs],
                 "bound": report.diff_bound, "iters": report.diff_iters,
                 "pairs": {f"{d.a}|{d.b}": d.text for d in report.diffs}}
    return env.get_template("report.html.j2").render(
        report=report, board=[asdict(r) for r in report.leaderboard], samples=report.samples, diff_data=diff_data)


def write(inputs: list[str], out: str, cap: int = SAMPLE_CAP, diff_iters: int = DIFF_ITERS, warn=None) -> int:
    """Write the page to ``out``; returns its size in bytes. ``warn``: where the one-line notes of files skipped in
    a directory go (the ``mpitp`` logger when None)."""
    from mpitp.results.safefile import write_replace

    data = render(build(inputs, cap, diff_iters=diff_iters, warn=warn)).encode()
    write_replace(out, data)
    return len(data)
