"""``mpitp report``: one self-contained HTML page (runs, leaderboard, samples, sweep plot) for files on disk.

Why one file with everything inline: an HPC user has results on a cluster and a laptop with a browser, often with no
server they may run; the page must open from disk and ask no host for anything (no CDN, no font, no image URL).

Every file is read through :func:`mpitp.results.reader.load` (which checks untrusted files) and everything a file
says reaches the page either through jinja2's autoescape (HTML text) or through :func:`script_json` (data for the
page's script), never by string concatenation into markup (:mod:`mpitp.results.report_html`).

Each file is read once: a task's logged samples are parsed once and its per-document scores read once, for the
Samples view and for every pair the Diff view compares (:func:`read_task`, :func:`paired`); writing is linear in the
documents (plus one paired bootstrap per pair, task and metric, as ``inspect diff``).

This module gathers the page (:func:`build`) and writes it (:func:`write`); each view's data is its own module:
``report_board`` (runs, leaderboard), ``report_samples`` (Samples), ``report_sweep`` (sweep charts and families),
the Diff view's pairs here; ``report_model`` holds the dataclasses they fill and ``report_html`` renders them.
"""

from __future__ import annotations

import glob
import logging
import os
import stat
from typing import TYPE_CHECKING

from mpitp.results.diff import paired_comparisons, statistics_text
from mpitp.results.journal import MAGIC
from mpitp.results.reader import BadInput, RunFile, load
from mpitp.results.report_board import higher_is_better, leaderboard, run_view
from mpitp.results.report_html import render, script_json
from mpitp.results.report_model import DIFF_ITERS, PAIR_BOUND, DiffView, Report
from mpitp.results.report_samples import SAMPLE_CAP, TEXT_BUDGET, TaskData, read_task, samples
from mpitp.results.report_sweep import (
    family,
    family_order,
    family_speed,
    family_sweeps,
    summary_speed,
    sweep_panels,
    sweep_tests,
)
from mpitp.results.sweepsummary import SUMMARY_GLOB, natural_key
from mpitp.results.untrusted import kind, shown

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpitp.results.docscores import DocScores

__all__ = ["DIFF_ITERS", "PAIR_BOUND", "SAMPLE_CAP", "TEXT_BUDGET", "Report", "build", "expand", "family", "paired",
           "pairs", "render", "script_json", "write"]

log = logging.getLogger("mpitp")

def expand(inputs: list[str], warn: Callable[[str], object] | None = None) -> tuple[list[str], list[str]]:
    """Result files and sweep summaries named by ``inputs`` (a directory contributes its ``*.h5`` and summary).

    A directory may be shared: what is found there under those names but is not a regular file (a FIFO, whose open
    would wait forever; a device; a socket), and a link another user made (to a file of yours they cannot read: the
    report would publish it; the rule of Linux's ``protected_symlinks``, which covers sticky folders only), are
    skipped, each with one line to ``warn``. A file named on the command line is read as given (a FIFO there is
    refused by the reader, one line).

    A directory that holds none (its files one folder down, as ``--output_path`` puts them) is said in one line, not
    dropped in silence while the other inputs make a page: alone it is the error that nothing was found."""
    files, summaries, empty = [], [], []
    for p in inputs:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.h5")), key=natural_key)  # a sweep's order: step-2, step-10
            summary_files = sorted(glob.glob(os.path.join(p, SUMMARY_GLOB)))  # one per sweep (summary_path)
            found += summary_files
            for f in found:
                try:
                    link = os.lstat(f)
                    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
                        (warn or log.warning)(f"skipped {shown(f)}: a link made by uid {link.st_uid}, not by this "
                                              f"user (uid {os.geteuid()}): not followed")
                        continue
                    mode = os.stat(f).st_mode
                except OSError as exc:  # a dangling link
                    mode, why = None, exc.strerror or str(exc)
                if mode is not None and stat.S_ISREG(mode):
                    (summaries if f in summary_files else files).append(f)
                else:
                    why = kind(mode) if mode is not None else why
                    (warn or log.warning)(f"skipped {shown(f)}: {why}, not a regular file")
            if not found:
                empty.append(p)
        elif p.endswith(".json"):
            summaries.append(p)
        else:
            files.append(p)
    if not files and not summaries:
        raise BadInput(f"no results files in {', '.join(inputs)}")
    for p in empty:
        (warn or log.warning)(f"skipped {shown(p)}: no *.h5 or {SUMMARY_GLOB} in it (its subfolders are not read)")
    return files, summaries


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

    def scores(path: str, task: str) -> DocScores | None:
        return by_path[path, task]

    if iters <= 0:  # as inspect diff: no paired tests at --bootstrap-iters 0
        return {}
    return {(i, j): paired_comparisons(runs[i], runs[j], [t for t in runs[i].tasks if t in runs[j].tasks], iters, seed,
                                       scores=scores)
            for i, j in pairs(len(runs))}


