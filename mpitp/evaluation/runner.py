"""One evaluation run: checks, sharded loading, lm-eval on rank 0, dispatch, TP serving and the HDF5 file.

:func:`prepare_eval` (rank 0's checks, before torch) and :func:`run_eval` (inside the run's torch world) are the
single code path behind ``mpitp eval`` (and job files). Every rank calls them; roles follow from the layout: global
rank 0 runs lm-eval and the dispatcher, other DP leaders serve chunks, TP workers mirror their leader's forwards.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp import gcpolicy, testing
from mpitp.errors import RelayedRefusal, UsageError
from mpitp.evaluation import requestlog
from mpitp.evaluation.checks import Checked, check_on_root, check_tasks, offline_include, remove_generated
from mpitp.evaluation.envinfo import EnvInfoEarly
from mpitp.evaluation.finish import RootResult
from mpitp.evaluation.phases import PhaseClock
from mpitp.evaluation.progress import TqdmProgress, make_progress
from mpitp.evaluation.provenance import run_metadata
from mpitp.evaluation.request_rows import result_from_row, rows_by_task
from mpitp.evaluation.settings import EvalConfig
from mpitp.parallel import comm as mpicomm
from mpitp.parallel.runtime import Launch, Runtime, barrier_after_load
from mpitp.replica.loading import warm_for_load

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from mpitp.evaluation.lm import MPITPLM
    from mpitp.replica.shard import ReplicaShard
    from mpitp.replica.stats import Stats

log = logging.getLogger("mpitp")


# ----------------------------------------------------------------------------------------------------- run


@dataclass
class EvalPlan:
    """One evaluation checked on rank 0 (every rank holds the verdict), before any torch starts: what
    :func:`mpitp.jobs.orchestrate.run_config` runs inside the run's torch world. Leaving its ``with`` block gives back
    rank 0's claim on the output and the task YAMLs ``--data-dir`` wrote, however the run ended."""

    cfg: EvalConfig
    checked: Checked
    t_start: float  # where the run's clock starts: the checks, or the demo's model before them
    phases: dict[str, float]  # rank 0's seconds so far: (demo,) checks

    def __enter__(self) -> EvalPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.checked.release()
        if self.checked.tasks is not None:
            remove_generated(self.checked.tasks.include)

    def execute(self, rt: Runtime) -> int:
        """Load the model TP-sharded and evaluate; lm-eval's results on rank 0 only. Exit status 0."""
        run_eval(self, rt)
        return 0


def prepare_eval(cfg: EvalConfig, launch: Launch, demo_s: float | None = None) -> EvalPlan:
    """``mpitp eval``'s checks: rank 0 checks the input (the other ranks warm the model's code where cores allow, then
    wait for its verdict: no deadline, only rank 0 works). ``demo_s``: the seconds the demo's model took just before
    (the run's clock and its phases count them). lm-eval's logging is set by the caller, for every kind of run
    (:func:`mpitp.jobs.orchestrate.prepare`)."""
    t_checks = time.perf_counter()
    warm_for_load(launch.world, cfg.model)
    checked = check_on_root(cfg, launch, None, "checking input")
    before = {} if demo_s is None else {"demo": demo_s}
    return EvalPlan(cfg, checked, t_checks - (demo_s or 0.0), {**before, "checks": time.perf_counter() - t_checks})


def run_eval(plan: EvalPlan, rt: Runtime) -> dict | None:
    """Load the checked model TP-sharded and evaluate it. lm-eval's results on rank 0 only."""
    from mpitp.replica.staging import staged_model

    cfg, checked = plan.cfg, plan.checked
    testing.report_io("before loading", rt.world)
    source = staged_model(cfg.model, rt.stage_dir, rt.world, rt.timeout, cfg.revision, cfg.subfolder)
    try:
        model, refused = load_for_layout(source, _with_assets(cfg, source), rt), None
    except UsageError as exc:
        model, refused = None, exc
    barrier_after_load(rt, refused)
    if rt.layout.pp > 1 and rt.layout.is_root:
        from mpitp.replica.pipeline import describe_split, num_layers

        log.info("pipeline: %s", describe_split(num_layers(checked.config), rt.layout.pp))
    testing.report_io("model loaded", rt.world)
    phases = {**plan.phases, "load": time.perf_counter() - plan.t_start - sum(plan.phases.values())}
    return evaluate_loaded(model, checked.tokenizer, cfg, rt, out=checked.output, task_manager=checked.task_manager,
                           t_start=plan.t_start, phases=phases)


