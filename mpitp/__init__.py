"""mpitp: lm-eval evaluation of Hugging Face models under MPI, tensor parallelism inside data-parallel groups.

The folders are the layers, lowest first; a module imports from its own layer and the ones below it, and
``tests/test_import_cycles.py`` fails on any import cycle:

- ``errors``, ``version``, ``testing`` (the one test seam), ``compat`` (every patch of lm-eval, transformers, torch);
- ``parallel``: the MPI world, object collectives with deadlines, the explicit dp x pp x tp ``Layout``, one torch
  world per model replica;
- ``replica``: TP/PP-sharded loading, vocab-parallel scoring, prefix sharing, the leader/worker protocol;
- ``results``: the HDF5 results file, its reader, comparisons and summaries; ``tasks``: offline tasks, the task index;
- ``evaluation``: lm-eval's requests sharded across the DP groups, the settings, one evaluation (``runner``) and
  ``mpitp.evaluate`` (``api``);
- ``jobs``: ``run_config`` (``orchestrate``: one evaluation or a sweep), sweeps, watches, job files, submission;
- ``cli``: the click commands, a thin layer over the rest.
"""

from mpitp.version import __version__  # noqa: F401 - mpitp.__version__


def evaluate(*args, **kwargs):
    """Evaluate a (possibly TP-sharded) model on lm-eval tasks from inside a running MPI job.

    Imported lazily so that ``import mpitp`` stays cheap (no torch/transformers import).
    See :func:`mpitp.evaluation.api.evaluate`.
    """
    from mpitp.evaluation.api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)
