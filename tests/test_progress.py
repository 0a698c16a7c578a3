"""Progress in batch logs: plain lines at an interval, never carriage returns (the real run: tests/test_slurm.py)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from mpitp.evaluation.progress import LineProgress, make_progress
from support import OFFLINE_ENV


def test_line_progress_writes_whole_lines_with_rate_and_eta():
    out = io.StringIO()
    p = LineProgress(interval=0, stream=out)
    p.add_total(10)
    p(4, 400)
    p(6, 600)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2, lines  # close() adds nothing new
    assert lines[0].startswith("mpitp: 4/10 requests (40%), ") and " tok/s, " in lines[0] and "ETA " in lines[0]
    assert lines[1].startswith("mpitp: 10/10 requests (100%), ") and "ETA" not in lines[1]


def test_interval_limits_the_lines():
    out = io.StringIO()
    p = LineProgress(interval=3600, stream=out)
    p.add_total(100)
    for _ in range(100):
        p(1, 10)
    p.close()
    assert out.getvalue().count("\n") == 1  # only the closing line


def test_a_terminal_gets_the_bar_a_file_gets_lines(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    real = sys.stderr
    try:
        sys.stderr = Tty()
        assert make_progress(lambda: "bar") == "bar"
        sys.stderr = io.StringIO()
        assert isinstance(make_progress(lambda: "bar"), LineProgress)
    finally:
        sys.stderr = real


@pytest.mark.mpi
def test_eval_with_stderr_to_a_file_has_no_carriage_returns(tmp_path):
    log = tmp_path / "err.log"
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "mpitp", "eval", "--demo", "--tasks", "mpitp_demo_mc", "--limit",
                               "4", "--bootstrap-iters", "0", "--output", str(tmp_path / "x.h5")],
                              stdout=subprocess.DEVNULL, stderr=err, timeout=600,
                              env={**os.environ, **OFFLINE_ENV, "MPITP_PROGRESS_INTERVAL": "0"})
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text, text[-2000:]
    assert re.search(r"^mpitp: (\d+)/\1 requests \(100%\), \d+ tok/s", text, flags=re.M), text[-2000:]
