"""What the console command's imports cost and a run never uses, saved: scipy's optimiser under transformers'
detection losses put off to its first call, and transformers' scan of its model folders done once, not twice.

Why: a small launch's start-up is imports (bench/README, "Session 16"), every rank's. Two shares of them compute
nothing an evaluation needs:

- ``transformers.modeling_utils`` imports its table of losses (``transformers.loss.loss_utils``), and three of the
  object-detection losses in it bind ``scipy.optimize.linear_sum_assignment`` at module level: 0.1-0.3 s per
  process on this project's 2-core VM (bench/README, "Session 18"), nothing else a run imports loads it. While
  ``transformers.loss.loss_utils`` executes, and only if nothing has imported ``scipy.optimize`` yet,
  ``sys.modules["scipy.optimize"]`` is a stand-in whose ``linear_sum_assignment`` imports the real module and
  calls the real function on its first call. Any other name asked of the stand-in (a release that imports more from
  it) imports the real module then and there and hands back the real attribute, so the deferral can be slower than
  planned but never wrong. Once that module has executed (or failed), the stand-in is taken out of ``sys.modules``.
- ``import transformers`` reads every file under ``transformers/models`` (``define_import_structure`` of the folder,
  0.25 s here) for its lazy table of names, and ``transformers.models``, imported by the auto classes, reads them
  all again: its ``__init__`` asks for the same folder by its ``__init__.py``, a different key of the same
  ``lru_cache`` (``create_import_structure_from_path(path)``, whose first step is ``dirname`` of a file). While that
  package executes, the function answers a file's path with its folder's, spelt as the first import spelt it (a
  ``Path``); a release that spells it otherwise scans again, as without the policy (bench/README, "Session 20").

Each is confined to the execution of the one module it covers (:data:`COVERED`), for the process's own command only
(:func:`start_up`, called beside :func:`mpitp.gcpolicy.start_up`): afterwards the module's loader is its own again,
what was replaced is put back, and the finder that did this leaves ``sys.meta_path`` once every covered module has
executed. All that stays is the forwarding function bound in transformers' loss modules and one more entry in
transformers' own cache. ``mpitp.compat`` lists both (kind ``defer`` and ``reuse``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpitp import compat

#: module whose execution the stand-in covers -> (the module put off, the names it forwards)
DEFERRED: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformers.loss.loss_utils": ("scipy.optimize", ("linear_sum_assignment",)),
}
#: the package whose execution scans its folder again -> the scanning function (its :mod:`mpitp.compat` target)
REUSED: dict[str, str] = {
    "transformers.models": "transformers.utils.import_utils.create_import_structure_from_path",
}
COVERED = (*DEFERRED, *REUSED)


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


@contextlib.contextmanager
def _folder_scanned_once(key: str) -> Iterator[None]:
    """The function ``key`` names (an ``lru_cache``-d scan of a folder, given the folder or a file in it) asked for a
    file's folder as a ``Path`` for the block: the key ``import transformers`` filled. Put back after."""
    target = compat.TARGETS[key]
    scan = getattr(sys.modules.get(target.module), target.attribute, None)
    if scan is None or not hasattr(scan, "cache_info"):  # not there, or no longer a cache: leave it alone
        yield
        return

    def scan_folder(module_path):
        return scan(Path(os.path.dirname(module_path)) if os.path.isfile(module_path) else module_path)

    with compat.replaced(key, scan_folder):
        yield


def _cover(fullname: str) -> contextlib.AbstractContextManager:
    if fullname in DEFERRED:
        return _stand_in(*DEFERRED[fullname])
    return _folder_scanned_once(REUSED[fullname])


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
