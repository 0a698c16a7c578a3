"""Batch-script rendering and submission.

Golden files pin the exact scripts; regenerate them after an intended
template change with ``MPITP_REGEN_GOLDEN=1 pytest tests/test_submit.py``
and review the diff.  Absolute repository paths appear as ``@REPO@``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from unittest import mock

import jinja2
import pytest
from click.testing import CliRunner

from mpitp.cli.submit import submit_command
from mpitp.jobs import submit as submit_mod
from mpitp.jobs.jobfile import JobFileError, load_job
from mpitp.jobs.submit import SubmitError, SubmitUsageError, log_paths, render_script, submit

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
DEMO = REPO / "jobs/demo.yaml"
LLAMA = REPO / "jobs/example-llama.yaml"
REGEN = os.environ.get("MPITP_REGEN_GOLDEN") == "1"

SITE_ENV = "module load cuda/12.4 openmpi\nsource /opt/venvs/mpitp/bin/activate\n"
NCCL = {"NCCL_SOCKET_IFNAME": "hsn0,hsn1", "NCCL_NET_GDR_LEVEL": "PHB"}

CASES = {
    "slurm-1x4": ("slurm", DEMO, dict(nodes=1, gpus_per_node=4, time="00:30:00", srun_mpi="pmix")),
    "slurm-2x8": ("slurm", LLAMA, dict(nodes=2, gpus_per_node=8, time="1-12:00:00", account="proj42",
                                       partition="gpu", cpus_per_task=8, env_setup=SITE_ENV,
                                       nccl_env=NCCL, srun_mpi="pmix")),
    "slurm-4x4-mpirun": ("slurm", DEMO, dict(nodes=4, gpus_per_node=4, time="02:00:00", launcher="mpirun",
                                             cpus_per_task=4, nccl_env=["NCCL_DEBUG=WARN"],
                                             extra_args=["--log-level", "debug info"])),
    # CPU partition (no GPU request), PMI-2 (PyPI MPICH), walltime requeue with a short grace.
    "slurm-cpu-pmi2-requeue": ("slurm", DEMO, dict(nodes=1, ranks_per_node=4, time="00:10:00", srun_mpi="pmi2",
                                                   signal_grace=60)),
    "slurm-cpu-no-requeue": ("slurm", DEMO, dict(nodes=2, ranks_per_node=8, cpus_per_task=2, time="04:00:00",
                                                 srun_mpi="pmi2", requeue=False)),
    "pbs-1x4": ("pbs", DEMO, dict(nodes=1, gpus_per_node=4, time="00:30:00")),
    "pbs-2x8": ("pbs", LLAMA, dict(nodes=2, gpus_per_node=8, time="12:00:00", account="proj42",
                                   queue="gpu", cpus_per_task=8, env_setup=SITE_ENV, nccl_env=NCCL)),
    "pbs-4x4": ("pbs", DEMO, dict(nodes=4, gpus_per_node=4, time="02:00:00", cpus_per_task=4,
                                  extra_args=["--log-level", "debug info"])),
    "pbs-cpu": ("pbs", DEMO, dict(nodes=2, ranks_per_node=8, cpus_per_task=2, time="04:00:00")),
    "pbs-cpu-no-requeue": ("pbs", DEMO, dict(nodes=1, ranks_per_node=4, time="01:00:00", requeue=False)),
}


def _render(case: str, mpi: str = "MPICH 4.3.2") -> str:
    """The case's script as if mpi4py were linked against ``mpi`` (the golden files are the same in either venv)."""
    scheduler, job, kwargs = CASES[case]
    old = os.umask(0o022)  # the outputs' folder is still to be made: with umask 002 the logs go to a private subfolder
    try:
        with mock.patch.object(submit_mod, "linked_mpi", return_value=mpi):
            text = render_script(scheduler, job, **kwargs)
    finally:
        os.umask(old)
    bin_dir = submit_mod._mpitp_bin()
    return text.replace(f"export PATH={bin_dir}:", "export PATH=@BIN@:").replace(str(REPO), "@REPO@")


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    golden = GOLDEN / f"{case}.sh"
    text = _render(case)
    if REGEN:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with MPITP_REGEN_GOLDEN=1"
    assert text == golden.read_text(), f"{golden} is stale; rerun with MPITP_REGEN_GOLDEN=1 and review the diff"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_script_is_valid_bash(case, tmp_path):
    script = tmp_path / "job.sh"
    scheduler, job, kwargs = CASES[case]
    script.write_text(render_script(scheduler, job, **kwargs))
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_rendered_scripts_have_the_essentials():
    slurm, mpirun, pbs = _render("slurm-2x8"), _render("slurm-4x4-mpirun"), _render("pbs-2x8")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=1-12:00:00", "#SBATCH --account=proj42",
                 "#SBATCH --partition=gpu", "#SBATCH --output=@REPO@/results/%x-%j.out",
                 "set -euo pipefail", "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK",
                 "export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK",
                 "export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
                 "export HF_EVALUATE_OFFLINE=1",  # evaluate's metric modules from the cache, the Hub not asked
                 "export NLTK_DATA=/shared/hf/datasets/nltk_data${NLTK_DATA:+:$NLTK_DATA}",  # the run's data_dir
                 "module load cuda/12.4 openmpi", "export NCCL_SOCKET_IFNAME=hsn0,hsn1",
                 "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 '    scontrol requeue "$SLURM_JOB_ID"', "srun --mpi=pmix --kill-on-bad-exit=1 mpitp run "
                 "@REPO@/jobs/example-llama.yaml &"):
        assert line in slurm.splitlines(), line
    cpu = _render("slurm-cpu-no-requeue")
    for line in ("#SBATCH --ntasks-per-node=8", "# srun --mpi=pmi2: as given (--srun-mpi pmi2)",
                 "export PATH=@BIN@:\"$PATH\"",
                 "srun --mpi=pmi2 --kill-on-bad-exit=1 mpitp run @REPO@/jobs/demo.yaml"):
        assert line in cpu.splitlines(), line
    assert "gpus" not in cpu and "--signal" not in cpu and "requeue" not in cpu
    assert "#SBATCH --signal=B:USR1@60" in _render("slurm-cpu-pmi2-requeue").splitlines()
    assert "#PBS -l select=2:ncpus=16:mpiprocs=8" in _render("pbs-cpu").splitlines()
    assert "#PBS -r y" in _render("pbs-cpu") and "#PBS -r" not in _render("pbs-cpu-no-requeue")
    assert "mpirun -n $SLURM_NTASKS mpitp run @REPO@/jobs/demo.yaml --log-level 'debug info'" in mpirun
    assert not any(line.startswith("srun ") for line in mpirun.splitlines())
    for line in ("#PBS -l select=2:ncpus=64:ngpus=8:mpiprocs=8", "#PBS -l walltime=12:00:00",
                 "#PBS -A proj42", "#PBS -q gpu", "#PBS -o @REPO@/results/", "#PBS -e @REPO@/results/",
                 'cd "$PBS_O_WORKDIR"', "export OMP_NUM_THREADS=8",
                 "mpiexec -n 16 --ppn 8 mpitp run @REPO@/jobs/example-llama.yaml"):
        assert line in pbs.splitlines(), line
    assert "NCCL" not in _render("slurm-1x4").replace("# Site NCCL settings", "")  # none baked in
    openmpi = _render("pbs-2x8", mpi="Open MPI 5.0.11").splitlines()  # its mpiexec refuses Hydra's --ppn (exit 213)
    assert "mpiexec -n 16 --map-by ppr:8:node mpitp run @REPO@/jobs/example-llama.yaml" in openmpi
    assert ("# mpiexec --map-by ppr:8:node: mpi4py here is linked against Open MPI 5.0.11, whose mpiexec is PRRTE's"
            in openmpi)
    # PBS's walltime SIGTERM: Open MPI's mpiexec kills the ranks within a second (measured: 0.6 s, exit 1, no stop line)
    said = "# of it, before mpitp can say so: the job ends with status 1, every landed request already in its results"
    assert any(line.startswith(said) for line in openmpi) and not any("exits 75" in line for line in openmpi)
    assert "# in its results file, and exits 75. Running this script again continues: completed runs are skipped, the" \
        in pbs.splitlines()
    assert "NLTK_DATA" not in _render("slurm-1x4")  # the demo job reads no data directory



