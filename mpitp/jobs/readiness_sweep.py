"""Sweeps in ``mpitp check`` (:mod:`mpitp.jobs.readiness`): the models a run loads, one :class:`CheckSpec` each.

Why: a sweep's ``--model`` (a job file's ``models:``) is a glob or a comma list, not a model: read as one, it was
taken for a Hub repo id and every sweep was refused, so ``submit`` queued none without ``--no-check``. The run
expands it with :func:`mpitp.jobs.sweep.expand_models`, and so does the check, with the same function: the same
checkpoints, in the same order, and the same one line for a glob that matches nothing. An adapter sweep
(``--peft``) loads one base: the base is checked once and each adapter's config as ``mpitp eval`` checks it
(:func:`mpitp.replica.adapters.check_config`).

Checkpoints of one training run mostly share their config and tokenizer: those whose files the check reads are the
same bytes (:func:`mpitp.jobs.readiness_cache.content_key`) form one group, checked once; its problems are said once,
naming the others.
"""

from __future__ import annotations

from dataclasses import replace

from mpitp.errors import UsageError
from mpitp.jobs import readiness_cache
from mpitp.jobs.readiness_spec import CheckSpec, Problem, Report

SHOWN = 3
"""Checkpoints named in a problem a group shares; the rest are counted."""


def model_groups(spec: CheckSpec, report: Report) -> list[list[CheckSpec]]:
    """The models ``spec``'s run loads, one :class:`CheckSpec` each (a sweep's checkpoints; an adapter sweep's base
    once), grouped by :func:`~mpitp.jobs.readiness_cache.content_key`, in the sweep's order. A sweep that cannot be
    expanded, and each adapter the run would refuse, is a problem in ``report``; ``report.swept`` counts a sweep's
    checkpoints or adapters."""
    from mpitp.jobs.adapter_sweep import check_one_kind
    from mpitp.jobs.sweep import expand_models, is_sweep

    if not spec.model:
        return []
    try:
        check_one_kind(spec.model, spec.peft)
        models = expand_models(spec.model) if is_sweep(spec.model) else [spec.model]
    except UsageError as exc:
        report.problems.append(Problem(str(exc)))
        return []
    if spec.peft:
        _check_adapters(spec, report)
    if len(models) == 1 and not is_sweep(spec.model):
        return [[spec]]
    report.swept = len(models)
    groups: dict[object, list[CheckSpec]] = {}
    for i, model in enumerate(models):
        member = replace(spec, model=model)
        groups.setdefault(readiness_cache.content_key(member) or i, []).append(member)
    return list(groups.values())


def _check_adapters(spec: CheckSpec, report: Report) -> None:
    """Each adapter of ``spec.peft`` (one, or a sweep's) checked as ``mpitp eval`` checks it; an adapter sweep at
    ``pp`` > 1 refused as the sweep refuses it."""
    from mpitp.jobs.adapter_sweep import pp_refusal
    from mpitp.jobs.sweep import expand_models, is_sweep
    from mpitp.replica.adapters import check_config

    try:
        adapters = expand_models(str(spec.peft), "--peft") if is_sweep(spec.peft) else [str(spec.peft)]
    except UsageError as exc:
        report.problems.append(Problem(str(exc)))
        return
    if is_sweep(spec.peft):
        report.swept = len(adapters)
        if spec.pp > 1:
            report.problems.append(Problem(pp_refusal(str(spec.peft))))
    for adapter in adapters:
        try:
            check_config(adapter)
        except UsageError as exc:
            report.problems.append(Problem(str(exc)))


def any_kept(group: list[CheckSpec]) -> bool:
    """Whether a "ready" kept for one checkpoint of ``group`` still holds: it holds for all (same files read)."""
    return any(readiness_cache.kept_ready(member) for member in group)


def settle(spec: CheckSpec, groups: list[list[CheckSpec]],
           answers: list[tuple[list[Problem], list[str] | None]]) -> list[Problem]:
    """Each group's problems (its first checkpoint's, checked), said once; a verdict found ready with the folders it
    read is kept for every checkpoint of the group (:func:`~mpitp.jobs.readiness_cache.keep_shared`)."""
    from mpitp.jobs.sweep import is_sweep

    out: list[Problem] = []
    for group, (problems, read) in zip(groups, answers):
        if read is not None:
            readiness_cache.keep_shared(group[0], group[1:], read)
        out += _named(group, problems) if is_sweep(spec.model) else problems
    return out


def _named(group: list[CheckSpec], problems: list[Problem]) -> list[Problem]:
    """A sweep's problems naming the checkpoint checked (where the text does not) and the others they hold for."""
    first = str(group[0].model)
    others = [str(m.model) for m in group[1:]]
    also = ""
    if others:
        shown = ", ".join(others[:SHOWN]) + (f" and {len(others) - SHOWN} more" if len(others) > SHOWN else "")
        also = f" (the same for {shown}: the same config and tokenizer files)"
    return [replace(p, what=(p.what if first in p.what else f"model {first}: {p.what}") + also) for p in problems]
