"""Between lm-eval's requests and the HDF5 file's request rows: a computed result as the row that keeps it, and a
stored row back as the result it was (a resumed run reuses it instead of computing it again)."""

from __future__ import annotations

import math


def result_from_row(row: dict, kind: str):
    """A stored row as the result the LM's request method returns: ``(text, n_tokens)`` for generation,
    ``(loglikelihood, is_greedy, n_tokens)`` otherwise."""
    from mpitp.evaluation.lm import KIND_GENERATE

    if kind == KIND_GENERATE:
        return (row["generation"], int(row["n_tokens"]))
    return (float(row["loglikelihood"]), bool(row["is_greedy"]), int(row["n_tokens"]))


def request_row(key: tuple, result, kind: str) -> dict:
    """The row (:data:`mpitp.results.schema.REQUEST_FIELDS`) that keeps ``result`` of the request whose key
    (:func:`mpitp.evaluation.lm.request_keys`) is ``key``."""
    from mpitp.evaluation.lm import KIND_GENERATE

    if kind == KIND_GENERATE:
        text, n = result
        ll, greedy = math.nan, False
    else:
        ll, greedy, n = result
        text = ""
    # Generated text can hold lone surrogates (byte-level tokens decoded mid-character); HDF5 stores UTF-8.
    text = text.encode("utf-8", "replace").decode("utf-8")
    _, doc, idx, digest, repeat = key
    return dict(doc_id=int(doc), idx=int(idx), kind=kind, loglikelihood=float(ll), is_greedy=bool(greedy),
                generation=text, n_tokens=int(n), args_hash=digest, repeat=int(repeat))


def rows_by_task(kind: str, keys: list, todo: list[int], indices, res) -> dict[str, list]:
    """The HDF5 rows of the requests ``todo[i]`` for ``i`` in ``indices`` (results ``res``), grouped by task."""
    by_task: dict[str, list] = {}
    for i, r in zip(indices, res):
        key = keys[todo[i]]
        by_task.setdefault(key[0], []).append(request_row(key, r, kind))
    return by_task
