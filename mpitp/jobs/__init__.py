"""Jobs: job files, campaigns (sweeps), watching checkpoints, scheduler submission and its templates; whether a job
will run offline (``readiness``: ``mpitp check``, run before ``submit`` queues it) and fetching what it lacks
(``prefetch``)."""
