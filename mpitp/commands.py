"""Registry of the subcommands defined outside ``cli.py``."""

from __future__ import annotations


def register(cli) -> None:
    pass
