"""Helpers shared by the per-rank scripts in this folder (imported from the script's own directory)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()


class Checks:
    """Counts checks; a failed one raises with the rank and context (install_excepthook then aborts the job)."""

    def __init__(self):
        self.count = 0

    def __call__(self, cond, what):
        self.count += 1
        if not cond:
            raise AssertionError(f"check failed on world rank {RANK}: {what}")


def say(*args):
    """Print from world rank 0 only, flushed (mpiexec interleaves ranks' output otherwise)."""
    if RANK == 0:
        print(*args, flush=True)


def same(a, b, path="obj") -> str | None:
    """Exact structural equality (types, dtypes, shapes, bits). Returns None when equal, else where they differ."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            d = same(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        if a.flags.f_contiguous != b.flags.f_contiguous:
            return f"{path}: memory order differs"
        if a.dtype == object:
            return same(a.ravel().tolist(), b.ravel().tolist(), path)
        if not np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                              np.ascontiguousarray(b).reshape(-1).view(np.uint8)):
            return f"{path}: array contents differ"
        return None
    if type(a).__module__.startswith("torch"):
        import torch

        if isinstance(a, torch.Tensor):
            if (a.dtype, a.shape, a.stride(), a.device) != (b.dtype, b.shape, b.stride(), b.device):
                return f"{path}: tensor {a.dtype}{tuple(a.shape)}{a.stride()} != {b.dtype}{tuple(b.shape)}{b.stride()}"
            if not torch.equal(a, b):
                return f"{path}: tensor contents differ"
            return None
    return None if a == b else f"{path}: {a!r} != {b!r}"
