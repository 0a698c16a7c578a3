"""lm-eval's evaluation documents decoded once per task instead of once per pass.

``Task.eval_docs`` is a property that calls ``validation_docs()`` / ``test_docs()`` each time it is read, and those
run the task's ``process_docs`` (a ``datasets.map`` over the whole split, e.g. hellaswag's) and hand back an arrow
dataset whose every iteration decodes each row into a new dict again. ``simple_evaluate`` reads it several times on
global rank 0: to count documents, to build the requests and again to compute the metrics after the last request,
while every DP group waits. Inside :func:`listed_once` a task's documents are produced once and kept, lazily (a
``--limit 10`` run of a large split decodes its first slice, not the split): the same documents, in the same order. Each
pass still gets documents of its own, as from arrow (a structural copy, much cheaper than decoding), so a task's
function that edits a document in place sees the same input on every pass as without this block.

A split whose features need no decoding (text, numbers, lists) is read from arrow a slice at a time (64 rows, then
twice as many each time up to 4096) instead of row by row: the same dicts, about 10x faster (hellaswag's 10,042
documents: 0.035 s against 0.35 s). The row-by-row read was most of full hellaswag's metrics phase on rank 0 (a run
whose requests come from lm-eval's request cache reads the documents there first), while every DP group waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.api.task import ConfigurableTask, Task

    from mpitp.evaluation.picked import Picked


def _fresh(value):
    """A copy of a decoded document: dicts and lists are new, leaves (strings, numbers, images) shared."""
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    return value


class _Listed:
    """A sequence over an iterable that is consumed only as far as it has been read; ``len`` and other attributes
    come from the source (``len`` of a source without one reads it to the end)."""

    def __init__(self, source: Iterable):
        self._source = source
        self._iter = None
        self._items: list = []

    def __len__(self) -> int:
        try:
            return len(self._source)
        except TypeError:  # a task's own generator of documents: count them by reading them all
            self._fill(None)
            return len(self._items)

    def __getattr__(self, name):  # a Dataset's own attributes (``features``, ``column_names``) come from the source
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._source, name)

    def _fill(self, n: int | None) -> None:
        if self._iter is None:
            self._iter = _slices(self._source)
        while n is None or len(self._items) < n:
            try:
                self._items.extend(next(self._iter))
            except StopIteration:
                self._iter = iter(())
                return

    def __iter__(self):
        i = 0
        while True:
            if i >= len(self._items):
                self._fill(i + 1)
                if i >= len(self._items):
                    return
            yield _fresh(self._items[i])
            i += 1

    def __getitem__(self, i):
        if not isinstance(i, int):  # a Dataset's column or slice (columns of lists): the source answers
            return self._source[i]
        self._fill(None if i < 0 else i + 1)
        return _fresh(self._items[i])


@contextlib.contextmanager
def listed_once(picked: Picked | None = None) -> Iterator[None]:
    """Inside this block each lm-eval task's ``eval_docs`` is computed once and then read from memory; where
    ``picked`` (``--samples``, :func:`~mpitp.evaluation.picked.picked_docs`) names a document past the end of a task's,
    it is refused in one line as the task's documents are first counted."""
    from lm_eval.api.task import Task

    from mpitp import compat
    from mpitp.evaluation.picked import check_in_range

    original = Task.__dict__["eval_docs"]
    listed: dict[int, tuple] = {}  # id(task) -> (task, docs): the task is held so its id is not reused meanwhile

    def eval_docs(task: Task) -> _Listed:
        hit = listed.get(id(task))
        if hit is None:
            source = original.fget(task)
            hit = listed[id(task)] = (task, _Listed(source))
            name = getattr(getattr(task, "config", None), "task", None)
            if picked and name in picked:
                check_in_range(picked, name, len(hit[1]))
        return hit[1]

    with compat.replaced("lm_eval.api.task.Task.eval_docs", property(eval_docs)):
        yield


def _plain_arrow(docs) -> bool:
    """Whether ``docs`` is a ``datasets.Dataset`` whose rows read in bulk are the dicts it gives row by row: no
    format set (a formatted view, numpy ..., reads its own way), no feature that decodes (images, audio), a column."""
    try:
        from datasets import Dataset
        from datasets.features.features import require_decoding
    except ImportError:  # pragma: no cover - lm-eval requires datasets
        return False
    return (type(docs) is Dataset and docs.format["type"] is None and len(docs.column_names) > 0
            and not any(require_decoding(feature) for feature in docs.features.values()))


#: rows :func:`_slices` reads from arrow at once: the first slice (a ``--limit 10`` run decodes 64, not the split),
#: doubled each time up to the last
_SLICES = (64, 4096)


def _slices(docs) -> Iterator[list]:
    """The rows of ``docs`` in order, in lists: a :func:`_plain_arrow` dataset's a slice at a time, anything else's
    one row each, as it iterates."""
    if not _plain_arrow(docs):
        yield from ([row] for row in docs)
        return
    size, start, n = _SLICES[0], 0, len(docs)
    while start < n:
        columns = docs[start:start + size]
        names = list(columns)
        yield [dict(zip(names, values)) for values in zip(*columns.values())]
        start += size
        size = min(2 * size, _SLICES[1])


def _plain_list(docs):
    """``docs`` as a list of the same dicts when it is a :func:`_plain_arrow` dataset (one arrow conversion, about
    20x faster than decoding row by row: 0.01 s against 0.2 s for arc_easy's 2,251 training rows); anything else
    (images, audio, a task's own list) as it is."""
    return docs.to_list() if _plain_arrow(docs) else docs


@contextlib.contextmanager
def fewshot_listed() -> Iterator[None]:
    """Inside this block a task's few-shot pool is read from arrow in one conversion. ``ConfigurableTask.__init__``
    turns ``fewshot_docs()`` into a list of dicts (its only caller), decoding the whole split row by row: every
    task build paid it (hellaswag's 10,042 documents, arc_easy's 2,251: 2.8 s of ``mpitp check``'s 13 s in a profile).
    The same documents, in the same order, as fresh dicts."""
    from lm_eval.api.task import ConfigurableTask

    from mpitp import compat

    original = ConfigurableTask.__dict__["fewshot_docs"]

    def fewshot_docs(task: ConfigurableTask) -> Iterable:
        return _plain_list(original(task))

    with compat.replaced("lm_eval.api.task.ConfigurableTask.fewshot_docs", fewshot_docs):
        yield
