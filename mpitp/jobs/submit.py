"""Batch scripts for SLURM and PBS Pro, rendered from Jinja2 templates.

Why a generator instead of hand-written scripts: the job geometry (one rank
per GPU, tensor-parallel groups that must not straddle nodes) has to agree
with every run in the job file, and that is cheap to check here, on the login
node, before anything waits in a queue.  ``StrictUndefined`` makes a template
typo an error instead of an empty ``#SBATCH`` value.

The templates live once, in ``mpitp/jobs/templates/`` (shipped as package data); read or adapt them there.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from mpitp.jobs.jobfile import Job, load_job
from mpitp.parallel.walltime import STOP_EXIT
from mpitp.results.safefile import script_mode, write_replace

__all__ = ["SCHEDULERS", "SubmitError", "SubmitUsageError", "render_script", "script_path",
           "submit"]

SCHEDULERS = ("slurm", "pbs")
#: Seconds between SLURM's warning signal and the time limit: enough for mpitp to stop (it only aborts; the results
#: are already on disk) and for the script to requeue, with slack for a long forward of a big model that has to
#: return before the signal is seen and SLURM's signal timing (it may come up to a minute early or late).
DEFAULT_SIGNAL_GRACE = 300
#: ``mpi4py.get_vendor()`` family -> the PMI flavour its PyPI/standard builds speak to srun.
_PMI_OF = {"Open MPI": "pmix", "MPICH": "pmi2", "Intel MPI": "pmi2", "MVAPICH": "pmi2", "MVAPICH2": "pmi2"}
_TERMINAL = {"slurm": {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                       "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}}
_LAUNCHERS = {"slurm": ("srun", "mpirun"), "pbs": ("mpiexec",)}
_SUBMIT_CMD = {"slurm": "sbatch", "pbs": "qsub"}
_TIME_RE = {
    "slurm": re.compile(r"^(?:(?P<d>\d+)-)?(?P<h>\d+):(?P<m>[0-5]\d):(?P<s>[0-5]\d)$"),
    "pbs": re.compile(r"^(?P<h>\d+):(?P<m>[0-5]\d):(?P<s>[0-5]\d)$"),
}
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SubmitError(Exception):
    """Submission failed (bad job geometry, missing scheduler, scheduler error)."""


class BadJob(SubmitError):
    """The job file does not fit the allocation asked for (a TP group across nodes, a layout the ranks do not
    divide): bad input, exit 2 like the job file's own errors, not a failed submission."""


class SubmitUsageError(SubmitError, ValueError):
    """An option value is malformed; the CLI reports it as a usage error."""


