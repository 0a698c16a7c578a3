"""The ``mpitp`` command line. Every subcommand works under ``mpiexec``/``srun`` and as a singleton.

``main`` is the failure boundary: a :class:`UsageError` becomes one line on rank 0 and exit status 2 on every rank;
any other exception on any rank is printed once with its rank and aborts the whole MPI job.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .comm import DEFAULT_TIMEOUT
from .errors import USAGE_EXIT, UsageError, abort, install_excepthook, report_and_abort, world_rank


def _positive_float(ctx, param, value):
    if value is None:
        return value
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise click.BadParameter(f"expected a number of seconds, got {value!r}") from None
    if not v > 0:
        raise click.BadParameter(f"must be > 0, got {value!r}")
    return v


def runtime_options(f):
    """Options shared by every subcommand that starts the MPI runtime."""
    f = click.option("--log-all-ranks", is_flag=True, help="Log from every rank, each line prefixed with its rank.")(f)
    f = click.option("--timeout", default=str(DEFAULT_TIMEOUT), callback=_positive_float, show_default=True,
                     help="Seconds any rank waits for its peers (MPI barriers and torch.distributed).")(f)
    f = click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="Torch threads per rank (default: cores per node / ranks per node).")(f)
    f = click.option("--device", default=None, help="Device override, e.g. cpu or cuda:0 (default: auto).")(f)
    f = click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Pipeline stages per model replica (TP inside each stage); dp = world size / (tp x pp).")(f)
    f = click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Tensor-parallel degree; dp = world size / (tp x pp).")(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mpitp")
def cli():
    """Evaluate Hugging Face models on lm-eval tasks under MPI: TP inside DP groups, results in HDF5."""


@cli.command()
@runtime_options
@click.option("--model", default=None, help="With --pp: print which decoder layers each stage of this model holds.")
def info(tp, pp, device, threads, timeout, log_all_ranks, model):
    """Print the dp x pp x tp layout, the MPI library and the torch backend (rank 0 prints)."""
    from .info import run_info

    run_info(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout, log_all_ranks=log_all_ranks,
             model=model)


def _register_optional():
    """Subcommands living in their own modules are added here so that ``mpitp --help`` stays fast."""
    from .commands import register

    register(cli)



def main(argv=None) -> None:
    install_excepthook()
    _register_optional()
    try:
        cli.main(args=argv, prog_name="mpitp", standalone_mode=False)
    except UsageError as exc:
        if not exc.collective:
            report_and_abort(exc)
        if world_rank() == 0:
            sys.stderr.write(f"mpitp: error: {exc}\n")
        sys.exit(USAGE_EXIT)
    except click.exceptions.Abort:
        # click turns Ctrl-C (KeyboardInterrupt) into Abort. A plain exit would leave this rank in MPI_Finalize
        # waiting for peers that never get there: abort the whole job instead, as the excepthook does.
        sys.stderr.write(f"[rank {world_rank()}] interrupted\n")
        abort(130)
    except click.ClickException as exc:
        # Option parsing is identical on every rank, so every rank fails together: print once.
        if world_rank() == 0:
            exc.show()
        sys.exit(USAGE_EXIT if exc.exit_code == 2 else exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def _limit(ctx, param, value):
    if value is None:
        return None
    try:
        v = float(value)
    except ValueError:
        raise click.BadParameter(f"expected a number, got {value!r}") from None
    if not v > 0:
        raise click.BadParameter(f"must be > 0, got {value}")
    return int(v) if v >= 1 and v == int(v) else v


def _batch(ctx, param, value):
    try:
        v = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a positive integer, got {value!r}") from None
    if v < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return v


def eval_options(f):
    """lm-eval's vocabulary, so an ``lm_eval --model hf`` command line translates one to one."""
    opts = [
        click.option("--model", "model", default=None,
                     help="HF model path or hub id; a glob or comma list evaluates each checkpoint (a sweep)."),
        click.option("--tasks", default=None, help="Comma-separated lm-eval task names."),
        click.option("--tokenizer", default=None, help="Tokenizer path or id (default: the model's)."),
        click.option("--revision", default=None, help="Model revision (hub models)."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                     show_default=True),
        click.option("--num-fewshot", type=click.IntRange(min=0), default=None),
        click.option("--limit", default=None, callback=_limit, help="Docs per task (int) or fraction (< 1)."),
        click.option("--batch-size", default="1", callback=_batch, show_default=True),
        click.option("--max-length", type=click.IntRange(min=2), default=None),
        click.option("--gen-kwargs", default=None, help="e.g. temperature=0,max_gen_toks=64"),
        click.option("--apply-chat-template", is_flag=True),
        click.option("--include-path", default=None, help="Directory of extra task YAMLs (as lm-eval)."),
        click.option("--data-dir", default=None, help="Serve stock tasks offline from DIR/<task>/<split>.jsonl."),
        click.option("--seed", type=int, default=None, help="One seed for python, numpy, torch and few-shot."),
        click.option("--output", default=None, help="HDF5 results file (default results/<model>-<time>.h5); for a "
                     "sweep a directory or a pattern with {name}."),
        click.option("--overwrite", is_flag=True, help="Replace an existing output file."),
        click.option("--resume", is_flag=True, help="Continue an existing output file."),
        click.option("--log-samples", is_flag=True, help="Store lm-eval's per-document samples."),
        click.option("--bootstrap-iters", type=click.IntRange(min=0), default=100000, show_default=True),
        click.option("--trust-remote-code", is_flag=True),
        click.option("--demo", is_flag=True, help="Built-in offline demo: tiny random Llama, three small tasks."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _sweep_options(f):
    from .sweep import sweep_options

    return sweep_options(f)


@cli.command(name="eval")
@runtime_options
@eval_options
@_sweep_options
def eval_cmd(tp, pp, device, threads, timeout, log_all_ranks, **kw):
    """Evaluate a model on lm-eval tasks: mpirun -n 4 mpitp eval --model M --tasks T --tp 2."""
    from .evalcmd import eval_main

    eval_main(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout, log_all_ranks=log_all_ranks, **kw)
