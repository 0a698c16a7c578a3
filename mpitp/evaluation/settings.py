"""The evaluation settings, declared once: :class:`EvalConfig`'s fields and :data:`RUNTIME`.

Each setting says here, and nowhere else, its name, type and default, whether it enters the resume identity, how a
job file's YAML value is read (``job=``), and which of mpitp's own command-line options sets it (``cli=``). From this
declaration come the job-file schema (:mod:`mpitp.jobs.jobfile`: its fields, checkers, nullability and ``RunSpec``),
a job run's :class:`EvalConfig` (:mod:`mpitp.jobs.jobrun`), mpitp's options of ``mpitp eval``
(:mod:`mpitp.evaluation.lmeval_args`; lm-eval's own flags come from lm-eval's parser) and the resume identity
(:meth:`EvalConfig.identity`). A new setting is one field here.

The rules a value follows are shared by every source (:func:`limit_value` is lm-eval's reading of ``--limit``,
:data:`DTYPES` the loader's); only the wording of a refusal differs, each in its source's style (argparse's
``--flag: must be ...`` on the command line, ``field 'x': expected ...`` in job files). This module imports no
heavy library: a job file is checked on a login node in well under a second.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from mpitp.replica.loading import DTYPES

ALWAYS = "always"
"""In the resume identity always (the settings older files were written with)."""
IF_SET = "if_set"
"""In the resume identity only when set: later settings, so files written before them still resume."""


class BadValue(ValueError):
    """A setting's value is refused; ``str()`` is the reason (the caller names the file, run and field or flag)."""


class FrozenDict(dict):
    """A read-only mapping that pickles (a job's runs are broadcast to every rank; ``MappingProxyType`` cannot be)."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("a job file's settings are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def thaw(value):
    """A frozen job-file value as plain mutable Python (dicts, lists), so the callee may change its copy."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------- shared value rules


def limit_value(v) -> int | float:
    """lm-eval's ``--limit``: a number < 1 is a fraction of each task's documents, one >= 1 a count of documents
    (``lm_eval.evaluator_utils.get_sample_size``: ``ceil(n * limit) if limit < 1.0 else int(limit)``), so 1.0 is
    one document. A whole count is kept as an int (the same meaning, and the spelling resume identities use)."""
    given = v
    if isinstance(v, bool):
        raise BadValue(f"expected a number, got {v!r}")
    if not isinstance(v, (int, float)):
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise BadValue(f"expected a number, got {v!r}") from None
    if not v > 0:
        raise BadValue(f"must be > 0, got {given}")
    if v == math.inf:
        raise BadValue(f"must be a finite number, got {given}")
    return int(v) if v >= 1 and v == int(v) else v


def batch_size_value(value) -> int | str:
    """lm-eval's batch size: a positive integer, ``auto`` or ``auto:N`` (N >= 1)."""
    text = str(value).strip()
    if text == "auto":
        return "auto"
    if text.startswith("auto:"):
        n = text[5:]
        if n.isdigit() and int(n) >= 1:
            return f"auto:{int(n)}"
        raise BadValue(f"expected auto:N with N a positive integer, got {value!r}")
    try:
        v = int(text)
    except ValueError:
        raise BadValue(f"expected a positive integer, 'auto' or 'auto:N', got {value!r}") from None
    if v < 1:
        raise BadValue(f"must be >= 1, got {value}")
    return value if isinstance(value, int) else text  # as typed: lm-eval records the string it was given


# ------------------------------------------------------------------------------- reading a job file's YAML value


def show(value: Any) -> str:
    if value is None:
        return "an empty value"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def suggest(word: Any, options) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def yaml_string(v: Any) -> str:
    if isinstance(v, str) and v.strip():
        return v.strip()
    hint = " (quote it in YAML)" if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
    raise BadValue(f"expected a non-empty string, got {show(v)}{hint}")


def yaml_int_at_least(lo: int, what: str) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if _is_int(v) and v >= lo:
            return v
        raise BadValue(f"expected {what}, got {show(v)}")
    return check


def yaml_dtype(v: Any) -> str:
    if v in DTYPES:
        return v
    choices = ", ".join(repr(d) for d in DTYPES)
    raise BadValue(f"expected one of {choices}, got {show(v)}{suggest(v, DTYPES)}")


def yaml_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise BadValue(f"expected true or false, got {show(v)}")


