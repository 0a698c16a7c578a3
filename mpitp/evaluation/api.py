"""``mpitp.evaluate``: lm-eval numbers for a live, already-sharded model, from inside a running MPI job.

For a training or analysis script that already runs under ``mpirun`` and holds a TP-sharded transformers model:
no checkpoint, no reload. It runs the very code path of ``mpitp eval``
(:func:`mpitp.evaluation.runner.evaluate_loaded`) and
leaves the caller's world as it found it: the model back in its previous train/eval mode, no process group
destroyed, no message left in flight (a closing barrier, after success), autograd off only inside, the random
generators' states as they were.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from mpitp.parallel import comm as mpicomm
from mpitp.parallel.comm import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from mpitp.parallel.layout import Layout


def _infer_tp(model) -> tuple[int, object]:
    """TP degree and torch group of a model sharded by transformers (its own default world), else (1, None)."""
    import torch.distributed as dist

    tp = int(getattr(model, "tp_size", None) or 1)
    if tp > 1:
        return tp, None
    from mpitp import compat

    if dist.is_available() and dist.is_initialized() and compat.device_mesh(model) is not None:
        return dist.get_world_size(), None
    return 1, None


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | str, tasks: str | Sequence[str], *,
             layout: Layout | None = None, comm: MPI.Comm | None = None, batch_size: int = 1,
             limit: int | float | None = None, num_fewshot: int | None = None,
             include_path: str | list[str] | None = None, output: str | None = None,
             timeout: float = DEFAULT_TIMEOUT, max_length: int | None = None, device: str | None = None,
             overwrite: bool = True, **lm_eval_kwargs) -> dict | None:
    """Evaluate ``model`` (already on this rank, TP-sharded or whole) on lm-eval ``tasks`` (names, or one string of
    comma-separated names as ``mpitp eval --tasks`` takes). Collective.

    Every rank of ``comm`` (default COMM_WORLD) must call it with the same arguments. ``layout`` defaults to one
    inferred from the model's TP process group (tp=1 when it has none). Returns lm-eval's results dict on rank 0 of
    ``comm`` (each part of a split COMM_WORLD gets its own) and None elsewhere; writes HDF5 only when ``output`` is
    given (replacing it unless ``overwrite=False``).
    Extra keyword arguments go to ``lm_eval.simple_evaluate`` (``gen_kwargs``, ``log_samples``, ...);
    ``data_dir`` serves tasks offline from local files, as ``mpitp eval --data-dir`` does;
    ``skip_head_check=True`` skips the probe comparing the vocab-parallel head with the model's logits
    (:mod:`mpitp.replica.headcheck`); ``no_prefix_sharing=True`` scores every row on its own
    (:mod:`mpitp.replica.prefix`). ``timeout`` bounds the MPI waits (handing out requests, the end of the
    evaluation), not the call's last barrier, which waits without one (a rank that raised must reach the caller, not
    time out); the replica's torch collectives keep the timeout its process group was created with
    (``mpitp.start(timeout=...)``), which torch does not let a caller change afterwards.
    """
    _check_model(model)
    _check_timeout(timeout)
    model = _unwrapped(model)
    layout, group = layout_for(model, comm, layout)
    _refuse_adapters_under_tp(model, layout.tp)
    return _evaluate(model, tokenizer, tasks, layout, group, batch_size, limit, num_fewshot, include_path, output,
                     timeout, max_length, device, overwrite, lm_eval_kwargs)


def _check_model(model) -> None:
    """A model that is not a loaded module (a path, say) is the caller's mistake, named before any collective; every
    rank holds the same argument, so every rank raises alike."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"mpitp.evaluate takes a loaded model (a torch.nn.Module), not {type(model).__name__} "
                        f"{model!r:.80}: load it first, e.g. mpitp.load_model(path, rt.layout.tp, rt.device)")


