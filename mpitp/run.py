"""One evaluation run: checks, sharded loading, lm-eval on rank 0, dispatch, TP serving and the HDF5 file.

:func:`run_eval` is the single code path behind ``mpitp eval`` (and job files). Every rank calls it; roles follow
from the layout: global rank 0 runs lm-eval and the dispatcher, other DP leaders serve chunks, TP workers mirror
their leader's forwards.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field

from . import __version__
from . import comm as mpicomm
from .checks import _check_all, _remove_generated, check_tasks, offline_include
from .dispatch import stall_hook
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
    data_dir: str | None = None
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
                "gen_kwargs", "apply_chat_template", "seed", "data_dir")
        return {k: getattr(self, k) for k in keys}


# ----------------------------------------------------------------------------------------------------- run


def _metadata(cfg: EvalConfig, rt: Runtime, tokenizer: str) -> dict:
    import lm_eval
    import torch
    import transformers

    from .world import mpi_library_version

    return dict(mpitp_version=__version__, model=cfg.model, tokenizer=tokenizer, dtype=cfg.dtype,
                world_size=rt.world.size, tp=rt.layout.tp, dp=rt.layout.dp, pp=rt.layout.pp,
                command=" ".join(sys.argv),
                lm_eval_version=getattr(lm_eval, "__version__", "unknown"), torch_version=torch.__version__,
                transformers_version=transformers.__version__, mpi_version=mpi_library_version(),
                config_json=json.dumps(cfg.identity(), sort_keys=True), **_extra_metadata(cfg))


def _extra_metadata(cfg: EvalConfig) -> dict:
    """What is on disk (weights, tokenizer, library versions: the rest of the resume identity, see
    :mod:`mpitp.fingerprint`) and the whole configuration (so ``mpitp rescore`` can rebuild the tasks: include
    paths, data directory, bootstrap iterations)."""
    from dataclasses import asdict

    from .fingerprint import record

    return dict(fingerprint_json=json.dumps(record(cfg.model, cfg.tokenizer, cfg.revision), sort_keys=True),
                eval_config_json=json.dumps(asdict(cfg), default=str, sort_keys=True))


def _resume_key(inst) -> tuple:
    from .lm import args_hash

    return (inst.task_name, int(inst.doc_id), int(inst.idx), args_hash(inst.args))


def _result_from_row(row: dict, kind: str):
    from .lm import KIND_GENERATE

    if kind == KIND_GENERATE:
        return (row["generation"], int(row["n_tokens"]))
    return (float(row["loglikelihood"]), bool(row["is_greedy"]), int(row["n_tokens"]))


def _request_row(inst, result, kind: str) -> dict:
    from .lm import KIND_GENERATE, args_hash

    if kind == KIND_GENERATE:
        text, n = result
        ll, greedy = math.nan, False
    else:
        ll, greedy, n = result
        text = ""
    # Generated text can hold lone surrogates (byte-level tokens decoded mid-character); HDF5 stores UTF-8.
    text = text.encode("utf-8", "replace").decode("utf-8")
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
    """``mpitp eval``: check the input, load the model TP-sharded, evaluate. lm-eval's results on rank 0 only."""
    from .model import load_model

    t_start = time.perf_counter()
    keep: dict = {}  # rank 0's TaskManager: built once while checking, used by lm-eval
    lay = rt.layout
    out, tokenizer = agree(lambda: _check_all(cfg, lay.tp, keep, lay.pp), rt.world.comm, rt.timeout,
                           "checking input")
    if lay.pp > 1:
        from .pipeline import describe_split, load_stage, num_layers

        model = load_stage(cfg.model, lay.tp, lay.pp, lay.pp_rank, cfg.dtype, cfg.revision, cfg.trust_remote_code)
        if lay.is_root:
            log.info("pipeline: %s", describe_split(num_layers(keep["config"]), lay.pp))
    else:
        model = load_model(cfg.model, lay.tp, rt.device, cfg.dtype, cfg.revision, cfg.trust_remote_code)
    mpicomm.barrier(rt.world.comm, rt.timeout, phase="model loading")
    try:
        return evaluate_loaded(model, tokenizer, cfg, rt, out=out, task_manager=keep.get("task_manager"),
                               t_start=t_start)
    finally:
        _remove_generated(keep.get("include"))


