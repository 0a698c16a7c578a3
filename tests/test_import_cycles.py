"""No import cycle inside mpitp: the layers the folders show only import downwards.

Every ``import`` statement of every module is read with ``ast``, those inside functions included (a lazy import is
still a dependency: it hides a cycle from ``python -c 'import ...'`` but not from the next person who has to follow
the code). ``from a import b`` counts as importing ``a.b`` where ``b`` is a module, else ``a``.
"""

from __future__ import annotations

import ast
import os

import mpitp

ROOT = os.path.dirname(os.path.abspath(mpitp.__file__))


def _modules() -> dict[str, str]:
    """``{dotted name: path}`` of every module under mpitp (a package is its ``__init__``)."""
    out = {}
    base = os.path.dirname(ROOT)
    for folder, _, files in os.walk(ROOT):
        for fn in files:
            if fn.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, fn), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, fn)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
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
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    """The reader sees imports at module level and inside functions (a test that cannot fail is a defect)."""
    g = import_graph()
    assert "mpitp.errors" in g["mpitp.evaluation.checks"]  # module level
    assert "mpitp.evaluation.api" in g["mpitp"]  # inside mpitp.evaluate
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_inside_mpitp():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
