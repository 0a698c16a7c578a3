"""Checkpoint sweeps: many models evaluated one after another in one MPI launch.

``mpitp eval --model 'ckpts/step-*'`` (a glob, a comma list, or both) and ``--watch DIR`` come here. What a launch
per checkpoint pays again and again is paid once: MPI start-up, the torch world of each replica, importing torch,
transformers and lm-eval, lm-eval's task index (``TaskManager``) and the tasks themselves (datasets read, documents
and prompts built: ``TaskManager.load`` is memoised for the sweep) and the token ids of the prompts, once per
tokenizer on each DP leader (``MPITPLM.encode_cache``, keyed by the hash of the tokenizer's files: a checkpoint with
another tokenizer tokenises with its own). Leaders tokenise the requests they are handed, and chunks go to whichever
group asks first, so a leader reuses the encodings of the requests it had before and encodes the others. Per
checkpoint remain the weights and lm-eval's request building (prompt rendering).

Each checkpoint gets its own results file, exactly as a separate ``mpitp eval`` would write it (same identity, so
``--resume`` works per file; with ``--resume`` a file already ``complete`` for the same checkpoint is skipped without
loading the model). A checkpoint that fails its checks or fails to load is reported and the sweep goes on. The
previous model is released before the next one loads: :func:`run_checkpoint` drops every reference and checks with
a weak reference that reference counting alone freed it. A sweep summary (``sweep-summary.json`` beside the
files) lists every checkpoint with its status, metrics and a paired test against the previous checkpoint.

While a checkpoint is evaluated, one rank per node reads the next checkpoint's weight files in a background thread
(into the page cache, 16 MiB at a time: no extra process memory), so its load reads from memory.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from mpitp.errors import UsageError
from mpitp.results.sweepsummary import Row, natural_key, render_summary, summary_path, write_summary
from mpitp.results.untrusted import own_folders, shown

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedModel

    from mpitp.evaluation.checks import Checked, CheckedTasks
    from mpitp.evaluation.runner import KeptChecks
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Launch, Runtime

_T = TypeVar("_T")

# mpi4py is imported inside the functions that need it: eval's dispatch imports this module; --help starts no MPI.

log = logging.getLogger("mpitp")
PEFT_OR_PRETRAINED = {"model": "pretrained", "peft": "peft"}  # the model_args key of a sweep's items

def is_pattern(part: str) -> bool:
    """Whether one entry of ``--model``/``--peft`` is a glob: glob characters in a name that is no existing folder
    (a checkpoint folder named ``m[1]`` is that folder; it was read as the pattern matching ``m1``)."""
    return glob.has_magic(part) and not os.path.isdir(os.path.expanduser(part))


def is_sweep(model: str | None) -> bool:
    """Whether ``--model`` (or ``--peft``) names several: a comma list or a glob, unless it is an existing folder."""
    return bool(model) and not os.path.isdir(os.path.expanduser(model)) and ("," in model or glob.has_magic(model))


def expand_models(spec: str, option: str = "--model") -> list[str]:
    """``a,b`` and globs (sorted naturally: step-2 before step-10) to a list of checkpoints (or of adapters, with
    ``option="--peft"``); each glob must match, and a match another user planted is skipped (:func:`own_folders`)."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if is_pattern(part):
            found = sorted(own_folders(glob.glob(os.path.expanduser(part)), f"{option} {shown(part)}"), key=natural_key)
            if not found:
                raise UsageError(f"{option} {part}: the pattern matches no directory")
            out += found
        else:
            out.append(part)
    seen: set[str] = set()
    models = [m for m in out if not (m in seen or seen.add(m))]
    if not models:
        raise UsageError(f"{option} {spec!r}: nothing given")
    return models


