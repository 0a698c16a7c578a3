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
  ``forwards``, ``tp_bytes``, ``mpi_bytes``.

Files are opened with HDF5 file locking off by default: lock failures on Lustre and NFS are a common h5py failure
on clusters and there is only ever one writer. Set ``MPITP_HDF5_LOCKING=1`` to turn it back on.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import h5py
import numpy as np

REQUEST_FIELDS = {
    "doc_id": np.int64,
    "idx": np.int32,
    "kind": h5py.string_dtype(),
    "loglikelihood": np.float64,
    "is_greedy": np.bool_,
    "generation": h5py.string_dtype(),
    "n_tokens": np.int32,
    "args_hash": h5py.string_dtype(),
}
STATS_FIELDS = ("busy_s", "requests", "tokens_scored", "tokens_generated", "forwards", "tp_bytes", "mpi_bytes")


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
    """Appends request rows as chunks complete and flushes, so a crash loses at most the chunks in flight."""

    def __init__(self, path: str, meta: dict, mode: str = "w"):
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self.path = path
        self.f = open_h5(path, mode)
        if mode != "a" or "status" not in self.f.attrs:
            self.f.attrs["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for k, v in meta.items():
            self.f.attrs[k] = _attr(v)
        self.f.attrs["status"] = "running"
        self.f.require_group("tasks")
        self.f.flush()

    def _requests(self, task: str) -> h5py.Group:
        g = self.f.require_group(f"tasks/{task}/requests")
        for name, dt in REQUEST_FIELDS.items():
            if name not in g:
                g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(1024,),
                                 compression="gzip", compression_opts=4)
        return g

    def append(self, task: str, rows: list[dict]) -> None:
        if not rows:
            return
        g = self._requests(task)
        n0 = g["doc_id"].shape[0]
        for name, dt in REQUEST_FIELDS.items():
            ds = g[name]
            ds.resize((n0 + len(rows),))
            ds[n0:] = np.asarray([r[name] for r in rows], dtype=object if dt == h5py.string_dtype() else dt)
        self.f.flush()

    def write_task(self, task: str, attrs: dict, metrics: dict) -> None:
        g = self.f.require_group(f"tasks/{task}")
        for k, v in attrs.items():
            g.attrs[k] = _attr(v)
        self._requests(task)
        m = g.require_group("metrics")
        for k, v in metrics.items():
            m.attrs[k] = _attr(v)

    def write_stats(self, per_group: list[dict]) -> None:
        if "stats" in self.f:
            del self.f["stats"]
        g = self.f.create_group("stats")
        g.create_dataset("dp_rank", data=np.arange(len(per_group), dtype=np.int32))
        for name in STATS_FIELDS:
            g.create_dataset(name, data=np.asarray([s.get(name, 0) for s in per_group], dtype=np.float64))

    def finish(self, results_json: dict, wall_time_s: float) -> None:
        self.f.attrs["results_json"] = json.dumps(results_json, default=str)
        self.f.attrs["wall_time_s"] = float(wall_time_s)
        self.f.attrs["status"] = "complete"
        self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None


def read_requests(path: str, task: str) -> dict[str, np.ndarray]:
    """All request rows of ``task``, sorted by (doc_id, idx); strings decoded."""
    with open_h5(path) as f:
        g = f[f"tasks/{task}/requests"]
        cols = {}
        for name in REQUEST_FIELDS:
            a = g[name][()]
            if a.dtype == object:
                a = np.array([x.decode() if isinstance(x, bytes) else x for x in a], dtype=object)
            cols[name] = a
    order = np.lexsort((cols["idx"], cols["doc_id"]))
    return {k: v[order] for k, v in cols.items()}


def read_metrics(path: str, task: str) -> dict:
    with open_h5(path) as f:
        return {k: (v.item() if hasattr(v, "item") else v) for k, v in f[f"tasks/{task}/metrics"].attrs.items()}
