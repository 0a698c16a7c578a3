"""mpitp.evaluate's layout path under a real 4-rank mpiexec: 3,000 calls do not exhaust MPICH's communicator
context ids (~2,048; the uncached path died after ~500 calls), and a torch world spanning replicas is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import STORIES
from support.mpi import explain, run_mpi_script

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # every test here launches mpiexec

CALLS = 3000


def test_3000_layouts_and_a_world_spanning_replicas_refused(shared_dir):
    proc = run_mpi_script(4, Path(__file__).parent / "mpi" / "api_layouts.py", [str(STORIES), str(CALLS)],
                          timeout=400)
    assert proc.returncode == 0, explain(proc)
    m = re.search(r"LAYOUTS (\d+) layout_for calls in ([\d.]+) s", proc.stdout)
    assert m and int(m.group(1)) == CALLS, explain(proc)
    refused = re.findall(r"rank (\d) REFUSED in ([\d.]+) s: (.*)", proc.stdout)
    assert sorted(r for r, _, _ in refused) == ["0", "1", "2", "3"], explain(proc)
    assert "NOT REFUSED" not in proc.stdout
    want = ("mpitp.evaluate needs one torch world per model replica: the torch world has 4 ranks but a replica has "
            "tp=2 (dp=2 replicas on 4 MPI ranks)")
    assert all(msg.startswith(want) for _, _, msg in refused), refused
    print(f"{CALLS} layout_for calls in {m.group(2)} s; (dp 2, tp 2) mesh over one torch world of 4 refused on every "
          f"rank in <= {max(float(t) for _, t, _ in refused):.2f} s")
