"""Every reach of mpitp's code into a library's private surface, found with ``ast`` (no import of the code scanned).

A reach is one of (each a :class:`Reach`: module, line, what, the text):

- ``private``: an attribute, an imported name or a module of a library (:data:`LIBRARIES`) whose name starts with one
  underscore (``TaskManager._index``, ``from lm_eval.tasks._index import Kind``), and any ``x._name`` (or
  ``getattr(x, "_name")``) where ``_name`` is defined nowhere in mpitp (``model._pp_forward_wrapped``): the object's
  type is not known to a syntax scan, so a private name mpitp never defines is taken to be a library's;
- ``source``: ``inspect.getsource`` (and its kin): reading a library's code as data;
- ``patch``: ``setattr``/``delattr``, ``del x.attr``, or an assignment to an attribute of a library module or of a
  name imported from one (``socket.socket.connect = ...``; the standard library counts, a process-wide patch is one
  whoever ships it), on anything but ``self``/``cls``.

Why a scan rather than review: the next reach into lm-eval's internals is written in a hurry by someone who has not
read :mod:`mpitp.compat`; this finds it on the next ``pytest -m "not mpi"``.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass

from support.imports import modules

LIBRARIES = ("lm_eval", "transformers", "torch", "click", "peft", "h5py", "datasets")
#: The standard library's modules a patch may target (assignments to their attributes are patches too).
STDLIB_PATCHABLE = ("socket", "os", "sys", "builtins", "argparse", "logging", "inspect", "io", "subprocess")
#: Underscore names that are public API of the standard library (namedtuple's methods, ``os._exit``,
#: ``sys._getframe``): not a library's private surface.
PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_exit", "_getframe"})
SOURCE_READERS = frozenset({"getsource", "getsourcelines", "findsource", "getsourcefile"})


@dataclass(frozen=True)
class Reach:
    module: str
    line: int
    kind: str  # private, source or patch
    name: str  # the attribute, module or function reached
    text: str  # the source line, stripped

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.kind} {self.name}: {self.text}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def _trees(root: str | None = None) -> dict[str, tuple[ast.Module, list[str]]]:
    out = {}
    for name, path in sorted((modules() if root is None else modules(root)).items()):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        out[name] = (ast.parse(text, path), text.splitlines())
    return out


def defined_names(trees) -> set[str]:
    """Every attribute name mpitp itself defines on its objects: methods and class-level names of its classes
    (dataclass fields included), attributes it assigns on ``self``/``cls``, and keyword arguments it passes (a
    ``SimpleNamespace(_x=...)``). A module-level function's name does not count: ``obj._load`` is not ``_load``."""
    names: set[str] = set()
    for tree, _ in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign):
                        names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) in ("self", "cls"):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return names


def _root(node) -> str | None:
    """The name an attribute chain starts from (``a`` of ``a.b.c``), ``super`` for ``super().x``, else None."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
        return "super"
    return node.id if isinstance(node, ast.Name) else None


def _bindings(tree) -> dict[str, str]:
    """``{local name: dotted path}`` of every import in the module (function-level ones included)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _library(path: str | None, libraries=LIBRARIES) -> bool:
    return path is not None and path.split(".")[0] in libraries


