"""``mpitp inspect``: show an mpitp HDF5 results file; the click layer over :mod:`mpitp.results.reader`,
:mod:`~mpitp.results.render`, :mod:`~mpitp.results.plot` and :mod:`~mpitp.results.diff`.

Two forms share one entry point, :data:`inspect_command`:

- ``mpitp inspect FILE [--task T] [--requests | --samples | --json | --csv] [--limit N] [--plot out.png]``
- ``mpitp inspect diff A.h5 B.h5 [--atol 1e-6] [--rtol 1e-5] [--bootstrap-iters 10000]`` (with paired tests of B
  against A on the per-document scores: :mod:`mpitp.results.compare`)
- ``mpitp inspect sweep-summary.json [--plot out.png]`` (a sweep's summary: :mod:`mpitp.jobs.sweep`)

Exit status: 0 success; 1 "the answer is no" (``diff`` found differences, ``--json`` on a file whose run has not
finished, ``--samples`` where none were logged); 2 bad input (missing, unreadable or non-mpitp file, bad option
combination, ``--plot`` without matplotlib), always reported as one line on stderr.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import click

from mpitp import compat
from mpitp.results.diff import diff_runs, render_diff, render_statistics
from mpitp.results.plot import figure_class, plot_run
from mpitp.results.reader import BadInput, check_path, load, load_samples, one_line
from mpitp.results.render import lm_eval_json, lm_eval_sample, render_csv, render_requests, render_summary
from mpitp.results.untrusted import load_json, shown

if TYPE_CHECKING:
    from typing import IO

BAD_INPUT_EXIT = 2
CONTEXT = {"help_option_names": ["-h", "--help"]}


class BadInputExit(click.ClickException):
    """One line on stderr and exit status 2: the input (file or options) cannot be inspected."""

    exit_code = BAD_INPUT_EXIT

    def show(self, file: IO[str] | None = None) -> None:
        click.echo(f"mpitp: error: {shown(self.format_message())}", err=True, file=file)


class Negative(click.ClickException):
    """Exit status 1 with a one-line note on stderr: the files differ, the run is unfinished, nothing logged.

    An exception rather than ``ctx.exit(1)``: ``mpitp``'s ``main`` runs click with ``standalone_mode=False``,
    where a ``ctx.exit`` code is returned rather than used as the process exit status.
    """

    exit_code = 1

    def show(self, file: IO[str] | None = None) -> None:
        click.echo(f"mpitp: {shown(self.format_message())}", err=True, file=file)


def _echo(text: str, **kwargs) -> None:
    """``click.echo`` of text that holds what a file says (names, generations, samples): every control character
    but the newlines of our own layout shown escaped, so a file cannot drive the terminal (:func:`shown`)."""
    click.echo(shown(text, keep_newlines=True), **kwargs)


def _bad_input_exits(command):
    """The library's :class:`BadInput` becomes click's exit-status-2 exception (one line, no traceback)."""

    @functools.wraps(command)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return command(*args, **kwargs)
        except BadInput as exc:
            raise BadInputExit(str(exc)) from None

    return wrapper


class _FileArgument(click.Argument):
    """FILE, left out of the usage pieces that click puts between ``inspect`` and a subcommand's name."""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        return []


class _InspectGroup(click.Group):
    """``inspect FILE [options]`` runs the group's own callback; ``inspect diff A B`` runs the subcommand.

    A plain click group with a positional FILE would read ``diff`` as FILE, so the first argument is looked at
    before parsing: a subcommand name dispatches to it, anything else is parsed as the FILE form.
    """

    allow_extra_args = False
    allow_interspersed_args = True

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            click.Command.parse_args(self, ctx, [])  # the FILE form's defaults, then the subcommand
            compat.pending_subcommand(ctx, args[:1], args[1:])  # as click.Group.parse_args leaves it
            return ctx.args
        click.Command.parse_args(self, ctx, args)
        compat.pending_subcommand(ctx, [], [])
        return []

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] FILE")
        formatter.write_usage(ctx.command_path, "diff [OPTIONS] A.h5 B.h5", prefix="   or: ")


