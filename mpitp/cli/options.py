"""Options shared by the subcommands that start the MPI runtime (``mpitp info``), and the reading of ``--tasks``."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import click

from mpitp.parallel import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Callable

_F = TypeVar("_F", bound="Callable[..., object]")


def _positive_float(ctx, param, value):
    if value is None:
        return value
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise click.BadParameter(f"expected a number of seconds, got {value!r}") from None
    if not v > 0:
        raise click.BadParameter(f"must be > 0, got {value!r}")
    return v


def task_names(ctx, param, value: str | None) -> tuple[str, ...] | None:
    """``--tasks a,b`` of ``mpitp check`` and ``mpitp tasks`` read as ``mpitp eval --tasks`` and a job file's
    ``tasks:`` read it (:func:`mpitp.evaluation.setting_values.yaml_tasks`: blanks around a name dropped, an empty or
    repeated name refused); ``"a, b"`` was checked as the unknown task ``' b'``."""
    from mpitp.evaluation.setting_values import BadValue, yaml_tasks

    if value is None:
        return None
    try:
        return yaml_tasks(value)
    except BadValue as exc:
        raise click.BadParameter(str(exc)) from None


def runtime_options(f: _F) -> _F:
    """Options shared by every subcommand that starts the MPI runtime."""
    f = click.option("--iface", default=None, metavar="NAME",
                     help="Network interface between nodes (sets MPITP_IFACE).")(f)
    f = click.option("--log-all-ranks", is_flag=True, help="Log from every rank, each line prefixed with its rank.")(f)
    f = click.option("--timeout", default=str(DEFAULT_TIMEOUT), callback=_positive_float, show_default=True,
                     help="Seconds any rank waits for its peers (MPI barriers and torch.distributed).")(f)
    f = click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="Torch threads per rank (default: cores per node / ranks per node).")(f)
    f = click.option("--device", default=None, help="Device override, e.g. cpu or cuda:0 (default: auto).")(f)
    f = click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Pipeline stages per model replica (TP inside each stage); dp = world size / (tp x pp).")(f)
    f = click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Tensor-parallel degree; dp = world size / (tp x pp).")(f)
    return f
