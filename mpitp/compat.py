"""Every place mpitp reaches into a library's private surface or patches a library, in one table, each checked at
start-up and every patch undone after use.

mpitp speeds lm-eval up and shards transformers' models by replacing a handful of their attributes for the length of
one step (a ``simple_evaluate`` call, one ``from_pretrained``), and it reads or writes a few of their private names
(lm-eval's task index inside a ``TaskManager``, click's pending subcommand, transformers' PP forward wrap). Those are
not public API: a release may rename or drop any of them, and a patch that silently no longer applies would change
speed or, worse, results. So each one is named here (:data:`TARGETS`: the attribute, the package, the version range
it was tested on, its kind and the mpitp modules that use it; :func:`table` lists them), checked at start-up
(:func:`check`: one line naming the supported range when the installed version lacks it) and only ever reached
through this module: :func:`replaced` (put back in ``finally``), :func:`attribute` (called or read, never replaced)
and the few named helpers below, one per private name. ``tests/test_compat.py`` resolves every target and checks
that nothing stays replaced after a run; ``tests/test_compat_scan.py`` scans mpitp's syntax for a private reach
anywhere else.

Tree attention (:mod:`mpitp.replica.prefix`) is not a replacement at all: it is registered under its own name
(:data:`TREE_ATTENTION`) with transformers' attention and mask interfaces and set on mpitp's own model only, so the
global ``"sdpa"`` function every other model in the process uses is never touched.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpitp.errors import UsageError

if TYPE_CHECKING:
    import argparse
    import ast
    from collections.abc import Callable, Iterable, Iterator
    from contextlib import AbstractContextManager

    import click
    import torch
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedConfig, PreTrainedModel

#: The attention implementation name mpitp's model runs under while prefix sharing is on (see the module docstring).
TREE_ATTENTION = "mpitp_tree"

#: torch's private function that says where a DTensor's local shard starts (called, never replaced)
LOCAL_SHARD = "torch.distributed.tensor._utils.compute_local_shape_and_global_offset"
#: the source of a model's ``forward``, read as syntax (:func:`forward_tree`); checked on Llama's
FORWARD_SOURCE = "transformers.models.llama.modeling_llama.LlamaForCausalLM.forward"
#: ``torch.distributed`` as transformers' TP layers name it: replaced while a replica runs on CPU, so their
#: all-reduces go over MPI (:mod:`mpitp.parallel.cpu_reduce`, :meth:`mpitp.replica.shard.ReplicaShard.tp_reductions`)
TP_DIST = "transformers.distributed.tensor_parallel.dist"
#: whether ``generate`` builds a model's cache as a ``DynamicCache`` (a classmethod, called, never replaced)
DEFAULT_CACHE = "transformers.generation.utils.GenerationMixin._supports_default_dynamic_cache"
#: lm-eval's task index module (private): its names are read through :func:`attribute` with this prefix
TASK_INDEX = "lm_eval.tasks._index"

# The supported ranges: pyproject.toml's (tests/test_compat.py checks that they agree).
LM_EVAL = ">=0.4.13,<0.4.14"
TRANSFORMERS = ">=5.24,<5.26"
TORCH = ">=2.13,<2.14"
CLICK = ">=8.2"
PYTHON = ">=3.10"  # argparse's and socket's attributes: requires-python

#: What mpitp does with a target (the ``kind`` column of :func:`table`).
KINDS = {
    "replace": "replaced for the length of a block (replaced), put back after",
    "read": "called or read, never replaced (attribute)",
    "register": "a name added to a registry; nothing replaced",
    "instance": "private attributes of its instances read or set (names), through a helper here",
    "override": "a private method an mpitp subclass overrides (gone, the override would silently never run)",
    "source": "its source read as syntax (forward_tree)",
    "defer": "a name it imports at module level, bound to a stand-in that imports the real one on first use "
             "(mpitp.importpolicy)",
    "reuse": "a cached function answered, while the library imports, with what it computed before "
             "(mpitp.importpolicy)",
}


@dataclass(frozen=True)
class Target:
    """One third-party attribute mpitp replaces or relies on: ``module`` (import path), ``attribute`` (dotted inside
    it), the distribution it ships in and the version range mpitp is tested with; ``optional`` ones may be missing
    (the step then runs unpatched: slower, same results). ``kind``: one of :data:`KINDS`; ``names``: for an
    ``instance`` target, the private attributes its instances carry (checked: the class's or function's code names
    each of them). ``at_use``: checked where mpitp first uses it (:func:`require`), not at start-up, because importing
    its module costs every run that never uses it (the DCP reader's: 40 ms of rank 0's start)."""

    package: str
    module: str
    attribute: str
    supported: str
    user: str  # the mpitp modules that use it, comma-separated, for the error line and the table
    optional: bool = False
    kind: str = "replace"
    names: tuple[str, ...] = ()
    at_use: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    @property
    def users(self) -> tuple[str, ...]:
        return tuple(u.strip() for u in self.user.split(",") if u.strip())

    def owner(self) -> tuple[object, str]:
        """(the object holding the attribute, its last name)."""
        obj = importlib.import_module(self.module)
        *path, last = self.attribute.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, last


def _by_name(targets: tuple[Target, ...]) -> dict[str, Target]:
    """The targets by full name; a name declared twice is an error (the later would silently replace the first)."""
    out: dict[str, Target] = {}
    for t in targets:
        if t.name in out:
            raise ValueError(f"mpitp.compat: {t.name} is declared twice")
        out[t.name] = t
    return out


_TP = "transformers"
TARGETS: dict[str, Target] = _by_name((
    Target("lm-eval", "lm_eval.api.task", "Task.eval_docs", LM_EVAL, "mpitp.evaluation.eval_docs"),
    Target("lm-eval", "lm_eval.api.task", "ConfigurableTask.fewshot_docs", LM_EVAL,
           "mpitp.evaluation.eval_docs, mpitp.jobs.readiness_tasks"),
    Target("lm-eval", "lm_eval.utils", "apply_template", LM_EVAL, "mpitp.evaluation.templates"),
    Target("lm-eval", "lm_eval.utils", "env", LM_EVAL, "mpitp.evaluation.templates", kind="read"),
    Target("lm-eval", "lm_eval.evaluator", "_process_results", LM_EVAL, "mpitp.results.docscores"),
    Target("lm-eval", "lm_eval.caching.cache", "PATH", LM_EVAL, "mpitp.evaluation.requestcache"),
    Target("lm-eval", "lm_eval.api.task", "save_to_cache", LM_EVAL, "mpitp.evaluation.requestcache"),
    Target("lm-eval", "lm_eval.caching.cache", "_cache_file_path", LM_EVAL, "mpitp.evaluation.requestcache",
           kind="read"),
    Target("lm-eval", "lm_eval.tasks", "TaskManager.load", LM_EVAL, "mpitp.jobs.sweep"),
    Target("lm-eval", "lm_eval.tasks", "TaskManager", LM_EVAL, "mpitp.tasks.index", kind="instance",
           names=("_index", "_all_tasks", "_all_subtasks", "_all_groups", "_all_tags")),
    Target("lm-eval", TASK_INDEX, "TaskIndex", LM_EVAL, "mpitp.tasks.index", kind="read"),
    Target("lm-eval", TASK_INDEX, "Entry", LM_EVAL, "mpitp.tasks.index", kind="read"),
    Target("lm-eval", TASK_INDEX, "Kind", LM_EVAL, "mpitp.tasks.index, mpitp.tasks.layout", kind="read"),
    Target("lm-eval", TASK_INDEX, "log", LM_EVAL, "mpitp.tasks.index", kind="read"),
    Target("lm-eval", "lm_eval.tasks._yaml_loader", "load_yaml", LM_EVAL, "mpitp.tasks.index", kind="read"),
    Target("lm-eval", "lm_eval._cli.run", "Run", LM_EVAL, "mpitp.evaluation.lmeval_args", kind="read"),
    Target("lm-eval", "lm_eval._cli.utils", "key_val_to_dict", LM_EVAL, "mpitp.evaluation.model_args", kind="read"),
    Target("lm-eval", "lm_eval.evaluator_utils", "find_test_root", LM_EVAL, "mpitp.evaluation.lmeval_args",
           kind="read"),
    Target("lm-eval", "lm_eval._cli.utils", "request_caching_arg_to_dict", LM_EVAL, "mpitp.evaluation.lmeval_args",
           kind="read"),
    Target("lm-eval", "lm_eval.loggers.evaluation_tracker", "GeneralConfigTracker._get_model_name", LM_EVAL,
           "mpitp.evaluation.outputs", kind="read"),
    Target("lm-eval", "lm_eval.api.task", "ConfigurableTask", LM_EVAL, "mpitp.jobs.readiness_tasks", kind="instance",
           names=("_metric_fn_list",)),
    Target("lm-eval", "lm_eval.models.huggingface", "HFLM._model_generate", LM_EVAL, "mpitp.evaluation.lm",
           kind="override"),
    Target("lm-eval", "lm_eval.models.huggingface", "HFLM._loglikelihood_tokens", LM_EVAL, "mpitp.evaluation.lm",
           kind="override"),
    Target("lm-eval", "lm_eval.evaluator", "get_git_commit_hash", LM_EVAL, "mpitp.evaluation.envinfo"),
    Target("lm-eval", "lm_eval.loggers.utils", "get_commit_from_path", LM_EVAL, "mpitp.evaluation.envinfo"),
    Target("torch", "torch.utils.collect_env", "get_pretty_env_info", TORCH, "mpitp.evaluation.envinfo"),
    Target("torch", "torch.nn", "Module.forward", TORCH, "mpitp.replica.leader"),  # on the leader's model only
    # Not replaced, only called (private: where a DTensor's local shard sits in the whole tensor; :func:`attribute`)
    Target("torch", "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", TORCH,
           "mpitp.replica.scoring, mpitp.replica.adapters", kind="read"),
    # Classes a DCP ``.metadata`` pickle names: the restricted unpickler hands back exactly these
    Target("torch", "torch.distributed.checkpoint.filesystem", "_StorageInfo", TORCH, "mpitp.replica.dcp_read",
           kind="read", at_use=True),
    Target("torch", "torch.serialization", "_get_layout", TORCH, "mpitp.replica.dcp_read", kind="read"),
    Target(_TP, "transformers.modeling_utils", "safe_open", TRANSFORMERS, "mpitp.replica.loading", optional=True),
    # scipy's optimiser, bound at module level by transformers' detection losses: put off to its first call
    Target(_TP, "transformers.loss.loss_for_object_detection", "linear_sum_assignment", TRANSFORMERS,
           "mpitp.importpolicy", optional=True, kind="defer"),
    # requests, imported by lm-eval's utilities for its API models: put off to the first name read of it
    Target("lm-eval", "lm_eval.utils", "requests", LM_EVAL, "mpitp.importpolicy", optional=True, kind="defer"),
    # the scan of transformers' model folders: kept in this user's cache, reused by `transformers.models`
    Target(_TP, "transformers.utils.import_utils", "create_import_structure_from_path", TRANSFORMERS,
           "mpitp.importpolicy", optional=True, kind="reuse"),
    Target(_TP, "transformers.distributed.mixin", "apply_tensor_parallelism", TRANSFORMERS, "mpitp.replica.pipeline"),
    Target(_TP, "transformers.distributed.tensor_parallel", "dist", TRANSFORMERS,
           "mpitp.replica.shard, mpitp.replica.conv1d_tp"),
    Target(_TP, "transformers.distributed.pipeline_parallel", "apply_pipeline_parallelism", TRANSFORMERS,
           "mpitp.replica.pipeline", kind="instance", names=("_pp_forward_wrapped",)),
    Target(_TP, "transformers.models.llama.modeling_llama", "LlamaForCausalLM.forward", TRANSFORMERS,
           "mpitp.replica.logits, mpitp.replica.pipeline", kind="source"),
    # A checkpoint's conversions (a fused tensor split by transformers' Split after the TP shard is cut): read
    Target(_TP, "transformers.conversion_mapping", "get_checkpoint_conversion_mapping", TRANSFORMERS,
           "mpitp.replica.tp_plans", kind="read"),
    Target(_TP, "transformers.core_model_loading", "Split", TRANSFORMERS, "mpitp.replica.tp_plans", kind="read"),
    Target(_TP, "transformers.generation.utils", "GenerationMixin._supports_default_dynamic_cache", TRANSFORMERS,
           "mpitp.replica.generation", kind="read"),
    # --gen_kwargs checked before the load: the defaults and logits processors generate builds, called, its log quiet
    Target(_TP, "transformers.generation.configuration_utils", "GenerationConfig._get_default_generation_params",
           TRANSFORMERS, "mpitp.evaluation.gen_kwargs_check", kind="read"),
    Target(_TP, "transformers.generation.utils", "GenerationMixin._get_logits_processor", TRANSFORMERS,
           "mpitp.evaluation.gen_kwargs_check", kind="read"),
    Target(_TP, "transformers.generation.configuration_utils", "logger", TRANSFORMERS,
           "mpitp.evaluation.gen_kwargs_check"),
    # on the leader's model only, for one greedy call: lm-eval's stop criteria asked row by row (finished_rows)
    Target(_TP, "transformers.generation.utils", "GenerationMixin.generate", TRANSFORMERS,
           "mpitp.replica.finished_rows"),
    Target(_TP, "transformers.modeling_utils", "PreTrainedModel.get_output_embeddings", TRANSFORMERS,
           "mpitp.replica.generation"),  # the child it returns, swapped on mpitp's model: output_head_replaced
    Target(_TP, "transformers.modeling_utils", "PreTrainedModel", TRANSFORMERS,
           "mpitp.replica.dcp_load, mpitp.evaluation.api", kind="instance",
           names=("_is_hf_initialized", "_device_mesh")),
    Target(_TP, "transformers.modeling_utils", "PreTrainedModel._initialize_missing_keys", TRANSFORMERS,
           "mpitp.replica.dcp_load", kind="override"),
    Target(_TP, "transformers.models.auto.auto_factory", "_get_model_class", TRANSFORMERS, "mpitp.replica.dcp",
           kind="read"),
    Target(_TP, "transformers.configuration_utils", "PreTrainedConfig._attn_implementation", TRANSFORMERS,
           "mpitp.replica.prefix, mpitp.evaluation.api", kind="read"),
    Target(_TP, "transformers.modeling_utils", "AttentionInterface", TRANSFORMERS, "mpitp.replica.prefix",
           kind="register"),
    Target(_TP, "transformers.masking_utils", "AttentionMaskInterface", TRANSFORMERS, "mpitp.replica.prefix",
           kind="register"),
    Target(_TP, "transformers.masking_utils", "sdpa_mask", TRANSFORMERS, "mpitp.replica.prefix", kind="register"),
    # mpitp's own TP plans (mpitp.replica.tp_plans): a parallel style registered under a new name, nothing replaced
    Target(_TP, "transformers.distributed.parallel_utils", "ALL_PARALLEL_STYLES", TRANSFORMERS,
           "mpitp.replica.tp_plans", kind="register"),
    Target(_TP, "transformers.distributed.tensor_parallel", "PackedColwiseParallel", TRANSFORMERS,
           "mpitp.replica.channel_tp", kind="read"),
    # the Conv1D and channel styles (mpitp.replica.conv1d_tp, channel_tp): transformers' style base class, the
    # placement of a fused output and transformers' local-parameter swap (the ``dist`` their row split reduces
    # through is TP_DIST's target above)
    Target(_TP, "transformers.distributed.tensor_parallel", "TensorParallelLayer", TRANSFORMERS,
           "mpitp.replica.conv1d_tp, mpitp.replica.channel_tp", kind="read"),
    Target("torch", "torch.distributed.tensor.placement_types", "_StridedShard", TORCH,
           "mpitp.replica.conv1d_tp, mpitp.replica.channel_tp, mpitp.replica.dcp_read", kind="read"),
    Target(_TP, "transformers.distributed.parallel_utils", "_use_local_dtensor_params", TRANSFORMERS,
           "mpitp.replica.conv1d_tp, mpitp.replica.channel_tp", kind="read"),
    Target("click", "click.core", "Context", CLICK, "mpitp.cli.inspect", kind="instance", names=("_protected_args",)),
    Target("python", "argparse", "_ActionsContainer", PYTHON, "mpitp.evaluation.lmeval_args", kind="instance",
           names=("_actions", "_option_string_actions")),
    # mpitp check's network guard (process-wide while it checks)
    Target("python", "socket", "socket.connect", PYTHON, "mpitp.jobs.readiness_guard"),
    Target("python", "socket", "socket.connect_ex", PYTHON, "mpitp.jobs.readiness_guard"),
    Target("python", "socket", "getaddrinfo", PYTHON, "mpitp.jobs.readiness_guard"),
))


def _version(package: str) -> str:
    import platform
    from importlib import metadata

    if package == "python":
        return platform.python_version()
    for dist in (package, package.replace("-", "_")):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def code_names(obj: object) -> set[str]:
    """Every name the code of ``obj`` (a function, or every function of a class and its bases) loads or stores as an
    attribute or global, nested functions included: how :func:`missing` checks an ``instance`` target's names."""
    out: set[str] = set()

    def walk(code: types.CodeType) -> None:
        out.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    fns = [obj] if not isinstance(obj, type) else \
        [v for klass in obj.__mro__[:-1] for v in vars(klass).values()]
    for f in fns:
        f = f.fget if isinstance(f, property) else getattr(f, "__func__", f)
        if hasattr(f, "__code__"):
            walk(f.__code__)
    return out


