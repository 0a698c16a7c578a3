"""SHA-256 of files, read in 1 MiB blocks: one implementation for every fingerprint, manifest and cache check."""

from __future__ import annotations

import hashlib
import os

BLOCK = 1 << 20


def update_file(h, path: str | os.PathLike) -> None:
    """Feed the bytes of ``path`` to the hash object ``h``."""
    with open(path, "rb") as f:
        update_fileobj(h, f)


def update_fileobj(h, f) -> None:
    """Feed the rest of the open binary file ``f`` to ``h``: for a file opened by descriptor after checks on that
    descriptor (``O_NOFOLLOW``, owner), where opening its path again could reach another file."""
    for block in iter(lambda: f.read(BLOCK), b""):
        h.update(block)


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    update_file(h, path)
    return h.hexdigest()