def _check_timeout(timeout) -> None:
    """``timeout`` bounds the collectives from the first one on, so it is checked before them, on every rank (each
    holds the same value, so each refuses alike): -1 ran and failed in the first wait it bounded, and "60" (a string)
    failed in the arithmetic of a deadline. None waits without one."""
    from mpitp.errors import UsageError
    from mpitp.evaluation import setting_values as values

    if timeout is not None:
        try:
            values.yaml_timeout(timeout)
        except values.BadValue as exc:
            raise UsageError(f"mpitp.evaluate: timeout={timeout!r}: {exc}", collective=True) from None


def _unwrapped(model):
    """The transformers model inside the wrappers a training script holds: ``DistributedDataParallel`` (its
    ``module``; every rank a whole replica, as tp=1 is scored) and a PEFT model (``get_peft_model``: a LoRA being
    trained; its ``get_base_model()``, adapter layers in place, so its forward is the adapted one). Passed as they
    were, a DDP model failed on every rank with "'DistributedDataParallel' object has no attribute 'config'", and a
    PEFT model on rank 0 alone with "'CausalLMOutputWithPast' object has no attribute 'last_hidden_state'" (the
    wrapper's ``model`` attribute is the whole causal LM). peft is looked up only where the caller imported it."""
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def _refuse_adapters_under_tp(model, tp: int) -> None:
    """PEFT's adapter layers around TP-sharded linear layers are not scored: a LoRA beside a row-wise layer adds each
    rank's partial product after the layer's all-reduce, which no single-process model computes, and mpitp cannot
    tell such a placement from a sound one (and peft's ``merge_and_unload`` fails on DTensor shards). An adapter
    merged by ``load_model(peft=...)`` into each shard, and tp=1, are scored. Every rank holds the same model type
    and tp: collective."""
    peft = sys.modules.get("peft")
    if tp == 1 or peft is None:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    from mpitp.errors import UsageError

    found = next((name for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)), None)
    if found is not None:
        raise UsageError(f"mpitp.evaluate: the model has PEFT adapter layers ({found}, ...) around its tp={tp} shards, "
                         "which it cannot score as one model: save the adapter (save_pretrained) and evaluate "
                         "mpitp.load_model(path, tp, device, peft=ADAPTER_DIR), which merges it into each shard, or "
                         "evaluate at tp=1", collective=True)


_LAYOUTS: list[tuple] = []  # (our duplicate of the caller's communicator, tp, layout), one per layout ever used


def layout_for(model: PreTrainedModel, comm: MPI.Comm | None = None,
               layout: Layout | None = None) -> tuple[Layout, ProcessGroup | None]:
    """``(layout, torch group)``: the caller's layout, or one inferred from the model's TP group over ``comm``.

    Building a layout creates MPI communicators, and MPICH has about 2,048 context ids per process: a training
    loop evaluating every few hundred steps ran out after ~500 calls. So inferred layouts are cached, keyed by the
    communicator's group (``MPI.Comm.Compare`` against a duplicate we own, so a communicator the caller frees or
    recreates never matches a stale entry) and tp. Collective over ``comm`` when it builds one. Refuses a torch
    world that does not match the layout (:func:`check_torch_world`).
    """
    from mpi4py import MPI

    from mpitp.errors import UsageError
    from mpitp.parallel.layout import make_layout
    from mpitp.parallel.world import world_from_comm

    if layout is None:
        comm = comm if comm is not None else MPI.COMM_WORLD
        tp, group = _infer_tp(model)
        for dup, tp_cached, cached in _LAYOUTS:
            if tp_cached == tp and MPI.Comm.Compare(comm, dup) in (MPI.IDENT, MPI.CONGRUENT):
                layout = cached
                break
        else:
            dup = comm.Dup()
            layout = make_layout(world_from_comm(dup), tp)
            _LAYOUTS.append((dup, tp, layout))
    else:
        group = None
    if layout.pp > 1:
        raise UsageError("mpitp.evaluate takes TP-sharded or whole models; for pipeline stages use "
                         "`mpitp eval --pp N`", collective=True)
    check_torch_world(layout, group)
    return layout, group