def _present(t: Target) -> bool:
    try:
        owner, last = t.owner()
        if not hasattr(owner, last):
            return False
        if t.kind == "instance":
            return set(t.names) <= code_names(getattr(owner, last))
        if t.kind == "source":
            import inspect

            return bool(inspect.getsource(getattr(owner, last)))
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return True


def missing(targets: dict[str, Target] | None = None) -> list[str]:
    """One line per required target (of :data:`TARGETS`) the installed packages lack (empty when all are there)."""
    lines = []
    for t in (TARGETS if targets is None else targets).values():
        if not t.optional and not _present(t):
            what = f"{t.name} ({', '.join(t.names)})" if t.names else t.name
            lines.append(f"{what} (used by {t.user}) is missing from {t.package} {_version(t.package)}; "
                         f"mpitp supports {t.package}{t.supported}")
    return lines


def available(*keys: str) -> bool:
    """Whether every target of ``keys`` is there (for a step that falls back to the library's own way without)."""
    return not missing({k: TARGETS[k] for k in keys})


def check(collective: bool = False, packages: tuple[str, ...] | None = None) -> None:
    """At start-up: refuse, in one line, an installation whose lm-eval, transformers or torch lacks a target
    (``collective``: every rank checks, so every rank raises together). ``packages``: only those distributions'
    targets; resolving transformers' and torch's imports their model code (seconds), so ``mpitp eval`` checks
    lm-eval's first and theirs after the input checks, and bad input is refused without waiting for them. Targets
    checked ``at_use`` are left to :func:`require`."""
    _refuse({k: t for k, t in TARGETS.items() if (packages is None or t.package in packages) and not t.at_use},
            collective)


