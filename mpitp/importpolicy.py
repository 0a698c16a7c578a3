"""What the console command's imports cost and a run never uses, saved: scipy's optimiser under transformers'
detection losses and lm-eval's ``requests`` put off to their first use, and transformers' scan of its model folders
done once, not twice.

Why: a small launch's start-up is imports (bench/README, "Session 16"), every rank's. Three shares of them compute
nothing an evaluation needs:

- ``transformers.modeling_utils`` imports its table of losses (``transformers.loss.loss_utils``), and three of the
  object-detection losses in it bind ``scipy.optimize.linear_sum_assignment`` at module level: 0.1-0.3 s per
  process on this project's 2-core VM (bench/README, "Session 18"), nothing else a run imports loads it. While
  ``transformers.loss.loss_utils`` executes, and only if nothing has imported ``scipy.optimize`` yet,
  ``sys.modules["scipy.optimize"]`` is a stand-in whose ``linear_sum_assignment`` imports the real module and
  calls the real function on its first call. Any other name asked of the stand-in (a release that imports more from
  it) imports the real module then and there and hands back the real attribute, so the deferral can be slower than
  planned but never wrong. Once that module has executed (or failed), the stand-in is taken out of ``sys.modules``.
  The same for ``requests`` (with ``chardet``, 0.06-0.09 s), which ``lm_eval.utils`` imports at module level for
  its API models' HTTP sessions and reads only when one is made: no name of it is bound at import.
- ``import transformers`` reads every file under ``transformers/models`` (``create_import_structure_from_path`` of
  the folder, 0.25-0.35 s here) for its lazy table of names, and ``transformers.models``, imported by the auto
  classes, reads them all again: its ``__init__`` asks for the same folder by its ``__init__.py``, a different key
  of the same ``lru_cache``. From the end of ``transformers.utils.import_utils``'s execution to the end of
  ``transformers``' own, the scan of the model folder is read from this user's cache (``<mpitp cache>/import-scan``,
  ``MPITP_IMPORT_CACHE=DIR`` moves it, ``=0`` turns it off) where it was kept by an earlier process, or made and kept
  there: keyed by the folder, the name, size and modification time of every file and folder under it and the
  scanning module's own file (45 ms to compute; a model added or edited, or another transformers, is a new key),
  every type checked on reading, and believed only from a file of this user's alone (the names it holds are the
  modules ``transformers.X`` imports); any other is scanned again and replaced. While ``transformers.models``
  executes, its own scan is that one. bench/README, "Session 20".

Each is confined to the execution of the modules it covers (:data:`COVERED`), for the process's own command only
(:func:`start_up`, called beside :func:`mpitp.gcpolicy.start_up`): afterwards a module's loader is its own again,
what was replaced is put back, and the finder that did this leaves ``sys.meta_path`` once every covered module has
been found. All that stays is the forwarding function bound in transformers' loss modules and the stand-in bound as
``lm_eval.utils.requests`` (the real module's names, imported on the first read). ``mpitp.compat`` lists them (kind
``defer`` and ``reuse``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.abc
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpitp import compat
from mpitp.digest import update_tree_stat

#: module whose execution the stand-in covers -> (the module put off, the names it forwards)
DEFERRED: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformers.loss.loss_utils": ("scipy.optimize", ("linear_sum_assignment",)),
    "lm_eval.utils": ("requests", ()),  # for lm-eval's API models' HTTP sessions: every name read when called
}
#: transformers' scan of a package's folder (its :mod:`mpitp.compat` target), and the modules whose execution it
#: covers: once the first has executed, the scan of the model folders is read from this user's cache or made and
#: kept there until the second (the package) has executed; the third asks for the same folder again
SCAN = "transformers.utils.import_utils.create_import_structure_from_path"
KEEPS, KEPT_UNTIL, REUSES = "transformers.utils.import_utils", "transformers", "transformers.models"
COVERED = (*DEFERRED, KEEPS, KEPT_UNTIL, REUSES)
#: the kept scan's format (a new one: every kept file is stale) and the bound on its size
FORMAT, MAX_BYTES = 1, 8 << 20

_scans: dict[str, Any] = {}  # the model folder -> its scan, kept or made while this process imported transformers
_held = contextlib.ExitStack()  # the scan replaced from KEEPS's execution to the end of KEPT_UNTIL's


def _real(module: str) -> types.ModuleType:
    """The real ``module``, imported now if need be (a stand-in still in ``sys.modules`` taken out first)."""
    if isinstance(sys.modules.get(module), _StandIn):
        del sys.modules[module]
    return importlib.import_module(module)


def _forwarder(module: str, name: str):
    def forward(*args: Any, **kwargs: Any) -> Any:
        return getattr(_real(module), name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"{module}.{name}, imported on its first call (mpitp.importpolicy)"
    return forward


class _StandIn(types.ModuleType):
    """``module`` while it is put off: the forwarded names, and the real module's attribute for any other."""

    def __init__(self, module: str, names: tuple[str, ...]):
        super().__init__(module)
        self.__dict__.update({n: _forwarder(module, n) for n in names})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real(self.__name__), name)