def evaluate_loaded(model, tokenizer, cfg: EvalConfig, rt: Runtime, *, out: str | None,
                    task_manager=None, extra_lm_eval: dict | None = None, t_start: float | None = None,
                    encode_cache: dict | None = None):
    """The one evaluation path (CLI, job files and :func:`mpitp.evaluate`) for a model already on this rank.

    Every rank of ``rt`` calls it; roles follow from the layout: global rank 0 runs lm-eval and the dispatcher,
    other DP leaders serve chunks, TP workers mirror their leader's forwards. ``out=None`` writes no file.
    """
    from .dispatch import Dispatcher, serve_remote
    from .engine import Stats, TPEngine

    t_start = time.perf_counter() if t_start is None else t_start
    lay = rt.layout
    group = rt.tp_group.group if rt.tp_group is not None else None
    stats = Stats()
    engine = TPEngine(model, lay, rt.device, rt.timeout, lay.tp, stats, group=group)
    state = None
    if not lay.is_leader:
        engine.serve()
        _merge_stage_stats(stats, lay, rt.timeout)
    else:
        from .lm import MPITPLM

        lm = MPITPLM(model, tokenizer, engine, batch_size=cfg.batch_size, max_length=cfg.max_length,
                     trust_remote_code=cfg.trust_remote_code)
        lm.encode_cache = encode_cache  # token ids shared by a sweep's checkpoints with one tokenizer
        try:
            if lay.is_root:
                tm = task_manager or task_manager_for(cfg)
                state = _run_root(cfg, rt, lm, out, stats, Dispatcher, tm, extra_lm_eval or {})
            else:
                serve_remote(lay, lm.compute, rt.timeout, stats)
        finally:
            engine.stop()
        _merge_stage_stats(stats, lay, rt.timeout)
        all_stats = mpicomm.gather_obj(stats.as_dict(), lay.dp_leader_comm, root=0, timeout=rt.timeout,
                                       phase="gathering stats")
        if lay.is_root:
            _finish_root(state, all_stats, time.perf_counter() - t_start)
    mpicomm.barrier(rt.world.comm, rt.timeout, phase="end of evaluation")
    return state["results"] if state else None


def _merge_stage_stats(stats, lay, timeout: float) -> None:
    """With pipeline stages the scoring reductions happen on the last stage: the leader takes its TP rank 0's
    ``tp_score`` counter, and the activations every rank of the replica sent (``pp``), so /stats shows both."""
    if lay.pp == 1:
        return
    parts = mpicomm.gather_obj((stats.tp_score.bytes, stats.tp_score.calls, stats.pp.bytes, stats.pp.calls),
                               lay.replica_comm, root=0, timeout=timeout, phase="gathering stage stats")
    if parts is not None:
        last = parts[lay.last_stage_leader]
        stats.tp_score.bytes, stats.tp_score.calls = last[0], last[1]
        stats.pp.bytes = sum(p[2] for p in parts)
        stats.pp.calls = sum(p[3] for p in parts)


def task_manager_for(cfg: EvalConfig):
    """Check the tasks and build lm-eval's TaskManager (rank 0), for callers that skipped :func:`_check_all`."""
    return check_tasks(cfg.tasks, offline_include(cfg))


def _run_windows(dispatcher, progress, docs: list[list], record) -> list:
    """Rolling requests dispatched window by window (see :data:`mpitp.lm.KIND_WINDOW`); a request's result is
    recorded (``record(indices, results)``) and counted on the progress bar as soon as its last window lands, so a
    crash still loses at most the chunks in flight and the bar counts requests, as for the other kinds."""
    from .lm import KIND_WINDOW, combine_windows

    windows, owner, slot = [], [], []
    for j, rows in enumerate(docs):
        for k, row in enumerate(rows):
            windows.append((row, 1.0 / len(rows)))
            owner.append(j)
            slot.append(k)
    weights = [len(row[0]) for row, _ in windows]
    parts = [[None] * len(rows) for rows in docs]
    left = [len(rows) for rows in docs]
    results: list = [None] * len(docs)
    progress.add_total(len(docs))
    empty = [j for j, n in enumerate(left) if n == 0]  # nothing to score (an empty document): lm-eval's 0.0
    for j in empty:
        results[j] = combine_windows([])
    if empty:
        record(empty, [results[j] for j in empty])
        progress(len(empty), 0)

    def on_windows(indices, res):
        finished = []
        for w, r in zip(indices, res):
            j = owner[w]
            parts[j][slot[w]] = r
            left[j] -= 1
            if left[j] == 0:
                results[j] = combine_windows(parts[j])
                finished.append(j)
        if finished:
            record(finished, [results[j] for j in finished])
        progress(len(finished), sum(weights[w] for w in indices))

    dispatcher.run(KIND_WINDOW, windows, weights, on_windows)
    return results


