"""Subcommands defined outside ``cli.py``: job files, scheduler submission, offline tasks, result inspection."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command(name="run")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--fail-fast", is_flag=True, help="Stop at the first failed run.")
@click.option("--device", default=None)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=3600.0, show_default=True)
@click.option("--log-all-ranks", is_flag=True)
def run_command(job_file, fail_fast, device, threads, timeout, log_all_ranks):
    """Run every evaluation of a job file in this MPI world (mpirun -n 4 mpitp run jobs/demo.yaml)."""
    from mpitp.jobs.jobrun import run_job

    sys.exit(run_job(job_file, fail_fast=fail_fast, device=device, threads=threads, timeout=timeout,
                     log_all_ranks=log_all_ranks))


@click.command(name="tasks")
@click.option("--data-dir", required=True, help="Directory laid out as DIR/<task>/<split>.jsonl (or named as downloaded).")
def tasks_command(data_dir):
    """List the stock lm-eval tasks runnable offline from --data-dir, and what the others miss."""
    from mpitp.errors import UsageError
    from mpitp.tasks.offline import offline_status

    try:
        rows = offline_status(data_dir)
    except UsageError as exc:
        raise click.UsageError(str(exc)) from None
    root = Path(data_dir).resolve()
    for row in rows:
        files = " ".join(f"{split}={_rel(f, root)}" for split, f in row.files.items())
        state = "runnable" if row.runnable else "missing " + ", ".join(row.missing)
        click.echo(f"{row.task:16s} {state}" + (f"  [{files}]" if files else ""))


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:  # a symlinked folder resolving elsewhere
        return str(path)


def register(cli) -> None:
    from mpitp.jobs.submit import submit_command

    cli.add_command(run_command)
    cli.add_command(tasks_command)
    cli.add_command(submit_command)
    from mpitp.evaluation.rescore import rescore_command

    cli.add_command(rescore_command)
    try:
        from mpitp.results.report import inspect_command
    except ImportError:  # pragma: no cover - being written
        return
    cli.add_command(inspect_command, name="inspect")