def test_strict_undefined_catches_missing_variable():
    _, context = submit_mod._prepare("slurm", DEMO, nodes=1, gpus_per_node=4, time="01:00:00")
    env = submit_mod._environment()
    assert isinstance(env.undefined, type) and issubclass(env.undefined, jinja2.StrictUndefined)
    for scheduler in ("slurm", "pbs"):
        for missing in ("nodes", "account", "env_setup"):
            ctx = {k: v for k, v in context.items() if k != missing}
            with pytest.raises(jinja2.UndefinedError, match=missing):
                env.get_template(f"{scheduler}.sh.j2").render(**ctx)


BASE = dict(nodes=1, gpus_per_node=4, time="01:00:00", srun_mpi="pmix")


@pytest.mark.parametrize("scheduler,changes,message", [
    ("slurm", dict(time="1:00"), "--time '1:00': expected a non-zero walltime as HH:MM:SS or D-HH:MM:SS"),
    ("slurm", dict(time="01:60:00"), "--time '01:60:00': expected a non-zero walltime as HH:MM:SS or D-HH:MM:SS"),
    ("slurm", dict(time="1-24:00:00"), "--time '1-24:00:00': expected a non-zero walltime as HH:MM:SS or D-HH:MM:SS"),
    ("slurm", dict(time="00:00:00"), "--time '00:00:00': expected a non-zero walltime as HH:MM:SS or D-HH:MM:SS"),
    ("pbs", dict(time="1-00:00:00"), "--time '1-00:00:00': expected a non-zero walltime as HH:MM:SS"),
    ("slurm", dict(nodes=0), "--nodes must be a positive integer, got 0"),
    ("pbs", dict(gpus_per_node=0), "give --ranks-per-node (MPI ranks per node; CPU partitions) or --gpus-per-node "
                                   "(one rank per GPU)"),
    ("slurm", dict(gpus_per_node=-1), "--gpus-per-node must be a non-negative integer, got -1"),
    ("slurm", dict(ranks_per_node=0), "--ranks-per-node must be a positive integer, got 0"),
    ("slurm", dict(ranks_per_node=8), "--ranks-per-node 8 is more than --gpus-per-node 4: ranks would share a GPU"),
    ("slurm", dict(signal_grace=3600), "--signal-grace 3600 s is not shorter than --time 01:00:00 = 3600 s: the job "
                                       "would be told to stop before it starts"),
    ("slurm", dict(signal_grace=0), "--signal-grace must be a positive integer, got 0"),
    ("slurm", dict(srun_mpi="pmi 2"), "--srun-mpi 'pmi 2': expected a plugin name such as pmi2 or pmix"),
    ("slurm", dict(cpus_per_task=0), "--cpus-per-task must be a positive integer, got 0"),
    ("pbs", dict(partition="gpu"), "--partition is a slurm option; use --queue with pbs"),
    ("slurm", dict(queue="gpu"), "--queue is a pbs option; use --partition with slurm"),
    ("pbs", dict(launcher="srun"), "--launcher 'srun' is not supported with pbs; use mpiexec"),
    ("slurm", dict(launcher="mpiexec"), "--launcher 'mpiexec' is not supported with slurm; use srun or mpirun"),
    ("slurm", dict(account="my proj"), "--account 'my proj' must not contain whitespace"),
    ("slurm", dict(nccl_env=["NCCL_DEBUG"]), "--nccl-env 'NCCL_DEBUG': expected NAME=VALUE with a valid variable name"),
    ("slurm", dict(nccl_env={"1BAD": "x"}), "--nccl-env '1BAD': expected NAME=VALUE with a valid variable name"),
    ("kube", {}, "unknown scheduler 'kube'; expected 'slurm' or 'pbs'"),
])
def test_option_errors(scheduler, changes, message):
    with pytest.raises(SubmitUsageError) as info:
        render_script(scheduler, DEMO, **{**BASE, **changes})
    assert str(info.value) == message


