"""Batch scripts for SLURM and PBS Pro, rendered from Jinja2 templates.

Why a generator instead of hand-written scripts: the job geometry (one rank
per GPU, tensor-parallel groups that must not straddle nodes) has to agree
with every run in the job file, and that is cheap to check here, on the login
node, before anything waits in a queue.  ``StrictUndefined`` makes a template
typo an error instead of an empty ``#SBATCH`` value.

The canonical templates live in ``mpitp/templates/`` (shipped as package data);
``hpc/`` holds identical copies for people who want to read or adapt them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import jinja2

from mpitp.jobfile import Job, JobFileError, load_job

__all__ = ["SCHEDULERS", "SubmitError", "SubmitUsageError", "render_script", "script_path",
           "submit", "submit_command"]

SCHEDULERS = ("slurm", "pbs")
_LAUNCHERS = {"slurm": ("srun", "mpirun"), "pbs": ("mpiexec",)}
_SUBMIT_CMD = {"slurm": "sbatch", "pbs": "qsub"}
_TIME_RE = {
    "slurm": re.compile(r"^(?:(?P<d>\d+)-)?(?P<h>\d+):(?P<m>[0-5]\d):(?P<s>[0-5]\d)$"),
    "pbs": re.compile(r"^(?P<h>\d+):(?P<m>[0-5]\d):(?P<s>[0-5]\d)$"),
}
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SubmitError(Exception):
    """Submission failed (bad job geometry, missing scheduler, scheduler error)."""


class SubmitUsageError(SubmitError, ValueError):
    """An option value is malformed; the CLI reports it as a usage error."""


def _environment() -> jinja2.Environment:
    # PackageLoader reads mpitp/templates from the installed package (wheel or source tree).
    return jinja2.Environment(
        loader=jinja2.PackageLoader("mpitp", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        autoescape=False,  # shell, not HTML; values are shell-quoted explicitly
    )


def _check_time(scheduler: str, time: str) -> str:
    match = _TIME_RE[scheduler].match(str(time))
    parts = match.groupdict() if match else {}
    days_ok = not parts.get("d") or int(parts["h"]) < 24  # D-HH:MM:SS keeps HH below 24
    if not (match and days_ok and any(int(v) for v in parts.values() if v)):
        want = "HH:MM:SS or D-HH:MM:SS" if scheduler == "slurm" else "HH:MM:SS"
        raise SubmitUsageError(f"--time {str(time)!r}: expected a non-zero walltime as {want}")
    return str(time)


def _positive(option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SubmitUsageError(f"{option} must be a positive integer, got {value!r}")
    return value


def _directive_word(option: str, value: str | None) -> str | None:
    """Values inside ``#SBATCH``/``#PBS`` lines are not shell-parsed: no spaces allowed."""
    if value is None or value == "":
        return None
    if re.search(r"\s", value):
        raise SubmitUsageError(f"{option} {value!r} must not contain whitespace")
    return value


def _nccl_pairs(nccl_env: Mapping[str, Any] | Iterable[str] | None) -> list[tuple[str, str]]:
    if not nccl_env:
        return []
    items = nccl_env.items() if isinstance(nccl_env, Mapping) else (
        tuple(s.split("=", 1)) if "=" in s else (s, None) for s in nccl_env)
    pairs = []
    for name, value in items:
        if value is None or not _ENV_NAME_RE.match(name):
            raise SubmitUsageError(f"--nccl-env {name!r}: expected NAME=VALUE with a valid variable name")
        pairs.append((name, shlex.quote(str(value))))
    return pairs


def _log_dir(job: Job) -> Path:
    """Logs go next to the outputs: their common directory (or the job file's, if none)."""
    common = Path(os.path.commonpath([os.path.dirname(r.output) for r in job.runs]))
    return job.path.parent if common == Path(common.anchor) else common


