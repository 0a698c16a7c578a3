"""Across nodes: real launches over ssh between emulated compute nodes (``hpc/local-nodes.sh``; :mod:`support.nodes`).

The layout mpitp exists for, TP inside nodes and DP across them, had never run: dp=4 over two nodes hung until
``--timeout`` (a wildcard receive after a wildcard probe matched nothing under MPICH's ch4:ucx between nodes; see
``mpitp.parallel.comm._matched_head``). Each layout here is compared request by request with single-process
``lm_eval --model hf`` (the project's parity rule); then the drills: a node lost mid-run, a node's network cut.
Every node's own hostname resolves to 127.0.1.1, so an address taken from the hostname would fail here too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support import OFFLINE_ENV, STORIES
from support.launch import Launch, file_rows, inspect_diff
from support.mpi import explain, mpi_family, mpitp_stderr, run_mpi
from support.nodes import launcher, namespace, require_nodes, set_link
from support.parity import compare_requests, mpitp_requests, reference_requests

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.multinode]

TASKS = ["arc_easy_local", "lambada_openai_local", "wikitext_local", "gsm8k_local"]
LIMIT = 2
BATCH = 2
GEN_KWARGS = "max_gen_toks=16"
TWO_BY_TWO = {"nodea": 2, "nodeb": 2}


@pytest.fixture(scope="module", autouse=True)
def nodes():
    require_nodes()


@pytest.fixture(scope="module")
def reference(test_tasks):
    """Single-process ``lm_eval --model hf`` on the same model, tasks and settings."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(2)
    return lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={STORIES},dtype=float32", tasks=TASKS, limit=LIMIT, batch_size=BATCH,
        device="cpu", gen_kwargs=GEN_KWARGS, log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=test_tasks))


def _args(test_tasks, out, *layout: str) -> list[str]:
    return ["eval", "--model", str(STORIES), "--tasks", ",".join(TASKS), "--include-path", test_tasks,
            "--limit", str(LIMIT), "--batch-size", str(BATCH), "--gen-kwargs", GEN_KWARGS, "--bootstrap-iters", "0",
            "--dtype", "float32", "--timeout", "120", *layout, "--output", str(out)]


def _check_parity(reference, out) -> float:
    ref = reference_requests(reference["samples"])
    got = mpitp_requests(str(out), TASKS)
    worst, problems = compare_requests(ref, got)
    assert not problems, "\n".join(problems[:20])
    assert len(got) == len(ref) >= len(TASKS) * LIMIT  # every request of every task compared
    return worst


@pytest.fixture(scope="module")
def two_by_two(reference, test_tasks, tmp_path_factory):
    """dp=2 x tp=2, a TP group on each node: the run the node-loss drill must reproduce after its resume."""
    out = tmp_path_factory.mktemp("multinode") / "dp2xtp2.h5"
    proc = run_mpi(4, _args(test_tasks, out, "--tp", "2"), launcher=launcher(TWO_BY_TWO), timeout=600)
    assert proc.returncode == 0, explain(proc)
    return out, proc


LAYOUTS = {"dp4": (TWO_BY_TWO, ["--tp", "1"]), "pp2xtp2": (TWO_BY_TWO, ["--tp", "2", "--pp", "2"])}


@pytest.mark.openmpi
def test_dp2_tp2_across_nodes_matches_lm_eval(reference, two_by_two):
    """TP inside each node, DP across the two: every request equals lm-eval's; the summary shows both groups
    worked and `mpitp` reports two nodes."""
    out, proc = two_by_two
    worst = _check_parity(reference, out)
    groups = re.findall(r"DP group (\d+): (\d+) requests", proc.stdout)
    assert [g for g, n in groups if int(n) > 0] == ["0", "1"], proc.stdout[-2000:]
    print(f"dp2xtp2 over nodea+nodeb ({mpi_family()}): max relative |d ll| {worst:.2e}, wall {proc.elapsed:.1f} s")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_across_nodes_matches_lm_eval(name, reference, test_tasks, tmp_path):
    """dp=4 (two DP leaders per node; the layout that hung) and pp=2 with one stage per node (tp=2 inside each:
    the activations and the rendezvous cross the nodes, gloo on the node network, not the hostname's 127.0.1.1)."""
    per_node, layout = LAYOUTS[name]
    out = tmp_path / f"{name}.h5"
    proc = run_mpi(4, _args(test_tasks, out, *layout), launcher=launcher(per_node), timeout=600)
    assert proc.returncode == 0, explain(proc)
    worst = _check_parity(reference, out)
    print(f"{name} over nodea+nodeb ({mpi_family()}): max relative |d ll| {worst:.2e}, wall {proc.elapsed:.1f} s")


