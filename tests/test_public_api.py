"""The public Python API: ``mpitp.start``, ``load_model``, ``evaluate``, ``UsageError`` (README, "Python API").

They are the names a training script may rely on (everything else may move), so they must resolve to the real
functions; and they are imported on first use, so ``import mpitp`` (which every ``mpitp.*`` import and ``mpitp
--help`` pays) stays free of torch, transformers, lm-eval and MPI. The end-to-end use under mpiexec is
``tests/mpi/api_train_eval.py`` (``tests/test_api.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO

PROBE = """
import json, sys
import mpi4py
mpi4py.rc.initialize = False  # resolving the names imports mpi4py.MPI: no MPI world in this test
import mpitp
heavy = ("torch", "transformers", "lm_eval", "mpi4py.MPI", "mpitp.parallel", "mpitp.replica", "mpitp.evaluation")
at_import = sorted(m for m in heavy if m in sys.modules)
from mpitp import start
import mpitp.errors, mpitp.evaluation.api, mpitp.parallel.runtime, mpitp.replica.loading
same = [mpitp.start is mpitp.parallel.runtime.start is start,
        mpitp.load_model is mpitp.replica.loading.load_model,
        mpitp.evaluate is mpitp.evaluation.api.evaluate,
        mpitp.UsageError is mpitp.errors.UsageError]
try:
    mpitp.no_such_name
    missing = None
except AttributeError as exc:
    missing = str(exc)
print(json.dumps({"at_import": at_import, "same": same, "missing": missing, "all": sorted(mpitp.__all__),
                  "dir": [n for n in ("UsageError", "evaluate", "load_model", "start") if n in dir(mpitp)]}))
"""


def test_public_names_are_lazy_and_are_the_real_functions():
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["at_import"] == [], f"import mpitp imported {got['at_import']}"
    assert got["same"] == [True, True, True, True]  # UsageError: README's "raise UsageError", caught by its public name
    assert got["missing"] == "module 'mpitp' has no attribute 'no_such_name'"
    assert got["all"] == ["UsageError", "__version__", "evaluate", "load_model", "start"]
    assert got["dir"] == ["UsageError", "evaluate", "load_model", "start"]


NOT_A_MODEL = """
import mpi4py
mpi4py.rc.initialize = False
import mpitp
from mpi4py import MPI
try:
    mpitp.evaluate("path/to/model", "path/to/model", ["mpitp_demo_mc"], limit=2)
except TypeError as exc:
    print(f"TypeError: {exc}")
print("MPI initialised:", MPI.Is_initialized())
"""


def test_evaluate_given_a_path_says_so_before_any_collective():
    """A path where the loaded model belongs (a slip of ``mpitp eval``'s habits) is named in one TypeError before MPI
    or any collective is touched (it was an AttributeError from deep inside, on every rank)."""
    p = subprocess.run([sys.executable, "-c", NOT_A_MODEL], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "TypeError: mpitp.evaluate takes a loaded model (a torch.nn.Module), not str 'path/to/model': load it first, "
        "e.g. mpitp.load_model(path, rt.layout.tp, rt.device)", "MPI initialised: False"], p.stdout


START_REFUSALS = """
import mpitp
for kw in ({"threads": -1}, {"threads": "2"}, {"threads": 0}, {"timeout": -1}, {"timeout": "60"}):
    try:
        with mpitp.start(device="cpu", **kw):
            print("started", kw)
    except mpitp.UsageError as exc:
        print(exc, exc.collective)
import torch.distributed as dist
print("torch world:", dist.is_initialized())
"""


def test_start_refuses_bad_threads_and_timeout_before_building_anything():
    """``threads=-1`` and ``threads="2"`` were a RuntimeError from ``torch.set_num_threads`` once the MPI and torch
    worlds were built (the job aborted), ``threads=0`` silently meant the default, ``timeout=-1`` was a DeadlineError
    traceback from the first wait and ``timeout="60"`` a deadline never checked; ``mpitp eval --threads/--timeout``
    refuse each. Now one UsageError each, on every rank, before anything is built."""
    p = subprocess.run([sys.executable, "-c", START_REFUSALS], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    threads = "expected a positive integer (or None: the cores per node / ranks per node) True"
    timeout = "expected a positive number of seconds (or None: no deadline) True"
    assert p.stdout.splitlines() == [
        f"mpitp.start: threads=-1: {threads}", f"mpitp.start: threads='2': {threads}",
        f"mpitp.start: threads=0: {threads}", f"mpitp.start: timeout=-1: {timeout}",
        f"mpitp.start: timeout='60': {timeout}", "torch world: False"], p.stdout


def test_load_model_refuses_a_bad_dtype_device_or_tp_before_reading_the_checkpoint():
    """``dtype="fp32"`` was an AttributeError from ``getattr(torch, "fp32")``, ``device="gpu"`` torch's RuntimeError
    after the load, and ``tp=2`` without a torch world of 2 ranks (``mpitp.start()`` at tp=1) transformers' OSError
    'We tried to initialize torch.distributed for you, but it failed': tracebacks that ended the job."""
    import pytest

    import mpitp
    from support import STORIES

    for args, why in ((dict(tp=1, device="cpu", dtype="fp32"),
                       "dtype='fp32': expected one of auto, float32, bfloat16, float16"),
                      (dict(tp=1, device="gpu", dtype="float32"), "device='gpu': Expected one of cpu, cuda, "),
                      (dict(tp=0, device="cpu", dtype="float32"), "tp=0: expected a positive integer"),
                      (dict(tp=2, device="cpu", dtype="float32"),
                       "tp=2, but this rank's torch world has 1 rank(s): a replica of tp=2 needs one torch world of "
                       "its 2 ranks (mpitp.start(tp=2) makes it; pass rt.layout.tp)")):
        with pytest.raises(mpitp.UsageError) as err:
            mpitp.load_model(str(STORIES), **args)
        assert str(err.value).startswith(f"mpitp.load_model: {why}") and err.value.collective, str(err.value)
