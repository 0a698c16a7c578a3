"""The ``mpi`` marker's guard (tests/conftest.py + :mod:`support.mpi`): a test not marked ``mpi`` cannot start an MPI
world, so ``pytest -m "not mpi"`` never launches one; queries and ordinary programs pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.mpi import launch_in, mpiexec_path, require_mpi_marker


@pytest.mark.parametrize("argv,what", [
    (["mpiexec", "-n", "2", sys.executable, "-m", "mpitp", "info"], "mpiexec"),
    (["/opt/mpi/bin/mpirun", "-np", "4", "python", "x.py"], "mpirun"),
    (["srun", "--mpi=pmi2", "mpitp", "run", "jobs/demo.yaml"], "srun"),
    (["torchrun", "--nproc-per-node", "2", "-m", "mpitp", "eval"], "torchrun"),
    ([sys.executable, "-m", "mpitp", "eval", "--demo"], "python -m mpitp eval"),
    ([sys.executable, "-m", "mpitp"], "python -m mpitp "),
    ([sys.executable, "-m", "mpitp", "inspect", "diff", "a.h5", "b.h5"], None),
    ([sys.executable, "-m", "mpitp", "eval", "--help"], None),
    (["srun", "--mpi=list"], None),
    (["bash", "-n", "job.sh"], None),
    ([sys.executable, "-c", "print(1)"], None),
    ("mpiexec -n 2 true", None),  # shell strings are not how the tests launch
])
def test_what_counts_as_a_launch(argv, what):
    assert launch_in(argv) == what


def test_a_test_not_marked_mpi_cannot_launch():
    with pytest.raises(pytest.fail.Exception, match=r"test_markers.py::test_a_test_not_marked_mpi_cannot_launch "
                                                    r"starts mpiexec but is not marked mpi"):
        mpiexec_path()
    with pytest.raises(pytest.fail.Exception, match="starts python -m mpitp eval but is not marked mpi"):
        subprocess.run([sys.executable, "-m", "mpitp", "eval", "--demo"], capture_output=True)
    with pytest.raises(pytest.fail.Exception, match="starts torchrun but is not marked mpi"):
        subprocess.Popen(["torchrun", "--nproc-per-node", "2", "-m", "mpitp"])
    assert subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout == "7\n"


@pytest.mark.mpi
def test_a_test_marked_mpi_may_launch():
    require_mpi_marker("mpiexec")  # no failure
    assert mpiexec_path()
