"""A rank that fails before it started MPI must still end the job: its peers wait for it in ``MPI_Init``.

Run: mpiexec -n 2 python tests/mpi/crash_before_mpi.py

The launcher's rank 0 raises before importing mpi4py.MPI (as a broken import or a bug in start-up code would);
rank 1 starts MPI and waits in a barrier with a one-hour deadline. Only the failing rank's abort can end it.
"""

from __future__ import annotations

import os

from mpitp.errors import install_excepthook

install_excepthook()
if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "0":
    raise RuntimeError("deliberate failure before MPI started")
from mpi4py import MPI  # noqa: E402

import mpitp.parallel.comm as mc  # noqa: E402

mc.barrier(MPI.COMM_WORLD, timeout=3600.0, phase="waiting for the failing rank")
print("rank 1 got past the barrier: the failing rank did not abort the job", flush=True)
