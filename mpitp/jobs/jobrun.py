"""``mpitp run JOB.yaml``: a campaign of runs, one after another, in one MPI world (one scheduler allocation).

Runs whose output is ``complete`` are skipped, ``running`` ones are resumed, and a run that fails on bad input (a
missing model, an unknown task, a tp that does not fit the world) is recorded and the job goes on, unless
``--fail-fast``. A fault inside a run (a rank crashing) still aborts the whole job: the survivors of a broken
collective cannot be trusted to carry on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp.errors import UsageError
from mpitp.evaluation.setting_values import thaw
from mpitp.evaluation.settings import EvalConfig, eval_settings
from mpitp.jobs.orchestrate import run_config
from mpitp.parallel import comm as mpicomm
from mpitp.parallel.runtime import agree, make_launch, setup_logging
from mpitp.parallel.world import world_from_comm
from mpitp.results.status import output_status

if TYPE_CHECKING:
    from pathlib import Path

    from mpitp.jobs.jobfile import RunSpec

log = logging.getLogger("mpitp")


@dataclass
class RunOutcome:
    """One run of the job file as the closing table shows it; ``failed`` decides the job's exit status."""

    name: str
    tp: int
    pp: int
    status: str
    wall_s: float
    output: str
    failed: bool = False

    @classmethod
    def of(cls, spec: RunSpec, status: str, wall_s: float = 0.0, failed: bool = False) -> RunOutcome:
        return cls(spec.name, spec.tp, spec.pp, status, wall_s, spec.output, failed)


def eval_config(spec: RunSpec) -> EvalConfig:
    """A job-file run as an :class:`EvalConfig` (``model: demo`` means the built-in demo): the settings the job file
    reads as themselves are copied (a ``gen_kwargs`` mapping stays a dict: lm-eval reads it as one), the lm-eval-named
    ones are applied with the flags' meaning."""
    from mpitp.jobs.jobfile import DEMO_MODEL

    kw = {f.name: thaw(getattr(spec, f.name)) for f in eval_settings() if f.metadata.get("job")}
    demo = kw.get("model") == DEMO_MODEL
    if demo:
        kw["model"] = None
    cfg = EvalConfig(demo=demo, **kw)
    from mpitp.evaluation.lmeval_args import apply_lm_eval_settings

    apply_lm_eval_settings(cfg, thaw(spec.lm_eval or {}))
    return cfg


def _load(path):
    from mpitp.jobs.jobfile import JobFileError, load_job

    try:
        return load_job(path)
    except JobFileError as exc:
        raise UsageError(str(exc)) from None


def run_job(path: str, *, fail_fast: bool, device: str | None, threads: int | None, timeout: float,
            log_all_ranks: bool) -> int:
    """Execute every run of the job file; returns the exit status (0 when every run completed or was skipped)."""
    from mpitp.parallel.walltime import hold_if_stopping, install

    world = world_from_comm()
    setup_logging(world.rank, log_all_ranks)
    install(world.rank)
    job = agree(lambda: _load(path), world.comm, timeout, "reading the job file")
    # Every existing output is checked before the first run, so a file mpitp would refuse stops nothing half-way:
    # each file of a sweep too (its checkpoints' outputs were found only at the sweep's turn, which then failed).
    agree(lambda: [output_status(out) for spec in job.runs for out in run_outputs(spec, matched=True)], world.comm,
          timeout, "checking outputs")
    summary = []
    for i, spec in enumerate(job.runs, 1):
        hold_if_stopping()
        t0 = time.perf_counter()
        state = agree(lambda: output_status(one_output(spec)), world.comm, timeout, "checking outputs")
        try:
            if state == "complete":
                agree(lambda: _same_settings(spec), world.comm, timeout, "checking a complete output")
                summary.append(RunOutcome.of(spec, "skipped (complete)"))
                continue
            if world.rank == 0:
                log.info("=== run %d/%d: %s (tp=%d%s)%s", i, len(job.runs), spec.name, spec.tp,
                         f", pp={spec.pp}" if spec.pp > 1 else "", " resuming" if state == "running" else "")
            cfg = agree(lambda: eval_config(spec), world.comm, timeout, "reading the run's settings")
            # Always (job files have no --resume/--overwrite): a sweep's files each resume or are skipped when
            # complete, and a file another job creates after the status was read is resumed (or refused while it
            # writes) as the job file promises, not met with eval's "exists: pass --resume or --overwrite".
            cfg.resume = True
            launch = make_launch(tp=spec.tp, pp=spec.pp, device=device or spec.device, threads=threads,
                                 timeout=spec.timeout or timeout, world=world, iface=spec.iface,
                                 stage_dir=spec.stage_dir, ep=spec.ep)
            failed = run_config(cfg, launch) != 0  # its own torch world, torn down before the next run
            status = "FAILED: a checkpoint of the sweep failed (see its sweep summary)" if failed else "complete"
            summary.append(RunOutcome.of(spec, status, time.perf_counter() - t0, failed))
        except UsageError as exc:
            if not exc.collective:
                raise
            summary.append(RunOutcome.of(spec, f"FAILED: {exc}", time.perf_counter() - t0, failed=True))
            if world.rank == 0:
                log.error("run %s failed: %s", spec.name, exc)
            if fail_fast:
                summary += [RunOutcome.of(s, "not started (--fail-fast)", failed=True) for s in job.runs[i:]]
                break
        mpicomm.barrier(world.comm, timeout, phase=f"end of run {spec.name}")
    if world.rank == 0:
        print_summary(job.path, summary)
    return 1 if any(r.failed for r in summary) else 0