def _positive_int(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter(f"must be >= 1, got {value}")
    return value


@click.group(cls=_InspectGroup, name="inspect", invoke_without_command=True, context_settings=CONTEXT)
@click.argument("file", cls=_FileArgument, required=False, metavar="FILE")
@click.option("--task", default=None, help="Only this task (needed for --requests and --samples).")
@click.option("--requests", "show_requests", is_flag=True, help="List the task's request rows.")
@click.option("--samples", "show_samples", is_flag=True, help="Print the task's logged lm-eval samples (JSON).")
@click.option("--limit", type=int, default=None, callback=_positive_int,
              help="At most N request rows / samples.")
@click.option("--json", "as_json", is_flag=True, help="lm-eval's results JSON (results, configs, versions, ...).")
@click.option("--csv", "as_csv", is_flag=True, help="One CSV row per (task, metric, filter).")
@click.option("--plot", default=None, metavar="OUT.png",
              help="Also write bar charts of the metrics and per-DP-group busy time (needs mpitp[plot]).")
@click.pass_context
@_bad_input_exits
def inspect_command(ctx: click.Context, file: str | None, task: str | None, show_requests: bool, show_samples: bool,
                    limit: int | None, as_json: bool, as_csv: bool, plot: str | None) -> None:
    """Show an mpitp results file: a metrics table with the run's status, model, layout and throughput.

    \b
    mpitp inspect FILE                         metrics table
    mpitp inspect FILE --json | --csv          lm-eval results JSON / CSV
    mpitp inspect FILE --task T --requests     request rows (--limit N)
    mpitp inspect FILE --task T --samples      logged samples (--limit N)
    mpitp inspect diff A.h5 B.h5               compare two runs (see diff --help)
    mpitp inspect sweep-summary.json --plot P  a sweep: metric vs checkpoint with error bars

    Exit status: 0 ok; 1 --json of an unfinished run, or no samples logged; 2 bad input.
    """
    if ctx.invoked_subcommand is not None:
        return
    if file is None:
        raise click.UsageError("missing FILE (or use: inspect diff A.h5 B.h5)", ctx=ctx)
    modes = [n for n, on in (("--json", as_json), ("--csv", as_csv), ("--requests", show_requests),
                             ("--samples", show_samples)) if on]
    if len(modes) > 1:
        raise BadInputExit(f"{' and '.join(modes)} cannot be combined")
    if (show_requests or show_samples) and task is None:
        raise BadInputExit(f"{modes[0]} needs --task T")
    if limit is not None and not (show_requests or show_samples):
        raise BadInputExit("--limit applies to --requests and --samples only")
    Figure = figure_class() if plot else None  # fail before any output when matplotlib is missing

    if file.endswith(".json"):  # a sweep summary: metric vs checkpoint
        if modes:  # were ignored: the table printed, exit 0, as if --json or --requests had been answered
            raise BadInputExit(f"{modes[0]} reads a results file (.h5), not a sweep summary (which takes --task and "
                               f"--plot); inspect one checkpoint's file")
        return _inspect_sweep(file, task, plot, Figure)
    run = load(file)
    if task is not None and not (task in run.extra_results and not (show_requests or show_samples)):
        run.task(task)  # a group's name shows its aggregate (it was 'has no task', though the table listed it)

    failure = None  # the note of an exit-status-1 answer, raised after any plot is written
    if as_json:
        res, complete = lm_eval_json(run, task)
        _echo(json.dumps(res, indent=2, default=str))
        if not complete:
            failure = (f"{file}: status is '{run.status}': lm-eval's results are not written yet; printed what "
                       f"is known so far")
    elif as_csv:
        _echo(render_csv(run, task), nl=False)
        if run.status != "complete":
            _echo(f"mpitp: {file}: status is '{run.status}': metrics may be missing", err=True)
    elif show_requests:
        _echo(render_requests(file, task, limit))
    elif show_samples:
        samples = load_samples(file, task)
        if not samples and run.status != "complete":  # lm-eval logs its samples with the metrics, at the end
            failure = (f"{file}: no samples stored for task {task} yet: status is '{run.status}' (logged samples "
                       f"are written when the run finishes)")
        elif not samples:
            failure = f"{file}: no samples stored for task {task} (the run did not use --log-samples)"
        else:
            picked = samples if limit is None else samples[:limit]
            for s in picked:
                try:
                    record = load_json(s, "a sample")
                    record = lm_eval_sample(record) if isinstance(record, dict) else record
                    _echo(json.dumps(record, indent=2, ensure_ascii=False, default=str))
                except ValueError:  # not JSON, or beyond the bounds (BadInput): shown as the text it is
                    _echo(s)
            if len(picked) < len(samples):
                _echo(f"mpitp: {len(picked)} of {len(samples)} samples of {task} shown", err=True)
    else:
        _echo(render_summary(run, task))

    if plot:
        try:
            plot_run(run, plot, task, Figure=Figure)
        except (OSError, ValueError) as exc:  # an unwritable path, an image format matplotlib does not know
            raise BadInputExit(f"--plot {plot}: {one_line(exc)}") from None
        _echo(f"mpitp: wrote {plot}", err=True)
    if failure:
        raise Negative(failure)


def _inspect_sweep(path: str, task: str | None, plot: str | None, Figure) -> None:
    """``mpitp inspect sweep-summary.json [--plot out.png]``: the sweep's table; the plot draws metric vs checkpoint
    with lm-eval's stderr as error bars."""
    from mpitp.results.sweepsummary import Row, plot_summary, read_summary, render_summary

    check_path(path)
    data = read_summary(path)  # not a regular file, too large or too deep: one line of its own
    try:
        rows = [_summary_row(Row, r) for r in data["checkpoints"]]
        comps = data.get("comparisons", [])
        if not isinstance(comps, list) or not all(
                isinstance(c, dict) and all(isinstance(c.get(k, ""), str) for k in ("a", "b", "sentence"))
                and ("sentence" not in c or {"a", "b"} <= set(c)) for c in comps):
            raise TypeError("its comparisons are not a list of {a, b, sentence} texts")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BadInputExit(f"{path} is not a sweep summary ({one_line(exc)})") from None
    tasks = sorted({t for r in rows for t in r.metrics})
    if task is not None and task not in tasks:  # before the table: the error came after it, under --plot only
        raise BadInputExit(f"{path} has no task '{task}' (tasks: {', '.join(tasks) or 'none evaluated'})")
    _echo(render_summary(rows, path))
    if plot:
        try:
            plot_summary(path, plot, Figure, task)
        except (OSError, ValueError) as exc:
            raise BadInputExit(f"--plot {plot}: {one_line(exc)}") from None
        _echo(f"mpitp: wrote {plot}", err=True)


def _summary_row(Row, r):
    """One checkpoint of a sweep summary, each field of its type (the file is untrusted): a TypeError or
    ValueError here is a malformed summary, reported as such."""
    row = Row(**r)
    texts = (row.model, row.name, row.output, row.status, row.error)
    if not all(isinstance(t, str) for t in texts) or isinstance(row.wall_s, bool) \
            or not isinstance(row.wall_s, (int, float)) or not isinstance(row.metrics, dict):
        raise TypeError("a checkpoint's fields are not of their types (texts, wall_s a number, metrics a mapping)")
    for m in row.metrics.values():
        if not isinstance(m, dict) or not all(isinstance(v, (int, float)) for v in m.values()):
            raise TypeError("a checkpoint's metrics are not numbers per task and metric")
    return row


@inspect_command.command("diff", context_settings=CONTEXT)
@click.argument("a", metavar="A.h5")
@click.argument("b", metavar="B.h5")
@click.option("--atol", type=click.FloatRange(min=0), default=1e-6, show_default=True,
              help="Absolute tolerance for loglikelihoods and metrics.")
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-5, show_default=True,
              help="Relative tolerance (of B's value).")
