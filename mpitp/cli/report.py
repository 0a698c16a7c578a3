"""``mpitp report FILE_OR_DIR... -o report.html``: one self-contained HTML page over results files and sweep
summaries (:mod:`mpitp.results.report`); a bad input is one line and exit status 2, as in ``mpitp inspect``."""

from __future__ import annotations

import click

from mpitp.cli.inspect import CONTEXT, _bad_input_exits
from mpitp.escape import shown


@click.command(name="report", context_settings=CONTEXT)
@click.argument("inputs", nargs=-1, required=True, metavar="FILE_OR_DIR...")
@click.option("-o", "--output", required=True, help="The HTML file to write.")
@click.option("--bootstrap-iters", type=click.IntRange(min=0), default=10000, show_default=True,
              help="Bootstrap resamples of the Diff section's paired tests (as mpitp inspect diff; every pair of up to "
                   "12 runs, neighbours past that; 0: none).")
@_bad_input_exits
def report_command(inputs: tuple[str, ...], output: str, bootstrap_iters: int) -> None:
    """Write one HTML page (runs, leaderboard, samples, sweep plot) that opens from disk with no server."""
    from mpitp.results.report import write

    size = write(list(inputs), output, diff_iters=bootstrap_iters,
                 warn=lambda line: click.echo(f"mpitp: warning: {shown(line)}", err=True))
    click.echo(f"report: {output} ({size} bytes)")
