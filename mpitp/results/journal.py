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
from mpitp.results.untrusted import MAX_JSON_CHARS

__all__ = ["MAGIC", "MAX_RECORD_BYTES", "Journal", "RecordTooLong", "frame", "fsync_dir", "journal_path",
           "read_journal"]

MAGIC = b"MPITPJ1\n"
_FRAME = struct.Struct("<II")
#: No record is longer (its JSON's UTF-8 bytes): a reader takes a longer one for a torn tail, and the writer splits
#: what it records at once (:mod:`mpitp.results.store`) to stay within it. JSON's own cap, so a record always parses.
MAX_RECORD_BYTES = MAX_JSON_CHARS


def journal_path(results_path: str) -> str:
    return f"{results_path}.journal"


def frame(obj: object) -> bytes:
    payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


class RecordTooLong(ValueError):
    """A record the readers would take for a torn tail: the writer records its rows in parts instead."""


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
        """Append one record; :class:`RecordTooLong` (nothing written) where its JSON is over
        :data:`MAX_RECORD_BYTES`."""
        data = frame(obj)
        if len(data) - _FRAME.size > MAX_RECORD_BYTES:
            raise RecordTooLong(f"a journal record of {len(data) - _FRAME.size} bytes, over the {MAX_RECORD_BYTES} "
                                f"a reader takes")
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


def _open_regular(path: str):
    """The regular file at ``path`` open for reading (None when there is none). The journal sits in a directory others
    may write to: a link there (to ``/dev/zero``, a FIFO, another user's file) is refused as bad input, never
    followed."""
    from mpitp.results.untrusted import BadInput, shown

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise BadInput(f"{shown(path)}: refused: the journal is a link or cannot be opened ({exc.strerror})") from None
    f = os.fdopen(fd, "rb")
    st = os.fstat(f.fileno())
    if stat.S_ISDIR(st.st_mode):
        f.close()
        return None
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise BadInput(f"{shown(path)}: refused: the journal is not a regular file")
    return f


def read_journal(path: str) -> tuple[dict | None, list[dict]]:
    """(header, records) of the journal at ``path``; (None, []) when it is missing or has no whole header.

    Read record by record: memory grows with the whole records the file really holds, never with its size (a sparse
    30 GB file read at once was a MemoryError) or a length a record declares (over :data:`MAX_RECORD_BYTES`, which the
    writer keeps to, a record is not one). Reading stops at the first short, oversized or corrupt record: a torn tail
    (a kill mid-write) is ignored.
    """
    from mpitp.results.untrusted import load_json

    f = _open_regular(path)
    if f is None:
        return None, []
    out = []
    with f:
        if f.read(len(MAGIC)) != MAGIC:
            return None, []
        while True:
            head = f.read(_FRAME.size)
            if len(head) < _FRAME.size:
                break
            length, crc = _FRAME.unpack(head)
            if length > MAX_RECORD_BYTES:
                break
            payload = f.read(length)
            if len(payload) < length or zlib.crc32(payload) != crc:
                break
            try:  # depth bounded (a deep record was a RecursionError's traceback)
                out.append(load_json(payload, f"{path}: record {len(out)}"))
            except ValueError:  # BadInput included: a record that is not JSON ends the journal there, as a torn one
                break
    if not out or not isinstance(out[0], dict) or "run_id" not in out[0]:
        return None, []
    return out[0], out[1:]