def _prepare(scheduler: str, job_path: str | os.PathLike[str], *, nodes: int, gpus_per_node: int,
             time: str, account: str | None = None, partition: str | None = None,
             queue: str | None = None, env_setup: str | None = None, launcher: str | None = None,
             cpus_per_task: int | None = None, nccl_env: Any = None,
             extra_args: Sequence[str] = ()) -> tuple[Job, dict[str, Any]]:
    """Validate everything and build the template context."""
    if scheduler not in SCHEDULERS:
        raise SubmitUsageError(f"unknown scheduler {scheduler!r}; expected 'slurm' or 'pbs'")
    _positive("--nodes", nodes)
    _positive("--gpus-per-node", gpus_per_node)
    if cpus_per_task is not None:
        _positive("--cpus-per-task", cpus_per_task)
    if scheduler == "pbs" and partition:
        raise SubmitUsageError("--partition is a slurm option; use --queue with pbs")
    if scheduler == "slurm" and queue:
        raise SubmitUsageError("--queue is a pbs option; use --partition with slurm")
    launcher = launcher or _LAUNCHERS[scheduler][0]
    if launcher not in _LAUNCHERS[scheduler]:
        choices = " or ".join(_LAUNCHERS[scheduler])
        raise SubmitUsageError(f"--launcher {launcher!r} is not supported with {scheduler}; use {choices}")
    if isinstance(extra_args, str):
        raise SubmitUsageError("extra_args must be a sequence of arguments, not a string")
    context = {
        "time": _check_time(scheduler, time),
        "account": _directive_word("--account", account),
        "partition": _directive_word("--partition", partition),
        "queue": _directive_word("--queue", queue),
        "nccl_env": _nccl_pairs(nccl_env),
    }

    job = load_job(job_path)
    for index, run in enumerate(job.runs, 1):
        if gpus_per_node % run.tp:
            raise SubmitError(f"{os.fspath(job_path)}: run {index} ({run.name!r}): tp={run.tp} does not divide "
                              f"gpus-per-node {gpus_per_node}, so a TP group would span nodes")
        if (nodes * gpus_per_node) % (run.tp * run.pp):
            raise SubmitError(f"{os.fspath(job_path)}: run {index} ({run.name!r}): tp={run.tp} x pp={run.pp} = "
                              f"{run.tp * run.pp} does not divide {nodes} nodes x {gpus_per_node} GPUs = "
                              f"{nodes * gpus_per_node} ranks")
    log_dir = _log_dir(job)
    context.update(
        job_name=re.sub(r"[^A-Za-z0-9_.-]", "_", f"mpitp-{job.name}")[:64],
        job_path=shlex.quote(str(job.path)),
        log_dir=_directive_word("log directory", str(log_dir)),
        nodes=nodes, gpus_per_node=gpus_per_node, ntasks=nodes * gpus_per_node,
        cpus_per_task=cpus_per_task, omp_threads=cpus_per_task or 1,
        ncpus=gpus_per_node * (cpus_per_task or 1),
        env_setup=(env_setup or "").strip("\n").rstrip() or None,
        launcher=launcher,
        run_args="".join(" " + shlex.quote(str(a)) for a in extra_args),
    )
    return job, context


def render_script(scheduler: str, job_path: str | os.PathLike[str], *, nodes: int, gpus_per_node: int,
                  time: str, account: str | None = None, partition: str | None = None,
                  queue: str | None = None, env_setup: str | None = None, launcher: str | None = None,
                  cpus_per_task: int | None = None,
                  nccl_env: Mapping[str, Any] | Iterable[str] | None = None,
                  extra_args: Sequence[str] = ()) -> str:
    """Validate the job and options, and return the batch script text.

    ``launcher`` defaults to ``srun`` for slurm (``mpirun`` also allowed) and is
    ``mpiexec`` for pbs.  ``nccl_env`` is a mapping or ``NAME=VALUE`` strings,
    exported with shell quoting.  ``extra_args`` are appended to ``mpitp run``.
    Raises :class:`SubmitError` / :class:`SubmitUsageError` or
    :class:`~mpitp.jobfile.JobFileError`.
    """
    _, context = _prepare(scheduler, job_path, nodes=nodes, gpus_per_node=gpus_per_node, time=time,
                          account=account, partition=partition, queue=queue, env_setup=env_setup,
                          launcher=launcher, cpus_per_task=cpus_per_task, nccl_env=nccl_env,
                          extra_args=extra_args)
    return _environment().get_template(f"{scheduler}.sh.j2").render(**context)