@pytest.mark.openmpi
def test_tp_group_spanning_nodes_is_refused(tmp_path):
    """One rank per node and tp=2: the TP group would span nodes; refused with one line, exit 2, in seconds."""
    proc = run_mpi(2, ["eval", "--demo", "--tp", "2", "--output", str(tmp_path / "x.h5")],
                   launcher=launcher({"nodea": 1, "nodeb": 1}), timeout=300)
    err = mpitp_stderr(proc.stderr)
    assert proc.returncode == 2, explain(proc)
    lines = [ln for ln in err.splitlines() if ln.startswith("mpitp: error:")]
    assert len(lines) == 1 and "would span nodes [0, 1]" in lines[0], explain(proc)
    assert "Traceback" not in err
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.openmpi
def test_info_shows_the_nodes_and_their_addresses():
    """``mpitp info`` under a two-node launch: one row per node with its ranks, the address it uses for traffic with
    the other node (its bridge address, not the 127.0.1.1 its hostname resolves to) and the groups it holds."""
    proc = run_mpi(4, ["info", "--tp", "2", "--pp", "2", "--timeout", "60"], launcher=launcher(TWO_BY_TWO), timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "world 4 = dp 1 x pp 2 x tp 2 on 2 node(s)" in proc.stdout, proc.stdout
    rows = re.findall(r"^(node[ab])\s+2 \(([\d,]+)\)\s+(\S+) \((\w+)\)\s+(\S+)\s+(\S+)\s+(.+?)\s*$", proc.stdout,
                      flags=re.M)
    assert rows == [("nodea", "0,1", "10.77.0.10", "eth0", "0", "0", "0.0"),
                    ("nodeb", "2,3", "10.77.0.11", "eth0", "0", "1", "0.1")], proc.stdout


def _node_ranks(job: Launch, node: str) -> list[int]:
    """Global ranks of ``job`` whose process lives in ``node``'s namespace."""
    inside = set(int(p) for p in subprocess.run(["ip", "netns", "pids", namespace(node)], capture_output=True,
                                                  text=True, timeout=30).stdout.split())
    return sorted(rank for rank, pid in job.rank_pids().items() if pid in inside)


STALL = {"MPITP_TEST_STALL": "between_chunks:1"}  # keeps the run going long enough to strike it mid-run


@pytest.mark.openmpi
def test_node_lost_then_resume(two_by_two, test_tasks, tmp_path):
    """Every rank of nodeb SIGKILLed mid-run: every rank on nodea gone within 30 s, the lost node named, the rows
    kept; ``--resume`` across both nodes completes and equals the uninterrupted run."""
    ref_out, _ = two_by_two
    out = tmp_path / "lost.h5"
    with Launch(4, _args(test_tasks, out, "--tp", "2"), env=STALL, launcher=launcher(TWO_BY_TWO)) as job:
        job.wait_rows(out)
        victims = _node_ranks(job, "nodeb")
        assert victims == [2, 3], (victims, job.rank_pids())
        seen = file_rows(out)[1]
        t_strike = time.monotonic()
        for rank in victims:
            psutil.Process(job.pids[rank]).send_signal(signal.SIGKILL)
        took = job.gone_within(t_strike, 30.0)
        assert job.proc.returncode != 0, job.explain()
    # The launcher names the node that failed (Hydra on stdout, Open MPI's prterun in its framed notice on stderr).
    # prterun reports whichever it sees first: the lost node, or a survivor on nodea aborting because its TCP socket to
    # a killed peer closed (seen once in 3 CI passes); either way every rank is gone (above) and the rows are kept.
    told = job.stdout + job.stderr
    assert "nodeb" in told or (mpi_family() == "openmpi" and "Socket closed" in told), job.explain()
    assert "Traceback" not in mpitp_stderr(job.stderr), job.explain()
    status, kept = file_rows(out)
    assert status == "running" and kept >= seen, (status, kept, seen)
    proc = run_mpi(4, _args(test_tasks, out, "--tp", "2", "--resume"), launcher=launcher(TWO_BY_TWO), timeout=600)
    assert proc.returncode == 0, explain(proc)
    assert file_rows(out)[0] == "complete"
    diff = inspect_diff(out, ref_out)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    print(f"node lost ({mpi_family()}): ranks {victims} killed, every rank gone {took:.1f} s later, {kept} rows kept "
          f"(seen {seen}); resume {proc.elapsed:.1f} s, inspect diff vs uninterrupted: same")


TWO_NODE_JOB = """\
defaults:
  model: demo
  tasks: [mpitp_demo_mc, mpitp_demo_ppl, mpitp_demo_gen]
  dtype: float32
  batch_size: 2
  limit: 4
runs:
  - name: two-nodes
    tp: 2
    output: {output}
"""


@pytest.mark.slurm
def test_slurm_submit_runs_a_two_node_step(tmp_path):
    """``mpitp submit --partition nodes --nodes 2 --ranks-per-node 2 --wait`` on the local SLURM whose two slurmds
    live in the emulated nodes (hpc/local-slurm.sh): the step's ranks sit on nodea and nodeb (the file says so) and
    the results equal a plain single-node ``mpiexec -n 4 mpitp run`` of the same job."""
    import shutil

    import h5py

    if shutil.which("sinfo") is None:
        pytest.skip("no SLURM commands (hpc/local-slurm.sh start)")
    states = subprocess.run(["sinfo", "-h", "-p", "nodes", "-o", "%t"], capture_output=True, text=True,
                            timeout=60).stdout.split()
    if not states or not set(states) <= {"idle", "mix", "alloc"}:
        why = f"no idle SLURM partition 'nodes' (states {states}); hpc/local-nodes.sh start, then local-slurm.sh start"
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "two.yaml").write_text(TWO_NODE_JOB.format(output="../out/two.h5"))
    (tmp_path / "jobs" / "ref.yaml").write_text(TWO_NODE_JOB.format(output="../out/ref.h5"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mpitp", "submit", "jobs/two.yaml", "--scheduler", "slurm",
                           "--partition", "nodes", "--nodes", "2", "--ranks-per-node", "2", "--time", "00:15:00",
                           "--no-requeue", "--wait"], capture_output=True, text=True, cwd=tmp_path, timeout=1200,
                          env={**os.environ, **OFFLINE_ENV})
    took = time.monotonic() - t0
    assert proc.returncode == 0, explain(proc) + "".join(p.read_text() for p in (tmp_path / "out").glob("*.err"))
    with h5py.File(tmp_path / "out" / "two.h5", "r") as f:
        assert f.attrs["status"] == "complete"
        assert f.attrs["nodes"] == "nodea:2,nodeb:2", f.attrs["nodes"]
    ref = run_mpi(4, ["run", str(tmp_path / "jobs" / "ref.yaml")], timeout=600)
    assert ref.returncode == 0, explain(ref)
    diff = inspect_diff(tmp_path / "out" / "two.h5", tmp_path / "out" / "ref.h5")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    print(f"SLURM two-node step (nodea:2,nodeb:2): submit --wait {took:.1f} s; inspect diff vs one node: same")


