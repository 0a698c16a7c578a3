"""lm-eval's documents decoded once per task (:mod:`mpitp.evaluation.eval_docs`): same requests, same metrics.

No MPI: real lm-eval ``simple_evaluate`` on the real local splits with a stand-in LM whose answer is a function of
the request's text, with and without :func:`listed_once`.
"""

from __future__ import annotations

import zlib


class _Counting:
    """A Dataset-like source that counts the rows it has been asked for."""

    features = {"q": "string"}

    def __init__(self, n: int):
        self.rows = [{"q": f"question {i}", "xs": [i, i + 1]} for i in range(n)]
        self.produced = 0

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        for row in self.rows:
            self.produced += 1
            yield {"q": row["q"], "xs": list(row["xs"])}

    def __getitem__(self, key):
        return [r[key] for r in self.rows]


def test_listed_reads_only_as_far_as_asked_and_hands_out_fresh_documents():
    from itertools import islice

    from mpitp.evaluation.eval_docs import _Listed

    source = _Counting(100)
    docs = _Listed(source)
    assert len(docs) == 100 and source.produced == 0 and docs.features == {"q": "string"}
    assert [d["q"] for d in islice(docs, 3)] == ["question 0", "question 1", "question 2"]
    assert source.produced == 3  # a --limit 3 run decodes three documents, not the split
    first = next(iter(docs))
    first["q"] = "edited"
    first["xs"].append(99)  # a task function editing a document in place ...
    assert next(iter(docs)) == {"q": "question 0", "xs": [0, 1]}  # ... does not change the next pass's
    assert docs[5]["q"] == "question 5" and source.produced == 6
    assert docs["q"][7] == "question 7"  # a column comes from the source
    assert len(list(docs)) == 100 and source.produced == 100
    assert len(list(docs)) == 100 and source.produced == 100  # the second full pass decodes nothing


def test_listed_generator_source_counts_and_copies_too():
    from mpitp.evaluation.eval_docs import _Listed

    source = _Counting(5)
    docs = _Listed(iter(source))  # a task's own generator: no len
    assert len(docs) == 5 and source.produced == 5
    next(iter(docs))["xs"].append(99)
    assert [d["xs"] for d in docs] == [[i, i + 1] for i in range(5)] and source.produced == 5


def test_listed_reads_a_plain_arrow_split_a_slice_at_a_time():
    """The same documents as arrow's row-by-row reading, in the same order (nested features, gaps, a selection), read
    64 rows at first and then in growing slices; a split whose features decode, or a formatted view, row by row."""
    from itertools import islice

    import datasets

    from mpitp.evaluation.eval_docs import _Listed

    rows = [{"q": f"q{i}", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "n": i, "xs": [i, None],
             "none": None} for i in range(300)]
    ds = datasets.Dataset.from_list(rows)
    docs = _Listed(ds)
    assert [d["q"] for d in islice(docs, 3)] == ["q0", "q1", "q2"] and len(docs._items) == 64
    assert list(docs) == list(ds) == rows and len(docs._items) == 300
    picked = ds.select([250, 3, 299, 64, 0])
    assert list(_Listed(picked)) == list(picked) == [rows[i] for i in (250, 3, 299, 64, 0)]
    numpy_view = _Listed(ds.with_format("numpy"))
    next(iter(numpy_view))
    assert len(numpy_view._items) == 1  # a formatted view reads its own way, row by row
    img = datasets.Dataset.from_dict({"im": [None, None]}, features=datasets.Features({"im": datasets.Image()}))
    images = _Listed(img)
    assert next(iter(images)) == {"im": None} and len(images._items) == 1


def _run(include_path, tasks, listed: bool):
    import contextlib

    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

    from mpitp.evaluation.eval_docs import fewshot_listed, listed_once

    seen = []

    class Stand(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            seen.extend(r.args for r in requests)
            return [(-(zlib.crc32("".join(r.args).encode()) % 1000) / 100.0, False) for r in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

    reads = []
    original = Task.__dict__["eval_docs"]

    def counted(task):
        reads.append(task.config.task)
        return original.fget(task)

    Task.eval_docs = property(counted)  # under listed_once: how often lm-eval's own property runs
    try:
        with contextlib.ExitStack() as blocks:
            if listed:
                blocks.enter_context(listed_once())
                blocks.enter_context(fewshot_listed())
            res = lm_eval.simple_evaluate(model=Stand(), tasks=tasks, limit=40, log_samples=False, num_fewshot=2,
                                          task_manager=TaskManager(include_path=include_path,
                                                                   include_defaults=False))
    finally:
        Task.eval_docs = original
    metrics = {t: {k: v for k, v in r.items() if "," in k} for t, r in res["results"].items()}
    return seen, metrics, reads


def test_same_requests_and_metrics_with_documents_listed_once(test_tasks):
    """Two-shot, so the few-shot pool read in one arrow conversion (:func:`fewshot_listed`) is in every request."""
    tasks = ["hellaswag_local", "arc_easy_local"]
    plain = _run(test_tasks, tasks, listed=False)
    listed = _run(test_tasks, tasks, listed=True)
    assert len(plain[0]) > 200 and listed[0] == plain[0]
    assert all(len(args[0]) > 300 for args in plain[0][:50])  # the contexts carry two examples each
    assert listed[1] == plain[1] and set(plain[1]) == set(tasks)
    assert sorted(listed[2]) == sorted(tasks)  # lm-eval's property ran once per task ...
    assert len(plain[2]) > 2 * len(tasks)  # ... where lm-eval alone reads it several times


def test_fewshot_pool_is_the_same_documents_from_one_conversion(tmp_path):
    """A plain-featured split becomes the list of the same dicts; a split whose features decode (an image) and a
    formatted view stay as they are."""
    import datasets

    from mpitp.evaluation.eval_docs import _plain_list

    rows = [{"q": f"q{i}", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "n": i} for i in range(50)]
    ds = datasets.Dataset.from_list(rows)
    listed = _plain_list(ds)
    assert isinstance(listed, list) and listed == list(ds) == rows
    assert _plain_list(ds.with_format("numpy")) is not None and not isinstance(_plain_list(ds.with_format("numpy")),
                                                                                list)
    img = datasets.Dataset.from_dict({"im": [None]}, features=datasets.Features({"im": datasets.Image()}))
    assert _plain_list(img) is img
    assert _plain_list(rows) is rows
