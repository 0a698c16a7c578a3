"""The HDF5 results file's schema: one file per evaluation run, written by global rank 0 only (PyPI h5py has no
MPI-IO) through :class:`mpitp.results.store.ResultWriter`, read through :mod:`mpitp.results.rows`.

Schema (stable; extend, don't break):

- root attrs: ``mpitp_version``, ``created``, ``model``, ``tokenizer``, ``dtype``, ``world_size``, ``tp``, ``dp``,
  ``command``, ``lm_eval_version``, ``torch_version``, ``transformers_version``, ``mpi_version``, ``status``
  (``running`` until metrics are written, then ``complete``), ``config_json`` (the settings resume must match),
  ``wall_time_s``, ``results_json`` (lm-eval's results dict, for ``inspect --json``), ``nodes`` (``nodea:2,nodeb:2``:
  the nodes the run used and their ranks; absent from older files).
- ``/tasks/<task>`` attrs ``output_type``, ``num_fewshot``, ``n_docs``; ``/tasks/<task>/metrics`` one attr per
  lm-eval metric key (``acc,none``, ``acc_stderr,none``, ...).
- ``/tasks/<task>/requests``: equal-length datasets, one row per lm-eval request instance: ``doc_id`` int64,
  ``idx`` int32, ``kind`` str, ``loglikelihood`` float64 (NaN for generations), ``is_greedy`` bool, ``generation``
  str, ``n_tokens`` int32, ``args_hash`` str (the resume key with task, doc_id and idx). Rows are appended as chunks
  complete, so their order is completion order; sort by (doc_id, idx) to compare.
- ``/stats``: one row per DP group: ``dp_rank``, ``busy_s``, ``requests``, ``tokens_scored``, ``tokens_generated``,
  ``forwards``, ``tp_bytes`` (all TP traffic this group's leader sent in the run's forwards; the start-up checks'
  probes are not counted, as they count no forward), ``tp_score_bytes`` (the scoring reductions alone),
  ``mpi_bytes`` (work and results between DP groups), ``pp_bytes`` (activations and scores all ranks of the group
  sent between pipeline stages; 0 without stages). With stages, ``tp_score_bytes`` is the last stage's (where
  scoring happens). ``row_tokens`` are the input tokens of the rows scored, each row alone, ``tokens_read`` the
  ones the forwards read for them (fewer where rows sharing a context were scored as one tree,
  :mod:`mpitp.replica.prefix`; both absent from older files). ``requests`` counts a rolling request's windows as
  shares of it (they may run in different groups), so a group's value can be fractional; the sum over groups is
  whole.
- ``/tasks/<task>/samples`` (with ``--log-samples``): one JSON document per lm-eval sample record.
- root attrs ``run_id`` (names the journal that belongs to this file) and ``journal_seq`` (the last journal record
  the snapshot holds); ``phases_json`` (rank 0's seconds per phase: checks, load, building requests, tokenising,
  dispatch, metrics, writing; written at the end); ``speed_json`` (per task and per DP group: requests, tokens,
  busy seconds, request latency quantiles; written at the end, absent from older files: :mod:`mpitp.results.speed`,
  docs/results-format.md); ``test_hooks`` (only in a test run: the live ``MPITP_TEST_*`` hooks,
  :mod:`mpitp.testing`). ``command``, ``config_json``, ``eval_config_json`` and ``results_json`` hold no secrets
  (:mod:`mpitp.evaluation.provenance`).
- ``<file>.journal`` beside the file while a run is going (or was killed): the rows landed since the last snapshot,
  in the format of :mod:`mpitp.results.journal`. Read the file with :func:`~mpitp.results.rows.load_rows` /
  :func:`~mpitp.results.rows.read_requests` (or
  ``mpitp inspect``), which merge both; a finished run (``status`` ``complete``) has no journal.
- ``/tasks/<task>/doc_scores``: lm-eval's per-document metric values (see :mod:`mpitp.results.docscores`).

Files are opened with HDF5 file locking off by default: lock failures on Lustre and NFS are a common h5py failure
on clusters and there is only ever one writer. Set ``MPITP_HDF5_LOCKING=1`` to turn it back on.
"""

from __future__ import annotations

import json
import os

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
    "repeat": np.int32,  # 0..k-1 for the k clones of a request of an lm-eval task with ``repeats: k``
}
STATS_FIELDS = ("busy_s", "requests", "tokens_scored", "tokens_generated", "forwards", "tp_bytes", "tp_score_bytes",
                "mpi_bytes", "pp_bytes", "row_tokens", "tokens_read")


def _locking() -> bool:
    return os.environ.get("MPITP_HDF5_LOCKING", "0") not in ("0", "", "false", "False")


def open_h5(path: str, mode: str = "r") -> h5py.File:
    """Open a results file; read-only opens are of files from anyone and are checked first: only a regular file is
    opened (a FIFO or device named ``*.h5`` is one line, not a hang: :func:`mpitp.results.untrusted.open_regular`),
    then :func:`mpitp.results.untrusted.check_h5` (no links, no data in other files, no declared sizes beyond the
    file's).

    HDF5 opens by name, and a name checked first can be swapped for a FIFO before HDF5 opens it; so the checked
    descriptor itself is what HDF5 opens, through ``/proc/self/fd/N`` (the same inode whatever the name points to
    now). Where there is no ``/proc`` (macOS), the name is opened and the file HDF5 got must be the one checked: a
    FIFO swapped in during that window can still block, nothing else passes."""
    if mode != "r":
        return h5py.File(path, mode, locking=_locking())
    from mpitp.results.untrusted import BadInput, check_h5, open_regular, shown

    fd = open_regular(path)
    try:
        by_fd = f"/proc/self/fd/{fd}"
        f = h5py.File(by_fd if os.path.exists(by_fd) else path, "r", locking=_locking())
        try:
            here, there = os.fstat(fd), os.fstat(f.id.get_vfd_handle())
            if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
                raise BadInput(f"{shown(path)}: refused: the file was replaced while it was opened")
            check_h5(f, path)
        except BaseException:
            f.close()
            raise
    finally:
        os.close(fd)
    return f


def h5_attr(v: object) -> object:
    """A value as an HDF5 attribute can hold it: None as "None", containers as JSON, other objects as text."""
    if v is None:
        return "None"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    if isinstance(v, str):
        return "".join([v])  # a plain str: numpy's str_ would become a fixed-width type h5py cannot store
    if isinstance(v, (bool, int, float, np.generic)):
        return v
    return str(v)


def py_value(v: object, errors: str = "surrogateescape") -> object:
    """HDF5 value -> plain Python (bytes decoded, numpy scalars unwrapped, arrays as lists of those). Rows and resume
    keep undecodable bytes round-trippable (``surrogateescape``); what is only shown (``inspect``) passes
    ``errors="replace"`` so printing it cannot fail."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors)
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return [py_value(x, errors) for x in v.tolist()]
    return v