def yaml_limit(v: Any) -> int | float:
    """:func:`limit_value`'s rule; YAML is typed, so a quoted number or a count with a fraction (1.5) is refused as
    the slip it most likely is."""
    ok = (_is_int(v) or isinstance(v, float)) and not isinstance(v, bool) and 0 < v < math.inf
    if not ok or (v > 1 and v != int(v)):
        raise BadValue(f"expected a positive integer (examples per task) or a fraction in (0, 1), got {show(v)}")
    return limit_value(v)


def yaml_timeout(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf:
        return float(v)
    raise BadValue(f"expected a positive number of seconds, got {show(v)}")


def yaml_tasks(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise BadValue(f"expected a list of task names or a comma-separated string, got {show(v)}")
    tasks: list[str] = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, str):
            raise BadValue(f"item {i}: expected a task name, got {show(item)}")
        for task in (t.strip() for t in item.split(",")):
            if not task:
                raise BadValue(f"empty task name in {show(item)}")
            if task in tasks:
                raise BadValue(f"task {task!r} is listed twice")
            tasks.append(task)
    if not tasks:
        raise BadValue("expected at least one task")
    return tuple(tasks)


def yaml_gen_kwargs(v: Any) -> str | FrozenDict:
    """A string (``temperature=0,top_p=1``, read by lm-eval) or a mapping, which reaches lm-eval as the dict it is:
    ``until: ["\\n\\n"]`` stays a list of stop strings."""
    if isinstance(v, str):
        return v.strip()
    if not isinstance(v, dict):
        raise BadValue(f"expected a string like 'temperature=0,top_p=1' or a mapping, got {show(v)}")
    out: dict[str, Any] = {}
    for key, val in v.items():
        if not isinstance(key, str):
            raise BadValue(f"key {show(key)}: expected a string key")
        scalar = (str, int, float, bool)
        if isinstance(val, list) and all(isinstance(x, scalar) for x in val):
            val = tuple(val)
        elif not isinstance(val, scalar):
            raise BadValue(f"key {key!r}: expected a number, string, boolean or list of them, got {show(val)}")
        out[key] = val
    return FrozenDict(out)


def yaml_output(v: Any) -> str:
    v = yaml_string(v)
    if not v.endswith((".h5", ".hdf5")):
        raise BadValue(f"expected a path ending in .h5, got {show(v)}")
    return v


def yaml_batch_size(v: Any) -> int | str:
    """lm-eval's batch size: a positive integer, ``auto`` or ``auto:N``."""
    if _is_int(v) and v >= 1:
        return v
    if isinstance(v, str) and (v == "auto" or (v.startswith("auto:") and v[5:].isdigit() and int(v[5:]) >= 1)):
        return v
    raise BadValue(f"expected a positive integer, 'auto' or 'auto:N', got {show(v)}")


def yaml_mapping(v: Any) -> str | FrozenDict:
    """An lm-eval dict setting (model_args, metadata, wandb_args ...): a mapping, or lm-eval's ``k=v,k2=v2``."""
    if isinstance(v, str):
        return v.strip()
    if isinstance(v, dict):
        return FrozenDict({k: (FrozenDict(x) if isinstance(x, dict) else x) for k, x in v.items()})
    raise BadValue(f"expected a mapping or a string like 'key=value,key2=value2', got {show(v)}")


# -------------------------------------------------------------------------------- reading a command-line value


def _cli(parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    """A shared rule as an argparse ``type``: its refusal becomes ``--flag: reason``."""
    def check(value: str):
        try:
            return parse(value)
        except BadValue as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    check.__name__ = getattr(parse, "__name__", "value")
    return check


def cli_int_at_least(lo: int) -> Callable[[str], int]:
    def check(value: str) -> int:
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return v
    return check


def cli_positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return v


cli_limit = _cli(limit_value)
cli_batch_size = _cli(batch_size_value)

RESULTS = "mpitp: HDF5 results and offline data"
LAYOUT = "mpitp: parallel layout"
SWEEPS = "mpitp: checkpoint sweeps (--model 'ckpts/step-*' or a comma list evaluates each)"
SHORTHANDS = "mpitp: model_args shorthands (the same as --model_args key=value)"
CLI_GROUPS = (LAYOUT, RESULTS, SWEEPS, SHORTHANDS)
"""mpitp's option groups in ``mpitp eval --help``, in this order."""


def cli(*flags: str, group: str, shorthand: bool = False, **argparse_kwargs) -> dict:
    """One of mpitp's own command-line options: ``argparse.add_argument`` arguments and its help group.
    ``shorthand``: the same as ``--model_args key=value`` (merged into model_args, disagreements refused)."""
    return dict(flags=flags, group=group, shorthand=shorthand, kwargs=argparse_kwargs)


# ---------------------------------------------------------------------------------------------- the declaration


def setting(default=None, *, factory: Callable[[], Any] | None = None, identity: str | None = None,
            job: Callable[[Any], Any] | None = None, lm_eval: bool = False, cli: dict | None = None):
    """A field of :class:`EvalConfig` with what the rest of mpitp derives from it.

    ``identity``: :data:`ALWAYS` or :data:`IF_SET` when the setting changes results (resume compares it).
    ``job``: the job-file field of that name and its YAML reader. ``lm_eval``: an lm-eval ``EvaluatorConfig`` field of
    that name, taken over with its meaning: ``mpitp eval`` copies it from lm-eval's parsed command line, a job file
    names it so and it is applied as ``--FIELD`` is (``mpitp.evaluation.lmeval_args.apply_lm_eval_settings``:
    model_args split and refused, predict_only implying log_samples ...; its YAML reader follows the field's type).
    ``cli``: mpitp's own ``mpitp eval`` option for it (lm-eval's flags come from lm-eval's parser, so they are not
    declared again here).
    """
    meta = dict(identity=identity, job=job, lm_eval=lm_eval, cli=cli)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EvalConfig:
    """Everything that defines an evaluation (lm-eval's vocabulary). Resume compares the ``identity`` part.

    The fields after ``skip_head_check`` are lm-eval's settings that ``mpitp eval`` took over from ``lm_eval`` (see
    :mod:`mpitp.evaluation.lmeval_args`); their defaults are lm-eval's, so older results files still resume.
    """

    model: str | None = setting(identity=ALWAYS, job=yaml_string)
    tasks: list[str] = setting(factory=list, identity=ALWAYS, job=yaml_tasks)
    tokenizer: str | None = setting(identity=ALWAYS, job=yaml_string,
                                    cli=cli("--tokenizer", group=SHORTHANDS, shorthand=True,
                                            help="model_args tokenizer="))
    revision: str | None = setting(identity=ALWAYS, job=yaml_string,
                                   cli=cli("--revision", group=SHORTHANDS, shorthand=True,
                                           help="model_args revision="))
    dtype: str = setting("auto", identity=ALWAYS, job=yaml_dtype,
                         cli=cli("--dtype", group=SHORTHANDS, shorthand=True, choices=DTYPES,
                                 help="model_args dtype="))
    num_fewshot: int | None = setting(identity=ALWAYS, job=yaml_int_at_least(0, "a non-negative integer"))
    limit: int | float | None = setting(identity=ALWAYS, job=yaml_limit)
    batch_size: int | str = setting(1, job=yaml_batch_size)
    max_length: int | None = setting(identity=ALWAYS, job=yaml_int_at_least(1, "a positive integer"),
                                     cli=cli("--max-length", group=SHORTHANDS, shorthand=True,
                                             type=cli_int_at_least(2), help="model_args max_length="))
    gen_kwargs: str | dict | None = setting(identity=ALWAYS, job=yaml_gen_kwargs)
    apply_chat_template: bool | str = setting(False, identity=ALWAYS, job=yaml_bool)
    include_path: str | list[str] | None = setting(job=yaml_string)
    seed: int | list | None = setting(identity=ALWAYS, job=yaml_int_at_least(0, "a non-negative integer"))
    output: str | None = setting(job=yaml_output, cli=cli(
        "--output", group=RESULTS,
        help="HDF5 results file (default: beside --output_path's files, else results/<model>-<time>.h5)."))
    resume: bool = setting(False, cli=cli("--resume", group=RESULTS, action="store_true",
                                          help="Continue an existing --output file."))
    overwrite: bool = setting(False, cli=cli("--overwrite", group=RESULTS, action="store_true",
                                             help="Replace an existing --output file."))
    data_dir: str | None = setting(identity=ALWAYS, job=yaml_string,
                                   cli=cli("--data-dir", group=RESULTS,
                                           help="Serve stock tasks offline from DIR/<task>/<split>.jsonl."))
    log_samples: bool = setting(False, job=yaml_bool)
    demo: bool = setting(False, cli=cli("--demo", group=RESULTS, action="store_true",
                                        help="Built-in offline demo: tiny random Llama, three small tasks."))
    bootstrap_iters: int = setting(100000, cli=cli("--bootstrap-iters", group=RESULTS, type=cli_int_at_least(0),
                                                   help="Bootstrap iterations for stderr (default 100000, as "
                                                        "lm-eval)."))
    trust_remote_code: bool = setting(False, identity=IF_SET, lm_eval=True)  # the model's code runs: recorded
    no_prefix_sharing: bool = setting(False, job=yaml_bool, cli=cli(  # see mpitp.replica.prefix
        "--no-prefix-sharing", group=RESULTS, action="store_true",
        help="Score every row on its own, even where rows share their context (by default such rows are scored as "
             "one tree, the context read once; same log-likelihoods up to rounding)."))
    skip_head_check: bool = setting(False, cli=cli(  # see mpitp.replica.headcheck: what it risks is said when used
        "--skip-head-check", group=RESULTS, action="store_true",
        help="Do not compare the vocab-parallel head with the model's own logits on a probe after loading (saves "
             "one small forward; risks wrong log-likelihoods for a model whose forward changes its logits in a way "
             "mpitp does not apply)."))
    model_source: str = setting("hf")
    model_args: dict | None = setting(lm_eval=True)
    hflm_args: dict | None = setting(identity=IF_SET)
    attn_implementation: str | None = setting(identity=IF_SET)
    subfolder: str | None = setting(identity=IF_SET)
    max_batch_size: int | None = setting(lm_eval=True)
    device: str | None = setting()
    output_path: str | None = setting(lm_eval=True)
    samples: dict | None = setting(identity=IF_SET, lm_eval=True)
    use_cache: str | None = setting(lm_eval=True)
    cache_requests: dict | None = setting(lm_eval=True)
    check_integrity: bool = setting(False, lm_eval=True)
    write_out: bool = setting(False, lm_eval=True)
    system_instruction: str | None = setting(identity=IF_SET, lm_eval=True)
    fewshot_as_multiturn: bool | None = setting(identity=IF_SET, lm_eval=True)
    show_config: bool = setting(False, lm_eval=True)
    verbosity: str | None = setting(lm_eval=True)
    wandb_args: dict | None = setting(lm_eval=True)
    wandb_config_args: dict | None = setting(lm_eval=True)
    hf_hub_log_args: dict | None = setting(lm_eval=True)
    trackio_args: dict | None = setting(lm_eval=True)
    predict_only: bool = setting(False, identity=IF_SET, lm_eval=True)
    confirm_run_unsafe_code: bool = setting(False, lm_eval=True)
    metadata: dict | None = setting(identity=IF_SET, lm_eval=True)

    def identity(self) -> dict:
        """The settings that determine results: a resumed run must match them exactly."""
        out = {}
        for f in fields(self):
            role = f.metadata.get("identity")
            if role is None:
                continue
            v = getattr(self, f.name)
            if f.name == "seed":
                v = _seed_identity(v)
            elif f.name == "metadata" and v:  # lm-eval merges model_args into it: only what --metadata added counts
                v = {mk: mv for mk, mv in v.items() if (self.model_args or {}).get(mk, object()) != mv}
            if role == ALWAYS or v not in (None, False, {}, []):
                out[f.name] = v
        return out

    def lm_eval_arguments(self) -> dict:
        """This configuration's arguments to ``lm_eval.simple_evaluate`` (the model, task manager and loggers come
        from the caller; so does mpitp's own request cache when ``--cache_requests`` is not given)."""
        return dict(num_fewshot=self.num_fewshot, limit=self.limit, gen_kwargs=self.gen_kwargs or {},
                    apply_chat_template=self.apply_chat_template, log_samples=self.log_samples,
                    bootstrap_iters=self.bootstrap_iters, model_args=self.model_args or "",
                    batch_size=self.batch_size, max_batch_size=self.max_batch_size, device=self.device,
                    samples=self.samples, check_integrity=self.check_integrity, write_out=self.write_out,
                    system_instruction=self.system_instruction, predict_only=self.predict_only,
                    fewshot_as_multiturn=self.multiturn(),
                    confirm_run_unsafe_code=self.confirm_run_unsafe_code, metadata=self.metadata, **self.seeds(),
                    **self.requests_cache())

    def requests_cache(self) -> dict:
        """lm-eval's ``--cache_requests true|refresh|delete`` as ``simple_evaluate``'s three flags."""
        c = self.cache_requests or {}
        return dict(cache_requests=bool(c.get("cache_requests")),
                    rewrite_requests_cache=bool(c.get("rewrite_requests_cache")),
                    delete_requests_cache=bool(c.get("delete_requests_cache")))

    def multiturn(self) -> bool | None:
        """lm-eval's CLI rule: few-shot as multi-turn defaults to on with a chat template, else stays unset."""
        if self.fewshot_as_multiturn is None and self.apply_chat_template:
            return True
        return self.fewshot_as_multiturn

    def load_kwargs(self) -> dict:
        """``from_pretrained`` arguments from ``--model_args`` beyond model, revision, dtype and remote code."""
        return {k: getattr(self, k) for k in ("attn_implementation", "subfolder") if getattr(self, k)}

    def fixed_batch_size(self) -> int:
        """The batch size to start from: the number given, or 1 for ``auto`` (sized later, see
        mpitp.replica.batchsize)."""
        return int(self.batch_size) if str(self.batch_size).isdigit() else 1

    def seeds(self) -> dict:
        """``simple_evaluate``'s four seed arguments (lm-eval's ``--seed`` slots: python, numpy, torch, few-shot)."""
        if self.seed is None:
            s = _DEFAULT_SEEDS  # what simple_evaluate takes without them: one spelling for both paths
        else:
            s = list(self.seed) if isinstance(self.seed, (list, tuple)) else [self.seed] * 4
        return dict(random_seed=s[0], numpy_random_seed=s[1], torch_random_seed=s[2], fewshot_random_seed=s[3])

    @classmethod
    def from_saved(cls, saved: dict) -> EvalConfig:
        """The configuration a results file recorded (``eval_config_json``); keys of other versions are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})


_DEFAULT_SEEDS = [0, 1234, 1234, 1234]  # lm-eval's (simple_evaluate's defaults, and its CLI's)


def _seed_identity(seed):
    """One spelling per meaning: lm-eval's default seeds as None (no --seed), four equal seeds as one int."""
    if isinstance(seed, (list, tuple)):
        seed = list(seed)
        if seed == _DEFAULT_SEEDS:
            return None
        if len(set(seed)) == 1:
            return seed[0]
    return seed


# ------------------------------------------------------------------------------ settings of the run, not of results


def _default_timeout():
    from mpitp.parallel.comm import DEFAULT_TIMEOUT  # imports mpi4py: only when the parser is built

    return DEFAULT_TIMEOUT


@dataclass(frozen=True)
class RuntimeSetting:
    """How a run is laid out and watched (not part of :class:`EvalConfig`): a job-file field and/or an option."""

    name: str
    default: Any = None
    job: Callable[[Any], Any] | None = None
    cli: dict | None = None


RUNTIME = (
    RuntimeSetting("tp", 1, yaml_int_at_least(1, "a positive integer"), cli(
        "--tp", group=LAYOUT, type=cli_int_at_least(1), default=1,
        help="Tensor-parallel degree; dp = world size / (tp x pp).")),
    RuntimeSetting("pp", 1, yaml_int_at_least(1, "a positive integer"), cli(
        "--pp", group=LAYOUT, type=cli_int_at_least(1), default=1,
        help="Pipeline stages per model replica (TP inside each stage).")),
    RuntimeSetting("threads", None, None, cli(
        "--threads", group=LAYOUT, type=cli_int_at_least(1), default=None,
        help="Torch threads per rank (default: cores per node / ranks per node).")),
    RuntimeSetting("timeout", None, yaml_timeout, cli(
        "--timeout", group=LAYOUT, type=cli_positive_float, default=lambda: float(_default_timeout()),
        help=lambda: f"Seconds any rank waits for its peers (default {_default_timeout()}).")),
    RuntimeSetting("log_all_ranks", False, None, cli(
        "--log-all-ranks", group=LAYOUT, action="store_true", help="Log from every rank, each line with its rank.")),
    RuntimeSetting("iface", None, yaml_string, cli(
        "--iface", group=LAYOUT, default=None, metavar="NAME",
        help="Network interface between nodes (gloo, NCCL, the rendezvous); sets MPITP_IFACE (default: the "
             "host name's address unless loopback, else the first physical interface).")),
    RuntimeSetting("stage_dir", None, yaml_string, cli(
        "--stage-dir", group=LAYOUT, default=None, metavar="DIR",
        help="Node-local directory: one rank per node copies a local model there before loading, the node's "
             "other ranks wait, every rank loads the copy; reused while the model is unchanged. ~, $VARS and {node} "
             "are expanded on each node (default: MPITP_STAGE_DIR, else load in place).")),
    RuntimeSetting("device", None, yaml_string),  # on the command line: lm-eval's own --device
    RuntimeSetting("watch", None, None, cli(
        "--watch", group=SWEEPS, default=None, metavar="DIR",
        help="Evaluate checkpoints (subdirectories of DIR) as they appear; resumable.")),
    RuntimeSetting("watch_idle", 600.0, None, cli(
        "--watch-idle", group=SWEEPS, type=cli_positive_float, default=600.0,
        help="With --watch: stop after this many seconds without a new complete checkpoint (default 600).")),
)


# ------------------------------------------------------------------------------------------------- derived views


def eval_settings():
    """:class:`EvalConfig`'s fields (``dataclasses.Field``: name, type, default and the metadata above)."""
    return fields(EvalConfig)


def default(f) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def job_fields() -> dict[str, Callable[[Any], Any]]:
    """Job-file fields read as themselves, with their YAML readers: the settings' and the runtime ones."""
    out = {f.name: f.metadata["job"] for f in eval_settings() if f.metadata.get("job")}
    out.update({s.name: s.job for s in RUNTIME if s.job})
    return out


def lm_eval_named():
    """The settings named as lm-eval's ``EvaluatorConfig`` fields that mpitp takes over as they are (``lm_eval``):
    a job file names them so, and ``mpitp eval`` copies them from lm-eval's parsed command line."""
    return [f for f in eval_settings() if f.metadata.get("lm_eval")]


def from_evaluator_config(f, value):
    """``EvaluatorConfig``'s value for setting ``f`` in mpitp's spelling: a flag as a bool, an empty mapping as None."""
    kind = str(f.type)
    if kind == "bool":
        return bool(value)
    if "dict" in kind:
        return value or None
    return value


def lm_eval_job_fields() -> dict[str, Callable[[Any], Any]]:
    """Job-file fields named as lm-eval's ``EvaluatorConfig`` fields, read with their meaning on the command line;
    the YAML reader follows the field's type."""
    out = {}
    for f in lm_eval_named():
        kind = str(f.type)
        if "dict" in kind:
            out[f.name] = yaml_mapping
        elif kind.startswith("bool"):
            out[f.name] = yaml_bool
        elif kind.startswith("int"):
            out[f.name] = yaml_int_at_least(1, "a positive integer")
        else:
            out[f.name] = yaml_string
    return out


def cli_options() -> list[tuple[str, dict]]:
    """``(dest, cli(...))`` for each of mpitp's own ``mpitp eval`` options, in help-group order (a default or help
    given as a function is computed now)."""
    found = [(s.name, s.cli) for s in RUNTIME if s.cli]
    for f in eval_settings():
        if f.metadata.get("cli"):  # a shorthand's absence must differ from its default: it is merged into model_args
            spec = f.metadata["cli"]
            found.append((f.name, {**spec, "kwargs": {"default": None if spec["shorthand"] else default(f),
                                                      **spec["kwargs"]}}))
    out = []
    for dest, spec in sorted(found, key=lambda item: CLI_GROUPS.index(item[1]["group"])):
        kwargs = {k: (v() if k in ("default", "help") and callable(v) else v) for k, v in spec["kwargs"].items()}
        out.append((dest, {**spec, "kwargs": kwargs}))
    return out


def cli_runtime_dests() -> tuple[str, ...]:
    return tuple(s.name for s in RUNTIME if s.cli)


def cli_setting_dests(*, shorthand: bool) -> tuple[str, ...]:
    """:class:`EvalConfig` fields set by mpitp's own options: directly, or (``shorthand``) through model_args."""
    return tuple(f.name for f in eval_settings() if f.metadata.get("cli")
                 and f.metadata["cli"]["shorthand"] == shorthand)
