"""The house in numbers, read with ``ast`` from mpitp's sources (issue 38's "Done means"):

    python bench/house_counts.py

- import cycles between modules and arrows against ARCHITECTURE.md's layers, counting function-level imports
  (tests/test_import_cycles.py and tests/test_layers.py fail on any);
- parameters without an annotation (``self``/``cls`` not counted), and how many of them are ``cfg``/``rt``/``launch``;
- hand-offs as dicts or tuples on the main path: functions of ``evaluation/``, ``jobs/`` and ``parallel/runtime``
  annotated to return ``dict``/``tuple``, and ``getattr(cfg, ...)`` with a default (a settings object that may lack
  a field);
- the largest module (lines) and the longest function (lines).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

MAIN_PATH = ("evaluation/", "jobs/", "parallel/runtime.py", "cli/evaluate.py", "cli/run.py")


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    out = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]
    return [p for p in out if p.arg not in ("self", "cls")]


def counts() -> dict:
    from support.imports import import_graph, import_sites
    from test_import_cycles import cycles
    from test_layers import FLOORS, violations

    params = unannotated = 0
    names: Counter = Counter()
    handoffs: list[str] = []
    getattr_cfg = 0
    biggest = (0, "")
    longest = (0, "")
    for path in sorted((ROOT / "mpitp").rglob("*.py")):
        rel = str(path.relative_to(ROOT / "mpitp"))
        text = path.read_text()
        biggest = max(biggest, (len(text.splitlines()), rel))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest = max(longest, (node.end_lineno - node.lineno + 1, f"{rel}::{node.name}"))
                for p in _params(node):
                    params += 1
                    if p.annotation is None:
                        unannotated += 1
                        names[p.arg] += 1
                ret = ast.unparse(node.returns) if node.returns is not None else ""
                if rel.startswith(MAIN_PATH) and not node.name.startswith("_") and (
                        ret.startswith(("dict", "tuple")) or "| dict" in ret):
                    handoffs.append(f"{rel}::{node.name} -> {ret}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id == "cfg"):
                getattr_cfg += 1
    return dict(module_cycles=len(cycles(import_graph())), layer_arrows=len(violations(import_sites(), FLOORS)),
                params=params, unannotated=unannotated,
                unannotated_cfg_rt=sum(names[n] for n in ("cfg", "rt", "launch")),
                top_unannotated=names.most_common(8), handoffs=handoffs, getattr_cfg_default=getattr_cfg,
                biggest_module=biggest, longest_function=longest)


def main() -> None:
    c = counts()
    print(f"import cycles between modules (function-level imports counted): {c['module_cycles']}")
    print(f"imports against the layers (function-level imports counted): {c['layer_arrows']}")
    print(f"parameters without an annotation: {c['unannotated']} of {c['params']} "
          f"(cfg/rt/launch: {c['unannotated_cfg_rt']}; most common: "
          f"{', '.join(f'{n} {k}' for n, k in c['top_unannotated'])})")
    print(f"main-path functions handing off a dict or tuple: {len(c['handoffs'])}")
    for h in c["handoffs"]:
        print(f"  {h}")
    print(f"getattr(cfg, name, default): {c['getattr_cfg_default']}")
    print(f"largest module: {c['biggest_module'][1]} ({c['biggest_module'][0]} lines); longest function: "
          f"{c['longest_function'][1]} ({c['longest_function'][0]} lines)")


if __name__ == "__main__":
    main()