def check_torch_world(layout: Layout, group: ProcessGroup | None) -> None:
    """mpitp runs a replica's TP collectives on the default torch world (``group`` None), so that world must be
    exactly the replica. A training script with one world over every rank and a (dp, tp) mesh would otherwise get
    broadcasts and reductions across replicas: a hang or garbage. Refused on every rank alike (collective)."""
    from mpitp.errors import UsageError

    if group is not None or layout.replica_size == 1:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(f"mpitp.evaluate: the model is sharded over tp={layout.tp} ranks but torch.distributed is "
                         f"not initialised", collective=True)
    size = dist.get_world_size()
    if size != layout.replica_size:
        raise UsageError(f"mpitp.evaluate needs one torch world per model replica: the torch world has {size} ranks "
                         f"but a replica has tp={layout.tp} (dp={layout.dp} replicas on {layout.world.size} MPI "
                         f"ranks); create the worlds with mpitp.parallel.runtime.start(tp={layout.tp}) instead of one "
                         "world with a (dp, tp) mesh", collective=True)


def _evaluate(model, tokenizer, tasks, layout, group, batch_size, limit, num_fewshot, include_path, output,
              timeout, max_length, device, overwrite, lm_eval_kwargs):
    import torch

    from mpitp.evaluation.checks import remove_generated
    from mpitp.evaluation.quiet import integration_hidden
    from mpitp.evaluation.runner import evaluate_loaded
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.replica_group import ReplicaGroup, backend_for
    from mpitp.parallel.runtime import Runtime

    output = os.fspath(output) if isinstance(output, os.PathLike) else output  # a pathlib.Path is a path too
    dev = _device(device, model)
    rt = Runtime(world=layout.world, layout=layout, device=dev, threads=torch.get_num_threads(), timeout=timeout,
                 replica_group=ReplicaGroup(size=layout.replica_size, rank=layout.replica_rank, tp_size=layout.tp,
                                            tp_rank=layout.tp_rank, backend=backend_for(dev), device=dev,
                                            tp_group=group))
    cfg_fields = {k: lm_eval_kwargs.pop(k) for k in CONFIG_KEYWORDS if k in lm_eval_kwargs}
    # The dtype the caller loaded the model in (the file's ``dtype``; "auto" would read as the checkpoint's own)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    cfg = EvalConfig(model=getattr(model, "name_or_path", type(model).__name__), dtype=dtype,
                     tokenizer=getattr(tokenizer, "name_or_path", tokenizer),
                     tasks=_task_names(tasks), batch_size=batch_size, limit=limit,
                     num_fewshot=num_fewshot, include_path=include_path, output=output, max_length=max_length,
                     overwrite=overwrite, **cfg_fields)
    if cfg.predict_only is True:  # as --predict_only implies --log_samples (the samples are the only output)
        cfg.log_samples = True
    from mpitp import compat

    compat.check(collective=True)  # every rank: the same installation (mpitp eval checks on rank 0, in check_all)
    tasks, claim = _checked(cfg, layout, timeout, lm_eval_kwargs, tokenizer)
    _recorded_as_mpitp_eval(cfg)
    was_training = model.training
    attention = compat.attention_implementation(model.config)  # prefix sharing may switch it to tree attention
    model.eval()
    try:
        with torch.no_grad(), _rng_kept(), integration_hidden():
            result = evaluate_loaded(model, tokenizer, cfg, rt, out=output,
                                     task_manager=tasks.task_manager if tasks is not None else None,
                                     extra_lm_eval=lm_eval_kwargs)
    finally:
        if tasks is not None:
            remove_generated(tasks.include)  # data_dir's task YAMLs: each call writes its own, in the temp folder
        if claim is not None:
            claim.release()
        model.train(was_training)
        if attention is not None and compat.attention_implementation(model.config) != attention:
            model.set_attn_implementation(attention)  # the caller's model goes back exactly as it came
    # Only after success: a rank that failed mid-forward leaves its peers inside a torch collective, which no barrier
    # can reach; its exception must go straight to the caller (or the abort) instead of waiting out the timeout.
    mpicomm.barrier(layout.world.comm, None, phase="end of mpitp.evaluate")
    return result


