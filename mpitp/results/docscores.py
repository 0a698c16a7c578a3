"""Per-document metric values: captured from lm-eval at the end of a run, stored, read back for paired tests.

lm-eval computes every metric per document (``task.process_results``) into ``raw_metrics`` before aggregating them,
whether or not ``--log-samples`` is on, but returns only the aggregates (and the per-document values inside the
samples when they are logged). :func:`capture` wraps the one function that receives them,
``lm_eval.evaluator._process_results``, for the duration of a ``simple_evaluate`` call and keeps a copy, so every
file carries what a paired comparison needs without the cost of logging samples.

Schema (an extension of :mod:`mpitp.results.schema`): ``/tasks/<task>/doc_scores``: dataset ``doc_id`` int64 and one
dataset per lm-eval metric key (``acc,none``): float64 of shape ``(n,)`` for numbers, ``(n, k)`` for fixed-length number
tuples (perplexity-type metrics: ``(loglikelihood, words)``), else one JSON string per document. Each metric dataset
has attrs ``aggregation`` (lm-eval's aggregation name, e.g. ``mean``) and ``higher_is_better``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence

    import h5py


@dataclass
class DocScores:
    """One task's per-document scores; ``values[key][i]`` belongs to document ``doc_id[i]``."""

    doc_id: np.ndarray
    values: dict[str, np.ndarray] = field(default_factory=dict)
    aggregation: dict[str, str] = field(default_factory=dict)
    higher_is_better: dict[str, bool | None] = field(default_factory=dict)
    source: str = "doc_scores"  # or "samples" when read from --log-samples records


def _aggregation_names(task) -> dict[str, str]:
    try:
        from lm_eval.api.registry import AGGREGATION_REGISTRY

        inverse = {v: k for k, v in AGGREGATION_REGISTRY.items()}
        return {m: inverse.get(fn, getattr(fn, "__name__", str(fn))) for m, fn in task.aggregation().items()}
    except Exception:  # noqa: BLE001 - a task without the usual methods: the scores are still worth keeping
        return {}


def _higher(task) -> dict[str, bool]:
    try:
        return {m: bool(v) for m, v in task.higher_is_better().items()}
    except Exception:  # noqa: BLE001
        return {}


@contextlib.contextmanager
def capture(picked: Mapping[str, Sequence[int]] | None = None) -> Iterator[dict[str, DocScores]]:
    """Inside this block, every ``simple_evaluate`` leaves ``{task: DocScores}`` in the yielded dict. ``picked``:
    the documents a ``samples`` argument kept (:func:`mpitp.evaluation.picked.picked_docs`), whose indices the scores
    carry instead of lm-eval's numbering of them."""
    from mpitp import compat

    out: dict[str, DocScores] = {}
    original = compat.attribute("lm_eval.evaluator._process_results")

    def recording(eval_results_acc: dict, *args: object, **kwargs: object) -> object:
        for name, acc in eval_results_acc.items():
            try:
                out[name] = from_raw(acc["raw_metrics"], _aggregation_names(acc["task"]), _higher(acc["task"]),
                                     (picked or {}).get(name))
            except Exception:  # noqa: BLE001 - never let the bookkeeping break the evaluation
                continue
        return original(eval_results_acc, *args, **kwargs)

    with compat.replaced("lm_eval.evaluator._process_results", recording):
        yield out


def from_raw(raw_metrics: dict, aggregation: dict, higher: dict, picked: Sequence[int] | None = None) -> DocScores:
    """lm-eval's ``raw_metrics`` (``{(metric, filter): [value per document in doc order]}``) as :class:`DocScores`.

    lm-eval walks the documents as ``enumerate(task.eval_docs)`` cut at the limit, so position i is doc_id i; with
    ``samples``, it walks the ``picked`` documents, position i being ``picked[i]``.
    """
    n = max((len(v) for v in raw_metrics.values()), default=0)
    ids = np.asarray(picked, dtype=np.int64) if picked else np.arange(n, dtype=np.int64)
    ds = DocScores(doc_id=ids)
    for (metric, filt), vals in raw_metrics.items():
        if len(vals) != n:
            continue
        key = f"{metric},{filt}"
        ds.values[key] = _column(vals)
        if metric in aggregation:
            ds.aggregation[key] = aggregation[metric]
        ds.higher_is_better[key] = higher.get(metric)
    return ds


def _column(vals: list) -> np.ndarray:
    def number(v: object) -> bool:
        return isinstance(v, (bool, int, float, np.number))

    if all(number(v) for v in vals):
        return np.asarray(vals, dtype=np.float64)
    if vals and all(isinstance(v, (list, tuple)) and len(v) == len(vals[0]) and all(number(x) for x in v)
                    for v in vals):
        return np.asarray(vals, dtype=np.float64)
    return np.asarray([json.dumps(v, default=str) for v in vals], dtype=object)


