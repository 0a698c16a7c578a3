"""Imports a run never uses, put off until their first use: scipy's optimiser under transformers' detection losses.

Why: ``transformers.modeling_utils`` imports its table of losses (``transformers.loss.loss_utils``), and three of the
object-detection losses in it bind ``scipy.optimize.linear_sum_assignment`` at module level. Importing
``scipy.optimize`` costs every process 0.1-0.3 s on this project's 2-core VM (importing the modules a run needs:
3.25-3.49 s with it, 3.13-3.18 s without; bench/README, "Session 18"), the largest share of a small launch's
start-up that nothing in an evaluation of a language model calls; nothing else a run imports loads it.

So, for the process's own command only (:func:`start_up`, called beside :func:`mpitp.gcpolicy.start_up`), while
``transformers.loss.loss_utils`` executes, and only if nothing has imported ``scipy.optimize`` yet,
``sys.modules["scipy.optimize"]`` is a stand-in whose ``linear_sum_assignment`` imports the real module and calls
the real function on its first call. Any other name asked of the stand-in (a release that imports more from it)
imports the real module then and there and hands back the real attribute, so the deferral can be slower than
planned but never wrong. Once that module has executed (or failed), the stand-in is taken out of ``sys.modules``
(a later ``import scipy.optimize`` gets the real one), the module's loader is its own again and the finder that did
this leaves ``sys.meta_path``: all that stays is the forwarding function bound in transformers' loss modules.
``mpitp.compat`` lists it (kind ``defer``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import types
from typing import Any

#: module whose execution the stand-in covers -> (the module put off, the names it forwards)
DEFERRED: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformers.loss.loss_utils": ("scipy.optimize", ("linear_sum_assignment",)),
}


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


class _Covering(importlib.abc.Loader):
    """The real loader of a :data:`DEFERRED` module, run with the stand-in in place."""

    def __init__(self, real: importlib.abc.Loader, deferred: str, names: tuple[str, ...]):
        self.real, self.deferred, self.names = real, deferred, names

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.real  # the module's own loader from here on
        if self.deferred in sys.modules:  # already imported, by whoever: nothing to put off
            self.real.exec_module(module)
            return
        stand_in = _StandIn(self.deferred, self.names)
        sys.modules[self.deferred] = stand_in
        try:
            self.real.exec_module(module)
        finally:
            if sys.modules.get(self.deferred) is stand_in:
                del sys.modules[self.deferred]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in DEFERRED:
            return None
        deferred, names = DEFERRED[fullname]
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if all(k in sys.modules for k in DEFERRED if k != fullname):
            stop()  # every module it covers is found: out of every later import's way
        spec.loader = _Covering(spec.loader, deferred, names)
        return spec


_finder: _Finder | None = None


def start_up() -> None:
    """Put :data:`DEFERRED` off in this process (call once, first thing in the command, before transformers is
    imported; a module already imported is left as it is)."""
    global _finder
    if _finder is None and not all(k in sys.modules for k in DEFERRED):
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


def stop() -> None:
    """Take the finder out of ``sys.meta_path`` (a no-op when it is not there)."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