def _environment() -> jinja2.Environment:
    # PackageLoader reads mpitp/jobs/templates from the installed package (wheel or source tree).
    return jinja2.Environment(
        loader=jinja2.PackageLoader("mpitp.jobs", "templates"),
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


def _mpitp_bin() -> str | None:
    """The folder of the ``mpitp`` command beside this Python (its venv's bin), else the one on PATH."""
    here = Path(sys.executable).parent
    if (here / "mpitp").exists():
        return str(here)
    found = shutil.which("mpitp")
    return os.path.dirname(found) if found else None


def _quoted_bin() -> str | None:
    """The shell-quoted folder for the script's PATH, or None: ``shlex.quote`` turns a missing one into ``''``, and
    ``PATH='':"$PATH"`` puts an empty entry, the job's working directory, first on PATH."""
    folder = _mpitp_bin()
    return shlex.quote(folder) if folder else None


def _check_job_path(path: Path) -> None:
    """The job file's path goes into the script's comment and command lines: a newline (any control character) in it
    would end the comment and run the rest as a command, before the last ``#SBATCH``/``#PBS`` line."""
    bad = sorted({c for c in str(path) if ord(c) < 32 or ord(c) == 127})
    if bad:
        raise SubmitUsageError(f"job file {str(path)!r}: its path contains control characters "
                               f"({', '.join(repr(c) for c in bad)}), which a batch script cannot carry safely; "
                               f"move or rename it")


def linked_mpi() -> str | None:
    """``"MPICH 5.0.2"``, ``"Open MPI 5.0.11"``, ...: the MPI library mpi4py is linked against, or None.

    Asked in a child process with MPI initialisation off when this process has not loaded MPI itself: a login node
    may not allow MPI_Init, and the family is all that is needed. The child is isolated from the working directory
    (:mod:`mpitp.isolated`: an ``mpi4py.py`` in a job folder must not run).
    """
    from mpitp.isolated import python_argv

    if "mpi4py.MPI" in sys.modules:
        name, version = sys.modules["mpi4py.MPI"].get_vendor()
        return f"{name} {'.'.join(map(str, version))}"
    code = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; from mpi4py import MPI; "
            "n, v = MPI.get_vendor(); print(n, '.'.join(map(str, v)))")
    try:
        done = subprocess.run(python_argv(code), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def srun_plugins() -> list[str] | None:
    """The MPI plugins ``srun --mpi=list`` offers here (None without srun)."""
    srun = shutil.which("srun")
    if srun is None:
        return None
    try:
        done = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = done.stdout + done.stderr
    names = re.findall(r"^\s+(\w+)\s*$", text, flags=re.M)  # one tab-indented name per line
    names += re.findall(r"srun: (?:mpi/)?(\w+)$", text, flags=re.M)  # older srun: "srun: mpi/pmi2"
    return sorted(set(names), key=names.index)


def _srun_mpi(choice: str | None) -> tuple[str, str]:
    """The ``srun --mpi`` plugin and why (written into the script as a comment)."""
    if choice and choice != "auto":
        if not re.fullmatch(r"\w+", choice):
            raise SubmitUsageError(f"--srun-mpi {choice!r}: expected a plugin name such as pmi2 or pmix")
        return choice, f"as given (--srun-mpi {choice})"
    family = linked_mpi()
    want = next((pmi for name, pmi in _PMI_OF.items() if family and family.startswith(name)), "pmi2")
    speaks = {"pmix": "PMIx", "pmi2": "PMI-2"}[want]
    reason = f"mpi4py here is linked against {family or 'an MPI it could not name'}, which speaks {speaks}"
    offered = srun_plugins()
    if offered is None:
        return want, f"{reason}; no srun here to check it against (--srun-mpi auto)"
    if not any(p == want or p.startswith(want + "_") for p in offered):
        raise SubmitError(f"--srun-mpi auto: {family or 'this MPI'} needs `srun --mpi={want}`, but `srun --mpi=list` "
                          f"offers {', '.join(offered) or 'nothing'}; use --launcher mpirun or name a plugin with "
                          f"--srun-mpi")
    return want, f"{reason}; `srun --mpi=list` offers {', '.join(offered)} (--srun-mpi auto)"


def _pbs_mpiexec(ranks_per_node: int) -> dict[str, Any]:
    """PBS's ``mpiexec`` line follows the MPI mpi4py is linked against (its launcher is that MPI's). Hydra (MPICH,
    Intel MPI, MVAPICH) takes ``--ppn N``; Open MPI's (PRRTE's prterun) stops at it ("An unrecognized option was
    included on the mpiexec command line", exit 213) and takes ``--map-by ppr:N:node``. Given SIGTERM (PBS's
    walltime) Open MPI's ends the ranks within a second, before rank 0's stop line and exit 75: the job ends with 1."""
    family = linked_mpi() or ""
    open_mpi = family.startswith("Open MPI")
    flag = f"--map-by ppr:{ranks_per_node}:node" if open_mpi else f"--ppn {ranks_per_node}"
    launcher = "PRRTE's" if open_mpi else "Hydra"
    return dict(per_node_flag=flag, open_mpi=open_mpi, per_node_reason=f"mpi4py here is linked against "
                f"{family or 'an MPI it could not name'}, whose mpiexec is {launcher}")


def _iface(name: str | None) -> str | None:
    """``--iface``: a network interface name (exported as ``MPITP_IFACE`` in the script)."""
    if name is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,31}", name):
        raise SubmitUsageError(f"--iface {name!r}: expected a network interface name such as ib0 or hsn0")
    return name


def _log_dir(job: Job) -> Path:
    """Logs go next to the outputs: their common directory (or the job file's, if none); where others may create
    files there (a group's project folder, ``umask 002`` for a folder still to be made), in its private subfolder
    ``mpitp-logs-<uid>`` (made ``0700`` at submit). Why: the batch system opens ``<name>-<job id>.out`` there by name
    and appends, following a link; job ids come in sequence, so a link another user planted at a coming id took the
    whole log into the file it named."""
    common = Path(os.path.commonpath([os.path.dirname(r.output) for r in job.runs]))
    folder = job.path.parent if common == Path(common.anchor) else common
    try:
        st = os.stat(folder)
        shared = st.st_uid != os.geteuid() or st.st_mode & 0o022
    except FileNotFoundError:  # made by submit with the umask's mode
        from mpitp.results.safefile import umask

        shared = umask() & 0o022 != 0o022
    except OSError:
        shared = True
    return folder / _private_logs() if shared else folder


