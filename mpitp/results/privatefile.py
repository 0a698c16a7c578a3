"""A JSON cache file of this user's alone: read without following a link, refused when anyone else could have
written it, bounded; written atomically, never group- or world-writable.

Two caches keep what they computed in such files (the task index, :mod:`mpitp.tasks.index`, and the environment
record, :mod:`mpitp.evaluation.envinfo`), and each had its own copy of the same five steps; a fix to one (a FIFO
planted in the cache folder, a group-writable file under ``umask 002``) must reach both, so the steps live here. What
a cache does with a refused file (warn once, count a rebuild, recompute silently) stays its own: the reader says why
by the exception it raises.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from mpitp.results.untrusted import BadInput, load_json, open_regular, private_problem

log = logging.getLogger("mpitp")

#: A cache file is written ``rw-r--r--`` less the umask: readable by others as the umask allows, writable by nobody
#: else whatever it says (the next read refuses a file others can write).
FILE_MODE = 0o644


class NotPrivate(BadInput):
    """The file belongs to another user, or its group or others may write it: its content may be someone else's."""


def read_private_json(path: str | os.PathLike[str], what: str, max_bytes: int | None = None,
                      max_age_s: float | None = None) -> object:
    """The JSON document in the regular file ``path``, or None when there is none (or it is larger than
    ``max_bytes`` or older than ``max_age_s``: stale, not broken).

    ``what`` names the cache in messages (``"task index cache"``). Raises :class:`NotPrivate` (its message the
    one-line problem) when anyone else could have written the file, :class:`BadInput` when it is not a regular file
    (a link, a FIFO), too large or too deep to parse, or not JSON, ``OSError`` when it cannot be read."""
    if not os.path.lexists(path):
        return None
    with os.fdopen(open_regular(str(path), f"the {what}", follow=False), "rb") as fh:  # no link, no FIFO hang
        st = os.fstat(fh.fileno())
        problem = private_problem(st, f"{what} file {path}")
        if problem:
            raise NotPrivate(problem)
        if max_bytes is not None and st.st_size > max_bytes or \
                max_age_s is not None and time.time() - st.st_mtime > max_age_s:
            return None
        text = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    return load_json(text, f"{what} {path}")


def write_private_json(path: str | os.PathLike[str], data: object, what: str, make_folder: bool = False) -> bool:
    """Write ``data`` as compact JSON to ``path`` atomically (:func:`mpitp.results.safefile.write_replace`), mode
    :data:`FILE_MODE` less the umask; ``make_folder``: create the folder first. Whether it was written: a read-only or
    full cache folder costs the next run a recomputation, nothing else, so the error is logged, not raised."""
    from pathlib import Path

    from mpitp.results.safefile import umask, write_replace

    try:
        if make_folder:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_replace(str(path), json.dumps(data, separators=(",", ":")).encode(), mode=FILE_MODE & ~umask())
    except OSError as exc:
        log.info("%s %s not written: %s", what, path, exc)
        return False
    return True


def keyed_file(folder: Path | None, key: object, what: str) -> Path | None:
    """The file in the cache folder ``folder`` that holds what was kept for ``key`` (a JSON value: the file is named
    by its digest); None when the cache is off (``folder`` None) or the folder and the one above are not this user's
    alone (created ``0700`` when missing), said at info level naming ``what``."""
    import hashlib

    from mpitp.results.untrusted import private_dir

    if folder is None:
        return None
    problem = private_dir(str(folder), levels=2)
    if problem:
        log.info("%s not kept: %s", what, problem)
        return None
    return folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"
