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


def test_trim_heap_gives_freed_heap_pages_back():
    """Blocks under malloc's mmap threshold freed behind one still in use stay resident until :func:`trim_heap`
    (glibc's ``malloc_trim``) gives their pages back; the process's private memory falls by most of them."""
    out = _python(
        "import ctypes\n"
        "from mpitp import gcpolicy\n"
        "def anon():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) // 1024\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "blocks = [libc.malloc(64 << 10) for _ in range(1600)]\n"  # 100 MiB in 64 KiB blocks: in the heap
        "for b in blocks:\n"
        "    ctypes.memset(b, 1, 64 << 10)\n"
        "pin = libc.malloc(64 << 10)\n"  # the heap's top stays in use: only trimming gives the pages below back
        "for b in blocks:\n"
        "    libc.free(b)\n"
        "before = anon()\n"
        "done = gcpolicy.trim_heap()\n"
        "print(done, before - anon())\n")
    done, freed = out.split()
    if done == "False":
        pytest.skip("this C library has no malloc_trim (not glibc): trim_heap is a no-op here")
    assert int(freed) >= 80, out
