"""No import cycle inside mpitp: the layers the folders show only import downwards.

Every ``import`` statement of every module is read with ``ast`` (:mod:`support.imports`), those inside functions
included (a lazy import is still a dependency: it hides a cycle from ``python -c 'import ...'`` but not from the next
person who has to follow the code). ``tests/test_layers.py`` checks the stronger rule: the order of the layers.
"""

from __future__ import annotations

from support.imports import import_graph


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
    assert "mpitp.evaluation.api" in g["mpitp"]  # inside mpitp.__getattr__ (the lazy mpitp.evaluate)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_inside_mpitp():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
