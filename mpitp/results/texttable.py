"""Plain-text tables for the terminal (``mpitp info``, ``mpitp run``'s summary, ``mpitp inspect``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mpitp.results.untrusted import shown


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Collection[int] = ()) -> str:
    """Columns padded to their widest cell, a dashed rule under the headers; columns in ``right`` right-aligned
    (numbers), trailing blanks stripped. Cells are shown escaped (:func:`mpitp.results.untrusted.shown`): they
    often come from a file, and a newline or terminal control code in one must not reach the terminal."""
    headers = [shown(h) for h in headers]
    cells = [[shown(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    out = [line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells]
    return "\n".join(s.rstrip() for s in out)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """``rows`` (dicts) as a :func:`text_table` of the keys in ``columns``."""
    return text_table(columns, [[r[c] for c in columns] for r in rows])