def scan(root: str | None = None, skip: tuple[str, ...] = ("mpitp.compat",)) -> list[Reach]:
    """Every :class:`Reach` in mpitp's modules (``root``: another package's folder), ``skip`` left out."""
    trees = _trees(root)
    ours = defined_names(trees)
    found: list[Reach] = []
    for module, (tree, lines) in trees.items():
        if module in skip:
            continue
        bound = _bindings(tree)

        def add(node, kind, name, module=module, lines=lines):
            found.append(Reach(module, node.lineno, kind, name, lines[node.lineno - 1].strip()))

        def foreign(obj, attr: str, bound=bound) -> bool:
            """Whether ``obj.attr`` (``attr`` private) is a library's: the object comes from a library import,
            or mpitp defines no such name."""
            if not _private(attr):
                return False
            root_name = _root(obj)
            return _library(bound.get(root_name)) or attr not in ours

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level and _library(node.module):
                for a in node.names:
                    if any(_private(p) for p in node.module.split(".")) or _private(a.name):
                        add(node, "private", f"{node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if _library(a.name) and any(_private(p) for p in a.name.split(".")):
                        add(node, "private", a.name)
            elif isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Load) and foreign(node.value, node.attr):
                    add(node, "private", node.attr)
                elif not isinstance(node.ctx, ast.Load) and _root(node) not in ("self", "cls"):
                    if foreign(node.value, node.attr) or _library(bound.get(_root(node)),
                                                                  LIBRARIES + STDLIB_PATCHABLE) \
                            or isinstance(node.ctx, ast.Del):
                        add(node, "patch", node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                fn = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                args = node.args
                if fn in SOURCE_READERS and (isinstance(node.func, ast.Name)
                                             and bound.get(fn, "").startswith("inspect.")
                                             or isinstance(node.func, ast.Attribute)
                                             and bound.get(_root(node.func)) == "inspect"):
                    add(node, "source", f"inspect.{fn}")
                elif isinstance(node.func, ast.Name) and fn in ("getattr", "hasattr") and len(args) >= 2 \
                        and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) \
                        and foreign(args[0], args[1].value):
                    add(node, "private", args[1].value)
                elif isinstance(node.func, ast.Name) and fn in ("setattr", "delattr") and args \
                        and _root(args[0]) not in ("self", "cls"):
                    name = args[1].value if len(args) > 1 and isinstance(args[1], ast.Constant) else "(a name)"
                    add(node, "patch", f"{fn} {name}")
        found += _overrides(module, tree, lines, bound)
    return sorted(set(found), key=lambda r: (r.module, r.line, r.kind, r.name))


_PRIVATE_DEF = re.compile(r"def (_[A-Za-z]\w*)|\.(_[A-Za-z]\w*)\s*=[^=]")


@functools.cache
def _library_private_names(path: str) -> frozenset[str]:
    """The private names the library code around ``path`` (``lm_eval.models.huggingface.HFLM``) defines or assigns,
    read as text from the folder of the longest prefix that is a module (never imported: seconds of torch
    otherwise)."""
    import importlib.util

    parts = path.split(".")
    spec = importlib.util.find_spec(parts[0])  # a top-level package: found, not imported
    if spec is None or not spec.origin:
        return frozenset()
    top = os.path.dirname(spec.origin)
    origin = spec.origin
    for n in range(len(parts), 1, -1):  # the longest prefix that is a module file or package of it
        base = os.path.join(top, *parts[1:n])
        hit = next((f for f in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(f)), None)
        if hit:
            origin = hit
            break
    with open(origin, encoding="utf-8", errors="replace") as f:
        text = f.read()
    files = [origin]
    if f"class {parts[-1]}" not in text:  # re-exported (click's __init__): its whole package, read as text
        files = [os.path.join(d, fn) for d, _, fns in os.walk(os.path.dirname(origin)) for fn in fns
                 if fn.endswith(".py")]
    names = set()
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            names.update(a or b for a, b in _PRIVATE_DEF.findall(f.read()))
    return frozenset(names)


def _overrides(module: str, tree, lines: list[str], bound: dict) -> list[Reach]:
    """``override`` reaches of the classes in ``tree`` that subclass a library class: a private method the base
    defines, overridden (it must still exist, or the override silently never runs), or called through
    ``super()``, and ``self._x`` where the base's code uses ``_x`` (its private state)."""
    out = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        bases = [bound[b.id] for b in cls.bases if isinstance(b, ast.Name) and _library(bound.get(b.id))]
        bases += [bound[b.value.id] + "." + b.attr for b in cls.bases if isinstance(b, ast.Attribute)
                  and isinstance(b.value, ast.Name) and _library(bound.get(b.value.id))]
        has_private = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name)
                          or isinstance(n, ast.Attribute) and _private(n.attr) for n in ast.walk(cls))
        theirs = set().union(*(_library_private_names(b) for b in bases)) if has_private else set()
        for node in ast.walk(cls):
            name = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body and \
                    _private(node.name) and (node.name in theirs or not bases):
                name = node.name if node.name in theirs else None
            elif isinstance(node, ast.Attribute) and _private(node.attr) and (
                    _root(node) == "super" or _root(node) == "self" and node.attr in theirs):
                name = node.attr
            if name is not None:
                out.append(Reach(module, node.lineno, "override", name, lines[node.lineno - 1].strip()))
    return out
