"""One path from settings to results: :func:`run_config`, used by ``mpitp eval`` and by every run of ``mpitp run``.

The built-in demo is filled in, a ``--model`` that names several checkpoints (a glob or a comma list) becomes a sweep
(:mod:`mpitp.jobs.sweep`), a ``--peft`` that names several adapters one over a single base load
(:mod:`mpitp.jobs.adapter_sweep`), ``--watch DIR`` a watch (:mod:`mpitp.jobs.watch`), and anything else is one
evaluation (:mod:`mpitp.evaluation.runner`). Each is first checked on rank 0 (:func:`prepare`, no torch on any rank
yet), then run inside the one torch world :func:`run_config` opens and closes. The command line (:mod:`mpitp.cli`)
imports this module, never the reverse.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mpitp.errors import UsageError

if TYPE_CHECKING:
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Launch, Runtime


class Plan(Protocol):
    """A run checked and not yet started (:func:`prepare`); ``execute`` runs it inside the run's torch world."""

    def __enter__(self) -> Plan: ...

    def __exit__(self, *exc) -> None: ...

    def execute(self, rt: Runtime) -> int: ...


def demo_config(cfg: EvalConfig, launch: Launch) -> EvalConfig:
    """Fill in the built-in demo: rank 0 builds (or reuses) the tiny model, every rank then reads it."""
    from mpitp.parallel import comm as mpicomm
    from mpitp.tasks.demo import prepare_demo

    paths = None
    if launch.world.rank == 0:
        paths = prepare_demo()
    return with_demo(cfg, mpicomm.bcast_obj(paths, launch.world.comm, timeout=launch.timeout,
                                            phase="demo preparation"))


def with_demo(cfg: EvalConfig, paths: tuple) -> EvalConfig:
    """``cfg`` with the demo's model, task folder and tasks (:func:`mpitp.tasks.demo.prepare_demo`'s ``paths``)
    where it names none of its own."""
    model_dir, include_path, tasks = paths
    cfg.model = cfg.model or model_dir
    cfg.include_path = [include_path, cfg.include_path] if cfg.include_path else include_path
    cfg.tasks = cfg.tasks or list(tasks)
    if cfg.model_args is not None:
        cfg.model_args.setdefault("pretrained", cfg.model)
    return cfg


@dataclass(frozen=True)
class Watch:
    """``--watch DIR`` and ``--watch-idle``: evaluate checkpoints as they appear in ``directory``."""

    directory: str
    idle_s: float


def prepare(cfg: EvalConfig, launch: Launch, watch: Watch | None = None) -> Plan:
    """What the settings ask for, checked on rank 0 before any torch starts: one evaluation, a sweep of checkpoints,
    a sweep of adapters over one base, or a watched directory.

    ``--verbosity`` and the filter of lm-eval's lines about mpitp's own integration (:mod:`mpitp.evaluation.quiet`)
    apply to every kind: only :func:`prepare_eval` installed them, so each checkpoint of a sweep or a watched
    directory printed lm-eval's two warnings about a pre-built model, and ``--verbosity`` did nothing there."""
    from mpitp.evaluation.quiet import quiet_integration
    from mpitp.evaluation.runner import prepare_eval
    from mpitp.jobs.adapter_sweep import check_one_kind, prepare_adapter_sweep
    from mpitp.jobs.sweep import is_sweep, prepare_sweep

    quiet_integration(cfg.verbosity, launch.world.rank == 0)
    t0 = time.perf_counter()
    if cfg.demo:
        cfg = demo_config(cfg, launch)
    if watch is not None:
        from mpitp.jobs.watch import prepare_watch

        return prepare_watch(cfg, launch, watch.directory, watch.idle_s)
    if not cfg.model:
        raise UsageError("no model given: pass --model hf --model_args pretrained=PATH_OR_ID, --model PATH "
                         "(or --demo)", collective=True)
    check_one_kind(cfg.model, cfg.peft, collective=True)  # every rank sees the same settings
    if is_sweep(cfg.peft):
        return prepare_adapter_sweep(cfg, launch)
    if is_sweep(cfg.model):
        return prepare_sweep(cfg, launch)
    if cfg.output is None:
        cfg.output = default_output(cfg)
    elif "{name}" in cfg.output:  # a sweep's pattern given one checkpoint: its name, as a sweep of one would write
        from mpitp.jobs.sweep import checkpoint_names, output_for

        cfg.output = output_for(cfg.output, checkpoint_names([cfg.model])[0], "")
    return prepare_eval(cfg, launch, demo_s=time.perf_counter() - t0 if cfg.demo else None)


def run_config(cfg: EvalConfig, launch: Launch, watch: Watch | None = None) -> int:
    """Every rank calls it with the same settings: the checks (:func:`prepare`), then the run inside the one torch
    world it owns (:func:`mpitp.parallel.runtime.replica_world`), torn down once however the run ends. Exit status:
    1 when a checkpoint of a sweep failed, else 0 (bad input raises :class:`UsageError`)."""
    from mpitp.parallel.runtime import replica_world

    with prepare(cfg, launch, watch) as plan, replica_world(launch) as rt:
        return plan.execute(rt)


def default_output(cfg: EvalConfig) -> str | None:
    """The HDF5 file's place: ``--use_cache PATH`` is mpitp's request store (``PATH.h5``, resumed when it exists);
    with ``--output_path`` the file goes beside lm-eval's; otherwise the checks pick results/<model>-<time>.h5."""
    if cfg.use_cache:
        cfg.resume = True
        return cfg.use_cache if cfg.use_cache.endswith((".h5", ".hdf5")) else f"{cfg.use_cache}.h5" if not \
            os.path.isdir(cfg.use_cache) else os.path.join(cfg.use_cache, "mpitp-cache.h5")
    if cfg.output_path:
        from mpitp.evaluation.outputs import hdf5_beside

        return hdf5_beside(cfg.output_path, cfg.model_args or {}, cfg.model)
    return None