@pytest.mark.openmpi
def test_network_cut_ends_the_job(test_tasks, tmp_path):
    """nodeb's interface goes down mid-run (--timeout 20): the job ends on its own, no traceback, and the rows landed
    so far stay in the file. Who ends it depends on the launcher: under MPICH rank 0's deadline (one line naming the
    phase; Hydra does not notice a silent node), under Open MPI prterun itself, which loses its ssh-connected daemon
    on nodeb within seconds and names the node."""
    out = tmp_path / "cut.h5"
    args = _args(test_tasks, out, "--tp", "2")
    args[args.index("--timeout") + 1] = "20"
    try:
        with Launch(4, args, env={"MPITP_TEST_STALL": "between_chunks:2"}, launcher=launcher(TWO_BY_TWO)) as job:
            job.wait_rows(out)
            seen = file_rows(out)[1]
            t_cut = time.monotonic()
            set_link("nodeb", up=False)
            # rank 0 finishes the chunks it holds (2 s stalls each), then waits --timeout for nodeb's results
            took = job.gone_within(t_cut, 90.0)
            assert job.proc.returncode != 0, job.explain()
    finally:
        set_link("nodeb", up=True)
    err = mpitp_stderr(job.stderr)
    said = re.findall(r"mpitp: error: rank (\d+) on (\S+): timed out after 20 s in phase '([^']+)'", err)
    if mpi_family() == "mpich":
        assert said, job.explain()
    else:
        said = said or ["prterun: " + ("lost nodeb" if "nodeb" in job.stdout + job.stderr else "?")]
        assert "nodeb" in job.stdout + job.stderr, job.explain()
    assert "Traceback" not in err, job.explain()
    status, kept = file_rows(out)
    assert status == "running" and kept >= seen > 0, (status, kept, seen)
    print(f"network cut ({mpi_family()}): every rank gone {took:.1f} s after nodeb's link went down "
          f"(--timeout 20), said {said}, {kept} rows kept")
