"""One model replica: loading and sharding, pipeline stages, vocab-parallel scoring, and the leader/worker protocol that drives it."""
