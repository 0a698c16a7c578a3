"""SHA-256 of files, read in 1 MiB blocks: one implementation for every fingerprint, manifest and cache check; the
sampled digest of a large file (:func:`sampled_sha`) that the results file's fingerprint and a stage's key share; and
the one reader of a safetensors header (:func:`safetensors_header`) that they and ``--watch`` use."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import BinaryIO

BLOCK = 1 << 20


def update_file(h, path: str | os.PathLike) -> None:
    """Feed the bytes of ``path`` to the hash object ``h``."""
    with open(path, "rb") as f:
        update_fileobj(h, f)


def update_fileobj(h, f: BinaryIO) -> None:
    """Feed the rest of the open binary file ``f`` to ``h``: for a file opened by descriptor after checks on that
    descriptor (``O_NOFOLLOW``, owner), where opening its path again could reach another file."""
    for block in iter(lambda: f.read(BLOCK), b""):
        h.update(block)


def update_tree_stat(h, root: str | os.PathLike, suffix: str = "", folders: bool = False) -> None:
    """Feed ``h`` one line per file under ``root`` whose name ends in ``suffix`` (path, size, modification time; in
    sorted order, ``__pycache__`` left out), and with ``folders`` one per folder too (an empty one counts): for a
    cache key that changes when a file there is added, removed or edited, without reading the files."""
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(suffix)):
            st = os.stat(os.path.join(top, name))
            h.update(f"{top}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        if folders:
            h.update(f"{top}/\n".encode())


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    update_file(h, path)
    return h.hexdigest()


#: The sampled digest: this many blocks of this many bytes spread evenly over the file (1 MiB read).
SAMPLES = 16
SAMPLE_BYTES = 64 << 10


def sampled_sha(path: str | int, size: int) -> str:
    """SHA-256 of :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES` spread evenly over the file (1 MiB read); ``path``
    may be an open descriptor (it is closed), for a file checked through that descriptor."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


#: A safetensors header longer than this is not read: a real one is a few MB at most (one JSON entry per tensor),
#: and eight stray bytes at the start of a file being written could claim up to 16 EB.
MAX_SAFETENSORS_HEADER = 100 << 20


def safetensors_header(f: BinaryIO) -> tuple[bytes, int]:
    """``(raw, n)`` for the safetensors file open in ``f`` at its start: ``n`` is the header length its first 8 bytes
    claim (little-endian) and ``raw`` those 8 bytes and the ``n`` bytes of JSON after them (fewer where the file
    ends first). Where ``n`` is over :data:`MAX_SAFETENSORS_HEADER`, ``raw`` is the 8 bytes alone (not read); for a
    file shorter than 8 bytes, ``raw`` is what there is and ``n`` is -1."""
    head = f.read(8)
    if len(head) < 8:
        return head, -1
    n = int.from_bytes(head, "little")
    return (head if n > MAX_SAFETENSORS_HEADER else head + f.read(n)), n
