"""``mpitp tasks --data-dir DIR [--tasks T,...]``: which lm-eval tasks run offline from DIR (:mod:`mpitp.tasks.offline`
for the six hand-described tasks, :mod:`mpitp.tasks.layout` for any task named with ``--tasks``).

DIR is often a group's shared folder, so the names printed here (its files and folders, and the reasons built from
them) go through :func:`mpitp.results.untrusted.shown`: a file named with terminal escapes cannot retitle or clear the
terminal of whoever lists it."""

from __future__ import annotations

from pathlib import Path

import click

from mpitp.cli.options import task_names


@click.command(name="tasks")
@click.option("--data-dir", required=True,
              help="Directory laid out as DIR/<dataset_path>/[<dataset_name>/]<split>.<jsonl|parquet>, or "
                   "DIR/<task>/<split>.jsonl for the six stock tasks of earlier versions (or named as downloaded).")
@click.option("--tasks", callback=task_names,
              help="Tasks, groups or tags to look up (groups expanded); default: the six stock tasks.")
@click.option("--num_fewshot", "--num-fewshot", "num_fewshot", type=click.IntRange(min=0),
              help="Few-shot examples: their split is then needed too.")
def tasks_command(data_dir: str, tasks: tuple[str, ...] | None, num_fewshot: int | None) -> None:
    """List the lm-eval tasks runnable offline from --data-dir, and what the others miss."""
    from mpitp.errors import UsageError
    from mpitp.results.untrusted import shown
    from mpitp.tasks.offline import offline_status, resolved

    root = resolved(data_dir)
    try:
        if tasks:
            return _generic(data_dir, list(tasks), num_fewshot, root)
        rows = offline_status(data_dir)
    except UsageError as exc:
        raise click.UsageError(shown(exc)) from None
    for row in rows:
        files = " ".join(f"{split}={_rel(f, root)}" for split, f in row.files.items())
        state = "runnable" if row.runnable else "missing " + ", ".join(row.missing)
        click.echo(shown(f"{row.task:16s} {state}" + (f"  [{files}]" if files else "")))


def _generic(data_dir, names: list[str], num_fewshot, root: Path) -> None:
    """One line per leaf task of ``names``: runnable (with its files), missing (which split), or not in DIR."""
    from mpitp.results.untrusted import shown
    from mpitp.tasks.layout import resolve_all
    from mpitp.tasks.offline import data_dir_problem

    problem = data_dir_problem(data_dir)
    if problem:
        raise click.UsageError(problem)
    res = resolve_all(names, data_dir, None, num_fewshot)
    missing: dict[str, list] = {}
    for gap in res.missing:
        missing.setdefault(gap.task, []).append(gap)
    width = max([16, *(len(leaf.name) for leaf in res.leaves)])
    for leaf in res.leaves:
        if leaf.name in res.files:
            files = " ".join(f"{s}={_rel(Path(f), root)}" for s, f in res.files[leaf.name].items())
            state = f"runnable  [{files}]"
        elif leaf.name in missing:
            state = "missing " + ", ".join(_rel(g.file, root) if g.file else g.reason.removeprefix("needs ")
                                           for g in missing[leaf.name])
        elif leaf.hub:
            where = leaf.folder(Path(".")).as_posix()
            state = f"not in DIR (expected {where}/<split>.<jsonl|parquet>; `mpitp prefetch` fetches it)"
        else:
            state = "reads no Hub dataset (left as it is)"
        click.echo(shown(f"{leaf.name:{width}s} {state}"))
    if not res.leaves:
        raise click.UsageError(shown(f"no task, group or tag named {', '.join(names)}"))


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:  # a symlinked folder resolving elsewhere
        return str(path)
