"""``mpitp eval --watch DIR``: evaluate checkpoints as a training job writes them, in one MPI launch.

Rank 0 scans ``DIR`` every :data:`POLL_S` seconds for subdirectories that are complete checkpoints
(:func:`_readiness`), with the same sizes and modification times on two scans :data:`POLL_S` apart (a checkpoint
still being written keeps growing). Complete means a ``config.json`` and whole weights: every shard a ``*.index.json``
lists, every ``NAME-0000i-of-0000N`` shard of a set that has begun and the index (Hugging Face writes the shards first
and the index last), each ``*.safetensors`` file as long as its own header says; or a torch DCP ``.metadata`` file
(torchtitan's ``step-N``: it writes ``.metadata`` last). Sizes alone cannot tell: a writer paused by a slow
filesystem leaves a truncated file unchanged for longer than one poll.

Each new one is evaluated like a sweep's checkpoint (:func:`mpitp.jobs.sweep.run_models`: its own results file, the
task manager and loaded tasks shared); one whose results file is already ``complete`` for the same weights is skipped,
a ``running`` one resumed, so a watch killed with its allocation picks up where it stopped. A checkpoint that failed
is evaluated again once its files change (a writer that replaces a bad file), never while they stay as they failed.
A watched directory that disappears counts as empty. The watch ends after ``--watch-idle`` seconds without a new
complete checkpoint, then writes the sweep summary and names the subdirectories that never became complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp.digest import MAX_SAFETENSORS_HEADER, safetensors_header
from mpitp.errors import UsageError
from mpitp.jobs.sweep import PlanWithoutClaim

if TYPE_CHECKING:
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Launch, Runtime

log = logging.getLogger("mpitp")

POLL_S = 2.0
#: The longest --watch-idle accepted (see :func:`check_idle`).
MAX_IDLE_S = 7 * 24 * 3600.0
#: A shard of a sharded save (``model-00001-of-00002.safetensors``, ``pytorch_model-00001-of-00003.bin``).
SHARD = re.compile(r"(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.(?P<ext>safetensors|bin)")
WEIGHTS = (".safetensors", ".bin")


def _readiness(path: str) -> tuple[tuple | None, str]:
    """``(snapshot, "")`` for a complete checkpoint (the (name, size, mtime) of every file), else ``(None, why)``;
    ``why`` is empty for a directory that holds no checkpoint at all (logs, a tokenizer), which the end of the watch
    need not mention."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        return None, f"cannot be listed ({exc.strerror})"
    if ".metadata" in names:  # a torch DCP step: torchtitan writes .metadata last, once every shard is written
        return _stat_all(path, names), "a file vanished while it was read"
    if any(n.endswith(".distcp") for n in names):
        return None, "no .metadata yet (torch DCP writes it last)"
    if "config.json" not in names:
        return None, "weights but no config.json" if any(n.endswith(WEIGHTS) for n in names) else ""
    why = _hf_incomplete(path, names)
    if why:
        return None, why
    snap = _stat_all(path, names)
    return snap, "" if snap else "a file vanished while it was read"


def _hf_incomplete(path: str, names: list[str]) -> str:
    """Why a Hugging Face checkpoint's weights are not all written yet ("" when they are)."""
    present = set(names)
    expected, indexes = set(), [n for n in names if n.endswith(".index.json")]
    for n in names:
        m = SHARD.fullmatch(n)
        if m:
            width, total = len(m["i"]), int(m["n"])
            expected |= {f"{m['stem']}-{i:0{width}d}-of-{m['n']}.{m['ext']}" for i in range(1, total + 1)}
    for index in indexes:
        try:
            with open(os.path.join(path, index)) as f:
                listed = set(json.load(f).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError, TypeError):
            return f"{index} is not a whole weight map yet"
        if not listed:
            return f"{index} lists no shard"
        expected |= listed
    missing = sorted(expected - present)
    if missing:
        return f"{missing[0]} not written yet" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    if expected and not indexes:
        return "every shard but no *.index.json yet (written last)"
    weights = [n for n in names if n.endswith(WEIGHTS)]
    if not weights:
        return "config.json but no weights yet"
    for n in weights:
        why = n.endswith(".safetensors") and safetensors_incomplete(os.path.join(path, n))
        if why:
            return f"{n}: {why}"
    return ""


