"""``mpitp run JOB.yaml``: every evaluation of a job file in this MPI world (:mod:`mpitp.jobs.jobrun`)."""

from __future__ import annotations

import sys

import click


@click.command(name="run")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--fail-fast", is_flag=True, help="Stop at the first failed run.")
@click.option("--device", default=None)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=3600.0, show_default=True)
@click.option("--log-all-ranks", is_flag=True)
def run_command(job_file: str, fail_fast: bool, device: str | None, threads: int | None, timeout: float,
                log_all_ranks: bool) -> None:
    """Run every evaluation of a job file in this MPI world (mpirun -n 4 mpitp run jobs/demo.yaml)."""
    from mpitp.jobs.jobrun import run_job

    sys.exit(run_job(job_file, fail_fast=fail_fast, device=device, threads=threads, timeout=timeout,
                     log_all_ranks=log_all_ranks))
