"""The ``mpitp`` command line. Every subcommand works under ``mpiexec``/``srun`` and as a singleton.

``main`` is the failure boundary: a :class:`UsageError` becomes one line on rank 0 and exit status 2 on every rank;
any other exception on any rank is printed once with its rank and aborts the whole MPI job.
"""

from __future__ import annotations

from mpitp.parallel.walltime import finished, listen_early

listen_early()  # first of all, before numpy and MPI load: a walltime signal while a rank starts must not be lost

import sys  # noqa: E402

import click  # noqa: E402

from mpitp import __version__  # noqa: E402
from mpitp.parallel.comm import DEFAULT_TIMEOUT  # noqa: E402
from mpitp.errors import USAGE_EXIT, UsageError, abort, install_excepthook, report_and_abort, world_rank  # noqa: E402


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
    from mpitp.cli.info import run_info

    run_info(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout, log_all_ranks=log_all_ranks,
             model=model)


def _register_optional():
    """Subcommands living in their own modules are added here so that ``mpitp --help`` stays fast."""
    from mpitp.cli.commands import register

    register(cli)



def main(argv=None) -> None:
    install_excepthook()
    _register_optional()
    try:
        code = cli.main(args=argv, prog_name="mpitp", standalone_mode=False)
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
    finally:  # also when the command ends by sys.exit (mpitp run, eval)
        finished()  # a late walltime signal must not kill a rank whose work is done
    if isinstance(code, int) and code:  # without standalone mode click returns an Exit's code instead of raising it
        sys.exit(code)


@cli.command(name="eval", add_help_option=False,
             context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def eval_cmd(args):
    """Evaluate a model on lm-eval tasks: every lm_eval --model hf command line, plus --tp/--pp (mpitp eval -h)."""
    from mpitp.cli.evaluate import eval_main

    eval_main(list(args))
