"""``mpitp report FILE_OR_DIR... -o report.html``: one self-contained HTML page over results files and sweep
summaries (:mod:`mpitp.results.report`); a bad input is one line and exit status 2, as in ``mpitp inspect``."""

from __future__ import annotations

import click

from mpitp.cli.inspect import CONTEXT, BadInputExit, _bad_input_exits
from mpitp.escape import shown
from mpitp.results.reader import one_line


@click.command(name="report", context_settings=CONTEXT)
@click.argument("inputs", nargs=-1, required=True, metavar="FILE_OR_DIR...")
@click.option("-o", "--output", required=True, help="The HTML file to write.")
@click.option("--bootstrap-iters", type=click.IntRange(min=0), default=10000, show_default=True,
              help="Bootstrap resamples of the Diff section's paired tests (as mpitp inspect diff; every pair of up to "
                   "12 runs, neighbours past that; 0: none).")
@_bad_input_exits
def report_command(inputs: tuple[str, ...], output: str, bootstrap_iters: int) -> None:
    """Write one HTML page (runs, leaderboard, samples, sweep plot) that opens from disk with no server."""
    from mpitp.results.report import output_problem, write
    from mpitp.results.safefile import replace_problem

    # before the page is built: a wrong -o was a traceback after all the work, or an input replaced by the page
    why = replace_problem(output) or output_problem(list(inputs), output)
    if why:
        raise BadInputExit(f"-o {output}: {why}")
    try:
        size = write(list(inputs), output, diff_iters=bootstrap_iters,
                     warn=lambda line: click.echo(f"mpitp: warning: {shown(line)}", err=True))
    except OSError as exc:  # a folder that refuses files after all (a read-only mount says yes to os.access)
        raise BadInputExit(f"-o {output}: {one_line(exc)}") from None
    click.echo(f"report: {output} ({size} bytes)")
