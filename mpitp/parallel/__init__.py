"""The parallel world: MPI ranks, the dp x pp x tp layout, MPI collectives with deadlines, the torch world of one
model replica, devices and stop signals.

The package itself imports nothing: importing ``mpi4py.MPI`` initialises MPI, and the commands that never use it
(``inspect``, ``report``, ``check``, ``--help``) read :data:`DEFAULT_TIMEOUT` for their options without paying that."""

#: Seconds a rank waits for a peer's message by default (``--timeout``): an hour, long enough for any legitimate wait.
DEFAULT_TIMEOUT = 3600.0
