"""The Python interpreters mpitp starts itself, isolated from the working directory.

mpitp starts a few Pythons of its own: ``mpitp check`` before ``mpitp submit`` queues a job, prefetch's checks, the
model check beside the task checks, and submit's question to mpi4py about the linked MPI. A plain
``python -m mpitp`` or ``python -c CODE`` puts the current directory first on ``sys.path``, so a ``json.py``,
``yaml.py`` or ``mpitp.py`` left in a shared job folder would run, as whoever starts mpitp from there, at the first
``import``. Every such child therefore starts with ``-I`` (isolated mode: neither the current nor the script's
directory on ``sys.path``, no ``PYTHON*`` variables, no user site-packages; ``-P`` would do only the first and needs
Python 3.11, mpitp supports 3.10) and gets this process's ``sys.path`` as arguments (:func:`child_path`), so that it
imports the same mpitp and the same libraries, ``PYTHONPATH`` entries included (cluster module systems set it, and
``-I`` drops it). Relative entries (``''``, ``.``: the working directory again) are left out. The boot code imports
nothing before it replaces ``sys.path`` but ``sys``, which is built in. Environment variables other than
``PYTHON*`` (``HF_*`` offline settings, ``NLTK_DATA``, ``MPITP_*``) reach the child as they always did.
"""

from __future__ import annotations

import os
import sys

BOOT = "import sys; i = sys.argv.index('--'); sys.path[:] = sys.argv[1:i]; del sys.argv[1:i + 1]; "
"""Run first in every child: ``sys.path`` from the arguments up to ``--``; ``sys.argv[1:]`` is then what follows."""


def child_path() -> list[str]:
    """This process's ``sys.path`` less relative entries (``''`` is the working directory wherever the child
    runs)."""
    return [p for p in sys.path if p and os.path.isabs(p)]


def python_argv(code: str, *args: object) -> list[str]:
    """The argv of an isolated ``python -c CODE ARGS``: CODE runs after :data:`BOOT` with ``sys.argv[1:] == ARGS``."""
    return [sys.executable, "-I", "-c", BOOT + code, *child_path(), "--", *map(str, args)]


def mpitp_argv(*args: object) -> list[str]:
    """The argv of an isolated ``python -m mpitp ARGS`` (``runpy``, as ``-m`` itself runs a module)."""
    return python_argv("import runpy; runpy.run_module('mpitp', run_name='__main__', alter_sys=True)", *args)
