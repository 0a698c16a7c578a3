"""Every place mpitp reaches into lm-eval, transformers or torch internals, in one table, each undone after use.

mpitp speeds lm-eval up and shards transformers' models by replacing a handful of their attributes for the length of
one step (a ``simple_evaluate`` call, one ``from_pretrained``). Those attributes are not public API: a release may
rename or drop any of them, and a patch that silently no longer applies would change speed or, worse, results. So
each one is named here (:data:`TARGETS`: the attribute, the package and the version range it was tested on), checked
at start-up (:func:`check`: one line naming the supported range when the installed version lacks it) and only ever
replaced through :func:`replaced`, which puts the original back in ``finally``. ``tests/test_compat.py`` resolves
every target and checks that nothing stays replaced after a run.

Tree attention (:mod:`mpitp.replica.prefix`) is not a replacement at all: it is registered under its own name
(:data:`TREE_ATTENTION`) with transformers' attention and mask interfaces and set on mpitp's own model only, so the
global ``"sdpa"`` function every other model in the process uses is never touched.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

from mpitp.errors import UsageError

#: The attention implementation name mpitp's model runs under while prefix sharing is on (see the module docstring).
TREE_ATTENTION = "mpitp_tree"

#: torch's private function that says where a DTensor's local shard starts (called, never replaced)
LOCAL_SHARD = "torch.distributed.tensor._utils.compute_local_shape_and_global_offset"

# The supported ranges: pyproject.toml's (tests/test_compat.py checks that they agree).
LM_EVAL = ">=0.4.13,<0.5"
TRANSFORMERS = ">=5.24,<6"
TORCH = ">=2.13,<2.14"


@dataclass(frozen=True)
class Target:
    """One third-party attribute mpitp replaces or relies on: ``module`` (import path), ``attribute`` (dotted inside
    it), the distribution it ships in and the version range mpitp is tested with; ``optional`` ones may be missing
    (the step then runs unpatched: slower, same results)."""

    package: str
    module: str
    attribute: str
    supported: str
    user: str  # the mpitp module that uses it, for the error line
    optional: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attribute}"

    def owner(self):
        """(the object holding the attribute, its last name)."""
        obj = importlib.import_module(self.module)
        *path, last = self.attribute.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, last


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("lm-eval", "lm_eval.api.task", "Task.eval_docs", LM_EVAL, "mpitp.evaluation.eval_docs"),
    Target("lm-eval", "lm_eval.utils", "apply_template", LM_EVAL, "mpitp.evaluation.templates"),
    Target("lm-eval", "lm_eval.utils", "env", LM_EVAL, "mpitp.evaluation.templates"),
    Target("lm-eval", "lm_eval.evaluator", "_process_results", LM_EVAL, "mpitp.results.docscores"),
    Target("lm-eval", "lm_eval.caching.cache", "PATH", LM_EVAL, "mpitp.evaluation.requestcache"),
    Target("lm-eval", "lm_eval.tasks", "TaskManager.load", LM_EVAL, "mpitp.jobs.sweep"),
    Target("torch", "torch.utils.collect_env", "get_pretty_env_info", TORCH, "mpitp.evaluation.runner"),
    Target("transformers", "transformers.modeling_utils", "safe_open", TRANSFORMERS, "mpitp.replica.loading",
           optional=True),
    Target("transformers", "transformers.distributed.mixin", "apply_tensor_parallelism", TRANSFORMERS,
           "mpitp.replica.pipeline"),
    Target("transformers", "transformers.modeling_utils", "AttentionInterface", TRANSFORMERS, "mpitp.replica.prefix"),
    Target("transformers", "transformers.masking_utils", "AttentionMaskInterface", TRANSFORMERS,
           "mpitp.replica.prefix"),
    Target("transformers", "transformers.masking_utils", "sdpa_mask", TRANSFORMERS, "mpitp.replica.prefix"),
    # Not replaced, only called (private: where a DTensor's local shard sits in the whole tensor; :func:`attribute`)
    Target("torch", "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", TORCH,
           "mpitp.replica.scoring, mpitp.replica.adapters"),
)}


def _version(package: str) -> str:
    from importlib import metadata

    for dist in (package, package.replace("-", "_")):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def missing(targets: dict[str, Target] | None = None) -> list[str]:
    """One line per required target (of :data:`TARGETS`) the installed packages lack (empty when all are there)."""
    lines = []
    for t in (TARGETS if targets is None else targets).values():
        try:
            owner, last = t.owner()
            if hasattr(owner, last):
                continue
        except (ImportError, AttributeError):
            pass
        if not t.optional:
            lines.append(f"{t.name} (used by {t.user}) is missing from {t.package} {_version(t.package)}; "
                         f"mpitp supports {t.package}{t.supported}")
    return lines


def check(collective: bool = False, packages: tuple[str, ...] | None = None) -> None:
    """At start-up: refuse, in one line, an installation whose lm-eval, transformers or torch lacks a target
    (``collective``: every rank checks, so every rank raises together). ``packages``: only those distributions'
    targets; resolving transformers' and torch's imports their model code (seconds), so ``mpitp eval`` checks
    lm-eval's first and theirs after the input checks, and bad input is refused without waiting for them."""
    lines = missing({k: t for k, t in TARGETS.items() if packages is None or t.package in packages})
    if lines:
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise UsageError(lines[0] + more, collective=collective)


def attribute(key: str):
    """The object ``TARGETS[key]`` names (``key``: its full dotted name), for the private functions mpitp calls but
    does not replace: one place names them, :func:`check` refuses an installation without them."""
    owner, last = TARGETS[key].owner()
    return getattr(owner, last)


@contextlib.contextmanager
def replaced(key: str, value, on=None):
    """Inside this block ``TARGETS[key]`` (``key``: the target's full dotted name) is ``value`` (on ``on``, an
    instance, instead of the target's owner); the original is put back in ``finally``, whatever the block raises.
    Yields the original."""
    target = TARGETS[key]
    owner, last = target.owner()
    if on is not None:
        owner = on
    # Read from the owner's own __dict__: a property must come back as the property object, and an attribute an
    # instance only inherits is deleted again rather than copied onto it.
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


def register_tree_attention(fn) -> None:
    """Register ``fn`` as transformers' attention function :data:`TREE_ATTENTION`, with the ``sdpa`` mask (it runs
    ``sdpa`` whenever no tree is passed). Registration adds a name; it replaces nothing, so nothing is undone."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, fn)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
