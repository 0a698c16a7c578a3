"""mpitp: lm-eval evaluation of Hugging Face models under MPI, tensor parallelism inside data-parallel groups.

The public Python API is the four names below; every other module may move between releases (the folders are the
layers: ARCHITECTURE.md, "Layers", kept true by ``tests/test_layers.py``):

- :func:`mpitp.start`: the runtime of this rank (MPI world, dp x pp x tp layout, device, one torch world per model
  replica). Collective. (:func:`mpitp.parallel.runtime.start`)
- :func:`mpitp.load_model`: this rank's part of a transformers checkpoint, whole at tp=1, else sharded by
  transformers' TP plan. (:func:`mpitp.replica.loading.load_model`)
- :func:`mpitp.evaluate`: lm-eval numbers for a live, already-sharded model, from inside a running MPI job; the same
  code path as ``mpitp eval``. Collective. (:func:`mpitp.evaluation.api.evaluate`)
- :class:`mpitp.UsageError`: what :func:`mpitp.evaluate` raises on every rank for bad settings (README, "Python API"),
  so a training script can catch it by a name that stays. (:class:`mpitp.errors.UsageError`)

They are imported on first use, so ``import mpitp`` (and with it ``mpitp --help`` and every ``mpitp.*`` import)
costs no torch, transformers, lm-eval or MPI start-up.
"""

from mpitp.version import __version__

__all__ = ["UsageError", "__version__", "evaluate", "load_model", "start"]


def __getattr__(name: str):
    """The public functions, imported on first access (PEP 562) and then kept as ordinary module attributes.

    Explicit imports, not a table of strings: the import graph (``tests/support/imports.py``) sees them.
    """
    if name == "evaluate":
        from mpitp.evaluation.api import evaluate as value
    elif name == "load_model":
        from mpitp.replica.loading import load_model as value
    elif name == "start":
        from mpitp.parallel.runtime import start as value
    elif name == "UsageError":
        from mpitp.errors import UsageError as value
    else:
        raise AttributeError(f"module 'mpitp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
