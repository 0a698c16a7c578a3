"""The evaluation: settings, checks, the lm-eval LM that rank 0 hands to lm-eval, dispatch of requests to DP groups,
the runner and the Python API."""