def _device(device, model) -> str:
    """The device the model's parameters are on, or the one named; a name torch does not know ("gpu") is refused on
    every rank alike before any work (it was a RuntimeError from ``torch.device`` on every rank once the checks had
    passed, which ended the job), and so is a device other than the model's ("cuda" for a model on the CPU: torch's
    AssertionError 'Torch not compiled with CUDA enabled' on every rank)."""
    import torch

    from mpitp.errors import UsageError

    on = next(model.parameters()).device
    if device is None:
        return str(on)
    try:
        named = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"mpitp.evaluate: device={device!r}: {str(exc).splitlines()[0]}", collective=True) from None
    if named.type != on.type:  # "cuda" for a model on the CPU: torch's AssertionError on every rank in the head check
        raise UsageError(f"mpitp.evaluate: device={device!r}, but the model's parameters are on {on}: move the model "
                         "there first (model.to(...)) or leave device out", collective=True)
    return str(named)


def _recorded_as_mpitp_eval(cfg) -> None:
    """The settings in ``mpitp eval``'s spelling, which the results file records and ``--resume`` compares: a
    ``gen_kwargs`` string as ``--gen_kwargs`` reads it (lm-eval's parser: a JSON object, else ``key=value`` pairs
    typed by ``key_val_to_dict``), and no ``tokenizer`` where it is the model's own (``--tokenizer`` not given). The
    file recorded ``'max_gen_toks=8'`` and the model's path as tokenizer, so ``mpitp eval --resume`` with the same
    settings refused it ("different settings: gen_kwargs 'max_gen_toks=8' in the file, {'max_gen_toks': 8} now;
    tokenizer '...' in the file, None now"). Every rank, after the checks passed: the same value everywhere."""
    from mpitp.evaluation.model_args import model_args_dict

    if cfg.tokenizer == cfg.model:
        cfg.tokenizer = None
    if isinstance(cfg.gen_kwargs, str) and cfg.gen_kwargs.strip():
        cfg.gen_kwargs = model_args_dict(cfg.gen_kwargs.strip(), "mpitp.evaluate: gen_kwargs")


def _task_names(tasks) -> list:
    """``"arc_easy,piqa"`` is two tasks, as ``mpitp eval --tasks`` and a job file's ``tasks:`` read it (lm-eval's
    ``simple_evaluate`` looked the whole string up as one name); a sequence is taken as given, checked on rank 0
    (:func:`_checked`: no empty or repeated name)."""
    if isinstance(tasks, str):
        return [t.strip() for t in tasks.split(",")]
    return list(tasks) if isinstance(tasks, (list, tuple)) else tasks  # anything else: refused by name on rank 0


