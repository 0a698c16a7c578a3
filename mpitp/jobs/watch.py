"""``mpitp eval --watch DIR``: evaluate checkpoints as a training job writes them, in one MPI launch.

Rank 0 scans ``DIR`` every :data:`POLL_S` seconds for subdirectories that are complete checkpoints: a
``config.json`` and weights (every shard a ``*.index.json`` lists, or at least one ``*.safetensors``/``*.bin``), or a
torch DCP ``.metadata`` file (torchtitan's ``step-N``: it writes ``.metadata`` last), and the same sizes and
modification times on two scans :data:`POLL_S` apart (a checkpoint still being written keeps growing).
Each new one is evaluated like a sweep's checkpoint (:func:`mpitp.jobs.sweep.run_models`: its own results file, the
task manager and loaded tasks shared); one whose results file is already ``complete`` for the same weights is skipped,
a ``running`` one resumed, so a watch killed with its allocation picks up where it stopped. The watch ends after
``--watch-idle`` seconds without a new complete checkpoint, then writes the sweep summary.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp.errors import UsageError
from mpitp.jobs.sweep import PlanWithoutClaim

if TYPE_CHECKING:
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Launch, Runtime

log = logging.getLogger("mpitp")

POLL_S = 2.0


def _snapshot(path: str) -> tuple | None:
    """(name, size, mtime) of every file of a checkpoint directory, or None when it is not (yet) complete."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    if ".metadata" in names:  # a torch DCP step: torchtitan writes .metadata last, once every shard is written
        return _stat_all(path, names)
    if "config.json" not in names:
        return None
    return _hf_snapshot(path, names)


def _hf_snapshot(path: str, names: list[str]) -> tuple | None:
    index = next((n for n in names if n.endswith(".index.json")), None)
    if index is not None:
        try:
            with open(os.path.join(path, index)) as f:
                shards = set(json.load(f).get("weight_map", {}).values())
        except (OSError, ValueError):
            return None
        if not shards or not shards <= set(names):
            return None
    elif not any(n.endswith((".safetensors", ".bin")) for n in names):
        return None
    return _stat_all(path, names)


def _stat_all(path: str, names: list[str]) -> tuple | None:
    out = []
    for n in names:
        try:
            st = os.stat(os.path.join(path, n))
        except OSError:
            return None
        out.append((n, st.st_size, st.st_mtime_ns))
    return tuple(out)


class Scanner:
    """Rank 0: which checkpoints under ``directory`` are complete and unchanged since the previous scan."""

    def __init__(self, directory: str):
        self.directory = directory
        self.previous: dict[str, tuple] = {}

    def stable(self) -> list[str]:
        from mpitp.jobs.sweep import natural_key

        now: dict[str, tuple] = {}
        for entry in sorted(os.listdir(self.directory), key=natural_key):
            path = os.path.join(self.directory, entry)
            if entry.startswith(".") or not os.path.isdir(path):
                continue
            snap = _snapshot(path)
            if snap is not None:
                now[path] = snap
        ready = [p for p, snap in now.items() if self.previous.get(p) == snap]
        self.previous = now
        return ready


def default_watch_dir(directory: str) -> str:
    """The same on every launch, so a restarted watch finds its files."""
    return os.path.join("results", f"watch-{os.path.basename(os.path.normpath(directory)) or 'checkpoints'}")


@dataclass
class WatchPlan(PlanWithoutClaim):
    """``mpitp eval --watch DIR``: the directory and the settings checked on rank 0 before torch starts."""

    cfg: EvalConfig
    directory: str
    idle_s: float
    poll_s: float = POLL_S

    def execute(self, rt: Runtime) -> int:
        """Every rank evaluates each checkpoint that appears, until none has for ``idle_s``. Exit status 1 when a
        checkpoint failed, else 0."""
        from mpitp.jobs.sweep import SweepState, finish
        from mpitp.results.sweepsummary import render_summary, summary_path, write_summary

        cfg, directory = self.cfg, self.directory
        cfg.resume = True  # a watch always continues its own files
        state = SweepState()
        t0 = time.monotonic()
        if rt.world.rank == 0:
            log.info("watching %s for checkpoints (ends after %.0f s without a new one)", directory, self.idle_s)
        try:
            rows = _watch_loop(cfg, rt, directory, self.idle_s, self.poll_s, default_watch_dir(directory), state)
        finally:
            finish(state)
        if rt.world.rank == 0:
            if rows:
                path = summary_path([r.output for r in rows])
                write_summary(path, rows, time.monotonic() - t0)
                print(render_summary(rows, path))
            else:
                print(f"watch {directory}: no complete checkpoint appeared")
        return 1 if any(r.status == "failed" for r in rows) else 0


def prepare_watch(cfg: EvalConfig, launch: Launch, directory: str, idle_s: float, poll_s: float = POLL_S) -> WatchPlan:
    """Rank 0 checks the watched directory and the settings; every rank gets the verdict."""
    from mpitp.parallel.runtime import agree

    def check() -> bool:
        if not os.path.isdir(directory):
            raise UsageError(f"--watch {directory}: no such directory")
        if cfg.model:
            raise UsageError("--watch and --model contradict each other: the watched directory names the models")
        if cfg.overwrite:
            raise UsageError("--watch resumes what it finds (a complete file is skipped): --overwrite does not apply")
        return True

    agree(check, launch.world.comm, launch.timeout, "checking --watch")
    return WatchPlan(cfg, directory, idle_s, poll_s)


def _watch_loop(cfg: EvalConfig, rt: Runtime, directory, idle_s, poll_s, base, state) -> list:
    from mpitp.jobs.sweep import output_for, run_models
    from mpitp.parallel import comm as mpicomm
    from mpitp.parallel.runtime import agree

    scanner = Scanner(directory) if rt.world.rank == 0 else None
    rows, seen = [], set()
    last_new = time.monotonic()
    while True:
        decision = None
        if rt.world.rank == 0:
            fresh = [p for p in scanner.stable() if p not in seen]
            if fresh:
                decision = ("run", fresh)
            elif time.monotonic() - last_new > idle_s:
                decision = ("stop", [])
            else:
                decision = ("wait", [])
        kind, fresh = mpicomm.bcast_obj(decision, rt.world.comm, timeout=rt.timeout + idle_s + poll_s,
                                        phase="watching for checkpoints")
        if kind == "stop":
            break
        if kind == "wait":
            time.sleep(poll_s)
            continue
        seen.update(fresh)
        names = [os.path.basename(os.path.normpath(p)) for p in fresh]
        outputs = agree(lambda: [output_for(cfg.output, n, base) for n in names], rt.world.comm, rt.timeout,
                        "naming outputs")
        run_models(cfg, rt, fresh, outputs, names, state, rows)
        last_new = time.monotonic()
    return rows
