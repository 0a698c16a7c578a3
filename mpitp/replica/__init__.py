"""One model replica: loading and sharding, pipeline stages, vocab-parallel scoring, and the leader/worker protocol
that drives it.

Read in this order: :mod:`~mpitp.replica.shard` (what every rank of a replica runs for one forward),
:mod:`~mpitp.replica.protocol` (the leader's messages), :mod:`~mpitp.replica.leader` and
:mod:`~mpitp.replica.worker` (the two sides), :mod:`~mpitp.replica.generation` (the state of one ``generate`` call on
both sides), :mod:`~mpitp.replica.scoring` (the vocab-parallel head).
"""
