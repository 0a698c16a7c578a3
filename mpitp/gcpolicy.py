"""The cyclic garbage collector's settings for an ``mpitp`` process: one that imports a lot, then computes, then leaves.

Why: CPython's cyclic collector runs a full collection (every tracked object traversed) whenever enough objects have
piled up since the last one, and every object a start-up creates that lives to the end is traversed again at each.
Importing torch, transformers and lm-eval creates a few million such objects: on this project's 2-core VM the
import of the modules a run needs took 4.1-4.4 s, of which seven full collections 0.6-1.0 s (3.2-3.6 s with the
collector held back), and at exit the interpreter's own collections while it tears down those modules took 1.1-1.3 s
after the last result was written (0.1-0.2 s with everything frozen first; bench/README, issue 41). Nothing the run
computes needs either. So, for the process's own command only (:func:`mpitp.cli.main`, never a library caller's
process):

- :func:`start_up`: while the process imports and checks, the youngest generation is collected after 100,000 net
  allocations instead of 700, the older two after 50 and 100 younger passes instead of 10 and 10. Young garbage is
  still collected, at far fewer passes.
- :func:`settle`: once a run has its modules (before the first forward): every object then alive moved to the
  permanent generation (:func:`gc.freeze`), never traversed again, and the default thresholds back, so what the
  run itself creates is collected as usual.
- :func:`leaving`: at exit, after MPI is finalised and the results are written, everything frozen again. Objects are
  still freed by reference counting as the modules are torn down, and ``atexit`` handlers and finalizers run as
  before; only cyclic garbage left at exit stays unreclaimed, which the operating system takes back with the process.

And the C heap, in any process that evaluates (:func:`trim_heap`): once the model is loaded and its start-up probes
have run, the pages malloc holds free go back to the system (glibc's ``malloc_trim``). glibc keeps a freed block of
under its dynamic mmap threshold (up to 32 MiB) in its arena, not the system, so what loading and the probes freed
stays resident for the whole evaluation: on the 1.02B model at tp=2, rank 0 held 39 MB free in the main arena and
34 MB in the arenas of two of the threads transformers reads tensors on, and its peak was 40 MiB lower with them
given back (bench/README, "Peak memory per rank"). A fixed, low mmap threshold would give such blocks back as they
are freed, but made every forward's activations fresh pages: scoring 20% slower there.
"""

from __future__ import annotations

import ctypes
import gc

#: The collector's thresholds during start-up (generation 0 allocations; generation 1 and 2 passes).
START_UP_THRESHOLDS = (100_000, 50, 100)

_default: tuple[int, int, int] | None = None  # the thresholds before start_up, put back by settle


def start_up() -> None:
    """Fewer collector passes while the process imports (call once, first thing in the command)."""
    global _default
    if _default is None:
        _default = gc.get_threshold()
    gc.set_threshold(*START_UP_THRESHOLDS)


def settle() -> None:
    """The modules are in: freeze what lives now and collect as usual from here (a no-op without :func:`start_up`:
    a library caller's collector is left as it was)."""
    global _default
    if _default is None:
        return
    gc.freeze()  # no collection first: the young generations hold up to millions of objects by now (0.1-0.3 s)
    gc.set_threshold(*_default)
    _default = None


def leaving() -> None:
    """The command is done: spare the interpreter's teardown a traversal of every object."""
    gc.freeze()


def trim_heap() -> bool:
    """Give the C heap's free pages back to the system, every arena's (a no-op where the C library has no
    ``malloc_trim``: not glibc). Returns whether it could."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