def _private_logs() -> str:
    """The name of the private log subfolder :func:`_log_dir` picks in a folder others may write."""
    return f"mpitp-logs-{os.geteuid()}"


def _make_log_dir(job: Job) -> None:
    """Make the folder :func:`_log_dir` names; a private subfolder that exists must be this user's alone."""
    folder = _log_dir(job)
    if folder.name == _private_logs():
        from mpitp.results.untrusted import private_dir

        problem = private_dir(str(folder))
        if problem:
            raise SubmitError(f"log folder: {problem}")
    else:
        folder.mkdir(parents=True, exist_ok=True)


def _seconds(time: str) -> int:
    parts = [int(p) for p in re.split(r"[-:]", time)]
    days = parts.pop(0) if len(parts) == 4 else 0
    h, m, s = parts
    return ((days * 24 + h) * 60 + m) * 60 + s


def _prepare(scheduler: str, job_path: str | os.PathLike[str], *, nodes: int, gpus_per_node: int | None = None,
             time: str, ranks_per_node: int | None = None, account: str | None = None,
             partition: str | None = None, queue: str | None = None, env_setup: str | None = None,
             launcher: str | None = None, srun_mpi: str | None = "auto", cpus_per_task: int | None = None,
             nccl_env: Any = None, iface: str | None = None, requeue: bool = True,
             signal_grace: int = DEFAULT_SIGNAL_GRACE, extra_args: Sequence[str] = ()) -> tuple[Job, dict[str, Any]]:
    """Validate everything and build the template context."""
    if scheduler not in SCHEDULERS:
        raise SubmitUsageError(f"unknown scheduler {scheduler!r}; expected 'slurm' or 'pbs'")
    _positive("--nodes", nodes)
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 0):
        raise SubmitUsageError(f"--gpus-per-node must be a non-negative integer, got {gpus_per_node!r}")
    gpus_per_node = gpus_per_node or 0
    if ranks_per_node is None:
        if not gpus_per_node:
            raise SubmitUsageError("give --ranks-per-node (MPI ranks per node; CPU partitions) or --gpus-per-node "
                                   "(one rank per GPU)")
        ranks_per_node = gpus_per_node
    _positive("--ranks-per-node", ranks_per_node)
    if gpus_per_node and ranks_per_node > gpus_per_node:
        raise SubmitUsageError(f"--ranks-per-node {ranks_per_node} is more than --gpus-per-node {gpus_per_node}: "
                               f"ranks would share a GPU")
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
    time = _check_time(scheduler, time)
    if requeue and scheduler == "slurm":
        _positive("--signal-grace", signal_grace)
        if signal_grace >= _seconds(time):
            raise SubmitUsageError(f"--signal-grace {signal_grace} s is not shorter than --time {time} = "
                                   f"{_seconds(time)} s: the job would be told to stop before it starts")
    srun_mpi, srun_mpi_reason = _srun_mpi(srun_mpi) if scheduler == "slurm" and launcher == "srun" else (None, None)
    mpiexec = _pbs_mpiexec(ranks_per_node) if scheduler == "pbs" else {}
    context = {
        "time": time,
        "account": _directive_word("--account", account),
        "partition": _directive_word("--partition", partition),
        "queue": _directive_word("--queue", queue),
        "nccl_env": _nccl_pairs(nccl_env),
        "iface": _iface(iface),
    }

    job = load_job(job_path)
    _check_job_path(job.path)
    per_node = f"gpus-per-node {ranks_per_node}" if ranks_per_node == gpus_per_node else \
        f"ranks-per-node {ranks_per_node}"
    unit = "GPUs" if ranks_per_node == gpus_per_node else "ranks"
    for index, run in enumerate(job.runs, 1):
        if ranks_per_node % run.tp:
            raise BadJob(f"{os.fspath(job_path)}: run {index} ({run.name!r}): tp={run.tp} does not divide "
                              f"{per_node}, so a TP group would span nodes")
        if (nodes * ranks_per_node) % (run.tp * run.pp):
            raise BadJob(f"{os.fspath(job_path)}: run {index} ({run.name!r}): tp={run.tp} x pp={run.pp} = "
                              f"{run.tp * run.pp} does not divide {nodes} nodes x {ranks_per_node} {unit} = "
                              f"{nodes * ranks_per_node} ranks")
    log_dir = _log_dir(job)
    context.update(
        job_name=re.sub(r"[^A-Za-z0-9_.-]", "_", f"mpitp-{job.name}")[:64],
        job_path=shlex.quote(str(job.path)),
        log_dir=_directive_word("log directory", str(log_dir)),
        nodes=nodes, gpus_per_node=gpus_per_node, ranks_per_node=ranks_per_node, ntasks=nodes * ranks_per_node,
        cpus_per_task=cpus_per_task, omp_threads=cpus_per_task or 1,
        ncpus=ranks_per_node * (cpus_per_task or 1),
        env_setup=(env_setup or "").strip("\n").rstrip() or None,
        mpitp_bin=_quoted_bin(),
        launcher=launcher, srun_mpi=srun_mpi, srun_mpi_reason=srun_mpi_reason,
        **mpiexec,
        requeue=bool(requeue), signal_grace=signal_grace, stop_exit=STOP_EXIT,
        run_args="".join(" " + shlex.quote(str(a)) for a in extra_args),
        nltk_data=_nltk_data(job),
    )
    return job, context


