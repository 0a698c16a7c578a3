"""lm-eval's own outputs on rank 0: ``--output_path`` files through its ``EvaluationTracker``, ``--wandb_args`` through
its ``WandbLogger``, ``--show_config``, its header line and tables: what ``lm_eval``'s ``run`` command does after
``simple_evaluate`` (``lm_eval/_cli/run.py``), in the same order, so the files have its names, layout and keys.

The results dict differs from a single-process ``lm_eval --model hf`` run only where mpitp ran differently, and
:func:`as_lm_eval_ran` puts back what lm-eval would record: the backend name it was given (``hf``, not the model
path that ``simple_evaluate`` records for a pre-built model), the full parameter count (a TP rank holds a shard),
the batch size as typed and the ``--use_cache`` path; and each task's metadata as the run's own settings have it (a
sweep loads its tasks once: they hold the first checkpoint's ``pretrained``).
"""

from __future__ import annotations

import copy
import json
import logging
from typing import TYPE_CHECKING

from mpitp import compat

if TYPE_CHECKING:
    from lm_eval.loggers import EvaluationTracker

    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.layout import Layout

log = logging.getLogger("mpitp")


def start_loggers(cfg: EvalConfig, t_start: float | None = None) -> dict:
    """Rank 0, before the evaluation (as lm-eval): the tracker, and the W&B / Trackio runs when asked for.

    ``lm_eval`` makes its tracker before it loads the model, so its ``total_evaluation_time_seconds`` covers loading,
    tasks, requests and metrics. mpitp makes it once the replicas are loaded: its clock is set back to ``t_start``
    (``time.perf_counter()`` at the run's start, as the results file's wall time), else the field read the dispatch
    and metrics only (0.3 s of a 19.5 s run).
    """
    from lm_eval.loggers import EvaluationTracker

    hub = dict(cfg.hf_hub_log_args or {})
    if cfg.output_path:
        hub["output_path"] = cfg.output_path
    tracker = EvaluationTracker(**hub)
    if t_start is not None:
        tracker.general_config_tracker.start_time = t_start
    wandb_logger = trackio_logger = None
    if cfg.wandb_args:
        from lm_eval.loggers import WandbLogger

        wandb_logger = WandbLogger(cfg.wandb_args, cfg.wandb_config_args or {})
    if cfg.trackio_args:
        from lm_eval.loggers import TrackioLogger

        trackio_logger = TrackioLogger(cfg.trackio_args)
    return dict(tracker=tracker, wandb=wandb_logger, trackio=trackio_logger)


def as_lm_eval_ran(results: dict, cfg: EvalConfig, *, num_parameters: int | None, device: str,
                   loggers: dict | None) -> None:
    """Record the run as ``lm_eval --model hf`` records it (see the module docstring). In place."""
    for task_config in results.get("configs", {}).values():  # a sweep's tasks, loaded once, hold its first item's
        meta = task_config.get("metadata") if isinstance(task_config, dict) else None
        if isinstance(meta, dict) and cfg.metadata:
            meta.update({k: v for k, v in cfg.metadata.items() if k in meta})
    conf = results.get("config")
    if conf is None:
        return
    conf["model"] = cfg.model_source
    if num_parameters is not None:
        conf["model_num_parameters"] = num_parameters
    conf["batch_size"] = cfg.batch_size
    conf["device"] = device
    conf["use_cache"] = cfg.use_cache
    if loggers and loggers.get("tracker") is not None:
        loggers["tracker"].general_config_tracker.model_source = cfg.model_source


def write_lm_eval_outputs(results: dict, cfg: EvalConfig, loggers: dict) -> None:
    """What lm-eval's ``run`` does with the results: show the config, log to W&B / Trackio, write the files."""
    from lm_eval.utils import handle_non_serializable

    results = copy.copy(results)  # the caller keeps its samples (the HDF5 file has them too)
    samples = results.pop("samples", None) if cfg.log_samples else None
    if samples is not None:
        samples = copy.deepcopy(samples)  # the tracker rewrites each sample's fields as it saves them
    if cfg.show_config:
        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    for name in ("wandb", "trackio"):
        logger = loggers.get(name)
        if logger is None:
            continue
        try:
            logger.post_init(results)
            logger.log_eval_result()
            if cfg.log_samples:
                logger.log_eval_samples(samples)
        except Exception as exc:  # noqa: BLE001 - lm-eval logs and goes on, so does mpitp
            log.warning("logging to %s failed: %s", "W&B" if name == "wandb" else "Trackio", exc)
    tracker = loggers["tracker"]
    tracker.save_results_aggregated(results=results, samples=samples)
    if cfg.log_samples:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    if cfg.output_path:
        log.info("lm-eval files: %s", output_dir(cfg.output_path, tracker))


def finish_loggers(loggers: dict) -> None:
    if loggers.get("wandb") is not None:
        loggers["wandb"].run.finish()
    if loggers.get("trackio") is not None:
        loggers["trackio"].finish()


def output_dir(output_path: str, tracker: EvaluationTracker) -> str:
    """Where lm-eval's tracker writes for ``output_path``: ``<path>/<model>/``, or the parent of a ``.json`` path."""
    from pathlib import Path

    path = Path(output_path)
    if path.suffix == ".json":
        return str(path.parent)
    return str(path / str(tracker.general_config_tracker.model_name_sanitized))


def hdf5_beside(output_path: str, model_args: dict, model: str) -> str:
    """The HDF5 file's default place with ``--output_path``: in the folder lm-eval writes to, one per run."""
    import time
    from pathlib import Path

    from lm_eval.utils import sanitize_model_name

    stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    path = Path(output_path)
    if path.suffix == ".json":
        return str(path.with_name(f"{path.stem}_{stamp}.h5"))
    model_name = compat.attribute("lm_eval.loggers.evaluation_tracker.GeneralConfigTracker._get_model_name")
    name = model_name(model_args) or model
    return str(path / sanitize_model_name(name) / f"results_{stamp}.h5")


def header_line(cfg: EvalConfig, results: dict) -> str:
    """lm-eval's line above the table: ``hf (pretrained=...), gen_kwargs: (...), limit: ..., batch_size: ...``."""
    args = dict(cfg.model_args or {})
    args.pop("trust_remote_code", None)
    sizes = ",".join(map(str, results.get("config", {}).get("batch_sizes", [])))
    limit = cfg.limit if cfg.limit is None else float(cfg.limit)
    return (f"{cfg.model_source} ({args}), gen_kwargs: ({cfg.gen_kwargs or {}}), limit: {limit}, "
            f"num_fewshot: {cfg.num_fewshot}, batch_size: {cfg.batch_size}{f' ({sizes})' if sizes else ''}")


def full_num_parameters(cfg: EvalConfig, layout: Layout) -> int | None:
    """The whole model's parameter count (what lm-eval records) when this rank holds only a TP shard or a stage:
    counted on a meta-device copy built from the config, so nothing is allocated. None when the rank has it all."""
    if layout.tp == 1 and layout.pp == 1:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from mpitp.replica.loading import load_config  # a torch DCP checkpoint's config is in its --hf-assets

    conf = load_config(cfg.model, cfg.revision, cfg.trust_remote_code, cfg.hf_assets)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, trust_remote_code=cfg.trust_remote_code)
    return model.num_parameters()