@click.option("--show", type=click.IntRange(min=0), default=10, show_default=True,
              help="Differing requests listed per task.")
@click.option("--bootstrap-iters", type=click.IntRange(min=0), default=10000, show_default=True,
              help="Paired bootstrap resamples per metric (0: no statistics).")
@click.option("--seed", type=int, default=1234, show_default=True, help="Seed of the bootstrap resampling.")
@_bad_input_exits
def diff_command(a: str, b: str, atol: float, rtol: float, show: int, bootstrap_iters: int, seed: int) -> None:
    """Compare two results files: metrics, and each request's loglikelihood, is_greedy and generation, matched by
    (task, doc_id, idx) whatever order the rows were stored in.

    Floats match when |a - b| <= atol + rtol * |b|; generations and is_greedy must be equal; a task or request
    present in one file only is a difference. Exit status 0 when the files agree, 1 when they differ, 2 on bad
    input.

    Then, per task and metric, B - A with paired tests on the per-document scores (paired bootstrap CI and
    p-value; McNemar for 0/1 metrics), so "B is better than A" comes with a confidence. The statistics do not
    change the exit status.
    """
    ra, rb = load(a), load(b)
    diffs, only = diff_runs(ra, rb, atol, rtol)
    text, differ = render_diff(ra, rb, diffs, only, atol, rtol, show)
    _echo(text)
    if bootstrap_iters:
        _echo("\n" + render_statistics(ra, rb, [d.task for d in diffs], bootstrap_iters, seed))
    if differ:
        raise Negative(f"{a} and {b} differ")
