"""The HDF5 results file: one per evaluation run, written by global rank 0 only (PyPI h5py has no MPI-IO).

Schema (stable; extend, don't break):

- root attrs: ``mpitp_version``, ``created``, ``model``, ``tokenizer``, ``dtype``, ``world_size``, ``tp``, ``dp``,
  ``command``, ``lm_eval_version``, ``torch_version``, ``transformers_version``, ``mpi_version``, ``status``
  (``running`` until metrics are written, then ``complete``), ``config_json`` (the settings resume must match),
  ``wall_time_s``, ``results_json`` (lm-eval's results dict, for ``inspect --json``).
- ``/tasks/<task>`` attrs ``output_type``, ``num_fewshot``, ``n_docs``; ``/tasks/<task>/metrics`` one attr per
  lm-eval metric key (``acc,none``, ``acc_stderr,none``, ...).
- ``/tasks/<task>/requests``: equal-length datasets, one row per lm-eval request instance: ``doc_id`` int64,
  ``idx`` int32, ``kind`` str, ``loglikelihood`` float64 (NaN for generations), ``is_greedy`` bool, ``generation``
  str, ``n_tokens`` int32, ``args_hash`` str (the resume key with task, doc_id and idx). Rows are appended as chunks
  complete, so their order is completion order; sort by (doc_id, idx) to compare.
- ``/stats``: one row per DP group: ``dp_rank``, ``busy_s``, ``requests``, ``tokens_scored``, ``tokens_generated``,
  ``forwards``, ``tp_bytes`` (all TP traffic this group's leader sent), ``tp_score_bytes`` (the scoring reductions
  alone), ``mpi_bytes`` (work and results between DP groups), ``pp_bytes`` (activations and scores all ranks of the
  group sent between pipeline stages; 0 without stages). With stages, ``tp_score_bytes`` is the last stage's (where
  scoring happens). ``requests`` counts a rolling request's windows as shares of it (they may run in different
  groups), so a group's value can be fractional; the sum over groups is whole.
- ``/tasks/<task>/samples`` (with ``--log-samples``): one JSON document per lm-eval sample record.
- ``/tasks/<task>/doc_scores``: lm-eval's per-document metric values (see :mod:`mpitp.docscores`).

Files are opened with HDF5 file locking off by default: lock failures on Lustre and NFS are a common h5py failure
on clusters and there is only ever one writer. Set ``MPITP_HDF5_LOCKING=1`` to turn it back on.
"""

from __future__ import annotations

import glob
import json
import os
from datetime import datetime, timezone

import h5py
import numpy as np

STR = h5py.string_dtype()
REQUEST_FIELDS = {
    "doc_id": np.int64,
    "idx": np.int32,
    "kind": STR,
    "loglikelihood": np.float64,
    "is_greedy": np.bool_,
    "generation": STR,
    "n_tokens": np.int32,
    "args_hash": STR,
}
STATS_FIELDS = ("busy_s", "requests", "tokens_scored", "tokens_generated", "forwards", "tp_bytes", "tp_score_bytes",
                "mpi_bytes", "pp_bytes")


def _locking() -> bool:
    return os.environ.get("MPITP_HDF5_LOCKING", "0") not in ("0", "", "false", "False")


def open_h5(path: str, mode: str = "r") -> h5py.File:
    return h5py.File(path, mode, locking=_locking())


def _attr(v):
    if v is None:
        return "None"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    if isinstance(v, str):
        return "".join([v])  # a plain str: numpy's str_ would become a fixed-width type h5py cannot store
    if isinstance(v, (bool, int, float, np.generic)):
        return v
    return str(v)


