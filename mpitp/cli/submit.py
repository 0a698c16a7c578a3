"""``mpitp submit JOB.yaml``: write a SLURM/PBS batch script for a job file and submit it (:mod:`mpitp.jobs.submit`);
``--wait`` follows the job to its end and prints the job file's summary."""

from __future__ import annotations

import time as _time

import click

from mpitp.jobs.jobfile import JobFileError, load_job
from mpitp.jobs.submit import (
    DEFAULT_SIGNAL_GRACE,
    SCHEDULERS,
    BadJob,
    SubmitError,
    SubmitUsageError,
    follow_command,
    job_summary,
    log_paths,
    script_path,
    submit,
    wait_for,
)


@click.command("submit")
@click.argument("job_file", metavar="JOB.yaml", type=click.Path(dir_okay=False))
@click.option("--scheduler", type=click.Choice(SCHEDULERS), required=True, help="Batch system.")
@click.option("--nodes", type=int, required=True, help="Number of nodes.")
@click.option("--ranks-per-node", type=int, help="MPI ranks per node (default: --gpus-per-node).")
@click.option("--gpus-per-node", type=int, help="GPUs per node, one rank each; 0 or absent: no GPU request.")
@click.option("--time", "walltime", required=True, metavar="HH:MM:SS",
              help="Walltime; slurm also takes D-HH:MM:SS.")
@click.option("--account", help="Account/project to charge.")
@click.option("--partition", help="Slurm partition.")
@click.option("--queue", help="PBS queue.")
@click.option("--cpus-per-task", type=int, help="CPU cores per rank (also OMP_NUM_THREADS).")
@click.option("--env-setup", metavar="TEXT",
              help='Shell lines run before launch, e.g. "module load cuda; source venv/bin/activate" '
                   "(default: put this mpitp's folder on PATH).")
@click.option("--nccl-env", multiple=True, metavar="NAME=VALUE", help="Site NCCL variable; repeatable.")
@click.option("--iface", metavar="NAME", help="Network interface between nodes, exported as MPITP_IFACE (gloo, "
                                            "NCCL and mpitp's rendezvous use it).")
@click.option("--launcher", type=click.Choice(("srun", "mpirun", "mpiexec")),
              help="MPI launcher (slurm: srun [default] or mpirun; pbs: mpiexec).")
@click.option("--srun-mpi", default="auto", show_default=True, metavar="auto|pmi2|pmix|...",
              help="srun's MPI plugin; auto: the one the MPI mpi4py is linked against speaks (MPICH: pmi2, "
                   "Open MPI: pmix), checked against `srun --mpi=list`.")
@click.option("--signal-grace", type=int, default=DEFAULT_SIGNAL_GRACE, show_default=True, metavar="SECONDS",
              help="slurm: USR1 this long before the walltime; mpitp stops and the job is requeued.")
@click.option("--no-requeue", is_flag=True, help="slurm: no walltime signal, no requeue (pbs: not rerunnable).")
@click.option("--wait", is_flag=True, help="Wait for the job to end, print the job file's summary; exit 1 unless "
                                           "it COMPLETED with every run complete.")
@click.option("--run-arg", "run_args", multiple=True, help="Extra argument for `mpitp run`; repeatable.")
@click.option("--script-dir", type=click.Path(file_okay=False), help="Where to write the script.")
@click.option("--dry-run", is_flag=True, help="Print the script; write and submit nothing.")
@click.option("--no-check", is_flag=True, help="Queue without `mpitp check` (whether every run works offline): "
                                               "a missing file then fails on the compute node, after the queue.")
def submit_command(job_file: str, scheduler: str, nodes: int, ranks_per_node: int | None, gpus_per_node: int | None,
                   walltime: str, account: str | None, partition: str | None, queue: str | None,
                   cpus_per_task: int | None, env_setup: str | None, nccl_env: tuple[str, ...], iface: str | None,
                   launcher: str | None, srun_mpi: str, signal_grace: int, no_requeue: bool, wait: bool,
                   run_args: tuple[str, ...], script_dir: str | None, dry_run: bool, no_check: bool) -> None:
    """Write a SLURM/PBS batch script for JOB.yaml and submit it."""
    from mpitp.jobs.readiness import NO_CHECK_RISK, NotReady

    if no_check and not dry_run:
        click.echo(f"warning: {NO_CHECK_RISK}", err=True)
    try:
        result = submit(scheduler, job_file, script_dir=script_dir, dry_run=dry_run, check=not no_check, nodes=nodes,
                        ranks_per_node=ranks_per_node, gpus_per_node=gpus_per_node, time=walltime,
                        account=account, partition=partition, queue=queue, env_setup=env_setup, launcher=launcher,
                        srun_mpi=srun_mpi, cpus_per_task=cpus_per_task, nccl_env=nccl_env, iface=iface,
                        requeue=not no_requeue, signal_grace=signal_grace, extra_args=run_args)
    except NotReady as exc:
        click.echo(str(exc), err=True)
        raise click.exceptions.Exit(2) from None
    except SubmitUsageError as exc:
        raise click.UsageError(str(exc)) from None
    except (BadJob, JobFileError) as exc:  # bad input, as mpitp run reports the same job file: exit 2
        err = click.ClickException(str(exc))
        err.exit_code = 2
        raise err from None
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    if dry_run:
        click.echo(result, nl=False)
        return
    job = load_job(job_file)
    path = script_path(job, scheduler, script_dir)
    click.echo(f"Submitted {scheduler} job {result} (script: {path})")
    logs = log_paths(scheduler, job, result)
    click.echo(f"logs: {logs[0]} and {logs[1]}")
    if not wait:
        click.echo(f"follow: {follow_command(scheduler, job, result)}")
        return
    t0 = _time.monotonic()
    try:
        info = wait_for(scheduler, result, echo=click.echo)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    ok, table = job_summary(job)
    click.echo(f"job {result} ended {info['state']} (exit {info['exit']}, restarts {info['restarts']}, run time "
               f"{info['elapsed']}, waited {_time.monotonic() - t0:.0f} s)")
    click.echo(table)
    if info["state"] not in ("COMPLETED", "FINISHED") or ok < len(job.runs) or info["exit"] not in ("0:0", "0"):
        raise click.exceptions.Exit(1)
