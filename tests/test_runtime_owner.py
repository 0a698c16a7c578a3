"""The runtime has one owner (issue 38): ``parallel.runtime.replica_world`` opens a run's torch world and closes it
once, and the runtime object is never changed after it is built.

Read with ``ast`` over mpitp's sources (no MPI): a module that opened a torch world of its own (``open_replica``), or
a function that set an attribute of the runtime, would bring back the two-phase runtime that sweeps, ``--watch`` and
job files used to re-enter.
"""

from __future__ import annotations

import ast
import dataclasses

import pytest

from support import REPO

#: Where a torch world may be opened: the one owner, and the public API's start for a user's own script.
OPENERS = {"mpitp/jobs/orchestrate.py": "replica_world", "mpitp/cli/info.py": "replica_world",
           "mpitp/parallel/runtime.py": "open_replica"}


def _calls(tree: ast.AST, name: str) -> int:
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name))


def test_only_the_owner_opens_a_torch_world():
    found = {}
    for path in sorted((REPO / "mpitp").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        for name in ("replica_world", "open_replica"):
            if _calls(tree, name):
                found.setdefault(rel, set()).add(name)
    assert found == {k: {v} for k, v in OPENERS.items()}, found


def test_nothing_sets_an_attribute_of_the_runtime():
    """``rt.x = ...`` / ``launch.x = ...`` anywhere in mpitp (the runtime's dataclasses are frozen, so such a line
    would fail at run time; this finds it before)."""
    bad = []
    for path in sorted((REPO / "mpitp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("rt", "launch"):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert bad == []


def test_the_runtime_is_frozen_and_closes_once():
    from mpitp.parallel.runtime import Launch, Runtime

    rt = Runtime(world=None, layout=None, device="cpu", threads=1, timeout=1.0)
    assert isinstance(rt, Launch)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.device = "cuda:0"
    with rt as same:  # no torch world (replica_group None): closing is a no-op, twice
        assert same is rt
    rt.close()


def test_cuda_runs_take_cudnn_out_of_sdpa_and_close_puts_it_back():
    """A CUDA rank turns torch's cuDNN attention off for the run (a plan build per new shape: bench/README.md, GPU
    drill) and ``close`` restores what it found, so a user's own script after ``mpitp.start(...).close()`` gets
    torch's default back. The switch is a plain flag in CPU builds of torch too."""
    import torch

    from mpitp.parallel.runtime import Runtime, _sdpa_without_cudnn

    original = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for before in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(before)
            assert _sdpa_without_cudnn() is before
            assert torch.backends.cuda.cudnn_sdp_enabled() is False
            rt = Runtime(world=None, layout=None, device="cuda:0", threads=1, timeout=1.0, cudnn_sdp_before=before)
            rt.close()
            assert torch.backends.cuda.cudnn_sdp_enabled() is before
        torch.backends.cuda.enable_cudnn_sdp(False)
        Runtime(world=None, layout=None, device="cpu", threads=1, timeout=1.0).close()  # a CPU run touches nothing
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    finally:
        torch.backends.cuda.enable_cudnn_sdp(original)
