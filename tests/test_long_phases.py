"""Phases where rank 0 works alone (lm-eval's metrics) may outlast ``--timeout``: idle peers wait on liveness.

Drill: the metrics phase of ``mpitp_slow_metrics_mc`` (tests/slow_tasks) is stretched by a stall hook to twice
``--timeout`` while the other DP group's leader and rank 0's TP worker wait; the run must complete.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support import STORIES
from support.launch import file_rows
from support.mpi import explain, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # every test here launches mpiexec

SLOW_TASKS = str(Path(__file__).parent / "slow_tasks")
TIMEOUT = 8
STALL_PER_DOC = 4.0
DOCS = 4


def test_metrics_phase_longer_than_timeout_completes(shared_dir, tmp_path):
    out = tmp_path / "slow-metrics.h5"
    proc = run_mpi(4, ["eval", "--model", str(STORIES), "--include-path", SLOW_TASKS, "--tasks",
                       "mpitp_slow_metrics_mc", "--limit", str(DOCS), "--tp", "2", "--bootstrap-iters", "0",
                       "--timeout", str(TIMEOUT), "--output", str(out)],
                   env={"MPITP_TEST_STALL": f"metrics:{STALL_PER_DOC}"}, timeout=600)
    assert proc.returncode == 0, explain(proc)
    stalls = re.findall(r"test hook: stalling ([\d.]+) s at metrics", proc.stderr)
    assert len(stalls) == DOCS, explain(proc)  # the hook fired, in the metrics phase, once per document
    stalled = STALL_PER_DOC * len(stalls)
    assert stalled > 1.5 * TIMEOUT
    assert proc.elapsed > stalled
    assert file_rows(out)[0] == "complete"
    print(f"metrics phase stretched to {stalled:.0f} s with --timeout {TIMEOUT} (dp 2 x tp 2): complete, wall "
          f"{proc.elapsed:.1f} s")