@dataclass
class KeptChecks:
    """What an adapter sweep (:mod:`mpitp.jobs.adapter_sweep`) keeps from one evaluation over its loaded base to the
    next: the tokenizer lm-eval built (``HFLM`` otherwise reads it from disk for every adapter: 0.4 s each in
    bench/bench_adapters.py), the prefix-sharing probe's verdict (it tests the attention code's handling of a tree,
    which an adapter's weights do not change) and the head check's seconds, reused unless the adapter changes a
    parameter of the head (``recheck_head``, set per adapter)."""

    tokenizer: object = None
    sharing: tuple | None = None  # (check_sharing's verdict, the attention calls of one forward)
    head_check_s: float | None = None
    recheck_head: bool = True


def _with_assets(cfg: EvalConfig, source: str) -> EvalConfig:
    """A torch DCP checkpoint loaded from a stage (``--stage-dir``) finds no ``config.json`` beside the copy: its
    assets folder is resolved from the original path first (``--hf-assets``, the folder or its parent)."""
    if source == cfg.model or cfg.hf_assets:
        return cfg
    from mpitp.replica import dcp

    if not dcp.is_dcp(cfg.model):
        return cfg
    import dataclasses

    return dataclasses.replace(cfg, hf_assets=dcp.assets_dir(cfg.model))


def load_for_layout(source: str, cfg: EvalConfig, rt: Runtime) -> PreTrainedModel:
    """This rank's part of the model in ``source``: its pipeline stage's layers TP-sharded, or (pp=1) the whole model
    TP-sharded. The one loading path of ``mpitp eval`` and sweeps (:mod:`mpitp.jobs.sweep`)."""
    from mpitp.testing import stall

    stall("before_load")  # fault drills: a node lost while the ranks load
    lay = rt.layout
    if lay.pp > 1:
        from mpitp.replica.pipeline import load_stage

        return load_stage(source, lay.tp, lay.pp, lay.pp_rank, cfg.dtype, cfg.revision, cfg.trust_remote_code,
                          peft=cfg.peft, **cfg.load_kwargs())
    from mpitp.replica.loading import load_model

    return load_model(source, lay.tp, rt.device, cfg.dtype, cfg.revision, cfg.trust_remote_code,
                      peft=cfg.peft, ep=rt.ep, **cfg.load_kwargs())


def evaluate_loaded(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | str, cfg: EvalConfig, rt: Runtime,
                    *, out: str | None, task_manager: TaskManager | None = None, extra_lm_eval: dict | None = None,
                    t_start: float | None = None, phases: dict | None = None, encode_cache: dict | None = None,
                    kept: KeptChecks | None = None) -> dict | None:
    """The one evaluation path (CLI, job files and :func:`mpitp.evaluate`) for a model already on this rank.

    Every rank of ``rt`` calls it; roles follow from the layout: global rank 0 runs lm-eval and the dispatcher,
    other DP leaders serve chunks, TP workers mirror their leader's forwards. ``out=None`` writes no file.
    ``kept``: an adapter sweep's :class:`KeptChecks` for the base ``model`` (filled by the first evaluation).
    """
    from mpitp.replica.shard import ReplicaShard
    from mpitp.replica.stats import Stats

    t_start = time.perf_counter() if t_start is None else t_start
    group = rt.replica_group.tp_group if rt.replica_group is not None else None
    stats = Stats()
    shard = ReplicaShard(model, rt.layout, rt.device, stats, tp_group=group, timeout=rt.timeout)
    with shard.tp_reductions():  # while it runs, its TP collectives of CPU tensors go over MPI (parallel.cpu_reduce)
        return _evaluate_shard(shard, tokenizer, cfg, rt, stats, out=out, task_manager=task_manager,
                               extra_lm_eval=extra_lm_eval, t_start=t_start, phases=phases,
                               encode_cache=encode_cache, kept=kept)


