"""``mpitp eval``: parse lm-eval's command line (plus mpitp's options) into an :class:`EvalConfig` and run it.

The click command passes its arguments through untouched: lm-eval's own argparse parser reads them
(:mod:`mpitp.evaluation.lmeval_args`), so ``mpitp eval`` takes every ``lm_eval`` command line."""

from __future__ import annotations

import sys

import click

from mpitp.errors import UsageError
from mpitp.evaluation.runner import run_eval
from mpitp.evaluation.settings import EvalConfig
from mpitp.parallel.runtime import agree, setup_logging, start, stop
from mpitp.parallel.world import world_from_comm


def demo_config(cfg: EvalConfig, rt) -> EvalConfig:
    """Fill in the built-in demo: rank 0 builds (or reuses) the tiny model, every rank then reads it."""
    from mpitp.parallel import comm as mpicomm
    from mpitp.tasks.demo import prepare_demo

    paths = None
    if rt.world.rank == 0:
        paths = prepare_demo()
    model_dir, include_path, tasks = mpicomm.bcast_obj(paths, rt.world.comm, timeout=rt.timeout,
                                                       phase="demo preparation")
    cfg.model = cfg.model or model_dir
    cfg.include_path = [include_path, cfg.include_path] if cfg.include_path else include_path
    cfg.tasks = cfg.tasks or list(tasks)
    if cfg.model_args is not None:
        cfg.model_args.setdefault("pretrained", cfg.model)
    return cfg


@click.command(name="eval", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def eval_command(args):
    """Evaluate a model on lm-eval tasks: every lm_eval --model hf command line, plus --tp/--pp (mpitp eval -h)."""
    eval_main(list(args))


def eval_main(argv: list[str]) -> None:
    """Rank 0 parses (a ``--config`` or ``--samples`` file is read once) and every rank gets its verdict."""
    from mpitp.evaluation.lmeval_args import parse_eval_args
    from mpitp.parallel.comm import DEFAULT_TIMEOUT

    world = world_from_comm()
    if world.rank == 0:
        from lm_eval.utils import setup_logging as lm_eval_logging

        lm_eval_logging()  # as lm_eval's own entry point does first: its parse-time warnings look like its others
    parsed = agree(lambda: parse_eval_args(argv), world.comm, DEFAULT_TIMEOUT, "parsing the command line")
    if parsed[0] == "exit":
        if world.rank == 0 and parsed[2]:
            (sys.stdout if parsed[1] == 0 else sys.stderr).write(parsed[2])
        sys.exit(parsed[1])
    _, cfg, opts, shown = parsed
    if world.rank == 0 and shown:
        sys.stdout.write(shown)  # lm-eval prints the settings read from --config
    setup_logging(world.rank, opts["log_all_ranks"])
    from mpitp.parallel.walltime import install

    install(world.rank)
    # torch starts after rank 0's checks (run_eval, run_sweep, run_watch): a refused run costs one rank's start-up.
    rt = start(tp=opts["tp"], pp=opts["pp"], device=opts["device"], threads=opts["threads"], timeout=opts["timeout"],
               world=world, init_torch=False, iface=opts.get("iface"), stage_dir=opts.get("stage_dir"))
    try:
        if cfg.demo:
            cfg = demo_config(cfg, rt)
        if opts.get("watch") is not None:
            from mpitp.jobs.watch import run_watch

            sys.exit(run_watch(cfg, rt, opts["watch"], opts["watch_idle"]))
        if not cfg.model:
            raise UsageError("no model given: pass --model hf --model_args pretrained=PATH_OR_ID, --model PATH "
                             "(or --demo)", collective=True)
        from mpitp.jobs.sweep import is_sweep, run_sweep

        if is_sweep(cfg.model):
            sys.exit(run_sweep(cfg, rt))
        if cfg.output is None:
            cfg.output = default_output(cfg)
        run_eval(cfg, rt)
    finally:
        stop(rt)


def default_output(cfg: EvalConfig) -> str | None:
    """The HDF5 file's place: ``--use_cache PATH`` is mpitp's request store (``PATH.h5``, resumed when it exists);
    with ``--output_path`` the file goes beside lm-eval's; otherwise the checks pick results/<model>-<time>.h5."""
    if cfg.use_cache:
        import os

        cfg.resume = True
        return cfg.use_cache if cfg.use_cache.endswith((".h5", ".hdf5")) else f"{cfg.use_cache}.h5" if not \
            os.path.isdir(cfg.use_cache) else os.path.join(cfg.use_cache, "mpitp-cache.h5")
    if cfg.output_path:
        from mpitp.evaluation.outputs import hdf5_beside

        return hdf5_beside(cfg.output_path, cfg.model_args or {}, cfg.model)
    return None
