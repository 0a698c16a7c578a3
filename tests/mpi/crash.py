"""An uncaught exception on one rank must bring the whole job down, promptly, reported once.

Run: mpiexec -n N python tests/mpi/crash.py [FAILING_RANK]      (default 2)

The failing rank raises after a first barrier, while every other rank waits in a barrier with a one-hour deadline:
only install_excepthook's MPI_Abort can end them. Before raising, the failing rank prints ``RAISING AT <epoch s>`` so
the test can time the shutdown from the raise itself (not from interpreter start-up).
"""

from __future__ import annotations

import sys
import time

from mpi4py import MPI

import mpitp.parallel.comm as mc
from mpitp.errors import install_excepthook

install_excepthook()
WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
FAILING = int(sys.argv[1]) if len(sys.argv) > 1 else 2
MESSAGE = "deliberate failure from the crash test"


def main():
    mc.barrier(WORLD, timeout=60.0, phase="before the crash")
    if RANK == FAILING:
        time.sleep(0.5)  # let the others settle into their wait
        print(f"RAISING AT {time.time():.3f}", flush=True)
        raise RuntimeError(MESSAGE)
    mc.barrier(WORLD, timeout=3600.0, phase="waiting for the failing rank")
    print(f"rank {RANK} got past the barrier: the failing rank did not abort the job", flush=True)


if __name__ == "__main__":
    main()