def checkpoint_names(models: list[str]) -> list[str]:
    """A short distinct name per checkpoint for its output file: the directory name, with parents when needed."""
    parts = [os.path.normpath(m).split(os.sep) for m in models]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):  # distinct once cleaned: ck/s+1 and ck/s_1
        names = [re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(p[-depth:])) or f"model{i}" for i, p in enumerate(parts)]
        if len(set(names)) == len(names):  # were both s_1.h5, the second replacing the first
            return names
    taken: set[str] = set()
    for i, name in enumerate(names):  # still equal with every parent: the later ones numbered
        names[i] = next(n for n in (name, *(f"{name}-{k}" for k in range(2, len(names) + 2))) if n not in taken)
        taken.add(names[i])
    return names


def output_for(spec: str | None, name: str, default_dir: str) -> str:
    """``--output`` of a sweep: a pattern with ``{name}``, else a directory (``DIR/<name>.h5``)."""
    if spec is None:
        return os.path.join(default_dir, f"{name}.h5")
    if "{name}" in spec:
        return spec.replace("{name}", name)
    if spec.endswith(".h5"):
        raise UsageError(f"--output {spec}: a sweep writes one file per checkpoint: give a directory or a pattern "
                         "with {name} (e.g. results/{name}.h5)")
    return os.path.join(spec, f"{name}.h5")