def test_slurm_day_walltime_is_accepted_and_pbs_long_hours_too():
    assert "#SBATCH --time=2-00:00:00" in render_script("slurm", DEMO, **{**BASE, "time": "2-00:00:00"})
    assert "#PBS -l walltime=48:00:00" in render_script("pbs", DEMO, **{**BASE, "time": "48:00:00"})


def test_tp_must_divide_gpus_per_node(tmp_path):
    job = tmp_path / "x.yaml"
    job.write_text("runs:\n  - {name: ok, model: demo, tasks: a, tp: 2}\n"
                   "  - {name: x, model: demo, tasks: b, tp: 3}\n")
    with pytest.raises(SubmitError) as info:
        render_script("slurm", job, **BASE)
    assert str(info.value) == (f"{job}: run 2 ('x'): tp=3 does not divide gpus-per-node 4, "
                               "so a TP group would span nodes")
    with pytest.raises(SubmitError, match=r"run 1 \('llama3.1-8b'\): tp=4 does not divide gpus-per-node 6"):
        render_script("pbs", LLAMA, **{**BASE, "gpus_per_node": 6})


def test_tp_times_pp_must_divide_the_allocation(tmp_path):
    """Pipeline stages may span nodes, but tp x pp must divide the ranks the script starts."""
    job = tmp_path / "x.yaml"
    nodes, gpus = BASE["nodes"], BASE["gpus_per_node"]
    ok = nodes * gpus // 2
    job.write_text(f"runs:\n  - {{name: ok, model: demo, tasks: a, tp: 2, pp: {ok // 2}}}\n"
                   f"  - {{name: x, model: demo, tasks: b, tp: 1, pp: {nodes * gpus + 1}}}\n")
    with pytest.raises(SubmitError) as info:
        render_script("slurm", job, **BASE)
    total = nodes * gpus
    assert str(info.value) == (f"{job}: run 2 ('x'): tp=1 x pp={total + 1} = {total + 1} does not divide "
                               f"{nodes} nodes x {gpus} GPUs = {total} ranks")