def script_path(job: Job, scheduler: str, script_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`submit` writes the script: next to the outputs unless ``script_dir``."""
    folder = Path(script_dir).absolute() if script_dir else _log_dir(job)
    return folder / f"mpitp-{job.name}.{scheduler}.sh"


def _parse_job_id(scheduler: str, output: str) -> str | None:
    if scheduler == "slurm":
        match = re.search(r"Submitted batch job (\d+)", output) or re.match(r"\s*(\d+)(?:;\S*)?\s*$", output)
        return match.group(1) if match else None
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines and re.fullmatch(r"\d+(?:\[\d*\])?(?:\.[\w.-]+)?", lines[-1]) else None


def submit(scheduler: str, job_path: str | os.PathLike[str], *,
           script_dir: str | os.PathLike[str] | None = None, dry_run: bool = False,
           **options: Any) -> str:
    """Render, write and submit the script; return the scheduler's job id.

    ``options`` are :func:`render_script`'s keyword arguments.  With
    ``dry_run`` nothing is written or run and the script text is returned.
    The log directory is created first: Slurm and PBS do not create it, and a
    missing one makes the job fail without any log at all.
    """
    text = render_script(scheduler, job_path, **options)
    if dry_run:
        return text
    command = _SUBMIT_CMD[scheduler]
    executable = shutil.which(command)
    if executable is None:
        raise SubmitError(f"{command} not found on PATH; use --dry-run to print the script")
    job = load_job(job_path)
    _log_dir(job).mkdir(parents=True, exist_ok=True)
    path = script_path(job, scheduler, script_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    try:
        done = subprocess.run([executable, str(path)], cwd=job.path.parent, capture_output=True,
                              text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SubmitError(f"{command} {path}: {exc}") from None
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise SubmitError(f"{command} {path} failed (exit {done.returncode}): {detail}")
    job_id = _parse_job_id(scheduler, done.stdout)
    if job_id is None:
        raise SubmitError(f"could not find a job id in {command} output: {done.stdout.strip()!r}")
    return job_id


@click.command("submit")
@click.argument("job_file", metavar="JOB.yaml", type=click.Path(dir_okay=False))
@click.option("--scheduler", type=click.Choice(SCHEDULERS), required=True, help="Batch system.")
@click.option("--nodes", type=int, required=True, help="Number of nodes.")
@click.option("--gpus-per-node", type=int, required=True, help="GPUs (= MPI ranks) per node.")
@click.option("--time", "walltime", required=True, metavar="HH:MM:SS",
              help="Walltime; slurm also takes D-HH:MM:SS.")
@click.option("--account", help="Account/project to charge.")
@click.option("--partition", help="Slurm partition.")
@click.option("--queue", help="PBS queue.")
@click.option("--cpus-per-task", type=int, help="CPU cores per rank (also OMP_NUM_THREADS).")
@click.option("--env-setup", metavar="TEXT",
              help='Shell lines run before launch, e.g. "module load cuda; source venv/bin/activate".')
@click.option("--nccl-env", multiple=True, metavar="NAME=VALUE", help="Site NCCL variable; repeatable.")
@click.option("--launcher", type=click.Choice(("srun", "mpirun", "mpiexec")),
              help="MPI launcher (slurm: srun [default] or mpirun; pbs: mpiexec).")
@click.option("--run-arg", "run_args", multiple=True, help="Extra argument for `mpitp run`; repeatable.")
@click.option("--script-dir", type=click.Path(file_okay=False), help="Where to write the script.")
@click.option("--dry-run", is_flag=True, help="Print the script; write and submit nothing.")
def submit_command(job_file: str, scheduler: str, nodes: int, gpus_per_node: int, walltime: str,
                   account: str | None, partition: str | None, queue: str | None,
                   cpus_per_task: int | None, env_setup: str | None, nccl_env: tuple[str, ...],
                   launcher: str | None, run_args: tuple[str, ...], script_dir: str | None,
                   dry_run: bool) -> None:
    """Write a SLURM/PBS batch script for JOB.yaml and submit it."""
    try:
        result = submit(scheduler, job_file, script_dir=script_dir, dry_run=dry_run, nodes=nodes,
                        gpus_per_node=gpus_per_node, time=walltime, account=account,
                        partition=partition, queue=queue, env_setup=env_setup, launcher=launcher,
                        cpus_per_task=cpus_per_task, nccl_env=nccl_env, extra_args=run_args)
    except SubmitUsageError as exc:
        raise click.UsageError(str(exc)) from None
    except (SubmitError, JobFileError) as exc:
        raise click.ClickException(str(exc)) from None
    if dry_run:
        click.echo(result, nl=False)
    else:
        path = script_path(load_job(job_file), scheduler, script_dir)
        click.echo(f"Submitted {scheduler} job {result} (script: {path})")