def write(group: h5py.Group, ds: DocScores) -> None:
    """Write ``ds`` as ``group/doc_scores`` (``group`` is an open h5py group of one task)."""
    import h5py

    g = group.create_group("doc_scores")
    g.create_dataset("doc_id", data=ds.doc_id.astype(np.int64))
    for key, col in ds.values.items():
        if col.dtype == object:
            d = g.create_dataset(key, data=col, dtype=h5py.string_dtype())
        else:
            d = g.create_dataset(key, data=col, compression="gzip" if col.size > 4096 else None)
        d.attrs["aggregation"] = ds.aggregation.get(key, "")
        hib = ds.higher_is_better.get(key)
        d.attrs["higher_is_better"] = "None" if hib is None else bool(hib)


def read(path: str, task: str, samples: list[dict] | None = None) -> DocScores | None:
    """The task's per-document scores: ``doc_scores`` when stored, else rebuilt from logged samples, else None.

    ``samples``: the task's logged samples when the caller has already parsed them (:func:`parse_samples`;
    ``mpitp report`` shows their texts too), so they are not read and parsed a second time."""
    import h5py

    from mpitp.results.schema import open_h5
    from mpitp.results.untrusted import BadInput

    def dataset(obj: object, what: str) -> h5py.Dataset:
        if not isinstance(obj, h5py.Dataset) or obj.ndim not in (1, 2):
            raise BadInput(f"{what} is not a column of per-document values")
        return obj

    with open_h5(path) as f:
        g = f.get(f"tasks/{task}")
        if not isinstance(g, h5py.Group):
            return None
        if "doc_scores" in g:
            d = g["doc_scores"]
            if not isinstance(d, h5py.Group):
                raise BadInput(f"/tasks/{task}/doc_scores is not a group")
            ids = dataset(d.get("doc_id"), "doc_scores/doc_id")
            if ids.ndim != 1 or ids.dtype.kind not in "iu":  # text or rows of ids: a traceback in mpitp report
                raise BadInput(f"doc_scores/doc_id holds {ids.dtype} of shape {ids.shape}, not one integer "
                               f"document number per row")
            ds = DocScores(doc_id=np.asarray(ids[()], dtype=np.int64))
            for key in d:
                if key == "doc_id":
                    continue
                col = dataset(d[key], f"doc_scores/{key}")[()]
                if col.dtype == object:
                    col = np.asarray([x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in col],
                                     dtype=object)
                elif col.dtype.kind not in "biuf":
                    raise BadInput(f"doc_scores/{key} holds {col.dtype}, not numbers or text")
                if (col.ndim != 1 and col.dtype == object) or len(col) != len(ds.doc_id):
                    raise BadInput(f"doc_scores/{key} has {len(col)} values for {len(ds.doc_id)} documents")
                ds.values[key] = col
                agg = d[key].attrs.get("aggregation", "")
                ds.aggregation[key] = agg.decode("utf-8", "replace") if isinstance(agg, bytes) else str(agg)
                hib = d[key].attrs.get("higher_is_better", "None")
                ds.higher_is_better[key] = None if isinstance(hib, (str, bytes)) or np.ndim(hib) else bool(hib)
            return ds
        if samples is not None:
            return from_samples(samples)
        if "samples" in g:
            return from_samples(parse_samples(dataset(g["samples"], "samples")[()].ravel()))
    return None


def parse_samples(texts: Iterable[object]) -> list[dict]:
    """lm-eval's logged sample records (JSON text, one per document, as stored) as dicts; a record that is not a JSON
    object is bad input (a file is untrusted)."""
    from mpitp.results.untrusted import load_json, mapping

    out = []
    for x in texts:  # bounded in size and depth: a sample nested 10^5 deep was a RecursionError's traceback
        s = load_json(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x), "a logged sample")
        out.append(mapping(s, "a logged sample"))
    return out


def from_samples(samples: list[dict]) -> DocScores | None:
    """Per-document scores out of lm-eval's sample records (each carries its metric values and its filter)."""
    raw: dict[tuple[str, str], dict[int, object]] = {}
    for s in samples:
        metrics, filt, doc = s.get("metrics", []), s.get("filter", "none"), s.get("doc_id")
        if not isinstance(metrics, list) or not isinstance(filt, str) or not isinstance(doc, int):
            continue  # a record of another shape (a file is untrusted): not a score
        for metric in metrics:
            if isinstance(metric, str) and metric in s:
                raw.setdefault((metric, filt), {})[doc] = s[metric]
    if not raw:
        return None
    docs = sorted(set().union(*(set(v) for v in raw.values())))
    ds = DocScores(doc_id=np.asarray(docs, dtype=np.int64), source="samples")
    for (metric, filt), by_doc in raw.items():
        if len(by_doc) != len(docs):
            continue
        key = f"{metric},{filt}"
        ds.values[key] = _column([by_doc[d] for d in docs])
        ds.aggregation[key] = default_aggregation(metric, ds.values[key])
    return ds


_BY_NAME = {"word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
            "bits_per_byte": "bits_per_byte", "perplexity": "perplexity"}


def default_aggregation(metric: str, col: np.ndarray) -> str:
    """lm-eval's default aggregation of a stock metric (samples do not record it)."""
    if metric in _BY_NAME:
        return _BY_NAME[metric]
    return "mean" if col.dtype != object and col.ndim == 1 else ""
