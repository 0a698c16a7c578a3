"""lm-eval's ``total_evaluation_time_seconds`` in ``--output_path``'s results JSON covers the whole run, as under
``lm_eval`` (whose tracker starts before the model loads), not only what follows mpitp's model load."""

from __future__ import annotations

import time
from types import SimpleNamespace

from mpitp.evaluation.outputs import start_loggers


def _cfg(tmp_path):
    return SimpleNamespace(hf_hub_log_args=None, output_path=str(tmp_path), wandb_args=None, trackio_args=None)


def test_tracker_clock_starts_at_the_run_start(tmp_path):
    t_start = time.perf_counter() - 12.5  # checks and the model load took 12.5 s before the tracker was made
    tracker = start_loggers(_cfg(tmp_path), t_start)["tracker"]
    tracker.general_config_tracker.log_end_time()
    total = float(tracker.general_config_tracker.total_evaluation_time_seconds)
    assert 12.5 <= total < 12.5 + 5, total


def test_without_a_start_the_tracker_keeps_its_own_clock(tmp_path):
    tracker = start_loggers(_cfg(tmp_path))["tracker"]
    tracker.general_config_tracker.log_end_time()
    assert float(tracker.general_config_tracker.total_evaluation_time_seconds) < 5
