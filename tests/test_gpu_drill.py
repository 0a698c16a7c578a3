"""bench/gpu_drill.py's logic on CPU (``--device cpu --dry``): every case runs and the table comes out, so the drill
is not broken the day a GPU is lent (real lm-eval references, real mpiexec runs, parity checked in float32)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import OFFLINE_ENV, REPO

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # every test here launches mpiexec


def test_gpu_drill_dry_run_on_cpu(shared_dir):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_drill.py"), "--device", "cpu", "--dry", "--dp",
                           "2"], capture_output=True, text=True, timeout=1200, cwd=str(REPO),
                          env={**__import__("os").environ, **OFFLINE_ENV})
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    table = out[out.index("case "):]
    for case in ("lm_eval hf float32", "lm_eval hf bfloat16", "mpitp tp=1 float32", "mpitp tp=1 bfloat16",
                 "mpitp dp=2 float32"):
        assert case in table, table
    assert table.count("OK max rel |d|") == 2, table  # tp=1 and dp=2 in float32 hold parity
    assert "TP cases skipped" in out
    assert "RATIO gpu_drill_parity 1" in out
    print(table)