def safetensors_incomplete(path: str) -> str:
    """Why ``path`` is not a whole safetensors file ("" when it is), from its header alone: 8 bytes of header length
    (little-endian), that much JSON, then the tensors' bytes, which must end exactly at the end of the file.

    Reads at most :data:`~mpitp.digest.MAX_SAFETENSORS_HEADER`: a file being written is checked every poll, its
    tensors never."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw, n = safetensors_header(f)
        if n < 0:
            return f"{size} bytes, shorter than the header length"
        if n > MAX_SAFETENSORS_HEADER:
            return f"a header of {n} bytes claimed (over {MAX_SAFETENSORS_HEADER >> 20} MB: not read)"
        if 8 + n > size:
            return f"{size} bytes, its header alone needs {8 + n}"
        header = json.loads(raw[8:])
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    except (ValueError, RecursionError):
        return "its header is not valid JSON"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return "its header declares no data offsets"
    if 8 + n + end != size:
        return f"{size} bytes where its header declares {8 + n + end}"
    return ""


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
    """Rank 0: which checkpoints under ``directory`` are complete, unchanged since the previous scan, and not yet
    evaluated as they are now.

    An evaluated checkpoint is :meth:`settle`-d: done for good when it ran (or was skipped as complete), remembered
    with the files it failed with otherwise, so the same files are not evaluated again, while a checkpoint whose files
    changed (a writer that was still at it, or replaced a bad file) is."""

    def __init__(self, directory: str):
        self.directory = directory
        self.previous: dict[str, tuple] = {}
        self.done: set[str] = set()
        self.failed: dict[str, tuple] = {}  # path -> the snapshot it failed with
        self.waiting: dict[str, str] = {}  # path -> why it was not complete at the last scan
        self.unreadable = False
        self.foreign: set[str] = set()  # entries another user made, skipped (said once each)

    def stable(self) -> list[str]:
        """The checkpoints to evaluate now, in natural order: complete, unchanged since the previous scan, not
        yet evaluated with these files."""
        now: dict[str, tuple] = {}
        self.waiting = {}
        for path in self._subdirectories():
            if path in self.done:
                continue
            snap, why = _readiness(path)
            if snap is not None:
                now[path] = snap
            elif why:
                self.waiting[path] = why
        ready = [p for p, snap in now.items() if self.previous.get(p) == snap and self.failed.get(p) != snap]
        for p in ready:
            if p in self.failed:
                log.info("watch: %s changed since it failed: evaluating it again", p)
        self.previous = now
        return ready

    def settle(self, path: str, failed: bool) -> None:
        """``path`` was evaluated (as handed out by the last :meth:`stable`)."""
        if failed:
            self.failed[path] = self.previous[path]
        else:
            self.done.add(path)
            self.failed.pop(path, None)

    def _subdirectories(self) -> list[str]:
        """The directory's subdirectories; none while the directory cannot be read (removed, or replaced by a
        file), said once: a training job that deletes and recreates its checkpoint folder has not ended."""
        from mpitp.jobs.sweep import natural_key

        try:
            entries = os.listdir(self.directory)
        except OSError as exc:
            if not self.unreadable:
                log.warning("watch: %s cannot be read (%s): counted as empty until it comes back or --watch-idle "
                            "runs out", self.directory, exc.strerror)
            self.unreadable = True
            return []
        if self.unreadable:
            log.info("watch: %s is back", self.directory)
            self.unreadable = False
        paths = (os.path.join(self.directory, e) for e in sorted(entries, key=natural_key) if not e.startswith("."))
        return [p for p in paths if os.path.isdir(p) and self._trusted(p)]

    def _trusted(self, path: str) -> bool:
        """Whether ``path`` is no other user's plant (:func:`~mpitp.results.untrusted.planted_by_other`: in a
        watched folder others may write, one was evaluated into the summary as a step of the run, and with
        ``--trust_remote_code`` its Python ran as this user on every rank); another's is skipped, one warning each."""
        from mpitp.results.untrusted import planted_by_other

        why = planted_by_other(path)
        if why and path not in self.foreign:
            self.foreign.add(path)
            log.warning("watch: skipped %s; its files would decide what runs (with --trust_remote_code, its Python)",
                        why)
        return why is None


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
        from mpitp.jobs.sweep import SweepState, finish, summarise

        cfg, directory = self.cfg, self.directory
        cfg.resume = True  # a watch always continues its own files
        state = SweepState()
        t0 = time.perf_counter()
        if rt.world.rank == 0:
            log.info("watching %s for checkpoints (ends after %.0f s without a new one)", directory, self.idle_s)
        try:
            rows = _watch_loop(cfg, rt, directory, self.idle_s, self.poll_s, default_watch_dir(directory), state)
        finally:
            finish(state)
        if not rows:
            if rt.world.rank == 0:
                print(f"watch {directory}: no complete checkpoint appeared")
            return 0
        return summarise(rt, rows, t0)


