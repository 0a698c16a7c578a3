"""``mpitp tasks --data-dir DIR``: which stock lm-eval tasks run offline from DIR (:mod:`mpitp.tasks.offline`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command(name="tasks")
@click.option("--data-dir", required=True,
              help="Directory laid out as DIR/<task>/<split>.jsonl (or named as downloaded).")
def tasks_command(data_dir):
    """List the stock lm-eval tasks runnable offline from --data-dir, and what the others miss."""
    from mpitp.errors import UsageError
    from mpitp.tasks.offline import offline_status

    try:
        rows = offline_status(data_dir)
    except UsageError as exc:
        raise click.UsageError(str(exc)) from None
    root = Path(data_dir).resolve()
    for row in rows:
        files = " ".join(f"{split}={_rel(f, root)}" for split, f in row.files.items())
        state = "runnable" if row.runnable else "missing " + ", ".join(row.missing)
        click.echo(f"{row.task:16s} {state}" + (f"  [{files}]" if files else ""))


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:  # a symlinked folder resolving elsewhere
        return str(path)