def require(*keys: str) -> None:
    """Before the first use of targets checked ``at_use``: the same one-line refusal as :func:`check`'s."""
    _refuse({k: TARGETS[k] for k in keys}, collective=False)


def _refuse(targets: dict[str, Target], collective: bool) -> None:
    lines = missing(targets)
    if lines:
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise UsageError(lines[0] + more, collective=collective)


def table() -> list[tuple[str, str, str, str]]:
    """(target, kind, tested versions, used by) per target: what mpitp reaches into, for review and
    ``python -m mpitp.compat``."""
    return [(f"{t.name} ({', '.join(t.names)})" if t.names else t.name, t.kind + (" (optional)" if t.optional else ""),
             f"{t.package}{t.supported}", ", ".join(t.users)) for t in TARGETS.values()]


def format_table() -> str:
    rows = [("target", "kind", "tested", "used by"), *table()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3] for r in rows)


def attribute(key: str) -> Any:
    """The object ``TARGETS[key]`` names (``key``: its full dotted name), for the private functions mpitp calls but
    does not replace: one place names them, :func:`check` refuses an installation without them."""
    owner, last = TARGETS[key].owner()
    return getattr(owner, last)


@contextlib.contextmanager
def _swap(owner, last: str, value):
    """``owner.last`` is ``value`` inside the block, put back in ``finally``; yields the original. Read from the
    owner's own ``__dict__``: a property must come back as the property object, and an attribute an instance only
    inherits is deleted again rather than copied onto it."""
    had_own = last in vars(owner)
    original = vars(owner)[last] if had_own else getattr(owner, last)
    setattr(owner, last, value)
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, last, original)
        else:
            delattr(owner, last)