def default_sweep_dir() -> str:
    return os.path.join("results", f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")


# ------------------------------------------------------------------------------------------ shared across runs


@dataclass
class SweepState:
    """What one checkpoint's run leaves for the next (rank 0's task manager; memoised task loading)."""

    tasks: CheckedTasks | None = None  # rank 0: checked by the first checkpoint, reused by the others
    prefetch: threading.Thread | None = None
    encode_caches: dict = field(default_factory=dict)  # tokenizer fingerprint -> {prompt: token ids}
    encodings_reused: int = 0  # cached token encodings available when the last checkpoint started
    loaded_tasks: dict = field(default_factory=dict)  # TaskManager.load's results by arguments (memoize_task_loading)


def tokenizer_key(cfg: EvalConfig) -> str | None:
    """The files of the checkpoint's tokenizer (hashed): checkpoints with equal files share token ids."""
    from mpitp.evaluation.fingerprint import local_dir, tokenizer_files
    from mpitp.replica.dcp import tokenizer_source

    source = tokenizer_source(cfg.model, cfg.tokenizer, cfg.hf_assets)  # DCP: its --hf-assets
    d = local_dir(source, cfg.revision if source == cfg.model else None)
    files = tokenizer_files(d) if d else {}
    return json.dumps(files, sort_keys=True) if files else None


def memoize_task_loading(tm: TaskManager, memo: dict) -> AbstractContextManager:
    """``TaskManager.load`` (datasets, documents, prompt templates) once per task list for the whole sweep: inside
    this block ``tm.load`` answers from ``memo`` (kept by the sweep from one checkpoint to the next).

    lm-eval rebuilds each task's requests from the loaded task on every ``simple_evaluate`` (and resets its few-shot
    seed), so reusing the loaded tasks gives the same requests as a fresh load.
    """
    from mpitp import compat

    original = tm.load

    def load(tasks: object, *args, **kwargs) -> object:
        key = json.dumps([tasks, args, kwargs], sort_keys=True, default=str)
        if key not in memo:
            memo[key] = original(tasks, *args, **kwargs)
        return memo[key]

    return compat.replaced("lm_eval.tasks.TaskManager.load", load, on=tm)


def weight_files(model: str) -> list[str]:
    """The files a load of ``model`` reads in bulk: an HF folder's ``*.safetensors``/``*.bin``, a torch DCP step's
    ``*.distcp`` shards (each rank preads its slices of them: the page cache serves all the node's ranks)."""
    if not os.path.isdir(model):
        return []
    pats = ("*.distcp",) if os.path.isfile(os.path.join(model, ".metadata")) else ("*.safetensors", "*.bin")
    return sorted(p for pat in pats for p in glob.glob(os.path.join(model, pat)))


def start_prefetch(model: str | None, rt: Runtime) -> threading.Thread | None:
    """Read ``model``'s weight files into the page cache in the background (node-local rank 0 only)."""
    if model is None or rt.world.local_rank != 0:
        return None
    files = weight_files(model)
    if not files:
        return None

    def read_all() -> None:
        for path in files:
            try:
                with open(path, "rb", buffering=0) as f:
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
                    buf = bytearray(16 << 20)
                    while f.readinto(buf):
                        pass
            except OSError:
                return

    t = threading.Thread(target=read_all, name="mpitp-prefetch", daemon=True)
    t.start()
    return t


# -------------------------------------------------------------------------------------------------- one model


class LoadFailed(Exception):
    """The checkpoint could not be loaded on some rank (every rank raises it together)."""


def _skip_complete(cfg: EvalConfig) -> bool:
    """Rank 0: with --resume, a complete file made from this very checkpoint needs no work."""
    if not (cfg.resume and cfg.output and os.path.exists(cfg.output)):
        return False
    from mpitp.evaluation.checks import check_resumable
    from mpitp.results.status import output_status

    if output_status(cfg.output) != "complete":
        return False
    check_resumable(cfg.output, cfg)  # same settings and the same weights, or a UsageError naming the difference
    return True


def everywhere(fn: Callable[[], _T], rt: Runtime, phase: str, undo: Callable[[_T], object] | None = None) -> _T:
    """``fn()`` on every rank of the world; if it fails on any rank, every rank raises :class:`LoadFailed` with the
    first error (ranks where it succeeded first pass their result to ``undo``), so a bad checkpoint or adapter
    fails its row of the sweep together instead of leaving the other ranks in a collective."""
    from mpitp.parallel import comm as mpicomm

    result, err = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a broken checkpoint is the sweep's business, not a crash
        text = " ".join(str(exc).split()) or type(exc).__name__
        err = f"rank {rt.world.comm.Get_rank()}: {type(exc).__name__}: {text[:300]}"
    first = mpicomm.first_objection(err, rt.world.comm, rt.timeout, phase=phase)
    if first:
        if result is not None and undo is not None:
            undo(result)
        del result
        gc.collect()
        raise LoadFailed(first)
    return result


def _load_everywhere(cfg: EvalConfig, rt: Runtime) -> PreTrainedModel:
    """Load on every rank; if any rank fails, every rank raises :class:`LoadFailed` with the first error."""
    from mpitp.evaluation.runner import load_for_layout

    return everywhere(lambda: load_for_layout(cfg.model, cfg, rt), rt, "loading the model")


def check_item(cfg: EvalConfig, rt: Runtime, state: SweepState, phase: str) -> Checked:
    """Rank 0's checks of one checkpoint or adapter (the tasks checked by the first are reused), shared with all."""
    from mpitp.evaluation.checks import check_on_root

    checked = check_on_root(cfg, rt, rt.timeout, phase, state.tasks)
    state.tasks = checked.tasks or state.tasks
    return checked


def evaluate_item(model: PreTrainedModel, cfg: EvalConfig, rt: Runtime, state: SweepState, checked: Checked,
                  t_start: float, kept: KeptChecks | None = None, phases: dict | None = None) -> dict | None:
    """:func:`mpitp.evaluation.runner.evaluate_loaded` with what a sweep keeps from one model to the next: lm-eval's
    loaded tasks (memoised), the prompts' token ids per tokenizer, an adapter sweep's ``kept`` (its one base's
    :class:`~mpitp.evaluation.runner.KeptChecks`); ``phases``: rank 0's checks and load seconds, as a run's own."""
    from mpitp.evaluation.runner import evaluate_loaded

    tm = checked.task_manager
    memo = memoize_task_loading(tm, state.loaded_tasks) if rt.layout.is_root and tm is not None else nullcontext()
    key = tokenizer_key(cfg)
    cache = state.encode_caches.setdefault(key, {}) if key is not None else None
    state.encodings_reused = len(cache or {})
    with memo:
        return evaluate_loaded(model, checked.tokenizer, cfg, rt, out=checked.output, task_manager=tm,
                               t_start=t_start, phases=phases, encode_cache=cache, kept=kept)


def run_checkpoint(cfg: EvalConfig, rt: Runtime, state: SweepState,
                   next_model: str | None = None) -> tuple[dict | None, bool]:
    """One checkpoint of a sweep: checks, load, evaluate, release. Returns (lm-eval results or None, released)."""
    from mpitp import testing
    from mpitp.parallel.runtime import barrier_after_load

    t_start = time.perf_counter()
    checked = check_item(cfg, rt, state, f"checking {cfg.model}")
    phases = {"checks": time.perf_counter() - t_start}  # the file's phases hold what its wall time does
    with checked:  # the claim on this checkpoint's output (mpitp.results.claim): the next one claims its own
        if state.prefetch is not None:
            state.prefetch.join()  # this checkpoint's files: the previous run read them ahead
        testing.report_io("before loading", rt.world)
        model = _load_everywhere(cfg, rt)
        testing.report_io("model loaded", rt.world)
        barrier_after_load(rt)
        phases["load"] = time.perf_counter() - t_start - phases["checks"]
        state.prefetch = start_prefetch(next_model, rt)
        res = evaluate_item(model, cfg, rt, state, checked, t_start, phases=phases)
    ref = weakref.ref(model)
    del model
    released = ref() is None  # freed by reference counting alone: nothing of the run still holds it
    gc.collect()
    if rt.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return res, released


# ----------------------------------------------------------------------------------------------------- sweep


def _metrics_of(res: dict | None) -> dict:
    """Per task, lm-eval's metric values; a results dict of another shape (a file is untrusted) has none."""
    if not isinstance(res, dict) or not isinstance(res.get("results"), dict):
        return {}
    return {t: {k: v for k, v in m.items() if k != "alias" and isinstance(v, (int, float))}
            for t, m in res["results"].items() if isinstance(m, dict)}


def _metrics_from_file(path: str) -> dict:
    from mpitp.results.schema import open_h5
    from mpitp.results.untrusted import load_json

    try:
        with open_h5(path) as f:
            return _metrics_of(load_json(f.attrs["results_json"], "results_json"))  # bounded: never a RecursionError
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):  # TypeError: results_json not text
        return {}


