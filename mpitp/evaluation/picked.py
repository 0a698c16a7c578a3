"""lm-eval's ``samples`` (``--samples``, ``mpitp.evaluate(samples=...)``: task -> document indices): checked, and read
as the documents lm-eval scores.

lm-eval keeps a task's documents whose index is listed (once each, in the task's order) and numbers the kept ones
0, 1, ... (``Instance.doc_id``); its logged samples then say ``indices[i]`` for document i, which names the wrong
document when the list is not in ascending order (``[7, 3]``: document 3 logged as 7). mpitp hands lm-eval the list in
ascending order, once each (the same documents), and keys its request rows and per-document scores by the index the
user named, so a ``--samples`` run's rows compare with a full run's, document by document.

Bad lists failed inside lm-eval, after the model load: an index past the end (an ``AssertionError`` traceback), a
negative one or a name as index ('task.build_requests() did not find any docs!'); a task the run does not score was
ignored (the whole task scored) and 1.5 read as a document index. Each is one line on rank 0 now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from mpitp.errors import UsageError

#: task -> the indices of the documents lm-eval scores, ascending, each once
Picked = dict[str, tuple[int, ...]]


def picked_docs(samples: Mapping[str, Sequence[int]] | None) -> Picked:
    """``samples`` as lm-eval walks it: each task's indices ascending, once each; entry ``i`` of a task's tuple is the
    index of its document ``i``. An empty list is dropped: lm-eval reads it as no selection (every document)."""
    return {task: tuple(sorted({int(i) for i in ids})) for task, ids in (samples or {}).items() if ids}


def check_samples(samples: object, tasks: Iterable[str], known: Iterable[str], cached: bool = False,
                  option: str = "--samples") -> None:
    """Refuse, in one line, a ``samples`` value lm-eval would fail on or misread: not a mapping of task names to
    lists of integers >= 0, naming a task that is not among the run's leaf ``tasks`` (``known``: every task name
    lm-eval's index holds, to tell a typo from a task this run does not score), or with lm-eval's own request cache
    (``cached``: ``--cache_requests true|refresh``), whose key leaves the samples out: it handed back every
    document's requests (scored under the listed documents' numbers), and a run with samples left only those in it
    for the next run. mpitp's request cache (on without ``--cache_requests``) keys the samples."""
    if samples is None:
        return
    if cached:
        raise UsageError(f"{option} with --cache_requests: lm-eval's request cache is keyed without the samples (it "
                         "hands back every document's requests): drop --cache_requests (mpitp's own request cache "
                         "keys them)")
    if not isinstance(samples, Mapping):  # a file is the command line's (mpitp.evaluate takes the mapping only)
        what = "a JSON object of task: [doc indices] or a JSON file" if option.startswith("--") else \
            "a mapping of task names to lists of document indices (a JSON file is --samples' alone)"
        raise UsageError(f"{option} {samples!r}: expected {what}")
    run = set(tasks)
    for task, ids in samples.items():
        if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                        for i in ids):
            raise UsageError(f"{option}: {task!r}: {ids!r} is not a list of document indices (integers >= 0)")
        if task not in run:
            what = "is not a task lm-eval knows" if task not in set(known) else "is not among the tasks this run scores"
            names = sorted(run)
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} tasks)" if len(names) > 8 else "")
            raise UsageError(f"{option} names {task!r}, which {what} ({shown}): lm-eval would ignore it")


def check_in_range(picked: Picked, task: str, n_docs: int) -> None:
    """One line for an index past the end of ``task``'s ``n_docs`` documents (lm-eval asserts it, a traceback)."""
    ids = picked.get(task)
    if ids and ids[-1] >= n_docs:
        raise UsageError(f"--samples {task}: document {ids[-1]} does not exist: the task has {n_docs} documents "
                         f"(indices 0 to {n_docs - 1})")
