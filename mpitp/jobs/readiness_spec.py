"""What ``mpitp check`` (:mod:`mpitp.jobs.readiness`) checks and what it finds: a :class:`CheckSpec` in, a
:class:`Report` of :class:`Problem` lines out, each with the command that fetches what is missing.

Kept apart from the checks themselves so that the model check's child process, the task checks and the entry point
share one vocabulary without importing each other."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckSpec:
    """What one evaluation needs: the settings of ``mpitp eval`` that decide what it reads."""

    tasks: tuple[str, ...]
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    data_dir: str | None = None
    include_path: tuple[str, ...] = ()
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    trust_remote_code: bool = False
    hf_assets: str | None = None
    """A torch DCP checkpoint's config and tokenizer folder (``--hf-assets``)."""
    label: str = ""
    """The run's name in a job file (prefixed to its problems)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """The run's layout: a model type it cannot be split by is refused here too, before the queue."""
    peft: str | None = None
    """The run's LoRA adapter, or an adapter sweep's glob or comma list (``--peft``): each adapter's config is
    checked as ``mpitp eval`` checks it, the base once."""


@dataclass(frozen=True)
class Problem:
    """One thing the run would miss offline, and the command that fetches it (None when none can)."""

    what: str
    fetch: str | None = None
    metric: str | None = None
    """The ``evaluate`` metric module it lacks (``mpitp prefetch`` downloads it), if that is the problem."""
    nltk: str | None = None
    """The nltk package it lacks (``mpitp prefetch`` downloads it into ``DATA/nltk_data``), if that is it."""

    def line(self) -> str:
        return self.what + (f"; fetch it: {self.fetch}" if self.fetch else "")


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    """The leaf tasks built and scored."""
    model_beside: bool = False
    """Whether the model was checked in a child process beside the tasks
    (:func:`mpitp.jobs.readiness_model.start_model_check`)."""
    model_kept: bool = False
    """Whether the model was not checked again: a kept verdict whose folders are unchanged
    (:mod:`mpitp.jobs.readiness_cache`); for a sweep, every checkpoint's."""
    swept: int = 0
    """How many checkpoints (or adapters) a sweep's ``--model`` (``--peft``) glob or list gave; 0 for one model."""

    @property
    def ready(self) -> bool:
        return not self.problems


def why(exc: BaseException) -> str:
    """``exc`` as one line of at most 240 characters (a library's error can be pages long)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def prefetch_command(spec: CheckSpec, *, tasks: Sequence[str] | None = None, model: bool = False) -> str:
    """The ``mpitp prefetch`` command that fetches ``tasks`` (or the model) for ``spec``."""
    argv = ["mpitp", "prefetch"]
    if model:
        argv += ["--model", str(spec.model)]
        if spec.revision:
            argv += ["--revision", spec.revision]
    elif spec.data_dir:
        from mpitp.tasks.layout import prefetch_command as tasks_command

        return tasks_command(tasks or spec.tasks, spec.data_dir, spec.include_path)
    else:
        argv += ["--tasks", ",".join(tasks or spec.tasks), "--data-dir", "DATA"]
        for path in spec.include_path:
            argv += ["--include_path", path]
    return shlex.join(argv)