def _read(files: list[str], named: set[str], warn: Callable[[str], object] | None
          ) -> tuple[list[RunFile], dict[str, dict[str, TaskData]]]:
    """Each results file and its tasks' data. A file found in a folder that is not a readable results file (an empty
    ``x.h5`` another user left in a shared folder, a file of another program) is skipped with one line to ``warn``, as
    a FIFO there is: it stopped the whole page. A file named on the command line is an error, one line."""
    runs, tasks = [], {}
    for p in files:
        try:
            run = load(p)
            tasks[run.path] = {task: read_task(run, task) for task in run.tasks}
        except BadInput as exc:
            if p in named:
                raise
            said = str(exc)  # the readers' lines start with the path ("X is not an mpitp results file (...)")
            (warn or log.warning)(f"skipped {said}" if said.startswith(shown(p)) else f"skipped {shown(p)}: {said}")
            continue
        runs.append(run)
    if not runs and files:
        raise BadInput(f"no readable results files among the {len(files)} found in {', '.join(map(shown, named))}")
    return runs, tasks


def build(inputs: list[str], cap: int = SAMPLE_CAP, text_budget: int = TEXT_BUDGET,
          diff_iters: int = DIFF_ITERS, warn: Callable[[str], object] | None = None) -> Report:
    files, summaries = expand(inputs, warn)
    runs, tasks = _read(files, set(inputs), warn)
    if not summaries:  # files of one model family are a sweep (a summary, when given, is the sweep instead)
        runs = [runs[i] for i in family_order(runs)]
    labels = [f"R{i + 1}" for i in range(len(runs))]
    data = {(i, task): tasks[run.path][task] for i, run in enumerate(runs) for task in run.tasks}
    sample_data, left_out = samples(runs, labels, data, cap, text_budget)
    comps = paired(runs, data, diff_iters)
    # Several summaries (a job's checkpoint and adapter sweeps, each step-1, step-2 ...): each chart and test line
    # names its summary, as its speed table does; they read "arc_easy: acc,none" and "step-2 vs step-1" twice.
    label = {s: f"{shown(s)}: " if len(summaries) > 1 else "" for s in summaries}
    report = Report(runs=[run_view(label, run) for label, run in zip(labels, runs)],
                    leaderboard=leaderboard(runs, higher_is_better(runs)), samples=sample_data, left_out=left_out,
                    sweeps=[p for s in summaries for p in sweep_panels(s, label[s])],
                    sweep_tests=[t for s in summaries for t in sweep_tests(s, label[s])],
                    sweep_speed=[t for s in summaries for t in summary_speed(s, runs)],
                    diffs=[DiffView(labels[i], labels[j], statistics_text(c)) for (i, j), c in comps.items()],
                    diff_bound=PAIR_BOUND, diff_iters=diff_iters)
    if not summaries:
        sweeps, tests = family_sweeps(runs, comps)
        report.sweeps += sweeps
        report.sweep_tests += tests
        report.sweep_speed += family_speed(runs)
    return report


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
"""The first bytes of an HDF5 file whose superblock is at offset 0, as h5py writes every results file."""


def output_problem(inputs: list[str], out: str) -> str | None:
    """Why ``out`` must not receive the page (None when it may): it is one of the files the report reads, an
    existing HDF5 file or a run's journal. ``mpitp report run.h5 -o run.h5`` replaced the results file with the page,
    its rows and scores lost; ``-o other.h5`` did the same to a run not even in the report."""
    try:
        with open(out, "rb") as f:
            head = f.read(len(HDF5_SIGNATURE))
        if head == HDF5_SIGNATURE:
            return "is an HDF5 file (a results file?), not a page to replace"
        if head == MAGIC:
            return "is a run's journal (the rows of a run not finished), not a page to replace"
    except OSError:  # none there yet, or unreadable: replace_problem says what matters
        return None
    try:
        files, summaries = expand(inputs, warn=lambda line: None)
    except BadInput:
        return None  # the report itself then says that nothing was found
    for p in files + summaries:
        try:
            if os.path.samefile(p, out):
                return f"is {shown(p)}, one of the report's inputs"
        except OSError:
            continue
    return None


def write(inputs: list[str], out: str, cap: int = SAMPLE_CAP, diff_iters: int = DIFF_ITERS,
          warn: Callable[[str], object] | None = None) -> int:
    """Write the page to ``out``; returns its size in bytes. ``warn``: where the one-line notes of files skipped in
    a directory go (the ``mpitp`` logger when None)."""
    from mpitp.results.safefile import write_replace

    data = render(build(inputs, cap, diff_iters=diff_iters, warn=warn)).encode()
    write_replace(out, data)
    return len(data)