class ResultWriter:
    """Rank 0's results file, rewritten atomically after every landed chunk.

    HDF5 written in place can be left unreadable by a kill in the middle of a metadata update, so the writer keeps
    the (small) results in memory and replaces the file with ``os.replace`` of a freshly written temporary: at any
    instant the file on disk is a complete, readable snapshot, and a crash loses at most the chunks in flight.
    """

    def __init__(self, path: str, meta: dict, resume: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        for stale in glob.glob(glob.escape(path) + ".tmp*"):  # a snapshot a killed run did not finish
            os.remove(stale)
        self.attrs: dict = {}
        self.tasks: dict[str, dict] = {}
        self.stats: list[dict] | None = None
        if resume and os.path.exists(path):
            self._load(path)
        self.attrs.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.attrs.update({k: _attr(v) for k, v in meta.items()})
        self.attrs["status"] = "running"
        self.attrs.pop("results_json", None)
        self.save()

    def _task(self, task: str) -> dict:
        return self.tasks.setdefault(task, {"attrs": {}, "metrics": {}, "rows": {k: [] for k in REQUEST_FIELDS},
                                            "samples": None, "doc_scores": None})

    def _load(self, path: str) -> None:
        with open_h5(path) as f:
            self.attrs = {k: _py(v) for k, v in f.attrs.items()}
            for task, g in f.get("tasks", {}).items():
                t = self._task(task)
                t["attrs"] = {k: _py(v) for k, v in g.attrs.items()}
                if "requests" in g:
                    for name in REQUEST_FIELDS:
                        if name in g["requests"]:
                            t["rows"][name] = [_py(x) for x in g["requests"][name][()]]

    def stored_rows(self) -> dict[tuple, dict]:
        """Every stored request row by its resume key ``(task, doc_id, idx, args_hash)``."""
        out = {}
        for task, t in self.tasks.items():
            cols = t["rows"]
            for i in range(len(cols["doc_id"])):
                row = {k: cols[k][i] for k in REQUEST_FIELDS}
                out[(task, int(row["doc_id"]), int(row["idx"]), row["args_hash"])] = row
        return out

    def append(self, task: str, rows: list[dict]) -> None:
        if not rows:
            return
        cols = self._task(task)["rows"]
        for r in rows:
            for k in REQUEST_FIELDS:
                cols[k].append(r[k])
        self.save()

    def write_task(self, task: str, attrs: dict, metrics: dict, samples: list | None = None) -> None:
        t = self._task(task)
        t["attrs"].update({k: _attr(v) for k, v in attrs.items()})
        t["metrics"] = {k: _attr(v) for k, v in metrics.items()}
        if samples is not None:
            t["samples"] = [json.dumps(s, default=str) for s in samples]

    def write_doc_scores(self, task: str, scores) -> None:
        """lm-eval's per-document metric values (a :class:`mpitp.docscores.DocScores`), written with the file."""
        self._task(task)["doc_scores"] = scores

    def write_stats(self, per_group: list[dict]) -> None:
        self.stats = per_group

    def finish(self, results_json: dict, wall_time_s: float) -> None:
        self.attrs["results_json"] = json.dumps(results_json, default=str)
        self.attrs["wall_time_s"] = float(wall_time_s)
        self.attrs["status"] = "complete"
        self.save()

    def save(self) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open_h5(tmp, "w") as f:
            for k, v in self.attrs.items():
                f.attrs[k] = v
            tasks = f.create_group("tasks")
            for name, t in self.tasks.items():
                g = tasks.create_group(name)
                for k, v in t["attrs"].items():
                    g.attrs[k] = v
                m = g.create_group("metrics")
                for k, v in t["metrics"].items():
                    m.attrs[k] = v
                req = g.create_group("requests")
                n = len(t["rows"]["doc_id"])
                for col, dt in REQUEST_FIELDS.items():
                    data = np.asarray(t["rows"][col], dtype=object if dt == STR else dt).reshape(n)
                    req.create_dataset(col, data=data, dtype=dt, maxshape=(None,), chunks=(max(1, min(n, 4096)),),
                                       compression="gzip", compression_opts=4)
                if t["samples"] is not None:
                    g.create_dataset("samples", data=np.asarray(t["samples"], dtype=object), dtype=STR)
                if t.get("doc_scores") is not None:
                    from .docscores import write as write_doc_scores

                    write_doc_scores(g, t["doc_scores"])
            if self.stats is not None:
                st = f.create_group("stats")
                st.create_dataset("dp_rank", data=np.arange(len(self.stats), dtype=np.int32))
                for col in STATS_FIELDS:
                    st.create_dataset(col, data=np.asarray([s.get(col, 0) for s in self.stats], dtype=np.float64))
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Nothing stays open between saves; kept so callers can treat the writer like a file."""


def _py(v):
    """HDF5 value -> plain Python (bytes decoded, numpy scalars unwrapped)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    if isinstance(v, np.generic):
        return v.item()
    return v


def read_requests(path: str, task: str) -> dict[str, np.ndarray]:
    """All request rows of ``task``, sorted by (doc_id, idx); strings decoded."""
    with open_h5(path) as f:
        g = f[f"tasks/{task}/requests"]
        cols = {}
        for name in REQUEST_FIELDS:
            a = g[name][()]
            if a.dtype == object:
                a = np.array([x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in a],
                             dtype=object)
            cols[name] = a
    if len({len(v) for v in cols.values()}) > 1:
        raise ValueError(f"requests of task {task}: columns of different lengths")
    order = np.lexsort((cols["idx"], cols["doc_id"]))
    return {k: v[order] for k, v in cols.items()}


def read_metrics(path: str, task: str) -> dict:
    with open_h5(path) as f:
        return {k: (v.item() if hasattr(v, "item") else v) for k, v in f[f"tasks/{task}/metrics"].attrs.items()}
