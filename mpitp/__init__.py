"""mpitp: lm-eval evaluation of Hugging Face models under MPI, tensor parallelism inside data-parallel groups.

The package is layered; each layer only imports the ones above it in this list:

- ``world``, ``comm``, ``errors``: the MPI process world, object collectives with deadlines, failure containment.
- ``layout``: the explicit dp x pp x tp layout object (no global process-group state anywhere).
- ``parallel.replica_group``: one torch.distributed world per model replica, brokered over MPI.
- ``replica``: TP/PP-sharded loading, vocab-parallel scoring, the leader/worker protocol.
- ``dispatch``, ``lm``: lm-eval requests sharded across DP groups.
- ``results``, ``evaluate``, ``cli``: HDF5 results, the public entry points.
"""

__version__ = "0.1.0"


def evaluate(*args, **kwargs):
    """Evaluate a (possibly TP-sharded) model on lm-eval tasks from inside a running MPI job.

    Imported lazily so that ``import mpitp`` stays cheap (no torch/transformers import).
    See :func:`mpitp.evaluation.api.evaluate`.
    """
    from mpitp.evaluation.api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)
