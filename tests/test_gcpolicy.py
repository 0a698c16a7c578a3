"""The collector policy of an ``mpitp`` process (mpitp.gcpolicy): few passes while it imports, everything frozen once
the run has its modules and again at exit; a library caller's collector untouched. Each case in a fresh interpreter
(freezing the test process's objects would outlive the test)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


def test_settle_freezes_and_restores_defaults():
    out = _python(
        "import gc\n"
        "from mpitp import gcpolicy\n"
        "default = gc.get_threshold()\n"
        "gcpolicy.settle()\n"  # without start_up: a library caller's collector is left as it was
        "print(gc.get_freeze_count() == 0, gc.get_threshold() == default)\n"
        "gcpolicy.start_up()\n"
        "print(gc.get_threshold() == gcpolicy.START_UP_THRESHOLDS)\n"
        "gcpolicy.settle()\n"
        "print(gc.get_freeze_count() > 0, gc.get_threshold() == default)\n")
    assert out.split() == ["True"] * 5


def test_start_up_spares_the_imports_full_collections():
    """Importing torch and transformers' model code under the start-up thresholds runs no full collection (with
    CPython's defaults it runs several, 0.6-1.0 s on the bench VM)."""
    imports = "import torch, transformers.modeling_utils, lm_eval.api.task\n"
    code = "import gc\nfrom mpitp import gcpolicy\n{}" + imports + "print(gc.get_stats()[2]['collections'])\n"
    assert int(_python(code.format("gcpolicy.start_up()\n"))) == 0
    assert int(_python(code.format(""))) >= 1


@pytest.mark.parametrize("argv", [None, ["--version"]])
def test_the_console_command_leaves_frozen(argv):
    """``mpitp`` as the process's own command freezes the collector before the interpreter tears its modules down;
    ``main(argv)`` (a caller such as a bench driver) leaves it alone."""
    call = "main()" if argv is None else f"main({argv!r})"
    out = _python(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen' if gc.get_freeze_count() else 'not frozen'))\n"
        "sys.argv = ['mpitp', '--version']\n"
        "from mpitp.cli import main\n"
        f"try:\n    {call}\nexcept SystemExit:\n    pass\n")
    assert out.splitlines()[-1] == ("frozen" if argv is None else "not frozen")
