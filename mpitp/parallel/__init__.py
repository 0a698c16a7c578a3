"""The parallel world: MPI ranks, the dp x pp x tp layout, MPI collectives with deadlines, the torch world of one
model replica, devices and stop signals.

The package itself imports nothing: importing ``mpi4py.MPI`` initialises MPI, and the commands that never use it
(``inspect``, ``report``, ``check``, ``--help``) read :data:`DEFAULT_TIMEOUT` for their options without paying that."""

#: Seconds a rank waits for a peer's message by default (``--timeout``): an hour, long enough for any legitimate wait.
DEFAULT_TIMEOUT = 3600.0


def check_ep(ep: int, tp: int) -> None:
    """``--ep`` spreads each layer's experts over a TP group's ranks (transformers' expert-parallel plan needs
    ep = tp): 1 or tp, else a :class:`~mpitp.errors.UsageError`. Here, MPI-free, for ``mpitp eval``'s launch and
    ``mpitp check``'s job runs alike."""
    if ep not in (1, tp):
        from mpitp.errors import UsageError

        raise UsageError(f"ep={ep}: the experts are spread over a TP group's ranks, so ep must be 1 or tp ({tp})")