def item_config(cfg: EvalConfig, field: str, item: str, out: str) -> EvalConfig:
    """The settings of one item of a sweep: ``field`` (``model`` or ``peft``) set to the checkpoint or adapter, its
    own output, and the same in ``--model_args`` (``pretrained=``, ``peft=``) and the task metadata lm-eval merges
    them into: lm-eval's output files name the item, not the sweep's glob."""
    model_args, metadata, arg = dict(cfg.model_args or {}), dict(cfg.metadata or {}), PEFT_OR_PRETRAINED[field]
    if arg in model_args:
        metadata.update({arg: item} if metadata.get(arg) == model_args[arg] else {})  # not a --metadata of its own
        model_args[arg] = item
    return dataclasses.replace(cfg, **{field: item}, output=out, tasks=list(cfg.tasks),
                               model_args=model_args or cfg.model_args, metadata=metadata or cfg.metadata)


def run_each(rt: Runtime, what: str, items: list[str], outputs: list[str], names: list[str],
             configure: Callable[[str, str], EvalConfig], evaluate: Callable[[int, EvalConfig], dict | None],
             rows: list[Row] | None = None) -> list[Row]:
    """The loop of every sweep (every rank calls it): for each checkpoint or adapter (``what`` names the kind), its
    settings (``configure(item, output)``, e.g. :func:`item_config`), a skip when ``--resume`` finds its file
    complete, ``evaluate(i, cfg)`` (lm-eval's results), one :class:`Row` each, in order; a failure is its row's and
    the loop goes on."""
    from mpitp.parallel import comm as mpicomm
    from mpitp.parallel.runtime import agree
    from mpitp.parallel.walltime import hold_if_stopping

    rows = [] if rows is None else rows
    for i, (item, out, name) in enumerate(zip(items, outputs, names)):
        hold_if_stopping()
        cfg_i = configure(item, out)
        t0 = time.perf_counter()
        if rt.world.rank == 0:
            log.info("=== %s %d/%d: %s -> %s", what, i + 1, len(items), shown(item), shown(out))
        try:
            if agree(lambda: _skip_complete(cfg_i), rt.world.comm, rt.timeout, "checking outputs"):
                rows.append(Row(item, name, out, "skipped (complete)", metrics=_metrics_from_file(out)))
                if rt.world.rank == 0:
                    log.info("%s: %s is complete for this %s: skipped", shown(item), shown(out), what)
                continue
            res = evaluate(i, cfg_i)
            rows.append(Row(item, name, out, "complete", wall_s=time.perf_counter() - t0, metrics=_metrics_of(res)))
        except (UsageError, LoadFailed) as exc:
            if isinstance(exc, UsageError) and not exc.collective:
                raise
            rows.append(Row(item, name, out, "failed", error=str(exc), wall_s=time.perf_counter() - t0))
            if rt.world.rank == 0:
                log.error("%s %s failed: %s", what, shown(item), exc)
        mpicomm.barrier(rt.world.comm, rt.timeout, phase=f"end of {what} {name}")
    return rows


