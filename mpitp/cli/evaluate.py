"""``mpitp eval``: parse lm-eval's command line (plus mpitp's options) into an :class:`EvalConfig` and run it.

The click command passes its arguments through untouched: lm-eval's own argparse parser reads them
(:mod:`mpitp.evaluation.lmeval_args`), so ``mpitp eval`` takes every ``lm_eval`` command line."""

from __future__ import annotations

import sys

import click


@click.command(name="eval", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def eval_command(args: tuple[str, ...]) -> None:
    """Evaluate a model on lm-eval tasks: every lm_eval --model hf command line, plus --tp/--pp (mpitp eval -h)."""
    eval_main(list(args))


def eval_main(argv: list[str]) -> None:
    """Rank 0 parses (a ``--config`` or ``--samples`` file is read once) and every rank gets its verdict."""
    from mpitp.evaluation.lmeval_args import ParsedExit, parse_eval_args
    from mpitp.jobs.orchestrate import Watch, run_config
    from mpitp.parallel import DEFAULT_TIMEOUT
    from mpitp.parallel.runtime import agree, make_launch, setup_logging
    from mpitp.parallel.world import world_from_comm

    world = world_from_comm()
    if world.rank == 0:
        from lm_eval.utils import setup_logging as lm_eval_logging

        lm_eval_logging()  # as lm_eval's own entry point does first: its parse-time warnings look like its others
    parsed = agree(lambda: parse_eval_args(argv), world.comm, DEFAULT_TIMEOUT, "parsing the command line")
    if isinstance(parsed, ParsedExit):
        if world.rank == 0 and parsed.text:
            (sys.stdout if parsed.status == 0 else sys.stderr).write(parsed.text)
        sys.exit(parsed.status)
    cfg, opts = parsed.cfg, parsed.runtime
    if world.rank == 0 and parsed.shown:
        sys.stdout.write(parsed.shown)  # lm-eval prints the settings read from --config
    setup_logging(world.rank, opts.log_all_ranks)
    from mpitp.parallel.walltime import install

    install(world.rank)
    # torch starts after rank 0's checks (orchestrate.prepare): a refused run costs one rank's start-up.
    launch = make_launch(tp=opts.tp, pp=opts.pp, device=opts.device, threads=opts.threads, timeout=opts.timeout,
                         world=world, iface=opts.iface, stage_dir=opts.stage_dir, ep=opts.ep)
    watch = Watch(opts.watch, opts.watch_idle) if opts.watch is not None else None
    status = run_config(cfg, launch, watch)
    if status:
        sys.exit(status)