def _run_root(cfg, rt, lm, out, stats, Dispatcher, tm, extra: dict):
    import lm_eval

    from .lm import KIND_ROLLING
    from .results import ResultWriter

    tokenizer_name = getattr(lm.tokenizer, "name_or_path", str(cfg.tokenizer))
    writer = ResultWriter(out, _metadata(cfg, rt, tokenizer_name), resume=cfg.resume) if out else None
    stored = writer.stored_rows() if (writer and cfg.resume) else {}
    progress = _Progress()
    dispatcher = Dispatcher(rt.layout, lm.compute, rt.timeout, stats, batch_size=cfg.batch_size)

    def runner(kind, items, weights, instances):
        """Reuse stored results (resume), compute the rest across DP groups, record each chunk as it lands."""
        keys = [_resume_key(inst) for inst in instances]
        results: list = [None] * len(items)
        todo = []
        for i, key in enumerate(keys):
            row = stored.get(key)
            if row is not None and row["kind"] == kind:
                results[i] = _result_from_row(row, kind)
            else:
                todo.append(i)
        if len(todo) < len(items):
            log.info("resume: reusing %d of %d %s results from %s", len(items) - len(todo), len(items), kind, out)

        def record(indices, res):
            """Store the rows of requests whose results are complete (``indices`` into ``todo``)."""
            if writer is None:
                return
            by_task: dict[str, list] = {}
            for i, r in zip(indices, res):
                inst = instances[todo[i]]
                by_task.setdefault(inst.task_name, []).append(_request_row(inst, r, kind))
            for task, rows in by_task.items():
                writer.append(task, rows)

        if kind == KIND_ROLLING:
            computed = _run_windows(dispatcher, progress, [items[i] for i in todo], record)
        else:
            todo_weights = [weights[i] for i in todo]

            def on_chunk(indices, res):
                record(indices, res)
                progress(len(indices), sum(todo_weights[i] for i in indices))

            progress.add_total(len(todo))
            computed = dispatcher.run(kind, [items[i] for i in todo], todo_weights, on_chunk)
        for i, r in zip(todo, computed):
            results[i] = r
        return results

    lm.runner = runner
    seeds = {} if cfg.seed is None else dict(random_seed=cfg.seed, numpy_random_seed=cfg.seed,
                                             torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    kwargs = dict(num_fewshot=cfg.num_fewshot, limit=cfg.limit, gen_kwargs=cfg.gen_kwargs,
                  apply_chat_template=cfg.apply_chat_template, log_samples=cfg.log_samples,
                  bootstrap_iters=cfg.bootstrap_iters, task_manager=tm, **seeds)
    kwargs.update(extra)
    from .docscores import capture

    try:
        with capture() as doc_scores:
            res = lm_eval.simple_evaluate(model=lm, tasks=cfg.tasks, **kwargs)
    finally:
        progress.close()
        dispatcher.shutdown()
        lm.runner = None  # runner -> dispatcher -> lm.compute -> lm: a cycle that would keep the model alive
    stall_hook("post_processing")
    return {"results": res, "writer": writer, "doc_scores": doc_scores}


def _finish_root(state, all_stats, wall: float) -> None:
    from lm_eval.utils import make_table

    res, writer = state["results"], state["writer"]
    if writer is not None:
        for task, cfgd in res.get("configs", {}).items():
            metrics = {k: v for k, v in res["results"].get(task, {}).items() if k != "alias"}
            n = res.get("n-samples", {}).get(task, {})
            writer.write_task(task, dict(output_type=cfgd.get("output_type"),
                                         num_fewshot=res.get("n-shot", {}).get(task, 0),
                                         n_docs=n.get("effective", n.get("original", 0))), metrics,
                              samples=res.get("samples", {}).get(task))
            if task in state.get("doc_scores", {}):
                writer.write_doc_scores(task, state["doc_scores"][task])
        writer.write_stats(all_stats)
        serialisable = {k: res[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better",
                                            "n-samples", "config", "groups", "group_subtasks") if k in res}
        writer.finish(serialisable, wall)
    print(make_table(res))
    total_busy = sum(s["busy_s"] for s in all_stats)
    for g, s in enumerate(all_stats):
        per_tok = s["tp_score_bytes"] / max(1, s["tokens_scored"])
        stages = f", stage traffic {s['pp_bytes'] / 1e6:.2f} MB" if s.get("pp_bytes") else ""
        print(f"DP group {g}: {s['requests']:.0f} requests, {s['tokens_scored']} tokens scored, "
              f"{s['tokens_generated']} generated, busy {s['busy_s']:.1f} s, TP traffic {s['tp_bytes'] / 1e6:.2f} MB "
              f"({per_tok:.1f} B/scored token in scoring reductions){stages}")
    where = f"; results: {writer.path}" if writer is not None else ""
    print(f"wall {wall:.1f} s, busy {total_busy:.1f} s over {len(all_stats)} group(s){where}")
