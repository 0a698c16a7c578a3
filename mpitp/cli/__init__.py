"""The ``mpitp`` command line. Every subcommand works under ``mpiexec``/``srun`` and as a singleton.

One module per command (``check``: check and prefetch, ``evaluate``: eval, ``run``, ``submit``, ``inspect``,
``info``, ``tasks``, ``rescore``, ``report``), each a thin click layer over library code that imports the heavy
libraries (torch, lm-eval, h5py) only when it runs, so that ``mpitp --help`` stays fast. The group imports a
command's module when the command is asked for (:data:`COMMANDS`, click's lazy group): ``mpitp eval`` on every rank
does not import ``submit``'s templates and YAML (60 ms); an import error there is a bug and surfaces as one (in
``mpitp --help`` too), not as a missing command.

``main`` is the failure boundary: a :class:`UsageError` becomes one line on rank 0 and exit status 2 on every rank;
any other exception on any rank is printed once with its rank and aborts the whole MPI job.
"""

from __future__ import annotations

from mpitp.parallel.walltime import finished, listen_early

listen_early()  # first of all, before numpy and MPI load: a walltime signal while a rank starts must not be lost

import importlib  # noqa: E402
import sys  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import click  # noqa: E402

from mpitp import compat, gcpolicy, importpolicy  # noqa: E402
from mpitp.errors import (  # noqa: E402
    FINALIZE_WAIT_S,
    USAGE_EXIT,
    UsageError,
    abort,
    finalize_within,
    install_excepthook,
    report_and_abort,
    world_rank,
)
from mpitp.testing import hooks, stall  # noqa: E402
from mpitp.version import __version__  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Sequence


#: each subcommand -> (the module defining it, the command's name there); imported when the command is asked for
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("mpitp.cli.check", "check_command"),
    "eval": ("mpitp.cli.evaluate", "eval_command"),
    "info": ("mpitp.cli.info", "info_command"),
    "inspect": ("mpitp.cli.inspect", "inspect_command"),
    "prefetch": ("mpitp.cli.check", "prefetch_command"),
    "report": ("mpitp.cli.report", "report_command"),
    "rescore": ("mpitp.cli.rescore", "rescore_command"),
    "run": ("mpitp.cli.run", "run_command"),
    "submit": ("mpitp.cli.submit", "submit_command"),
    "tasks": ("mpitp.cli.tasks", "tasks_command"),
}


#: Commands that never use MPI: launched as several ranks (``srun mpitp check`` in a batch script, ``mpiexec -n 2 mpitp
#: submit``), rank 0 alone runs them. Every rank printed the same lines, wrote the same ``--json-out`` or report, and
#: ``submit`` submitted the job once per rank, ``prefetch`` downloaded into one folder from each.
ONE_PROCESS = frozenset({"check", "inspect", "prefetch", "report", "rescore", "submit", "tasks"})


def _left_to_rank0(args: Sequence[str]) -> bool:
    """This is not rank 0 of a launch of a :data:`ONE_PROCESS` command: it leaves at once, status 0 (rank 0's status
    is the launch's; a usage error is rank 0's line, as for every command)."""
    return bool(args) and args[0] in ONE_PROCESS and world_rank() != 0


class _Commands(click.Group):
    """:data:`COMMANDS`, each imported when asked for (``mpitp --help`` lists them alphabetically)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, name = COMMANDS[cmd_name]
        return getattr(importlib.import_module(module), name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mpitp")
def cli() -> None:
    """Evaluate Hugging Face models on lm-eval tasks under MPI: TP inside DP groups, results in HDF5."""


def _finalize_wait() -> float:
    """The bound on MPI_Finalize, after the drills' stall at the door (a node's link cut while the ranks leave). A
    malformed hook was already said once, as the command's usage error: not again here."""
    try:
        hooks()
    except UsageError:
        return FINALIZE_WAIT_S
    stall("before_finalize")
    stall(f"before_finalize_rank{world_rank()}")
    return hooks().finalize_wait or FINALIZE_WAIT_S


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None:  # the process's own command: few collector passes while it imports (mpitp.gcpolicy), and
        gcpolicy.start_up()  # what it never calls imported when first called (mpitp.importpolicy)
        importpolicy.start_up()
    if _left_to_rank0(sys.argv[1:] if argv is None else argv):
        return
    install_excepthook()
    try:
        hooks()  # MPITP_TEST_* read on every rank before any work: a malformed one is one usage error, together
        # click's and Python's internals mpitp reaches (already imported: microseconds); lm-eval's, transformers' and
        # torch's are checked where a command first imports them (mpitp.evaluation.checks.check_all)
        compat.check(collective=True, packages=("click", "python"))
        code = cli.main(args=argv, prog_name="mpitp", standalone_mode=False)
    except UsageError as exc:
        if not exc.collective:
            report_and_abort(exc)
        if world_rank() == 0:
            from mpitp.results.untrusted import shown  # a message may quote a file's names: escaped

            sys.stderr.write(f"mpitp: error: {shown(exc)}\n")
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
        failing = sys.exc_info()[1]
        # Only as the process's own command (the console script, python -m mpitp): a caller that passes argv
        # (bench drivers) goes on using MPI. A failure goes on to the excepthook's abort instead.
        if argv is None and (failing is None or isinstance(failing, SystemExit)):
            # bounded: a node lost after the work was done must not hold this rank forever
            finalize_within(_finalize_wait())
            gcpolicy.leaving()
    if isinstance(code, int) and code:  # without standalone mode click returns an Exit's code instead of raising it
        sys.exit(code)
