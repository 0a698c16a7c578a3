"""``mpitp rescore FILE.h5``: lm-eval's metrics recomputed from the stored request results
(:mod:`mpitp.evaluation.rescore`), printed, and written to ``--output`` or ``--in-place``."""

from __future__ import annotations

import os
import sys

import click

from mpitp.errors import UsageError


@click.command(name="rescore")
@click.argument("file", metavar="FILE.h5")
@click.option("--output", default=None, help="Write the rescored results to a new file (a copy with new metrics).")
@click.option("--in-place", is_flag=True, help="Replace FILE's metrics with the rescored ones (atomically).")
@click.option("--include-path", default=None,
              help="The task YAML folder (code: required when the file names one; never taken from the file).")
@click.option("--data-dir", default=None,
              help="The offline data directory (required when the file names one; never taken from the file).")
@click.option("--bootstrap-iters", type=click.IntRange(min=0), default=None,
              help="lm-eval's stderr bootstrap iterations (default: the run's).")
def rescore_command(file: str, output: str | None, in_place: bool, include_path: str | None, data_dir: str | None,
                    bootstrap_iters: int | None) -> None:
    """Recompute lm-eval's metrics of FILE from its stored request results, without loading a model.

    Refused (exit 2) when the task's requests changed: only filters and metrics may differ from the run, and when
    the file names task folders or data (--include-path, --data-dir) the user did not pass: they are code.
    """
    from lm_eval.utils import make_table

    from mpitp.evaluation.rescore import metric_changes, rescore, write_rescored
    from mpitp.results.untrusted import shown

    if output and in_place:
        raise UsageError("--output and --in-place contradict each other: pick one", collective=True)
    if output and os.path.exists(output):
        raise UsageError(f"output {output} already exists", collective=True)
    try:
        res, doc_scores, served, stored = rescore(file, include_path, data_dir, bootstrap_iters)
    except UsageError as exc:  # a single process: every "rank" raised it
        raise UsageError(str(exc), collective=True) from None
    print(shown(make_table(res), keep_newlines=True))  # names from the file and its tasks: escaped
    changes = metric_changes(file, res)
    print("\n".join(["metrics changed:"] + ["  " + shown(c) for c in changes]) if changes
          else "metrics: identical to the stored ones")
    print(f"rescored from {served} stored request results ({stored} rows in the file), no model loaded")
    if output or in_place:
        dst = output or file
        write_rescored(file, dst, res, doc_scores)
        print(f"wrote {dst}")
    sys.stdout.flush()
