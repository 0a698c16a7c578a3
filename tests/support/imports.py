"""mpitp's import statements, read with ``ast``: the graph behind ``test_import_cycles`` and ``test_layers``.

Every ``import`` of every module counts, those inside functions included (a lazy import is still a dependency: it
hides a cycle from ``python -c 'import ...'`` but not from the next person who has to follow the code).
``from a import b`` counts as importing ``a.b`` where ``b`` is a module, else ``a``; ``import a.b.c`` where ``c`` is
an attribute counts as importing the module that holds it.
"""

from __future__ import annotations

import ast
import os

import mpitp

ROOT = os.path.dirname(os.path.abspath(mpitp.__file__))


def modules(root: str = ROOT) -> dict[str, str]:
    """``{dotted name: path}`` of every module under ``root`` (a package is its ``__init__``)."""
    out = {}
    base = os.path.dirname(root)
    for folder, _, files in os.walk(root):
        for fn in files:
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, fn), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, fn)
    return out


def import_sites(root: str = ROOT) -> list[tuple[str, int, str]]:
    """``(importing module, line, imported module)`` for every import inside ``root``'s package, in file order."""
    mods = modules(root)
    sites = []
    for name, path in sorted(mods.items()):
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # import a.b.c where a.b.c is an attribute: the module holding it
                    t = t.rpartition(".")[0]
                if t and t != name:
                    sites.append((name, node.lineno, t))
    return sorted(set(sites))


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """``{module: the modules it imports}`` for every module under ``root``."""
    graph: dict[str, set[str]] = {m: set() for m in modules(root)}
    for name, _, target in import_sites(root):
        graph[name].add(target)
    return graph
