"""An append-only, checksummed journal of result rows beside the HDF5 results file (``<out>.journal``).

Why: rewriting the gzip'd HDF5 file for every landed chunk costs O(all rows) per chunk (quadratic over a run), and
HDF5 written in place can be left unreadable by a kill in the middle of a metadata update. Appending a chunk's rows
to a flat file costs O(chunk); a kill at any instant can tear only the record being written, which the length and
CRC-32 of every record detect, so readers stop at the last whole record and lose nothing else.

Layout: the 8-byte magic ``MPITPJ1\\n``, then records, each ``<u32 length><u32 crc32(payload)><payload>`` with a
UTF-8 JSON payload. The first record is the header ``{"run_id": ..., "base_seq": n}``: the journal belongs to the
HDF5 snapshot whose root attr ``run_id`` matches, and holds the records with ``seq > base_seq``. Every later record is
``{"seq": n, "tasks": {task: {column: [values]}}}``. The snapshot's root attr ``journal_seq`` says up to which record
its rows go, so a reader takes the journal's records with ``seq > journal_seq`` (see :mod:`mpitp.results.store`).

A new journal is written whole to a temporary, fsync'd and renamed into place (the directory fsync'd too), so a
journal on disk always has a whole header. JSON, not pickle: ``inspect`` must be safe on a file from anyone.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib

from mpitp.results.safefile import fsync_dir, temp_beside

__all__ = ["MAGIC", "Journal", "frame", "fsync_dir", "journal_path", "read_journal"]

MAGIC = b"MPITPJ1\n"
_FRAME = struct.Struct("<II")


def journal_path(results_path: str) -> str:
    return f"{results_path}.journal"


def frame(obj: object) -> bytes:
    payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class Journal:
    """The writing side: one open file descriptor, written at its end (one writer); :meth:`sync` makes it durable."""

    def __init__(self, path: str, header: dict, mode: int | None = None):
        self.path = path
        # A new file with a random name (O_EXCL, never through a link planted in a shared directory), renamed into
        # place; the descriptor stays open for the appends: the renamed inode, not whatever the name points to later.
        fd, tmp = temp_beside(path, mode)
        try:
            data = memoryview(MAGIC + frame(header))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        fsync_dir(path)
        self.fd = fd  # at the end of the header: every write appends (one writer)
        self.bytes = 0

    def append(self, obj: object) -> None:
        data = frame(obj)
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.bytes += len(data)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def remove(self) -> None:
        self.close()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        fsync_dir(self.path)


def _read_regular(path: str) -> bytes | None:
    """The bytes of the regular file at ``path`` (None when there is none). The journal sits in a directory others
    may write to: a link there (to ``/dev/zero``, a FIFO, another user's file) is refused as bad input, never
    followed, and no more than the file's size at open is read."""
    from mpitp.results.untrusted import BadInput, shown

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise BadInput(f"{shown(path)}: refused: the journal is a link or cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{shown(path)}: refused: the journal is not a regular file")
        return f.read(st.st_size)


def read_journal(path: str) -> tuple[dict | None, list[dict]]:
    """(header, records) of the journal at ``path``; (None, []) when it is missing or has no whole header.

    Reading stops at the first short, oversized or corrupt record: a torn tail (a kill mid-write) is ignored.
    """
    from mpitp.results.untrusted import load_json

    data = _read_regular(path)
    if data is None:
        return None, []
    if not data.startswith(MAGIC):
        return None, []
    pos, out = len(MAGIC), []
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        start, end = pos + _FRAME.size, pos + _FRAME.size + length
        if end > len(data):
            break
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            break
        try:  # no size cap beyond the frame's; depth bounded (a deep record was a RecursionError's traceback)
            out.append(load_json(payload, f"{path}: record {len(out)}", max_chars=None))
        except ValueError:  # BadInput included: a record that is not JSON ends the journal there, as a torn one
            break
        pos = end
    if not out or not isinstance(out[0], dict) or "run_id" not in out[0]:
        return None, []
    return out[0], out[1:]