def run_models(cfg: EvalConfig, rt: Runtime, models: list[str], outputs: list[str], names: list[str],
               state: SweepState | None = None, rows: list[Row] | None = None) -> list[Row]:
    """Evaluate ``models`` one after another (every rank calls it); one :class:`Row` each, in order."""
    state = state or SweepState()

    def evaluate(i: int, cfg_i: EvalConfig) -> dict | None:
        model = cfg_i.model
        res, released = run_checkpoint(cfg_i, rt, state, models[i + 1] if i + 1 < len(models) else None)
        if rt.world.rank == 0:
            log.info("%s: tokenizer: %s", shown(model), f"{state.encodings_reused} token encodings reused from earlier "
                     "checkpoints" if state.encodings_reused else "tokenised afresh")
            if released:
                log.info("%s: model released before the next checkpoint", shown(model))
            else:
                log.warning("%s: the model was still referenced after its run (freed by the garbage "
                            "collector)", shown(model))
        return res

    return run_each(rt, "checkpoint", models, outputs, names, lambda m, out: item_config(cfg, "model", m, out),
                    evaluate, rows)


class PlanWithoutClaim:
    """A plan (:class:`mpitp.jobs.orchestrate.Plan`: checked before torch starts, run inside the run's torch world by
    ``execute``) whose checks hold nothing to give back on leaving its ``with`` block (each item of a sweep claims
    its own output; :class:`mpitp.evaluation.runner.EvalPlan` releases its claim there)."""

    def __enter__(self) -> PlanWithoutClaim:
        return self

    def __exit__(self, *exc) -> None:
        return None


@dataclass
class SweepPlan(PlanWithoutClaim):
    """``mpitp eval --model 'glob,list'``: the checkpoints expanded and named on rank 0, every rank holding them."""

    cfg: EvalConfig
    models: list[str]
    names: list[str]
    outputs: list[str]

    def execute(self, rt: Runtime) -> int:
        """Every rank evaluates the checkpoints in order. Exit status 1 when one failed."""
        if rt.world.rank == 0:
            log.info("sweep: %d checkpoints: %s", len(self.models), ", ".join(self.names))
        t0 = time.perf_counter()
        state = SweepState()
        try:
            rows = run_models(self.cfg, rt, self.models, self.outputs, self.names, state)
        finally:
            finish(state)
        return summarise(rt, rows, t0)


