"""Jobs: job files, campaigns (sweeps), watching checkpoints, scheduler submission and its templates."""