def _same_settings(spec: RunSpec) -> None:
    """Rank 0, for a run whose output is already complete: a :class:`UsageError` naming the difference unless that
    file was made with this run's settings and checkpoint (the test ``--resume`` applies). Skipped on its status
    alone, an edited run (another limit, task or model) reported "skipped (complete)" over the old numbers."""
    from mpitp.evaluation.checks import check_resumable
    from mpitp.jobs.orchestrate import with_demo
    from mpitp.tasks.demo import prepare_demo

    cfg = eval_config(spec)
    if cfg.demo:
        cfg = with_demo(cfg, prepare_demo())
    try:
        check_resumable(one_output(spec), cfg)
    except UsageError as exc:
        raise UsageError(f"{exc}; it is complete for those: give this run another output, or move the file away to "
                         "recompute it") from None


def run_outputs(spec: RunSpec, matched: bool = False) -> list[str]:
    """The results files of a run: its ``output``, or, when that is a pattern with ``{name}`` (a sweep of
    checkpoints or adapters, or one model), each member's file as the sweep names it
    (:func:`mpitp.jobs.sweep.checkpoint_names`, :func:`~mpitp.jobs.sweep.output_for`). A glob that matches nothing
    now is a :class:`UsageError`, or no file with ``matched`` (the run fails on it in its turn)."""
    if "{name}" not in spec.output:
        return [spec.output]
    from mpitp.jobs.sweep import checkpoint_names, expand_models, is_sweep, output_for

    field = "peft" if is_sweep(spec.peft) else "model"
    spec_items = getattr(spec, field)
    try:
        items = expand_models(spec_items, f"--{field}") if is_sweep(spec_items) else [spec_items]
    except UsageError:
        if matched:
            return []
        raise
    return [output_for(spec.output, name, "") for name in checkpoint_names(items)]


def one_output(spec: RunSpec) -> str:
    """The file a run that is no sweep writes (``output: out/{name}-x.h5`` names it by its model, as
    :func:`mpitp.jobs.orchestrate.prepare` does); a sweep's pattern as it is (its own files are skipped or resumed
    one by one). Read literally, a complete ``{name}`` run was never skipped: each ``mpitp run`` loaded its model
    again and rewrote the file with a resume of 0 requests."""
    from mpitp.jobs.sweep import is_sweep

    return spec.output if is_sweep(spec.model) or is_sweep(spec.peft) else run_outputs(spec)[0]


def run_status(spec: RunSpec) -> str:
    """Where a run stands, read from its results files (:func:`run_outputs`): ``complete`` when every one is,
    ``missing`` when none exists, else ``running (K/N files complete)``. Read as the literal ``.../{name}.h5``, a
    sweep run was always ``missing``: ``mpitp submit --wait`` said "0/2 runs ok" and exited 1 after a job that had
    completed both sweeps."""
    states = [output_status(out) for out in run_outputs(spec, matched=True)]  # a glob matching nothing: none
    done = states.count("complete")
    if states and done == len(states):
        return "complete"
    if not states or states.count("missing") == len(states):
        return "missing"
    return states[0] if len(states) == 1 else f"running ({done}/{len(states)} files complete)"


def print_summary(path: Path, summary: list[RunOutcome]) -> None:
    from mpitp.results.texttable import format_table

    rows = [dict(run=r.name, tp=r.tp, pp=r.pp, status=r.status, wall=f"{r.wall_s:.1f}s", output=r.output)
            for r in summary]
    print(f"\njob {path}: {sum(1 for r in summary if not r.failed)}/{len(rows)} runs ok")
    print(format_table(rows, ["run", "tp", "pp", "status", "wall", "output"]))