def prepare_sweep(cfg: EvalConfig, launch: Launch) -> SweepPlan:
    """The sweep's checkpoints and outputs, agreed before torch starts (the other ranks then import the loading code
    while rank 0 checks the first checkpoint)."""
    from mpitp.parallel.runtime import agree
    from mpitp.replica.loading import warm_for_load

    models = agree(lambda: expand_models(cfg.model), launch.world.comm, launch.timeout, "expanding --model")
    names, outputs = name_outputs(cfg, "model", models, launch)
    warm_for_load(launch.world, models[0])
    return SweepPlan(cfg, models, names, outputs)


def name_outputs(cfg: EvalConfig, field: str, items: list[str], rt: Launch) -> tuple[list[str], list[str]]:
    """Each checkpoint's or adapter's (``field``: ``model`` or ``peft``) short name and results file (``--output`` a
    directory or a pattern), the same on every rank; existing files checked first (:func:`_refuse_existing`)."""
    from mpitp.parallel.runtime import agree

    names = checkpoint_names(items)
    default_dir = agree(default_sweep_dir, rt.world.comm, rt.timeout, "naming outputs")
    outputs = agree(lambda: [output_for(cfg.output, n, default_dir) for n in names], rt.world.comm, rt.timeout,
                    "naming outputs")
    agree(lambda: _refuse_existing(cfg, field, items, outputs), rt.world.comm, rt.timeout, "checking outputs")
    return names, outputs


def _refuse_existing(cfg: EvalConfig, field: str, items: list[str], outputs: list[str]) -> None:
    """Rank 0, before the first item: a sweep rerun without ``--resume``/``--overwrite`` over files that exist, or
    resumed with settings its files were not made with, is one line (as one ``mpitp eval`` is). Found item by item,
    it failed every item and rewrote the sweep summary with none of its metrics. With ``--resume`` only the first
    existing file is read here: a setting of the sweep (limit, tasks, few-shot) shows in any of them; a checkpoint
    rewritten since is that item's own failure, found when its turn comes."""
    from mpitp.evaluation.checks import check_writable

    if cfg.resume and cfg.output is None:  # each launch named a new folder: every checkpoint evaluated again
        raise UsageError(f"--resume: a sweep without --output writes into a new folder each launch "
                         f"({os.path.dirname(outputs[0])}): give the --output (folder or {{name}} pattern) to continue")
    for out in {os.path.dirname(os.path.abspath(o)): o for o in reversed(outputs)}.values():  # the summary's too
        check_writable(out)  # else every item failed, then writing the summary was a traceback and MPI_Abort
    existing = [(item, out) for item, out in zip(items, outputs) if os.path.exists(out)]
    if not existing or cfg.overwrite:
        return
    if not cfg.resume:
        raise UsageError(f"output {existing[0][1]} already exists ({len(existing)} of the sweep's {len(outputs)} "
                         "files do): pass --resume to continue the sweep (complete files are skipped) or --overwrite "
                         "to replace them")
    from mpitp.evaluation.checks import check_resumable

    check_resumable(existing[0][1], item_config(cfg, field, *existing[0]))


def summarise(rt: Runtime, rows: list[Row], t0: float, **extra) -> int:
    """Rank 0 writes the sweep's summary (:func:`~mpitp.results.sweepsummary.summary_path`, with ``extra``) and prints
    it. Exit status 1 when an item failed."""
    if rt.world.rank == 0:
        path = summary_path(rows)
        write_summary(path, rows, time.perf_counter() - t0, **extra)
        print(render_summary(rows, path))
    return 1 if any(r.status == "failed" for r in rows) else 0


def finish(state: SweepState) -> None:
    """Remove the task YAMLs ``--data-dir`` generated for the sweep (rank 0 holds them)."""
    from mpitp.evaluation.checks import remove_generated

    if state.prefetch is not None:
        state.prefetch.join()
    if state.tasks is not None:
        remove_generated(state.tasks.include)
