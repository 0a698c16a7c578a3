"""One evaluation run: checks, sharded loading, lm-eval on rank 0, dispatch, TP serving and the HDF5 file.

:func:`run_eval` is the single code path behind ``mpitp eval`` (and job files). Every rank calls it; roles follow
from the layout: global rank 0 runs lm-eval and the dispatcher, other DP leaders serve chunks, TP workers mirror
their leader's forwards.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from . import __version__
from . import comm as mpicomm
from .errors import UsageError
from .runtime import Runtime, agree

log = logging.getLogger("mpitp")


@dataclass
class EvalConfig:
    """Everything that defines an evaluation (lm-eval's vocabulary). Resume compares the ``identity`` part."""

    model: str | None = None
    tasks: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int = 1
    max_length: int | None = None
    gen_kwargs: str | None = None
    apply_chat_template: bool = False
    include_path: str | list[str] | None = None
    seed: int | None = None
    output: str | None = None
    overwrite: bool = False
    resume: bool = False
    log_samples: bool = False
    bootstrap_iters: int = 100000
    trust_remote_code: bool = False
    demo: bool = False

    def identity(self) -> dict:
        """The settings that determine results: a resumed run must match them exactly."""
        keys = ("model", "tokenizer", "revision", "dtype", "tasks", "num_fewshot", "limit", "max_length",
                "gen_kwargs", "apply_chat_template", "seed")
        return {k: getattr(self, k) for k in keys}


# ----------------------------------------------------------------------------------------------------- checks


def check_tasks(tasks: list[str], include_path: str | None):
    """Every task name must be known to lm-eval (with the extra include path); suggest close matches."""
    from lm_eval.tasks import TaskManager

    for path in [include_path] if isinstance(include_path, str) else include_path or []:
        if not os.path.isdir(path):
            raise UsageError(f"--include-path {path}: no such directory")
    if not tasks:
        raise UsageError("no tasks given: pass --tasks a,b (or --demo)")
    tm = TaskManager(include_path=include_path, verbosity="ERROR")
    known = set(tm.all_tasks)
    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, sorted(known), n=5, cutoff=0.6)
            hint = f"; did you mean: {', '.join(close)}?" if close else ""
            raise UsageError(f"unknown task '{t}'{hint}")
    return tm


def default_output(model: str) -> str:
    name = os.path.basename(os.path.normpath(model)) or "model"
    return os.path.join("results", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.h5")


def check_output(cfg: EvalConfig) -> str:
    """Resolve the output path; refuse to overwrite silently and fail early when it cannot be written."""
    out = cfg.output or default_output(cfg.model)
    if cfg.resume and cfg.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: pick one")
    if os.path.exists(out):
        if not (cfg.resume or cfg.overwrite):
            raise UsageError(f"output {out} already exists: pass --resume to continue it or --overwrite to replace it")
        if os.path.isdir(out):
            raise UsageError(f"output {out} is a directory")
    elif cfg.resume:
        log.info("--resume: %s does not exist yet, starting a new run", out)
    d = os.path.dirname(os.path.abspath(out))
    probe_dir = d
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not os.access(probe_dir, os.W_OK):
        raise UsageError(f"cannot write output {out}: {probe_dir} is not writable")
    return out


def _check_all(cfg: EvalConfig, tp: int) -> tuple[str, str]:
    from .model import check_dtype, check_tp, load_config

    if cfg.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.limit is not None and not cfg.limit > 0:
        raise UsageError(f"--limit must be > 0, got {cfg.limit:g}")
    check_dtype(cfg.dtype)
    check_tasks(cfg.tasks, cfg.include_path)
    config = load_config(cfg.model, cfg.revision, cfg.trust_remote_code)
    check_tp(config, tp)
    out = check_output(cfg)
    return out, cfg.tokenizer or cfg.model


# ----------------------------------------------------------------------------------------------------- run


def _metadata(cfg: EvalConfig, rt: Runtime, tokenizer: str) -> dict:
    import lm_eval
    import torch
    import transformers

    from .world import mpi_library_version

    return dict(mpitp_version=__version__, model=cfg.model, tokenizer=tokenizer, dtype=cfg.dtype,
                world_size=rt.world.size, tp=rt.layout.tp, dp=rt.layout.dp, command=" ".join(sys.argv),
                lm_eval_version=getattr(lm_eval, "__version__", "unknown"), torch_version=torch.__version__,
                transformers_version=transformers.__version__, mpi_version=mpi_library_version(),
                config_json=json.dumps(cfg.identity(), sort_keys=True))


def _request_row(inst, result, kind: str) -> dict:
    from .lm import KIND_GENERATE, args_hash

    if kind == KIND_GENERATE:
        text, n = result
        ll, greedy = math.nan, False
    else:
        ll, greedy, n = result
        text = ""
    return dict(doc_id=int(inst.doc_id), idx=int(inst.idx), kind=kind, loglikelihood=float(ll),
                is_greedy=bool(greedy), generation=text, n_tokens=int(n), args_hash=args_hash(inst.args))


class _Progress:
    """One tqdm bar on rank 0 across all DP groups."""

    def __init__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=0, desc="mpitp", unit="req", dynamic_ncols=True, file=sys.stderr)
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add_total(self, n: int) -> None:
        self.bar.total = (self.bar.total or 0) + n
        self.bar.refresh()

    def __call__(self, n: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens / max(1e-9, time.perf_counter() - self.t0):.0f} tok/s",
                                 refresh=False)
        self.bar.update(n)

    def close(self):
        self.bar.close()