def _evaluate_shard(shard: ReplicaShard, tokenizer: PreTrainedTokenizerBase | str, cfg: EvalConfig, rt: Runtime,
                    stats: Stats, *, out: str | None, task_manager: TaskManager | None, extra_lm_eval: dict | None,
                    t_start: float, phases: dict | None, encode_cache: dict | None,
                    kept: KeptChecks | None) -> dict | None:
    """:func:`evaluate_loaded` once this rank's :class:`~mpitp.replica.shard.ReplicaShard` is built."""
    from mpitp.evaluation import finish
    from mpitp.evaluation.dispatch import serve_remote
    from mpitp.replica.batchsize import AutoBatch, agreed_budget, is_auto
    from mpitp.replica.headcheck import check_head
    from mpitp.replica.leader import ReplicaLeader
    from mpitp.replica.worker import ReplicaWorker

    gcpolicy.settle()  # the run's modules are in (mpitp.gcpolicy)
    model, lay = shard.model, rt.layout

    reuse_head = kept is not None and kept.head_check_s is not None and not kept.recheck_head
    head_check_s = check_head(shard, rt.world.comm, rt.timeout, skip=cfg.skip_head_check,
                              passed=kept.head_check_s if reuse_head else None)
    from mpitp.replica.prefix_probe import check_sharing

    if kept is not None and kept.sharing is not None:
        sharing, shard.attention_layers = kept.sharing
        shard.share = sharing is None
    else:
        sharing = check_sharing(shard, enabled=not cfg.no_prefix_sharing, timeout=rt.timeout)
        if kept is not None:
            kept.sharing = (sharing, shard.attention_layers)
    chunks = stage_head = None
    if shard.pipeline:  # collective over the replica, as the prefix-sharing probe is
        from mpitp.replica.stage_chunks import check_chunking
        from mpitp.replica.stage_head import spread_head

        chunks = check_chunking(shard, rt.timeout) or "on"
        stage_head = spread_head(shard, rt.timeout) or "spread"  # after the probes, which score on the last stage
    if kept is not None and not cfg.skip_head_check:
        kept.head_check_s = head_check_s
    if kept is not None and kept.tokenizer is not None:
        tokenizer = kept.tokenizer
    gcpolicy.trim_heap()  # what loading and the probes freed, given back before the requests (mpitp.gcpolicy)
    # --batch_size auto: the memory budget is agreed collectively over the replica, before the roles split
    budget = agreed_budget(lay.replica_comm, rt.device, rt.world.local_size) if is_auto(cfg.batch_size) else None
    state = None
    if not lay.is_leader:
        ReplicaWorker(shard, rt.timeout).serve()
        _merge_stage_stats(stats, lay, rt.timeout)
    else:
        from mpitp.evaluation.lm import MPITPLM

        leader = ReplicaLeader(shard, rt.timeout)
        auto = None
        if budget is not None:
            auto = AutoBatch(budget, model.config, lay.tp, 1, next(model.parameters()).element_size(),
                             cfg.max_batch_size)
        lm = MPITPLM(model, tokenizer, leader, batch_size=cfg.fixed_batch_size(), max_length=cfg.max_length,
                     auto=auto, encode_cache=encode_cache, seed=cfg.sampling_seed(),
                     trust_remote_code=cfg.trust_remote_code, **(cfg.hflm_args or {}))
        if kept is not None:
            kept.tokenizer = lm.tokenizer
        # No ``finally``: after a failure (an OOM inside a forward) the workers may sit in a torch collective of
        # that forward and can join no message; the exception goes straight to the abort, which ends every rank.
        # Only rank 0's refusal between dispatch runs, when every other rank waits for a message, is relayed.
        if lay.is_root:
            tm = task_manager or task_manager_for(cfg)
            root = _RootRun(cfg, rt, lm, out, stats)
            try:
                state = root.evaluate(tm, extra_lm_eval or {}, t_start)
            except UsageError as exc:
                if not root.dispatcher.fail(str(exc)):
                    raise
                leader.stop(refusal=str(exc))
                raise RelayedRefusal(str(exc)) from None
            state.phases.update(phases or {})
        else:
            try:
                serve_remote(lay, lm.compute, rt.timeout, stats, idle=leader.idle)
            except RelayedRefusal as exc:
                leader.stop(refusal=str(exc))
                raise
        leader.stop()
        _merge_stage_stats(stats, lay, rt.timeout)
        all_stats = mpicomm.gather_obj(stats.snapshot(), lay.dp_leader_comm, root=0, timeout=rt.timeout,
                                       phase="gathering stats")
        if lay.is_root:
            finish.finish_root(state, all_stats, time.perf_counter() - t_start, head_check_s, sharing,
                               head_kept=reuse_head, chunks=chunks, stage_head=stage_head,
                               prefill=leader.gen.ragged.summary())
    # Rank 0 computes lm-eval's metrics and writes the file meanwhile: bounded work, so a deadline. Without one a node
    # whose network went away at the end held every rank here forever (the launcher kills dead ranks, not silent ones).
    mpicomm.barrier(rt.world.comm, rt.timeout, phase="end of evaluation")
    return state.results if state else None


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