@contextmanager
def _rng_kept():
    """The caller's random streams (Python's, NumPy's, torch's CPU and CUDA generators) as they were before the call.
    lm-eval's ``simple_evaluate`` reseeds all of them (0, 1234, 1234): a training loop evaluating every N steps had
    its shuffles and dropout masks restarted from those seeds after each call (``np.random.rand()`` right after a
    call was 0.1915, NumPy's first draw under seed 1234, whatever the script had seeded)."""
    import random

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _checked(cfg, layout: Layout, timeout: float, lm_eval_kwargs: dict, tokenizer=None):
    """The run's values, keywords and task names checked on global rank 0 before any rank starts serving, the verdict
    shared (:func:`mpitp.parallel.runtime.agree`): a refusal is a :class:`~mpitp.errors.UsageError` on every rank
    alike. Found on rank 0 alone after the others had begun to serve, an unknown task, ``limit=0``, ``max_length=1``
    (a UsageError on rank 0 alone once the first request did not fit; ``num_fewshot=-1`` ran) or a keyword
    ``simple_evaluate`` does not take (a TypeError from inside lm-eval) left them inside a collective until the
    deadline (an hour by default); so did ``gen_kwargs`` that ``mpitp eval`` refuses (``max_gen_toks=abc``, a
    ValueError; ``use_cache=False``, a TypeError from ``generate`` on the leader alone), and an output ``mpitp eval``
    refuses up front (a directory, a FIFO, a folder that takes no files: an IsADirectoryError from the results writer
    on rank 0 once the requests were computed); so did ``limit`` with ``samples`` (lm-eval's ValueError), a
    tokenizer path that does not load, a ``seed`` of three values (an IndexError) or -1 (NumPy's
    ValueError), and ``limit="5"`` (now read as 5 on every rank).
    Returns, on rank 0, the :class:`~mpitp.evaluation.checks.CheckedTasks` (lm-eval's TaskManager and the include
    path, with ``data_dir``'s task YAMLs to remove afterwards) and the claim on ``output`` (one writer per file, as
    ``mpitp eval`` holds it; None without one); (None, None) elsewhere."""
    from mpitp.errors import UsageError
    from mpitp.evaluation import setting_values as values
    from mpitp.evaluation.checks import (
        check_gen_kwargs,
        check_output,
        check_tasks_once,
        remove_generated,
        run_task_names,
    )
    from mpitp.evaluation.gen_kwargs_check import check_generation
    from mpitp.evaluation.lmeval_args import check_integrity_runnable
    from mpitp.evaluation.picked import check_samples
    from mpitp.parallel.runtime import agree
    from mpitp.results.claim import claim_output

    built = []

    def check() -> int | float | None:
        at_least = values.yaml_int_at_least
        for name, value, rule in (("limit", cfg.limit, values.limit_value),
                                  ("batch_size", cfg.batch_size, values.yaml_batch_size),
                                  ("num_fewshot", cfg.num_fewshot, at_least(0, "an integer >= 0")),
                                  ("max_length", cfg.max_length, at_least(2, "an integer >= 2 (tokens)")),
                                  ("bootstrap_iters", cfg.bootstrap_iters, at_least(0, "an integer >= 0")),
                                  ("seed", cfg.seed, values.seeds_value),
                                  ("gen_kwargs", cfg.gen_kwargs, values.yaml_gen_kwargs),
                                  ("apply_chat_template", cfg.apply_chat_template, values.bool_or_name),
                                  ("output", cfg.output, values.string_value),
                                  ("include_path", cfg.include_path, values.paths_value),
                                  ("data_dir", cfg.data_dir, values.string_value),
                                  *((name, getattr(cfg, name), values.flag_value) for name in _FLAGS),
                                  ("system_instruction", cfg.system_instruction, values.string_value),
                                  ("max_batch_size", cfg.max_batch_size, at_least(1, "an integer >= 1")),
                                  ("tasks", cfg.tasks, values.yaml_tasks)):
            try:
                if value is not None or name == "tasks":  # the one setting without a default
                    rule(value)
            except values.BadValue as exc:
                raise UsageError(f"mpitp.evaluate: {name}={value!r}: {exc}") from None
        if cfg.samples is not None and cfg.limit is not None:
            raise UsageError("mpitp.evaluate: limit and samples exclude each other (lm-eval scores either each task's "
                             "first documents or the listed ones): pass one of them")
        if cfg.check_integrity:
            check_integrity_runnable("mpitp.evaluate: check_integrity=True")
        if lm_eval_kwargs.get("use_cache") is not None:
            raise UsageError(f"mpitp.evaluate: use_cache={lm_eval_kwargs['use_cache']!r} is refused: lm-eval's cache "
                             "of model responses is keyed by the request, not the weights, so a live model's later "
                             "calls would get its first call's scores; each call computes afresh (output= keeps them)")
        unknown = sorted(set(lm_eval_kwargs) - set(_simple_evaluate_keywords()))
        if unknown:
            known = [*_simple_evaluate_keywords(), *CONFIG_KEYWORDS]
            hint = values.suggest(unknown[0], known)
            raise UsageError(f"mpitp.evaluate: unknown keyword argument {unknown[0]!r}{hint}: "
                             "neither mpitp.evaluate's own nor one of lm_eval.simple_evaluate's")
        check_generation(check_gen_kwargs(cfg.gen_kwargs, layout.tp, layout.pp))
        if isinstance(tokenizer, str) or cfg.apply_chat_template:
            _check_tokenizer(tokenizer, cfg.apply_chat_template)
        if cfg.output and not cfg.overwrite and os.path.exists(cfg.output):
            # here, on rank 0 (which writes it), not on every rank: a rank whose working folder or node had no such
            # file went on to these checks while rank 0 raised, and waited out the timeout (an hour by default)
            raise UsageError(f"mpitp.evaluate: output {cfg.output} already exists (pass overwrite=True)")
        if cfg.output:
            check_output(cfg)
        tasks = check_tasks_once(cfg)
        try:
            check_samples(cfg.samples, run_task_names(cfg.tasks, tasks.task_manager),
                          tasks.task_manager.all_tasks, bool(lm_eval_kwargs.get("cache_requests")),
                          "mpitp.evaluate: samples")
            claim = claim_output(cfg.output) if cfg.output else None  # last: a refusal must leave no claim behind
        except BaseException:
            remove_generated(tasks.include)
            raise
        built.append((tasks, claim))
        return None if cfg.limit is None else values.limit_value(cfg.limit)

    # limit="5" is 5 documents, as on the command line; passed on as the string, lm-eval's `limit < 1.0` raised a
    # TypeError on rank 0 alone. Every rank takes the number rank 0 read.
    cfg.limit = agree(check, layout.world.comm, timeout, "checking mpitp.evaluate's settings")
    return built[0] if built else (None, None)