def test_job_file_errors_propagate(tmp_path):
    job = tmp_path / "x.yaml"
    job.write_text("runs: [{model: demo, tasks: a, tp: two}]\n")
    with pytest.raises(JobFileError, match="field 'tp'"):
        render_script("slurm", job, **BASE)


# -------------------------------------------------------------------- submit()

@pytest.fixture
def job(tmp_path):
    """A copy of the demo job under tmp, so logs and scripts land in tmp."""
    (tmp_path / "jobs").mkdir()
    shutil.copy(DEMO, tmp_path / "jobs/demo.yaml")
    return tmp_path / "jobs/demo.yaml"


def _fake_command(folder: Path, name: str, output: str, status: int = 0) -> Path:
    """A stand-in for sbatch/qsub that records its argv and cwd, then answers like the real one."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f'#!/bin/sh\necho "$@" > "$0.args"\npwd > "$0.cwd"\n{output}\nexit {status}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def fake_path(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    return folder


@pytest.mark.parametrize("scheduler,command,output,job_id", [
    ("slurm", "sbatch", "echo 'Submitted batch job 12345'", "12345"),
    ("pbs", "qsub", "echo 6789.pbs01", "6789.pbs01"),
])
def test_submit_with_fake_scheduler(job, fake_path, tmp_path, scheduler, command, output, job_id):
    fake = _fake_command(fake_path, command, output)
    assert submit(scheduler, job, **BASE) == job_id
    script = tmp_path / f"results/demo/mpitp-demo.{scheduler}.sh"
    assert script.exists() and os.access(script, os.X_OK)
    assert script.read_text() == render_script(scheduler, job, **BASE)
    assert Path(f"{fake}.args").read_text().strip() == str(script)
    assert Path(f"{fake}.cwd").read_text().strip() == str(job.parent)
    assert (tmp_path / "results/demo").is_dir()  # log directory exists before the job starts


def test_logs_in_a_folder_others_can_write_go_to_a_private_subfolder(job, fake_path, tmp_path):
    """The batch system appends to ``<name>-<job id>.out`` by name, following a link: in a group's folder another user
    planted links at coming job ids and took the whole log (the probe: a link owned by nobody to a file of theirs).
    There the logs go to ``mpitp-logs-<uid>``, made 0700; one that another user made first is refused."""
    _fake_command(fake_path, "sbatch", "echo 'Submitted batch job 8'")
    shared = tmp_path / "results/demo"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    sub = shared / f"mpitp-logs-{os.geteuid()}"
    assert f"#SBATCH --output={sub}/%x-%j.out" in render_script("slurm", job, **BASE)
    assert log_paths("slurm", load_job(job), "8")[0] == sub / "mpitp-demo-8.out"
    assert submit("slurm", job, **BASE) == "8"
    assert stat.S_IMODE(sub.stat().st_mode) == 0o700 and (sub / "mpitp-demo.slurm.sh").exists()
    shared.chmod(0o755)  # this user's alone: the folder itself, as before
    assert f"#SBATCH --output={shared}/%x-%j.out" in render_script("slurm", job, **BASE)
    if os.geteuid() == 0:  # a subfolder planted by another user (uid 65534): refused, nothing submitted
        shared.chmod(0o777)
        sub.chmod(0o777)
        os.chown(sub, 65534, 65534)
        with pytest.raises(SubmitError, match=r"log folder: .*belongs to uid 65534"):
            submit("slurm", job, **BASE)


def test_submit_script_dir(job, fake_path, tmp_path):
    _fake_command(fake_path, "sbatch", "echo 'Submitted batch job 7'")
    assert submit("slurm", job, script_dir=tmp_path / "scripts", **BASE) == "7"
    assert (tmp_path / "scripts/mpitp-demo.slurm.sh").exists()


def test_submit_dry_run_writes_and_runs_nothing(job, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    text = submit("slurm", job, dry_run=True, **BASE)
    assert text == render_script("slurm", job, **BASE)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("scheduler,command", [("slurm", "sbatch"), ("pbs", "qsub")])
def test_submit_without_scheduler_command(job, tmp_path, monkeypatch, scheduler, command):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SubmitError) as info:
        submit(scheduler, job, **BASE)
    assert str(info.value) == f"{command} not found on PATH; use --dry-run to print the script"
    assert not (tmp_path / "results").exists()


def test_submit_reports_scheduler_failure(job, fake_path, tmp_path):
    _fake_command(fake_path, "sbatch", "echo 'sbatch: error: Invalid account' >&2", status=1)
    with pytest.raises(SubmitError) as info:
        submit("slurm", job, **BASE)
    script = tmp_path / "results/demo/mpitp-demo.slurm.sh"
    assert str(info.value) == f"sbatch {script} failed (exit 1): sbatch: error: Invalid account"


def test_submit_reports_unparseable_output(job, fake_path):
    _fake_command(fake_path, "qsub", "echo 'queue is closed'")
    with pytest.raises(SubmitError, match="could not find a job id in qsub output: 'queue is closed'"):
        submit("pbs", job, **BASE)


# ------------------------------------------------------------------------ CLI

CLI_BASE = ["--nodes", "1", "--gpus-per-node", "4", "--time", "01:00:00"]


def test_cli_dry_run_prints_script(job):
    result = CliRunner().invoke(submit_command, [str(job), "--scheduler", "pbs", *CLI_BASE, "--dry-run",
                                                 "--queue", "gpu", "--nccl-env", "NCCL_DEBUG=WARN"])
    assert result.exit_code == 0, result.output
    assert result.output == render_script("pbs", job, **BASE, queue="gpu", nccl_env=["NCCL_DEBUG=WARN"])


def test_cli_submits(job, fake_path, tmp_path):
    _fake_command(fake_path, "sbatch", "echo 'Submitted batch job 12345'")
    result = CliRunner().invoke(submit_command, [str(job), "--scheduler", "slurm", *CLI_BASE,
                                                 "--env-setup", "module load cuda", "--run-arg", "-v"])
    assert result.exit_code == 0, result.output
    script = tmp_path / "results/demo/mpitp-demo.slurm.sh"
    logs = tmp_path / "results/demo/mpitp-demo-12345"
    assert result.output == (f"Submitted slurm job 12345 (script: {script})\nlogs: {logs}.out and {logs}.err\n"
                             f"follow: squeue -j 12345; tail -f {logs}.out\n")
    assert "module load cuda\n" in script.read_text()
    assert "jobs/demo.yaml -v &\n" in script.read_text()


def _fake_srun(folder: Path, plugins: list[str]) -> None:
    listing = "\\n".join(["MPI plugin types are..."] + [f"\\t{p}" for p in plugins])
    _fake_command(folder, "srun", f'printf "{listing}\\n"')


@pytest.mark.parametrize("plugins", [["none", "pmi2", "cray_shasta", "pmix"], ["none", "pmi2"], ["none", "pmix_v4"]])
def test_srun_mpi_auto_follows_the_linked_mpi(fake_path, plugins):
    family = submit_mod.linked_mpi()
    assert family and family.split()[0] in ("MPICH", "Open")
    want = "pmix" if family.startswith("Open MPI") else "pmi2"
    _fake_srun(fake_path, plugins)
    if not any(p.startswith(want) for p in plugins):
        with pytest.raises(SubmitError) as info:
            render_script("slurm", DEMO, **{**BASE, "srun_mpi": "auto"})
        assert str(info.value) == (f"--srun-mpi auto: {family} needs `srun --mpi={want}`, but `srun --mpi=list` "
                                   f"offers {', '.join(plugins)}; use --launcher mpirun or name a plugin with "
                                   f"--srun-mpi")
        return
    text = render_script("slurm", DEMO, **{**BASE, "srun_mpi": "auto"})
    speaks = "PMIx" if want == "pmix" else "PMI-2"
    assert (f"# srun --mpi={want}: mpi4py here is linked against {family}, which speaks {speaks}; `srun --mpi=list` "
            f"offers {', '.join(plugins)} (--srun-mpi auto)") in text.splitlines()
    assert f"srun --mpi={want} --kill-on-bad-exit=1 mpitp run {DEMO} &" in text.splitlines()


def test_cli_usage_error(job):
    result = CliRunner().invoke(submit_command, [str(job), "--scheduler", "slurm", "--nodes", "1",
                                                 "--gpus-per-node", "4", "--time", "1h", "--dry-run"])
    assert result.exit_code == 2
    assert "--time '1h': expected a non-zero walltime as HH:MM:SS or D-HH:MM:SS" in result.output


def test_cli_geometry_error(job):
    result = CliRunner().invoke(submit_command, [str(job), "--scheduler", "slurm", "--nodes", "1",
                                                 "--gpus-per-node", "3", "--time", "01:00:00", "--dry-run"])
    assert result.exit_code == 2  # bad input, as mpitp run says of the same job file
    assert result.output == (f"Error: {job}: run 2 ('demo-tp2'): tp=2 does not divide gpus-per-node 3, "
                             "so a TP group would span nodes\n")


def test_cli_missing_scheduler_command(job, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = CliRunner().invoke(submit_command, [str(job), "--scheduler", "pbs", *CLI_BASE])
    assert result.exit_code == 1
    assert result.output == "Error: qsub not found on PATH; use --dry-run to print the script\n"


def test_cli_job_file_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("runs: [{model: demo, tasks: a, dtype: bf16}]\n")
    result = CliRunner().invoke(submit_command, [str(bad), "--scheduler", "slurm", *CLI_BASE, "--dry-run"])
    assert result.exit_code == 2
    assert "field 'dtype'" in result.output and "did you mean 'bfloat16'?" in result.output


def _readme_submit_lines() -> list[str]:
    """README's ``mpitp submit`` example commands (continuation lines joined, comments dropped)."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    return [line.split("#")[0].strip() for line in text.splitlines() if line.startswith("mpitp submit jobs/")]


