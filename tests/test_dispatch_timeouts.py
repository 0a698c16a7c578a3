"""The stop message to remote DP groups is sent under --timeout (it used the one-hour default). A recording
stand-in for the send beside the real path (the fault drills run the real one under mpiexec)."""

from __future__ import annotations

from types import SimpleNamespace

import mpitp.evaluation.dispatch as dispatch


def test_stop_and_idle_are_sent_under_the_run_timeout(monkeypatch):
    sent = []
    monkeypatch.setattr(dispatch.mpicomm, "send_obj",
                        lambda obj, dest, tag, comm, timeout=None, phase="": sent.append((obj[0], dest, timeout)))
    layout = SimpleNamespace(dp_leader_comm=None, dp=3)
    idled = []
    d = dispatch.Dispatcher(layout, compute=lambda kind, items, tick: [], timeout=42.0, stats=None,
                            idle=lambda: idled.append(True))
    assert d.run("loglikelihood", [], []) == []
    d.shutdown()
    assert sent == [("idle", 1, 42.0), ("idle", 2, 42.0), ("stop", 1, 42.0), ("stop", 2, 42.0)], sent
    assert idled == [True]  # rank 0's own TP workers released too