def _nltk_data(job) -> str | None:
    """``NLTK_DATA`` for the job's runs, quoted: each ``data_dir``'s ``nltk_data`` folder (mpitp prefetch's)."""
    from mpitp.tasks.layout import nltk_folder

    folders = dict.fromkeys(str(nltk_folder(run.data_dir)) for run in job.runs if getattr(run, "data_dir", None))
    return shlex.quote(os.pathsep.join(folders)) if folders else None


def render_script(scheduler: str, job_path: str | os.PathLike[str], **options: Any) -> str:
    """Validate the job and options, and return the batch script text.

    Options (all keyword): ``nodes``, ``time``, ``ranks_per_node`` (defaults to ``gpus_per_node``),
    ``gpus_per_node`` (0/None: no GPU request), ``account``, ``partition`` (slurm), ``queue`` (pbs),
    ``env_setup``, ``iface`` (the network interface between nodes: ``MPITP_IFACE``), ``launcher`` (slurm: ``srun``
    [default] or ``mpirun``; pbs: ``mpiexec``), ``srun_mpi`` (``auto`` [default], ``pmi2``, ``pmix``, ...),
    ``cpus_per_task``, ``nccl_env`` (a mapping or ``NAME=VALUE``
    strings, exported with shell quoting), ``requeue`` (slurm: requeue at the walltime, default True),
    ``signal_grace`` (seconds), ``extra_args`` (appended to ``mpitp run``).
    Raises :class:`SubmitError` / :class:`SubmitUsageError` or :class:`~mpitp.jobs.jobfile.JobFileError`.
    """
    _, context = _prepare(scheduler, job_path, **options)
    return _environment().get_template(f"{scheduler}.sh.j2").render(**context)