@contextlib.contextmanager
def _stand_in(deferred: str, names: tuple[str, ...]) -> Iterator[None]:
    """``deferred`` a stand-in in ``sys.modules`` for the block, unless something imported it already."""
    if deferred in sys.modules:  # already imported, by whoever: nothing to put off
        yield
        return
    stand_in = _StandIn(deferred, names)
    sys.modules[deferred] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(deferred) is stand_in:
            del sys.modules[deferred]


def _folder(module_path) -> str:
    """The folder a scan of ``module_path`` reads (its first step: a file's folder), resolved."""
    path = os.fspath(module_path)
    return os.path.realpath(os.path.dirname(path) if os.path.isfile(path) else path)


def _encode(node: dict) -> list:
    """A scan as JSON: each entry ``["d", folder, scan]`` or ``["b", backends, [[module, names], ...]]``, in order."""
    return [["d", k, _encode(v)] if isinstance(k, str) else ["b", sorted(k), [[m, sorted(n)] for m, n in v.items()]]
            for k, v in node.items()]


def _strs(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("not a list of names")
    return value


def _decode(entries: Any, depth: int = 0) -> dict:
    """:func:`_encode` undone, every type checked (ValueError on anything else: the file is not believed)."""
    if not isinstance(entries, list) or depth > 16:
        raise ValueError("not a scan")
    node: dict = {}
    for entry in entries:
        if isinstance(entry, list) and len(entry) == 3 and entry[0] == "d" and isinstance(entry[1], str):
            node[entry[1]] = _decode(entry[2], depth + 1)
        elif isinstance(entry, list) and len(entry) == 3 and entry[0] == "b" and isinstance(entry[2], list):
            modules = {}
            for pair in entry[2]:
                if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                    raise ValueError("not a module's names")
                modules[pair[0]] = set(_strs(pair[1]))
            node[frozenset(_strs(entry[1]))] = modules
        else:
            raise ValueError("not a scan entry")
    return node


def _key(folder: str, scanner: str) -> list:
    """What the scan depends on: every file and folder under ``folder`` (name, size, modification time) and the
    scanning module's own file; a model added, removed or edited, or a new transformers, is a new key."""
    h = hashlib.sha256()
    st = os.stat(scanner)
    h.update(f"{scanner}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    update_tree_stat(h, folder, folders=True)
    return [FORMAT, folder, h.hexdigest()]


def kept_folder() -> Path | None:
    """Where scans are kept (``<mpitp cache>/import-scan``, ``MPITP_IMPORT_CACHE``); None when that is off. What it
    holds follows from the installation's files alone (``mpitp check`` does not count it among a check's inputs)."""
    from mpitp.tasks.demo import cache_folder

    return cache_folder("MPITP_IMPORT_CACHE", "import-scan")


def _kept_file(key: list):
    from mpitp.results.privatefile import keyed_file

    return keyed_file(kept_folder(), key, "transformers' model scan")


def _read_kept(path, key: list) -> dict | None:
    """The scan kept in ``path`` for ``key``; None when there is none, or it is not this user's alone, stale or
    malformed (silently: every rank reads it, and the scan made instead replaces the file, privately)."""
    from mpitp.results.privatefile import read_private_json
    from mpitp.results.untrusted import BadInput

    try:
        data = read_private_json(path, "transformers' model scan", max_bytes=MAX_BYTES)
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        return _decode(data.get("scan"))
    except (BadInput, OSError, ValueError):  # NotPrivate is a BadInput
        return None


def _scan_kept(scan, folder: str, scanner: str):
    """``scan`` (transformers' own), answering for the model folder ``folder`` from this user's cache (kept there
    after a scan) and from ``_scans`` after the first time; any other folder scanned as it asks."""

    def scan_models(module_path):
        path = os.fspath(module_path)
        if os.path.basename(path.rstrip(os.sep)) != "models" or _folder(path) != folder:
            return scan(module_path)
        if folder not in _scans:
            key = _key(folder, scanner)
            kept = _kept_file(key)
            found = _read_kept(kept, key) if kept is not None else None
            if found is None:
                found = scan(module_path)
                if kept is not None:
                    from mpitp.results.privatefile import write_private_json

                    write_private_json(kept, {"key": key, "scan": _encode(found)}, "transformers' model scan")
            _scans[folder] = found
        return _scans[folder]

    return scan_models


def _scanning() -> tuple[Any, Any] | None:
    """(the scan, the module holding it) when it is transformers' ``lru_cache``-d function still; else None."""
    target = compat.TARGETS[SCAN]
    module = sys.modules.get(target.module)
    scan = getattr(module, target.attribute, None)
    return (scan, module) if scan is not None and hasattr(scan, "cache_info") else None


@contextlib.contextmanager
def _keep_scan() -> Iterator[None]:
    """After :data:`KEEPS` has executed: its scan answers for the model folder from the kept scan, until
    :func:`_release_scan` (the end of :data:`KEPT_UNTIL`'s execution)."""
    yield
    found = _scanning()
    if found is not None:
        scan, module = found
        folder = os.path.realpath(os.path.join(os.path.dirname(module.__file__), os.pardir, "models"))
        _held.enter_context(compat.replaced(SCAN, _scan_kept(scan, folder, module.__file__)))


@contextlib.contextmanager
def _release_scan() -> Iterator[None]:
    try:
        yield
    finally:
        _held.close()


@contextlib.contextmanager
def _reuse_scan() -> Iterator[None]:
    """While :data:`REUSES` executes: a scan of its own folder (asked by its ``__init__.py``) is the one ``import
    transformers`` made or read; failing that, asked as that import asks (a ``Path`` of the folder: its cache key)."""
    found = _scanning()
    if found is None:
        yield
        return
    scan = found[0]

    def scan_folder(module_path):
        folder = _folder(module_path)
        if folder in _scans:
            return _scans[folder]
        return scan(Path(os.path.dirname(module_path)) if os.path.isfile(module_path) else module_path)

    with compat.replaced(SCAN, scan_folder):
        yield


def _cover(fullname: str) -> contextlib.AbstractContextManager:
    if fullname in DEFERRED:
        return _stand_in(*DEFERRED[fullname])
    return {KEEPS: _keep_scan, KEPT_UNTIL: _release_scan, REUSES: _reuse_scan}[fullname]()


class _Covering(importlib.abc.Loader):
    """The real loader of a covered module, run inside its cover (:func:`_cover`)."""

    def __init__(self, real: importlib.abc.Loader, fullname: str):
        self.real, self.fullname = real, fullname

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.real  # the module's own loader from here on
        with _cover(self.fullname):
            self.real.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in COVERED:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if all(k in sys.modules for k in COVERED if k != fullname):
            stop()  # every module it covers is found: out of every later import's way
        spec.loader = _Covering(spec.loader, fullname)
        return spec


_finder: _Finder | None = None


def start_up() -> None:
    """Cover :data:`COVERED` in this process (call once, first thing in the command, before transformers is
    imported; a module already imported is left as it is)."""
    global _finder
    if _finder is None and not all(k in sys.modules for k in COVERED):
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


def stop() -> None:
    """Take the finder out of ``sys.meta_path`` (a no-op when it is not there)."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
