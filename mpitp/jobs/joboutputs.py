"""The results files of a job file's runs, ``{name}`` expanded: what ``mpitp run`` checks, skips and resumes, and what
no two runs of one file may share. Imports no MPI and no heavy library: :func:`mpitp.jobs.jobfile.load_job` reads them
on a login node (``mpitp check``, ``mpitp submit``) as well as on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpitp.errors import UsageError

RunSpec = Any
"""A :class:`mpitp.jobs.jobfile.RunSpec` (not imported: the job file imports this module)."""


def run_outputs(spec: RunSpec, matched: bool = False) -> list[str]:
    """The results files of a run: its ``output``, or, when that is a pattern with ``{name}`` (a sweep of
    checkpoints or adapters, or one model), each member's file as the sweep names it
    (:func:`mpitp.jobs.sweep.checkpoint_names`, :func:`~mpitp.jobs.sweep.output_for`). A glob that matches nothing
    now is a :class:`UsageError`, or no file with ``matched`` (the run fails on it in its turn)."""
    if "{name}" not in spec.output:
        return [spec.output]
    from mpitp.jobs.sweep import checkpoint_names, expand_models, is_sweep, output_for

    field = "peft" if is_sweep(spec.peft) else "model"
    spec_items = getattr(spec, field)
    try:
        items = expand_models(spec_items, f"--{field}") if is_sweep(spec_items) else [spec_items]
    except UsageError:
        if matched:
            return []
        raise
    return [output_for(spec.output, name, "") for name in checkpoint_names(items)]


def shared_output(specs: Sequence[RunSpec]) -> tuple[int, int, str] | None:
    """``(earlier, later, file)`` for the first file two runs would write (run numbers from 1), or None. The outputs
    as written were compared when the file was read, but not once ``{name}`` was expanded: ``output: out/{name}.h5``
    for model ``m1`` and ``output: out/m1.h5`` in another run were one file, the second run refused at its turn, after
    the first had run ('cannot resume ... different settings'), or, with the same settings, skipped as complete over
    numbers it never computed. A sweep's members are those its globs match now."""
    seen: dict[str, int] = {}
    for index, spec in enumerate(specs, 1):
        for out in run_outputs(spec, matched=True):
            other = seen.setdefault(out, index)
            if other != index:
                return other, index, out
    return None
