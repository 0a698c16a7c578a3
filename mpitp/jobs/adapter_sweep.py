"""Adapter sweeps: many LoRA adapters evaluated over one base model load, in one MPI launch.

``mpitp eval --model BASE --peft 'adapters/step-*'`` (a glob, a comma list, or both; a ``peft:`` list in a job file)
comes here. A fine-tuning campaign produces one base model and tens of adapters; loading and sharding the base once
per adapter would dominate the sweep, so the base is loaded and sharded once (when the first adapter that has work
needs it), and for each adapter every rank merges it into its own shard (:func:`mpitp.replica.adapters.apply` with
``keep``), evaluates, and copies the original values of the parameters the adapter touched back (bit for bit: no
``W -= B @ A``, whose rounding would leak from one adapter into the next).

Everything else is the checkpoint sweep's (:mod:`mpitp.jobs.sweep`): one results file per adapter, named after its
folder, exactly as a separate ``mpitp eval --peft ADAPTER`` would write it (its identity records the base and that
adapter's hash, so ``--resume`` skips a complete file of the same adapter and refuses one of another), lm-eval's
tasks and the prompts' token ids kept from one adapter to the next, a failed adapter reported while the sweep goes
on, and ``sweep-summary.json`` with paired tests of each adapter against the previous one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp.errors import UsageError
from mpitp.jobs.sweep import (
    LoadFailed,
    PlanWithoutClaim,
    SweepState,
    _load_everywhere,
    check_item,
    evaluate_item,
    everywhere,
    expand_models,
    finish,
    is_sweep,
    item_config,
    name_outputs,
    run_each,
    summarise,
)
from mpitp.results.sweepsummary import Row

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Launch, Runtime

log = logging.getLogger("mpitp")


def check_one_kind(model: str | None, peft: str | None, collective: bool = False) -> None:
    """A sweep goes over checkpoints or over adapters of one base, not both: a grid of both would be one load per
    checkpoint with an adapter sweep inside, which no one has asked for yet; refused with one line."""
    if is_sweep(model) and is_sweep(peft):
        raise UsageError(f"--model {model} and --peft {peft} are both sweeps: sweep the checkpoints or the adapters "
                         "of one base model, not both (one launch per checkpoint, each sweeping the adapters)",
                         collective=collective)


@dataclasses.dataclass
class BaseModel:
    """The base model, loaded and sharded on first use and kept for every adapter; ``loads`` counts the loads
    (the sweep summary records it: one, or none when every adapter was already complete)."""
    cfg: EvalConfig
    rt: object
    model: object = None
    loads: int = 0
    error: str | None = None
    kept: object = None  # mpitp.evaluation.runner.KeptChecks: the tokenizer and checks kept between adapters
    head_names: frozenset = frozenset()  # the parameters of the output head (the head check re-runs if one changes)
    originals: dict = dataclasses.field(default_factory=dict)  # this load's base values of what adapters changed

    def get(self) -> PreTrainedModel:
        if self.error is not None:  # a base that failed to load is not retried for every adapter
            raise LoadFailed(self.error)
        if self.model is None:
            from mpitp.parallel.runtime import barrier_after_load

            t0 = time.perf_counter()
            try:
                self.model = _load_everywhere(self.cfg, self.rt)
            except LoadFailed as exc:
                self.error = f"base model {self.cfg.model}: {exc}"
                raise LoadFailed(self.error) from None
            barrier_after_load(self.rt)
            self.loads += 1
            from mpitp.evaluation.runner import KeptChecks

            self.kept, self.head_names, self.originals = KeptChecks(), head_parameters(self.model), {}
            if self.rt.world.rank == 0:
                log.info("adapter sweep: base model %s loaded and sharded (load %d) in %.1f s", self.cfg.model,
                         self.loads, time.perf_counter() - t0)
        return self.model


def head_parameters(model: PreTrainedModel) -> frozenset:
    """Names of the parameters of ``model``'s output head (the tied input embedding's too, under its own name)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return frozenset()
    ids = {id(p) for p in head.parameters()}
    return frozenset(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


def _apply_everywhere(model, adapter: str, rt: Runtime, originals: dict):
    """Every rank merges ``adapter`` into its shard, keeping the original values (once per parameter for the whole
    sweep, in ``originals``); if any rank fails, every rank restores what it changed and raises :class:`LoadFailed`
    (the sweep goes on with the base intact)."""
    from mpitp.replica import adapters

    return everywhere(lambda: adapters.apply(model, adapters.read(adapter), keep=True, originals=originals), rt,
                      f"applying adapter {adapter}", undo=lambda done: done.restore())


def run_adapter(cfg: EvalConfig, rt: Runtime, state: SweepState, base: BaseModel) -> dict | None:
    """One adapter of the sweep: checks, merge into the base shards, evaluate, restore. Returns lm-eval's results."""
    t_start = time.perf_counter()
    checked = check_item(cfg, rt, state, f"checking {cfg.peft}")
    phases = {"checks": time.perf_counter() - t_start}  # the merge is this run's load
    with checked:  # the claim on this adapter's output (mpitp.results.claim)
        model = base.get()
        done = _apply_everywhere(model, cfg.peft, rt, base.originals)
        phases["load"] = time.perf_counter() - t_start - phases["checks"]
        # No parameter of the head changed (same on every rank: each holds its shard of the same parameters): the
        # base's head check stands. A head LoRA or a saved copy of the head re-runs it.
        base.kept.recheck_head = bool(base.head_names & done.touched)
        try:
            return evaluate_item(model, cfg, rt, state, checked, t_start, kept=base.kept, phases=phases)
        finally:
            restored = done.restore()
            if rt.world.rank == 0:
                log.info("%s: %d parameters merged, %d restored to the base values", cfg.peft, done.changed,
                         restored)


def run_adapters(cfg: EvalConfig, rt: Runtime, adapters: list[str], outputs: list[str], names: list[str],
                 state: SweepState, base: BaseModel) -> list[Row]:
    """Evaluate ``adapters`` one after another over ``base`` (every rank calls it); one :class:`Row` each."""
    return run_each(rt, "adapter", adapters, outputs, names, lambda a, out: item_config(cfg, "peft", a, out),
                    lambda i, cfg_i: run_adapter(cfg_i, rt, state, base))


@dataclass
class AdapterSweepPlan(PlanWithoutClaim):
    """``mpitp eval --model BASE --peft 'glob,list'``: the adapters expanded and named on rank 0, every rank holding
    them."""

    cfg: EvalConfig
    adapters: list[str]
    names: list[str]
    outputs: list[str]

    def execute(self, rt: Runtime) -> int:
        """Every rank evaluates the adapters over one load of the base. Exit status 1 when an adapter failed."""
        cfg = self.cfg
        if rt.world.rank == 0:
            log.info("adapter sweep: %d adapters over %s: %s", len(self.adapters), cfg.model, ", ".join(self.names))
        t0 = time.perf_counter()
        state = SweepState()
        base = BaseModel(dataclasses.replace(cfg, peft=None), rt)
        try:
            rows = run_adapters(cfg, rt, self.adapters, self.outputs, self.names, state, base)
        finally:
            finish(state)
        return summarise(rt, rows, t0, base=cfg.model, base_loads=base.loads)


def pp_refusal(peft: str) -> str:
    """Why an adapter sweep does not run with pipeline stages (said by the run and by ``mpitp check`` alike)."""
    return (f"--peft {peft}: adapter sweeps run at --pp 1 (a pipeline stage renumbers its layers after loading); "
            "use --tp or one launch per adapter")


def prepare_adapter_sweep(cfg: EvalConfig, launch: Launch) -> AdapterSweepPlan:
    """The adapters and their outputs, agreed before torch starts; pipeline stages refused."""
    from mpitp.parallel.runtime import agree
    from mpitp.replica.loading import warm_for_load

    check_one_kind(cfg.model, cfg.peft, collective=True)
    if launch.layout.pp > 1:
        raise UsageError(pp_refusal(cfg.peft), collective=True)
    adapters = agree(lambda: expand_models(cfg.peft, "--peft"), launch.world.comm, launch.timeout,
                     "expanding --peft")
    names, outputs = name_outputs(cfg, "peft", adapters, launch)
    warm_for_load(launch.world, cfg.model)  # other ranks warm the loading code while rank 0 checks the first adapter
    return AdapterSweepPlan(cfg, adapters, names, outputs)