def check_idle(idle_s: float) -> None:
    """Refuse, in one line, a ``--watch-idle`` that would never end the watch (rank 0, before torch starts).

    The command line refuses what is not > 0 (nan included); infinity passes that test, and a watch that cannot end
    holds its allocation until the scheduler kills it, so its sweep summary is never written. The bound is finite too,
    :data:`MAX_IDLE_S` (a week): a training job that writes no checkpoint for a week has ended or died, and a week
    outlasts the walltime limit of most clusters' queues, so a longer value changes nothing but the odds that a
    mistaken unit (milliseconds) or a wish for "forever" goes unnoticed while it holds nodes that evaluate nothing."""
    if not math.isfinite(idle_s):
        raise UsageError(f"--watch-idle: must be a finite number of seconds, got {idle_s}")
    if idle_s > MAX_IDLE_S:
        raise UsageError(f"--watch-idle: must be at most {MAX_IDLE_S:.0f} s (a week), got {idle_s:g}")


def prepare_watch(cfg: EvalConfig, launch: Launch, directory: str, idle_s: float, poll_s: float = POLL_S) -> WatchPlan:
    """Rank 0 checks the watched directory and the settings; every rank gets the verdict."""
    from mpitp.parallel.runtime import agree

    def check() -> bool:
        check_idle(idle_s)
        if not os.path.isdir(directory):
            raise UsageError(f"--watch {directory}: no such directory")
        if cfg.model:
            raise UsageError("--watch and --model contradict each other: the watched directory names the models")
        if cfg.overwrite:
            raise UsageError("--watch resumes what it finds (a complete file is skipped): --overwrite does not apply")
        from mpitp.evaluation.checks import check_writable
        from mpitp.jobs.sweep import output_for

        check_writable(output_for(cfg.output, "{name}", default_watch_dir(directory)))  # else a traceback at the end
        return True

    agree(check, launch.world.comm, launch.timeout, "checking --watch")
    return WatchPlan(cfg, directory, idle_s, poll_s)


def _watch_loop(cfg: EvalConfig, rt: Runtime, directory, idle_s, poll_s, base, state) -> list:
    from mpitp.jobs.sweep import checkpoint_names, output_for, run_models
    from mpitp.parallel import comm as mpicomm
    from mpitp.parallel.runtime import agree

    scanner = Scanner(directory) if rt.world.rank == 0 else None
    rows: list = []
    last_new = time.monotonic()
    while True:
        decision = None
        if rt.world.rank == 0:
            fresh = scanner.stable()
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
        # Named as a sweep of the folder names them (a control character, ESC or newline, not put in a file name):
        # epoch=0-step=100 was epoch=0-step=100.h5 here, epoch_0-step_100.h5 for a --model 'DIR/*' of the same files
        names = checkpoint_names(fresh)
        outputs = agree(lambda: [output_for(cfg.output, n, base) for n in names], rt.world.comm, rt.timeout,
                        "naming outputs")
        new = _run_again(rows, lambda: run_models(cfg, rt, fresh, outputs, names, state, rows))
        if scanner is not None:
            for row in new:
                scanner.settle(row.model, row.status == "failed")
        last_new = time.monotonic()
    if scanner is not None:
        for path, why in scanner.waiting.items():
            log.warning("watch: %s was never a complete checkpoint: %s", path, why)
    return rows


def _run_again(rows: list, run) -> list:
    """``run()`` (which appends rows), each new row in the place of an earlier one of the same checkpoint (one that
    failed, now evaluated again): the summary keeps one row per checkpoint, the latest, in the order they appeared."""
    start = len(rows)
    place = {r.model: i for i, r in enumerate(rows)}
    run()
    new = rows[start:]
    del rows[start:]
    for row in new:
        if row.model in place:
            rows[place[row.model]] = row
        else:
            rows.append(row)
    return new
