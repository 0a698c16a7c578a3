"""The layers of mpitp hold: every import points down the floors of ARCHITECTURE.md's "Layers", never up or sideways.

``tests/test_import_cycles.py`` only fails on a cycle between modules; two packages can still lean on each other
through different modules (``evaluation`` <-> ``jobs`` did, through ``readiness``), and a library can grow a
dependency on the MPI machinery without any cycle. So the order of the floors is declared here (:data:`FLOORS`),
ARCHITECTURE.md's "Layers" block must say the same, and every import statement of mpitp (read with ``ast``,
function-level imports included: :mod:`support.imports`) must go from a unit to a unit on a lower floor, or stay
inside its own unit (a folder, or a module at mpitp's top level). The arrows still left are in :data:`ALLOWED`, each
with its reason; an entry nobody needs any more fails the test, so the list can only shrink.
"""

from __future__ import annotations

import re

from support import REPO
from support.imports import import_sites, modules

FLOORS: list[tuple[str, ...]] = [  # lowest first; a unit imports only from the floors before its own
    # leaves: import nothing of mpitp
    ("escape.py", "version.py", "watchdog.py", "digest.py", "isolated.py", "gcpolicy.py"),
    ("errors.py",),
    ("testing.py", "compat.py"),
    ("parallel/", "results/"),  # results/: a library that knows no MPI
    ("replica/", "tasks/"),  # tasks/ reads results/'s guards for files from elsewhere (untrusted, safefile)
    ("importpolicy.py",),  # its patches are compat's targets; its kept scan a private file in mpitp's cache
    ("evaluation/",),
    ("jobs/",),  # job files, sweeps, submission, and `mpitp check` / `prefetch` (readiness, prefetch)
    ("cli/",),
    ("__init__.py", "__main__.py"),  # the public API (lazy) and `python -m mpitp`
]

ALLOWED: dict[tuple[str, str], str] = {  # (importing module, imported module): why it is still there
}


_PACKAGES = {m for m, path in modules().items() if path.endswith("__init__.py")}


def unit(module: str) -> str:
    """The layer unit of a dotted module name: ``parallel/`` for ``mpitp.parallel.comm``, ``errors.py`` for
    ``mpitp.errors``, ``__init__.py`` for ``mpitp`` itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if len(parts) > 2 or module in _PACKAGES else f"{parts[1]}.py"


def _file(module: str) -> str:
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if module in _PACKAGES else f"{path}.py"


def violations(sites, floors, allowed=()) -> list[str]:
    """One line per import that points up or sideways, or from or to a unit no floor declares."""
    level = {u: i for i, floor in enumerate(floors) for u in floor}
    out = []
    for importer, line, target in sites:
        a, b = unit(importer), unit(target)
        if a == b or (importer, target) in allowed:
            continue
        where = f"{_file(importer)}:{line} imports {target}"
        if a not in level or b not in level:
            out.append(f"{where}: {a if a not in level else b} is on no floor (declare it in FLOORS and "
                       "ARCHITECTURE.md)")
        elif level[b] > level[a]:
            out.append(f"{where}: {a} (floor {level[a]}) -> {b} (floor {level[b]}) points up")
        elif level[b] == level[a]:
            out.append(f"{where}: {a} -> {b} points sideways (both on floor {level[a]})")
    return out


def architecture_floors(text: str) -> list[tuple[str, ...]]:
    """The floors the first code block under "## Layers" shows: entries between ``|`` lines; an entry is a line
    that starts at column 0 with one or more unit names (``name/`` or ``name.py``), then its description."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    floors: list[list[str]] = [[]]
    for line in block.splitlines()[1:]:
        if line.strip() == "|":
            floors.append([])
        elif line and not line[0].isspace():
            names = []
            for token in line.split():
                if not re.fullmatch(r"[\w]+(/|\.py)", token):
                    break
                names.append(token)
            floors[-1].extend(names)
    return [tuple(f) for f in floors]


def test_the_checker_sees_up_and_sideways_arrows():
    """A test that cannot fail is a defect: up, sideways and undeclared arrows are each named with their line."""
    floors = [("errors.py",), ("parallel/", "results/"), ("evaluation/",)]
    sites = [("mpitp.parallel.comm", 20, "mpitp.errors"),  # down: fine
             ("mpitp.parallel.comm", 21, "mpitp.parallel.world"),  # inside its unit: fine
             ("mpitp.parallel.comm", 30, "mpitp.evaluation.api"),  # up
             ("mpitp.results.store", 40, "mpitp.parallel.comm"),  # sideways
             ("mpitp.evaluation.lm", 50, "mpitp.cli.run"),  # to an undeclared unit
             ("mpitp.evaluation.x", 60, "mpitp.results.store")]  # down
    assert violations(sites, floors) == [
        "mpitp/parallel/comm.py:30 imports mpitp.evaluation.api: "
        "parallel/ (floor 1) -> evaluation/ (floor 2) points up",
        "mpitp/results/store.py:40 imports mpitp.parallel.comm: "
        "results/ -> parallel/ points sideways (both on floor 1)",
        "mpitp/evaluation/lm.py:50 imports mpitp.cli.run: cli/ is on no floor (declare it in FLOORS and "
        "ARCHITECTURE.md)"]
    assert violations(sites[2:3], floors, {("mpitp.parallel.comm", "mpitp.evaluation.api")}) == []
    assert (unit("mpitp"), unit("mpitp.errors"), unit("mpitp.jobs"), unit("mpitp.jobs.submit"),
            unit("mpitp.tasks.demo.model")) == ("__init__.py", "errors.py", "jobs/", "jobs/", "tasks/")


def test_every_module_is_on_a_floor():
    level = {u for floor in FLOORS for u in floor}
    missing = sorted({unit(m) for m in modules()} - level)
    assert not missing, f"units on no floor of FLOORS (and ARCHITECTURE.md's Layers): {missing}"


def test_imports_point_down_the_floors():
    found = violations(import_sites(), FLOORS, ALLOWED)
    assert not found, "imports against the layers (ARCHITECTURE.md, Layers):\n" + "\n".join(found)


def test_the_allow_list_only_shrinks():
    """An allowed arrow that no import needs any more is removed from ALLOWED, so it cannot come back unseen."""
    pairs = {(importer, target) for importer, _, target in import_sites()}
    stale = sorted(set(ALLOWED) - pairs)
    assert not stale, f"ALLOWED entries no import needs any more (delete them): {stale}"


def test_architecture_md_shows_the_declared_floors():
    shown = architecture_floors((REPO / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert shown == FLOORS, ("ARCHITECTURE.md's Layers block and FLOORS (tests/test_layers.py) differ:\n"
                             f"  ARCHITECTURE.md: {shown}\n  FLOORS:          {FLOORS}")