def replaced(key: str, value: object, on: object | None = None) -> AbstractContextManager[Any]:
    """Inside this block ``TARGETS[key]`` (``key``: the target's full dotted name) is ``value`` (on ``on``, an
    instance, instead of the target's owner); the original is put back in ``finally``, whatever the block raises.
    Yields the original."""
    owner, last = TARGETS[key].owner()
    return _swap(owner if on is None else on, last, value)


@contextlib.contextmanager
def output_head_replaced(model: PreTrainedModel, head: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside this block the child module ``model.get_output_embeddings()`` returns is ``head`` (on this model only:
    the greedy head of :mod:`mpitp.replica.generation`); put back after. Set both ways through torch's own
    ``setattr`` (a child lives in the module's ``_modules``, not its ``__dict__``)."""
    current = model.get_output_embeddings()  # the model's own: a family names its head (GPT-NeoX-Japanese: embed_out)
    # a child, or deeper (BERT-generation's lm_head.decoder): found by identity, set on its parent
    name = next((n for n, mod in model.named_modules() if mod is current and n), None)
    if name is None:
        raise RuntimeError("could not locate the LM head among the model's modules")
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, head)
    try:
        yield current
    finally:
        setattr(parent, leaf, current)


# ------------------------------------------------------------------------------------------------ private names
def adopt_task_index(tm: TaskManager, index: dict) -> None:
    """Give the ``TaskManager`` ``tm`` the task index ``index`` as ``TaskManager.__init__`` (lm-eval 0.4.13) sets it
    up after ``TaskIndex.build`` (:mod:`mpitp.tasks.index` builds it from its cache instead)."""
    kind = attribute(f"{TASK_INDEX}.Kind")
    tm._index = index
    tm._all_tasks = sorted(index)
    tm._all_subtasks = sorted(k for k, e in index.items() if e.kind in (kind.TASK, kind.PY_TASK))
    tm._all_groups = sorted(k for k, e in index.items() if e.kind == kind.GROUP)
    tm._all_tags = sorted(k for k, e in index.items() if e.kind == kind.TAG)


def metric_functions(task: Task) -> dict:
    """``{metric: function or None}`` of an lm-eval task (None where ``evaluate`` could not load it)."""
    return getattr(task, "_metric_fn_list", None) or {}


def undo_pp_forward_wrap(model: PreTrainedModel) -> None:
    """Put back the class's ``forward`` on a model transformers' pipeline split wrapped with its naive PP forward
    (mpitp drives its stages itself), and clear the flag so a later split would wrap it again."""
    if "forward" in vars(model):
        del model.forward
    model._pp_forward_wrapped = False


def mark_initialised(params: Iterable[torch.nn.Parameter]) -> None:
    """Mark each parameter initialised, as transformers marks the ones it loaded (its init then skips them)."""
    for p in params:
        p._is_hf_initialized = True


def attention_implementation(config: PreTrainedConfig) -> str | None:
    """The attention implementation a transformers config runs under (None when it has none)."""
    return getattr(config, "_attn_implementation", None)


def device_mesh(model: PreTrainedModel) -> DeviceMesh | None:
    """The device mesh transformers' own TP loading left on ``model`` (None when it loaded it whole)."""
    return getattr(model, "_device_mesh", None)


def forward_tree(fn: Callable) -> ast.Module:
    """The syntax tree (:mod:`ast`) of ``fn``'s source, dedented: how mpitp learns what a model class's forward does
    around its head (:mod:`mpitp.replica.logits`) and its embeddings (:mod:`mpitp.replica.pipeline`) without a
    table of model types. Raises ``OSError``/``TypeError`` without source, ``SyntaxError`` when unreadable."""
    import ast
    import inspect
    import textwrap

    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def parser_actions(parser: argparse.ArgumentParser) -> list:
    """The actions of an ``argparse`` parser, in order (argparse has no public list of them)."""
    return list(parser._actions)


def add_option_alias(parser: argparse.ArgumentParser, action: argparse.Action, alias: str) -> bool:
    """Make ``alias`` another option string of ``action`` (``--batch-size`` for ``--batch_size``) unless the parser
    already has it; whether it was added."""
    if alias in parser._option_string_actions:
        return False
    action.option_strings.append(alias)
    parser._option_string_actions[alias] = action
    return True


def pending_subcommand(ctx: click.Context, name: list[str], args: list[str]) -> None:
    """Leave ``name`` (a subcommand, or nothing) and its ``args`` on a click context as ``click.Group.parse_args``
    leaves them, for ``Group.invoke`` to dispatch (a group that parses its own arguments first)."""
    ctx._protected_args, ctx.args = name, args


def register_tree_attention(fn: Callable) -> None:
    """Register ``fn`` as transformers' attention function :data:`TREE_ATTENTION`, with the ``sdpa`` mask (it runs
    ``sdpa`` whenever no tree is passed). Registration adds a name; it replaces nothing, so nothing is undone."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, fn)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)


if __name__ == "__main__":
    print(format_table())