def task_manager_for(cfg: EvalConfig) -> TaskManager:
    """Check the tasks and build lm-eval's TaskManager (rank 0), for callers that skipped :func:`check_all`."""
    return check_tasks(cfg.tasks, offline_include(cfg))


def _run_windows(dispatcher, progress, docs: list[list], record, tasks: list[str]) -> list:
    """Rolling requests dispatched window by window (see :data:`mpitp.evaluation.lm.KIND_WINDOW`); a request's result is
    recorded (``record(indices, results)``) and counted on the progress bar as soon as its last window lands, so a
    crash still loses at most the chunks in flight and the bar counts requests, as for the other kinds."""
    from mpitp.evaluation.lm import KIND_WINDOW, combine_windows

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

    def on_windows(indices: tuple[int, ...], res: list) -> None:
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

    dispatcher.run(KIND_WINDOW, windows, weights, on_windows, owners=requestlog.windows(docs, tasks))
    return results


class _RootRun:
    """Rank 0's evaluation, step by step: open the results file (resume: read what it holds), run lm-eval's
    ``simple_evaluate`` with ``lm``, whose requests come back to :meth:`serve` (stored results first, the rest
    dispatched over the DP groups, each chunk's rows recorded as it lands), then put lm-eval's outputs where
    ``lm_eval`` puts them. Seconds per phase go to a :class:`~mpitp.evaluation.phases.PhaseClock`."""

    def __init__(self, cfg: EvalConfig, rt: Runtime, lm: MPITPLM, out: str | None, stats: Stats):
        from mpitp.evaluation.dispatch import Dispatcher

        self.cfg, self.rt, self.lm, self.out = cfg, rt, lm, out
        self.tokenizer_name = getattr(lm.tokenizer, "name_or_path", str(cfg.tokenizer))
        self.clock = PhaseClock()
        self.request_cache: str | None = None  # lm-eval's request cache folder for this run (set with its arguments)
        self.writer, self.stored, self._opened = None, {}, False  # until lm-eval first asks (:meth:`_open_once`)
        self.progress = make_progress(TqdmProgress)  # a line every few seconds in batch logs, a bar on a terminal
        self.dispatcher = Dispatcher(rt.layout, lm.compute, rt.timeout, stats, batch_size=cfg.fixed_batch_size(),
                                     idle=lm.leader.idle)

    # ------------------------------------------------------------------------------------------ the results file
    def _open_once(self) -> None:
        """Open the results file when lm-eval first asks for results, not before: a refusal while it builds requests
        (``--samples`` past a task's end, ``--max-length`` too short) left a 'running' file of no rows that the fixed
        rerun had to ``--overwrite`` (``--resume`` refuses other settings); an unwritable file still fails first."""
        if self._opened:
            return
        self._opened, t0 = True, time.perf_counter()
        self.writer, self.stored = self._open_writer()
        self.clock.add("writing", time.perf_counter() - t0)

    def _open_writer(self):
        """(writer or None, the rows it holds by resume key: empty unless resuming)."""
        if not self.out:
            return None, {}
        from mpitp.parallel.walltime import watch_writer
        from mpitp.results.store import ResultWriter

        writer = ResultWriter(self.out, run_metadata(self.cfg, self.rt, self.tokenizer_name), resume=self.cfg.resume)
        stored = writer.stored_rows() if self.cfg.resume else {}
        watch_writer(writer)
        return writer, stored

    def _record(self, kind: str, keys: list, todo: list[int], indices, res) -> None:
        """Store the rows of requests whose results are complete (``indices`` into ``todo``). The rows are built and
        written on the writer's thread: the dispatch loop pays O(1) per chunk."""
        if self.writer is not None:
            self.writer.record(functools.partial(rows_by_task, kind, keys, todo, indices, res))

    def _save_landed(self) -> None:
        """After a failure: what landed goes to disk before the job is torn down."""
        if self.writer is not None:
            try:
                self.writer.close(timeout=30)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass

    # ---------------------------------------------------------------------------------------- lm-eval's requests
    def serve(self, kind: str, items: list, weights: list, keys: list[tuple]) -> list:
        """``lm.serve_requests`` (``keys``: the requests' :func:`~mpitp.evaluation.lm.request_keys`): reuse stored
        results (resume), compute the rest across DP groups, record each chunk as it lands. The seconds spent here
        are the dispatch phase."""
        self._open_once()
        t_run = time.perf_counter()
        try:
            return self._serve(kind, items, weights, keys)
        finally:
            self.clock.dispatch += time.perf_counter() - t_run

    def _serve(self, kind, items, weights, keys) -> list:
        self._size_batches(kind, items, weights)
        results, todo = self._reuse_stored(kind, keys)
        record = functools.partial(self._record, kind, keys, todo)
        for i, r in zip(todo, self._compute(kind, items, weights, todo, record, [keys[i][0] for i in todo])):
            results[i] = r
        return results

    def _size_batches(self, kind: str, items: list, weights: list) -> None:
        """With ``--batch_size auto``, chunks hold whole auto-sized batches of their longest rows (as for a fixed
        size)."""
        if self.lm.auto is None:
            return
        self.dispatcher.batch_size = self.lm.auto.size(self.lm.longest_tokens(kind, items, weights))

    def _reuse_stored(self, kind: str, keys: list) -> tuple[list, list[int]]:
        """(results with the stored ones filled in, indices of the requests still to compute)."""
        results: list = [None] * len(keys)
        todo = []
        for i, key in enumerate(keys):
            row = self.stored.get(key)
            if row is not None and row["kind"] == kind:
                results[i] = result_from_row(row, kind)
            else:
                todo.append(i)
        if len(todo) < len(keys):
            log.info("resume: reusing %d of %d %s results from %s", len(keys) - len(todo), len(keys), kind, self.out)
        return results, todo

    def _compute(self, kind: str, items: list, weights: list, todo: list[int], record, tasks: list[str]) -> list:
        """The results of ``items[i]`` for ``i`` in ``todo`` (of tasks ``tasks``, in the same order), dispatched over
        the DP groups."""
        from mpitp.evaluation.lm import KIND_ROLLING

        if kind == KIND_ROLLING:
            return _run_windows(self.dispatcher, self.progress, [items[i] for i in todo], record, tasks)
        todo_weights = [weights[i] for i in todo]
        self.progress.add_total(len(todo))
        return self.dispatcher.run(kind, [items[i] for i in todo], todo_weights,
                                   functools.partial(self._landed, record, todo_weights),
                                   owners=requestlog.whole(tasks))

    def _landed(self, record, weights: list, indices, res) -> None:
        record(indices, res)
        self.progress(len(indices), sum(weights[i] for i in indices))

    # -------------------------------------------------------------------------------------------------- lm-eval
    def evaluate(self, tm: TaskManager, extra: dict, t_start: float) -> RootResult:
        """Run lm-eval with every request served by :meth:`serve`; lm-eval's outputs written as ``lm_eval`` does.
        ``t_start``: the run's start (perf_counter), where lm-eval's tracker clock starts too.
        What it returns is for :func:`mpitp.evaluation.finish.finish_root` to write and report."""
        from mpitp.evaluation.outputs import as_lm_eval_ran, full_num_parameters, start_loggers

        cfg, lm = self.cfg, self.lm
        lm.check_chat_template(cfg.apply_chat_template)  # relayed as any refusal between runs: no peer left waiting
        loggers = start_loggers(cfg, t_start)
        kwargs = self._lm_eval_kwargs(tm, extra, loggers["tracker"])
        picked = kwargs.get("samples") or {}
        with lm.serving(self.serve, self.clock, picked):
            res, doc_scores = self._simple_evaluate(kwargs, picked)
        self.dispatcher.shutdown()  # only after success: a failure aborts the job (see evaluate_loaded)
        self._open_once()  # lm-eval asked for nothing: the file still records the run
        testing.stall("post_processing")
        as_lm_eval_ran(res, cfg, num_parameters=full_num_parameters(cfg, self.rt.layout), device=self.rt.device,
                       loggers=loggers)
        return RootResult(results=res, writer=self.writer, phases=self.clock.phases, cfg=cfg, loggers=loggers,
                          doc_scores=doc_scores)

    def _lm_eval_kwargs(self, tm, extra: dict, tracker) -> dict:
        """``simple_evaluate``'s arguments: the settings, lm-eval's request cache (:mod:`mpitp.evaluation.requestcache`
        unless the caller or ``--cache_requests`` says otherwise), then the caller's own (``mpitp.evaluate``)."""
        from mpitp.evaluation.picked import picked_docs

        cfg = self.cfg
        kwargs = dict(cfg.lm_eval_arguments(), task_manager=tm, evaluation_tracker=tracker)
        if not extra and not cfg.cache_requests:  # mpitp.evaluate's callers pass lm-eval arguments of their own
            from mpitp.evaluation.requestcache import cache_dir, tokenizer_identity

            self.request_cache = cache_dir(cfg, tm, tokenizer_identity(self.lm.tokenizer, self.tokenizer_name))
            if self.request_cache:
                kwargs["cache_requests"] = True
        kwargs.update(extra)
        if kwargs.get("samples") is not None:  # lm-eval labels its samples indices[i]: --samples [7, 3] logged doc 3
            kwargs["samples"] = picked_docs(kwargs["samples"])  # as 7; the same documents, in the order it walks them
        return kwargs

    def _simple_evaluate(self, kwargs: dict, picked: dict[str, tuple[int, ...]]) -> tuple[dict, dict]:
        """(lm-eval's results, its per-document scores captured on the way; ``picked``: the documents of
        ``--samples``, :func:`~mpitp.evaluation.picked.picked_docs`)."""
        import lm_eval

        from mpitp.evaluation.eval_docs import fewshot_listed, listed_once
        from mpitp.evaluation.requestcache import used
        from mpitp.evaluation.templates import compiled_once
        from mpitp.results.docscores import capture

        env_info = EnvInfoEarly()
        try:
            self.clock.t_eval = time.perf_counter()
            with env_info, used(self.request_cache), compiled_once(), listed_once(picked), fewshot_listed(), \
                    capture(picked) as doc_scores:
                res = lm_eval.simple_evaluate(model=self.lm, tasks=self.cfg.tasks, **kwargs)
            self.clock.eval_done()
        except BaseException:
            self._save_landed()
            raise
        finally:
            self.progress.close()
        return res, doc_scores