def script_path(job: Job, scheduler: str, script_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`submit` writes the script: next to the outputs unless ``script_dir``."""
    folder = Path(script_dir).absolute() if script_dir else _log_dir(job)
    return folder / f"mpitp-{job.name}.{scheduler}.sh"


def write_script(path: Path, text: str) -> None:
    """Write the batch script as a new file (:mod:`mpitp.results.safefile`) with mode ``0o700 & ~umask``, replacing
    a previous script atomically. Something else at ``path`` (a link, a folder) is refused: the script folder may be
    shared, and a link planted there must not get the script written through it nor its target made executable."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
        raise SubmitError(f"{path} exists and is not a plain file (a link or folder); refusing to write the batch "
                          f"script there: remove it or choose --script-dir")
    write_replace(str(path), text.encode("utf-8"), mode=script_mode())


def _parse_job_id(scheduler: str, output: str) -> str | None:
    if scheduler == "slurm":
        match = re.search(r"Submitted batch job (\d+)", output) or re.match(r"\s*(\d+)(?:;\S*)?\s*$", output)
        return match.group(1) if match else None
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines and re.fullmatch(r"\d+(?:\[\d*\])?(?:\.[\w.-]+)?", lines[-1]) else None


def submit(scheduler: str, job_path: str | os.PathLike[str], *,
           script_dir: str | os.PathLike[str] | None = None, dry_run: bool = False, check: bool = True,
           **options: Any) -> str:
    """Render, write and submit the script; return the scheduler's job id.

    ``options`` are :func:`render_script`'s keyword arguments.  With
    ``dry_run`` nothing is written or run and the script text is returned.
    The log directory is created first: Slurm and PBS do not create it, and a
    missing one makes the job fail without any log at all. With ``check``, a job
    that would not run offline is refused first (``mpitp check``, raises
    :class:`mpitp.jobs.readiness.NotReady`): nothing is queued.
    """
    text = render_script(scheduler, job_path, **options)
    if dry_run:
        return text
    command = _SUBMIT_CMD[scheduler]
    executable = shutil.which(command)  # before the readiness check: a missing sbatch is known in a millisecond
    if executable is None:
        raise SubmitError(f"{command} not found on PATH; use --dry-run to print the script")
    if check:
        from mpitp.jobs.readiness import require_ready

        require_ready(job_path)
    job = load_job(job_path)
    _make_log_dir(job)
    path = script_path(job, scheduler, script_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_script(path, text)
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


def log_paths(scheduler: str, job: Job, job_id: str) -> list[Path]:
    """Where the batch system writes the job's stdout and stderr (as the scripts ask for them)."""
    folder = _log_dir(job)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"mpitp-{job.name}")[:64]
    if scheduler == "slurm":
        return [folder / f"{name}-{job_id}.out", folder / f"{name}-{job_id}.err"]
    seq = job_id.split(".")[0]
    return [folder / f"{name}.o{seq}", folder / f"{name}.e{seq}"]


def follow_command(scheduler: str, job: Job, job_id: str) -> str:
    if scheduler == "slurm":
        return f"squeue -j {job_id}; tail -f {shlex.quote(str(log_paths(scheduler, job, job_id)[0]))}"
    return f"qstat -x {job_id}"


def job_state(scheduler: str, job_id: str) -> dict[str, str]:
    """The scheduler's view of a job: ``state`` (SLURM's JobState or PBS's job_state), ``restarts``, ``exit``."""
    if scheduler == "slurm":
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and "JobState=" in done.stdout:
            fields = dict(re.findall(r"(\w+)=(\S*)", done.stdout))
            return dict(state=fields.get("JobState", "?"), restarts=fields.get("Restarts", "0"),
                        exit=fields.get("ExitCode", "?"), elapsed=fields.get("RunTime", "?"))
        # Gone from slurmctld's memory (MinJobAge): accounting may still know it.
        acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,Elapsed"],
                              capture_output=True, text=True, timeout=60) if shutil.which("sacct") else None
        if acct is not None and acct.returncode == 0 and acct.stdout.strip():
            state, code, elapsed = (acct.stdout.strip().splitlines()[-1].split("|") + ["?", "?"])[:3]
            return dict(state=state.split()[0], restarts="?", exit=code, elapsed=elapsed)
        raise SubmitError(f"scontrol does not know job {job_id}: {(done.stderr or done.stdout).strip()}")
    done = subprocess.run(["qstat", "-x", "-f", job_id], capture_output=True, text=True, timeout=60)
    fields = dict(re.findall(r"^\s*([\w.]+) = (.*)$", done.stdout, flags=re.M))  # resources_used.walltime
    if done.returncode != 0 or "job_state" not in fields:
        raise SubmitError(f"qstat does not know job {job_id}: {(done.stderr or done.stdout).strip()}")
    state = {"F": "FINISHED", "R": "RUNNING", "Q": "QUEUED", "H": "HELD", "E": "EXITING"}.get(fields["job_state"],
                                                                                           fields["job_state"])
    return dict(state=state, restarts=fields.get("run_count", "?"), exit=fields.get("Exit_status", "?"),
                elapsed=fields.get("resources_used.walltime", "?"))


def wait_for(scheduler: str, job_id: str, poll: float = 5.0,
             echo: Callable[[str], object] | None = None) -> dict[str, str]:
    """Poll until the job has ended (a requeued job is not ended: it is PENDING again)."""
    last = None
    while True:
        info = job_state(scheduler, job_id)
        if echo and info["state"] != last:
            echo(f"job {job_id}: {info['state']}" + (f" (restarts {info['restarts']})" if info["restarts"] not in
                                                      ("0", "?") else ""))
            last = info["state"]
        if info["state"] in _TERMINAL.get(scheduler, set()) or info["state"] == "FINISHED":
            return info
        _time.sleep(poll)


def job_summary(job: Job) -> tuple[int, str]:
    """(number of runs complete, a table of every run's output status) for a job file, read from its outputs."""
    from mpitp.jobs.jobrun import run_status
    from mpitp.results.texttable import format_table

    rows = [dict(run=r.name, tp=r.tp, pp=r.pp, status=run_status(r), output=r.output) for r in job.runs]
    ok = sum(1 for r in rows if r["status"] == "complete")
    return ok, f"job {job.path}: {ok}/{len(rows)} runs ok\n" + format_table(rows, ["run", "tp", "pp", "status",
                                                                                      "output"])