def _check_tokenizer(tokenizer, chat: bool | str) -> None:
    """A tokenizer named by path or hub id loads on rank 0 (lm-eval loads it there, and each DP leader): one that does
    not was an OSError on rank 0 alone once the run had begun, its peers left serving. ``chat``
    (``apply_chat_template=True``): it has a chat template, which lm-eval's run checks on rank 0 only after the
    others began to serve (:meth:`mpitp.evaluation.lm.MPITPLM.check_chat_template`, a UsageError there alone); so
    did a template's name (``apply_chat_template="default"``: its peer waited for rank 0 for ever)."""
    from transformers import AutoTokenizer

    from mpitp.errors import UsageError

    if isinstance(tokenizer, str):
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ... for a missing one
            raise UsageError(f"mpitp.evaluate: tokenizer {tokenizer!r} cannot be loaded: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"mpitp.evaluate: apply_chat_template={chat!r}, but the tokenizer has no chat template "
                         f"({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)})")


#: The run's settings that are flags: True or False (the string "no" read as true and skipped the head check).
_FLAGS = ("log_samples", "skip_head_check", "no_prefix_sharing", "overwrite", "write_out", "predict_only",
          "check_integrity", "confirm_run_unsafe_code", "fewshot_as_multiturn")
#: lm-eval's flags among them (``fewshot_as_multiturn`` None: lm-eval's rule, on with a chat template).
_LM_EVAL_FLAGS = _FLAGS[4:]

#: Keywords :func:`evaluate` takes into the run's :class:`~mpitp.evaluation.settings.EvalConfig` (recorded in the
#: results file, as ``mpitp eval`` records them) rather than handing them to ``lm_eval.simple_evaluate``.
#: lm-eval's own settings among them went on to ``simple_evaluate`` unrecorded: ``system_instruction="..."`` left the
#: file's config without it (``mpitp eval --system_instruction`` records it, and resume compares it) and
#: ``max_batch_size=2`` with ``batch_size="auto"`` picked 64, which only the configuration's value bounds.
CONFIG_KEYWORDS = ("gen_kwargs", "apply_chat_template", "log_samples", "bootstrap_iters", "seed", "skip_head_check",
                   "no_prefix_sharing", "data_dir", "samples", "max_batch_size", "system_instruction", *_LM_EVAL_FLAGS)


def _simple_evaluate_keywords() -> list[str]:
    """The keywords a caller may pass on to ``lm_eval.simple_evaluate``: its parameters, less those mpitp sets."""
    import inspect

    import lm_eval

    return [k for k in inspect.signature(lm_eval.simple_evaluate).parameters if k not in ("model", "tasks")]
