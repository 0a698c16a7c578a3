"""One path from settings to results: :func:`run_config`, used by ``mpitp eval`` and by every run of ``mpitp run``.

The built-in demo is filled in, a ``--model`` that names several checkpoints (a glob or a comma list) becomes a sweep
(:mod:`mpitp.jobs.sweep`), a ``--peft`` that names several adapters one over a single base load
(:mod:`mpitp.jobs.adapter_sweep`), and anything else is one evaluation (:func:`mpitp.evaluation.runner.run_eval`). The
command line (:mod:`mpitp.cli`) imports this module, never the reverse.
"""

from __future__ import annotations

import os

from mpitp.errors import UsageError


def demo_config(cfg, rt):
    """Fill in the built-in demo: rank 0 builds (or reuses) the tiny model, every rank then reads it."""
    from mpitp.parallel import comm as mpicomm
    from mpitp.tasks.demo import prepare_demo

    paths = None
    if rt.world.rank == 0:
        paths = prepare_demo()
    model_dir, include_path, tasks = mpicomm.bcast_obj(paths, rt.world.comm, timeout=rt.timeout,
                                                       phase="demo preparation")
    cfg.model = cfg.model or model_dir
    cfg.include_path = [include_path, cfg.include_path] if cfg.include_path else include_path
    cfg.tasks = cfg.tasks or list(tasks)
    if cfg.model_args is not None:
        cfg.model_args.setdefault("pretrained", cfg.model)
    return cfg


def run_config(cfg, rt) -> int:
    """Every rank calls it with the same settings. Exit status: 1 when a checkpoint of a sweep failed, else 0 (bad
    input raises :class:`UsageError`)."""
    from mpitp.evaluation.runner import run_eval
    from mpitp.jobs.adapter_sweep import check_one_kind, run_adapter_sweep
    from mpitp.jobs.sweep import is_sweep, run_sweep

    if cfg.demo:
        cfg = demo_config(cfg, rt)
    if not cfg.model:
        raise UsageError("no model given: pass --model hf --model_args pretrained=PATH_OR_ID, --model PATH "
                         "(or --demo)", collective=True)
    check_one_kind(cfg.model, cfg.peft, collective=True)  # every rank sees the same settings
    if is_sweep(cfg.peft):
        return run_adapter_sweep(cfg, rt)
    if is_sweep(cfg.model):
        return run_sweep(cfg, rt)
    if cfg.output is None:
        cfg.output = default_output(cfg)
    run_eval(cfg, rt)
    return 0


def default_output(cfg) -> str | None:
    """The HDF5 file's place: ``--use_cache PATH`` is mpitp's request store (``PATH.h5``, resumed when it exists);
    with ``--output_path`` the file goes beside lm-eval's; otherwise the checks pick results/<model>-<time>.h5."""
    if cfg.use_cache:
        cfg.resume = True
        return cfg.use_cache if cfg.use_cache.endswith((".h5", ".hdf5")) else f"{cfg.use_cache}.h5" if not \
            os.path.isdir(cfg.use_cache) else os.path.join(cfg.use_cache, "mpitp-cache.h5")
    if cfg.output_path:
        from mpitp.evaluation.outputs import hdf5_beside

        return hdf5_beside(cfg.output_path, cfg.model_args or {}, cfg.model)
    return None
