"""Every corpus line as ``mpitp eval <argv> --tp 2`` (or its layout), one MPI world: ``mpiexec -n 2 python THIS LINES``.

One launch for the whole corpus (a launch costs ~10-20 s on a loaded CI box); each line still goes through the whole
``mpitp eval`` path: parsing on rank 0, checks, loading, evaluation, files, and tears its torch world down after.
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    from mpi4py import MPI

    from mpitp.cli.evaluate import eval_main
    from mpitp.errors import UsageError
    from support.dropin_corpus import layout

    failed = 0
    for name, argv in json.load(open(path)):
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"=== mpitp {name}: {' '.join(argv + layout(name))}", flush=True)
        try:
            eval_main([*argv, *layout(name)])
        except UsageError as exc:
            failed += 1
            if MPI.COMM_WORLD.Get_rank() == 0:
                print(f"=== FAILED {name}: {exc}", flush=True)
        MPI.COMM_WORLD.Barrier()
    return 1 if failed else 0


if __name__ == "__main__":
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mpitp.errors import install_excepthook

    install_excepthook()
    sys.exit(main(sys.argv[1]))