def run_eval(cfg: EvalConfig, rt: Runtime) -> dict | None:
    """Evaluate ``cfg`` on the runtime ``rt``. Returns lm-eval's results dict on rank 0, None elsewhere."""
    from .dispatch import Dispatcher, serve_remote
    from .engine import Stats, TPEngine
    from .model import load_model

    t_start = time.perf_counter()
    lay = rt.layout
    out, tokenizer = agree(lambda: _check_all(cfg, lay.tp), rt.world.comm, rt.timeout, "checking input")
    model = load_model(cfg.model, lay.tp, rt.device, cfg.dtype, cfg.revision, cfg.trust_remote_code)
    stats = Stats()
    engine = TPEngine(model, lay, rt.device, rt.timeout, lay.tp, stats)
    mpicomm.barrier(rt.world.comm, rt.timeout, phase="model loading")

    results = None
    if not lay.is_leader:
        engine.serve()
    else:
        from .lm import MPITPLM

        lm = MPITPLM(model, tokenizer, engine, batch_size=cfg.batch_size, max_length=cfg.max_length,
                     trust_remote_code=cfg.trust_remote_code)
        try:
            if lay.is_root:
                results = _run_root(cfg, rt, lm, out, tokenizer, stats, t_start, Dispatcher)
            else:
                serve_remote(lay, lm.compute, rt.timeout)
        finally:
            engine.stop()
        all_stats = mpicomm.gather_obj(stats.as_dict(), lay.dp_leader_comm, root=0, timeout=rt.timeout,
                                       phase="gathering stats")
        if lay.is_root:
            _finish_root(results, all_stats)
    mpicomm.barrier(rt.world.comm, rt.timeout, phase="end of evaluation")
    return results["results"] if results else None


def _run_root(cfg, rt, lm, out, tokenizer, stats, t_start, Dispatcher):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .results import ResultWriter

    writer = ResultWriter(out, _metadata(cfg, rt, tokenizer), mode="w")
    progress = _Progress()
    dispatcher = Dispatcher(rt.layout, lm.compute, rt.timeout, stats, progress=progress)

    def runner(kind, items, weights, instances):
        progress.add_total(len(items))

        def on_chunk(indices, res):
            by_task: dict[str, list] = {}
            for i, r in zip(indices, res):
                inst = instances[i]
                by_task.setdefault(inst.task_name, []).append(_request_row(inst, r, kind))
            for task, rows in by_task.items():
                writer.append(task, rows)

        return dispatcher.run(kind, items, weights, on_chunk)

    lm.runner = runner
    seeds = {} if cfg.seed is None else dict(random_seed=cfg.seed, numpy_random_seed=cfg.seed,
                                             torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    try:
        res = lm_eval.simple_evaluate(
            model=lm, tasks=cfg.tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit, gen_kwargs=cfg.gen_kwargs,
            apply_chat_template=cfg.apply_chat_template, log_samples=cfg.log_samples,
            bootstrap_iters=cfg.bootstrap_iters, task_manager=TaskManager(include_path=cfg.include_path,
                                                                           verbosity="ERROR"), **seeds)
    finally:
        progress.close()
        dispatcher.shutdown()
    return {"results": res, "writer": writer, "t_start": t_start}


def _finish_root(state, all_stats) -> None:
    from lm_eval.utils import make_table

    res, writer = state["results"], state["writer"]
    try:
        for task, cfgd in res.get("configs", {}).items():
            metrics = {k: v for k, v in res["results"].get(task, {}).items() if k != "alias"}
            n = res.get("n-samples", {}).get(task, {})
            writer.write_task(task, dict(output_type=cfgd.get("output_type"),
                                         num_fewshot=res.get("n-shot", {}).get(task, 0),
                                         n_docs=n.get("effective", n.get("original", 0))), metrics)
        writer.write_stats(all_stats)
        serialisable = {k: res[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better",
                                            "n-samples", "config", "groups", "group_subtasks") if k in res}
        writer.finish(serialisable, time.perf_counter() - state["t_start"])
    finally:
        writer.close()
    print(make_table(res))
    total_busy = sum(s["busy_s"] for s in all_stats)
    for g, s in enumerate(all_stats):
        print(f"DP group {g}: {s['requests']} requests, {s['tokens_scored']} tokens scored, "
              f"{s['tokens_generated']} generated, busy {s['busy_s']:.1f} s, TP traffic {s['tp_bytes'] / 1e6:.2f} MB")
    print(f"wall {time.perf_counter() - state['t_start']:.1f} s, busy {total_busy:.1f} s over {len(all_stats)} "
          f"group(s); results: {writer.path}")
