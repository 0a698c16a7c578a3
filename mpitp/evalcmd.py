"""``mpitp eval``: turn command-line options into an :class:`EvalConfig` and run it."""

from __future__ import annotations

import sys

from .errors import UsageError
from .run import EvalConfig, run_eval
from .runtime import setup_logging, start
from .world import world_from_comm


def demo_config(cfg: EvalConfig, rt) -> EvalConfig:
    """Fill in the built-in demo: rank 0 builds (or reuses) the tiny model, every rank then reads it."""
    from . import comm as mpicomm
    from .demo import prepare_demo

    paths = None
    if rt.world.rank == 0:
        paths = prepare_demo()
    model_dir, include_path, tasks = mpicomm.bcast_obj(paths, rt.world.comm, timeout=rt.timeout,
                                                       phase="demo preparation")
    cfg.model = cfg.model or model_dir
    cfg.include_path = [include_path, cfg.include_path] if cfg.include_path else include_path
    cfg.tasks = cfg.tasks or list(tasks)
    return cfg


def eval_main(*, tp, device, threads, timeout, log_all_ranks, tasks, pp=1, watch=None, watch_idle=600.0,
              **kw) -> None:
    setup_logging(world_from_comm().rank, log_all_ranks)
    cfg = EvalConfig(tasks=[t.strip() for t in tasks.split(",") if t.strip()] if tasks else [], **kw)
    rt = start(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout)
    if cfg.demo:
        cfg = demo_config(cfg, rt)
    if watch is not None:
        from .watch import run_watch

        sys.exit(run_watch(cfg, rt, watch, watch_idle))
    if not cfg.model:
        raise UsageError("no model given: pass --model PATH_OR_ID (or --demo)", collective=True)
    from .sweep import is_sweep, run_sweep

    if is_sweep(cfg.model):
        sys.exit(run_sweep(cfg, rt))
    run_eval(cfg, rt)
