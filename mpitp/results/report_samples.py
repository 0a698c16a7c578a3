"""The Samples view of the ``mpitp report`` page: per task, one row per document with its text and target and each
run's score, log-likelihood and answer.

Each run's task is read once (:func:`read_task`): its logged samples parsed once and its per-document scores read
once, for this view and for every pair the Diff view compares. The page's size is bounded (:data:`SAMPLE_CAP` rows,
:data:`TEXT_BUDGET` characters), and what is left out past a bound is listed on the page."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mpitp.results import docscores
from mpitp.results.docscores import DocScores
from mpitp.results.reader import RunFile, load_requests, load_samples
from mpitp.results.report_model import finite

SAMPLE_CAP = 200_000  # sample rows embedded per report; past it a task's rows are left out (and the page says so)
TEXT_BUDGET = 40_000_000  # characters of document and target text per report; past it rows keep scores, not text
DOC_CHARS, TARGET_CHARS = 2000, 500  # one document's text and target are cut there
CORRECTNESS = ("acc", "exact_match")  # the per-document score shown in Samples when the task has one of these


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
        return _likeliest([float(r[0]) for r in resps])
    return str(resps[0]) if isinstance(resps[0], str) else json.dumps(resps[0])


def _likeliest(lls: list[float]) -> str:
    """A choice among continuations as the report names it: the index of the likeliest (the first of equals)."""
    return f"choice {lls.index(max(lls))}"


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
    lls, from_rows = _from_rows(run.path, task)
    return TaskData(texts, answers if logged else from_rows, docscores.read(run.path, task, samples=logged), lls)


def _scores(ds: DocScores | None) -> dict[int, float | None]:
    """doc_id -> the task's first per-document metric (correctness for accuracy-like tasks)."""
    if ds is None:
        return {}
    numeric = [k for k, col in ds.values.items() if col.dtype != object and col.ndim == 1]
    preferred = [k for k in numeric if k.split(",")[0] in CORRECTNESS] + numeric
    return {int(d): finite(v) for d, v in zip(ds.doc_id, ds.values[preferred[0]])} if preferred else {}


def _from_rows(path: str, task: str) -> tuple[dict[int, float | None], dict[int, str]]:
    """doc_id -> the log-likelihood of the document's first request (its first choice or its continuation), and
    doc_id -> its answer as the request rows give it, for a run that logged no samples (its answers were blank
    beside its scores): a generation's first text (unfiltered: the filters' output is in the samples only), or for
    a choice among continuations the likeliest (:func:`_likeliest`)."""
    cols = load_requests(path, task)
    lls: dict[int, float | None] = {}
    choices: dict[int, list[float]] = {}
    answers: dict[int, str] = {}
    for d, kind, ll, text in zip(cols.get("doc_id", []), cols.get("kind", []), cols.get("loglikelihood", []),
                                 cols.get("generation", [])):
        d = int(d)
        lls.setdefault(d, finite(ll))
        if kind == "generate_until":
            answers.setdefault(d, str(text)[:TARGET_CHARS])
        elif kind == "loglikelihood":
            choices.setdefault(d, []).append(float(ll))
    for d, c in choices.items():
        answers[d] = _likeliest(c)
    return lls, answers


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