def test_readme_submit_examples_render():
    """Each ``mpitp submit`` line of README renders its script (as --dry-run): the first one asked for 4 GPUs per
    node for example-llama.yaml, whose Qwen runs are tp=8, and was refused ('tp=8 does not divide gpus-per-node 4')."""
    import shlex

    lines = _readme_submit_lines()
    assert len(lines) >= 3, lines
    for line in lines:
        args = [a for a in shlex.split(line)[2:] if a != "--wait"]
        args[0] = str(REPO / args[0])
        result = CliRunner().invoke(submit_command, [*args, *([] if "--dry-run" in args else ["--dry-run"])])
        assert result.exit_code == 0, (line, result.output)


def test_wait_table_reads_each_file_of_a_sweep_run(tmp_path):
    """``mpitp submit --wait``'s closing table for runs whose output is a ``{name}`` pattern (a ``models:`` sweep, a
    ``peft:`` list, one model): read as the literal ``out/{name}.h5`` they were "missing" and a job that completed
    them all ended "0/3 runs ok", exit 1. Each member's file is read now."""
    import h5py

    from mpitp.jobs.jobfile import load_job
    from mpitp.jobs.submit import job_summary

    for d in ("ck/step-1", "ck/step-2", "ad/a1", "ad/a2", "one"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "job.yaml").write_text(
        "defaults: {tasks: [arc_easy]}\nruns:\n"
        "  - {name: sweep, models: ['ck/step-*'], output: 'out/{name}.h5'}\n"
        "  - {name: ad, model: one, peft: [ad/a1, ad/a2], output: 'out/ad-{name}.h5'}\n"
        "  - {name: single, model: one, output: 'out/single-{name}.h5'}\n")
    (tmp_path / "out").mkdir()

    def write(name, status="complete"):
        with h5py.File(tmp_path / "out" / name, "w") as f:
            f.attrs["status"] = status

    for name in ("step-1.h5", "step-2.h5", "ad-a1.h5", "ad-a2.h5", "single-one.h5"):
        write(name)
    ok, table = job_summary(load_job(tmp_path / "job.yaml"))
    assert ok == 3 and "3/3 runs ok" in table, table
    write("step-2.h5", "running")
    (tmp_path / "out" / "ad-a2.h5").unlink()
    ok, table = job_summary(load_job(tmp_path / "job.yaml"))
    assert ok == 1, table
    assert "running (1/2 files complete)" in table.splitlines()[3] and "running (1/2" in table.splitlines()[4]
    for d in ("step-1", "step-2"):
        (tmp_path / "ck" / d).rmdir()
    assert "missing" in job_summary(load_job(tmp_path / "job.yaml"))[1].splitlines()[3]
