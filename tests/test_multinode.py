"""Across nodes: real launches over ssh between emulated compute nodes (``hpc/local-nodes.sh``; :mod:`support.nodes`).

The layout mpitp exists for, TP inside nodes and DP across them, had never run: dp=4 over two nodes hung until
``--timeout`` (a wildcard receive after a wildcard probe matched nothing under MPICH's ch4:ucx between nodes; see
``mpitp.parallel.comm._matched_head``). Each layout here is compared request by request with single-process
``lm_eval --model hf`` (the project's parity rule). The drills (a node lost, a node's network cut, rank 0 killed,
SIGTERM, at load, mid-run and at the exit) are ``tests/test_fault_matrix.py``.
Every node's own hostname resolves to 127.0.1.1, so an address taken from the hostname would fail here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from support import OFFLINE_ENV, STORIES
from support.launch import inspect_diff
from support.mpi import explain, mpi_family, mpitp_stderr, run_mpi
from support.nodes import SCHEDULABLE, launcher, require_nodes, slurm_nodes_ready
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
    """dp=2 x tp=2, a TP group on each node."""
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
    groups = re.findall(r"DP group (\d+): ([\d.]+) requests", proc.stdout)  # a share of rolling windows: 6.76
    assert [g for g, n in groups if float(n) > 0] == ["0", "1"], proc.stdout[-2000:]
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
    # A replica spanning the nodes (pp2xtp2) starts as one on a node does (measured 1.3 s; issue 41 measured 20 s: two
    # 10 s name lookups in torch's store client on nodes without DNS): the load phase, its rendezvous included.
    load = float(re.search(r"rank 0 phases: .*?\bload ([\d.]+) s", proc.stdout).group(1))
    assert load < 10, proc.stdout[-2000:]
    print(f"{name} over nodea+nodeb ({mpi_family()}): max relative |d ll| {worst:.2e}, load {load:.1f} s, wall "
          f"{proc.elapsed:.1f} s")


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
    states = slurm_nodes_ready()
    if not states or not set(states) <= SCHEDULABLE:
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
