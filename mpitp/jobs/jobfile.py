"""Job files: the YAML description of an evaluation campaign.

A job file is read twice: on the login node (``mpitp submit``) and by every
rank on the compute nodes (``mpitp run``).  Everything is therefore checked
here, before any model or data set is touched: a typo must cost seconds on
the login node, not a queue wait followed by a crash on 64 GPUs.  Every
error names the file, the run and the field so it can be fixed without
guessing.

Layout::

    defaults:            # optional; any run field except name/output
      dtype: bfloat16
    runs:
      - model: meta-llama/Llama-3.1-8B
        tasks: [arc_easy, hellaswag]
        tp: 4
        pp: 2            # optional: pipeline stages (dp = ranks / (tp * pp))

A run's own values replace the defaults (lists are replaced, not merged).
``null`` for an optional field clears a default.  Relative paths resolve
against the job file's directory so a job behaves the same whatever
directory the scheduler starts it in.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpitp.evaluation import settings
from mpitp.evaluation.setting_values import (
    DTYPES,
    BadValue,
    FrozenDict,
    show,
    suggest,
    thaw,
    yaml_string,
    yaml_tasks,
)
from mpitp.jobs.jobyaml import JobFileError, read_yaml

__all__ = ["DEMO_MODEL", "DTYPES", "Job", "JobFileError", "RunSpec", "load_job"]

DEMO_MODEL = "demo"  # built-in tiny model; never treated as a path
_PER_RUN_ONLY = ("name", "output")  # would collide if shared by all runs
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_UNSET_VAR_RE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class RunSpec:
    """One fully validated evaluation run of a job file (paths are absolute strings): the run's own fields (name,
    output), one field per job-file setting of :mod:`mpitp.evaluation.settings` read as itself (frozen: lists are
    tuples, mappings :class:`FrozenDict`), the job-file runtime settings (tp, pp, timeout, iface, stage_dir, device) and
    ``lm_eval``, the lm-eval-named settings as a read-only mapping. Mappings are excluded from the hash (equality still
    compares them). ``tests/test_jobfile.py`` keeps the fields in step with the declarations: same names, order and
    defaults."""

    name: str
    model: str
    tasks: tuple[str, ...]
    output: str
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    num_fewshot: int | None = None
    limit: int | float | None = None
    batch_size: int | str = 1
    max_length: int | None = None
    gen_kwargs: str | FrozenDict | None = dataclasses.field(default=None, hash=False)
    apply_chat_template: bool | str = False
    include_path: str | tuple[str, ...] | None = None
    seed: int | tuple[int | None, ...] | None = None
    data_dir: str | None = None
    log_samples: bool = False
    bootstrap_iters: int = 100000
    no_prefix_sharing: bool = False
    peft: str | None = None
    hf_assets: str | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    timeout: float | None = None
    iface: str | None = None
    stage_dir: str | None = None
    device: str | None = None
    lm_eval: FrozenDict | None = dataclasses.field(default=None, hash=False)

    def to_eval_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the eval function, one per field, same names.

        Returns plain mutable types (list of tasks, dict/list gen_kwargs) so the callee may modify them without
        touching this frozen spec.
        """
        return {f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}


def declared_run_fields() -> list[tuple[str, Any, bool]]:
    """``(name, default, hashed)`` of every field :class:`RunSpec` must have, from the declarations: the run's own,
    the job-file settings of :class:`mpitp.evaluation.settings.EvalConfig` (a mapping-typed one unhashed), the
    job-file runtime settings, ``lm_eval``."""
    out: list[tuple[str, Any, bool]] = [(n, dataclasses.MISSING, True) for n in ("name", "model", "tasks", "output")]
    for f in settings.eval_settings():
        if f.metadata.get("job") and f.name not in ("model", "tasks", "output"):
            out.append((f.name, settings.default(f), "dict" not in str(f.type)))
    out += [(s.name, s.default, True) for s in settings.RUNTIME if s.job]
    return out + [("lm_eval", None, False)]


@dataclass(frozen=True)
class Job:
    """A loaded job file: its absolute path and its runs, in file order."""

    path: Path
    runs: tuple[RunSpec, ...]

    @property
    def name(self) -> str:
        """Short name for scheduler job names and script files (the file stem)."""
        return self.path.stem


# --------------------------------------------------------------------------
# Field checkers: each returns the normalised value or raises _Bad(reason).

_Bad = BadValue
_show, _suggest, _string, _tasks = show, suggest, yaml_string, yaml_tasks


def _name(v: Any) -> str:
    if isinstance(v, str) and _NAME_RE.match(v):
        return v
    raise _Bad(f"expected a name of letters, digits and ._+- (used in file names), got {_show(v)}")


def _models(v: Any) -> tuple[str, ...]:
    """A sweep: a list of checkpoints (paths, globs) or one string (a glob or comma list)."""
    items = [p.strip() for p in v.split(",")] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(p, str) and p.strip() for p in items):
        raise _Bad(f"expected a list of model paths or globs, or a glob string, got {_show(v)}")
    return tuple(p.strip() for p in items)


_CHECKS: dict[str, Callable[[Any], Any]] = {"name": _name, "models": _models, **settings.job_fields()}
"""The job file's own fields (a run's name; a sweep's models) and the settings read as themselves."""
_LM_EVAL_FIELDS = settings.lm_eval_job_fields()
"""Fields named as lm-eval's ``EvaluatorConfig`` fields: a mapping, a flag, a string ... with the flag's meaning."""


_REQUIRED = ("model", "tasks")
# Fields whose RunSpec default is None accept an explicit null (to clear a default); lm-eval-named ones always do.
_NULLABLE = {f.name for f in dataclasses.fields(RunSpec) if f.default is None}
_PATH_FIELDS = ("include_path", "data_dir", "output", "hf_assets")
_LM_EVAL_PATHS = ("output_path", "use_cache")  # lm-eval-named fields that name a local path
_MAYBE_PATH_FIELDS = ("model", "tokenizer")  # HF id or local directory


# --------------------------------------------------------------------------
# Loading


def _derive_name(model: str, tasks: tuple[str, ...]) -> str:
    """``<model basename>-<task>+<task>``, made safe for file names."""
    stem = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    shown = "+".join(tasks) if len(tasks) <= 3 else f"{tasks[0]}+{len(tasks) - 1}more"
    name = re.sub(r"[^A-Za-z0-9._+-]+", "_", f"{stem}-{shown}")
    return name.lstrip("._+-") or "run"


def _expand(value: str) -> str:
    """Expand ``~`` and ``$VARS`` (e.g. ``$SCRATCH/hf``); unset variables are an error
    rather than a literal ``$SCRATCH`` directory created next to the job file."""
    expanded = os.path.expanduser(os.path.expandvars(value))
    missing = _UNSET_VAR_RE.search(expanded)
    if missing:
        raise _Bad(f"environment variable ${missing.group(1)} is not set (in {value!r})")
    return expanded


def _resolve(field: str, value: str, base: Path) -> str:
    if field in _MAYBE_PATH_FIELDS:
        if field == "model" and value == DEMO_MODEL:
            return value
        explicit = value.startswith(("/", "./", "../", "~", "$"))
        if not explicit and not (base / value).exists():
            return value  # a Hugging Face hub id
    return os.path.normpath(base / _expand(value))


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read and validate a job file; raise :class:`JobFileError` on the first problem."""
    shown = os.fspath(path)
    abspath = Path(shown).expanduser().absolute()

    def fail(where: str | None, field: str | None, msg: str, run: int | None = None,
             run_name: str | None = None) -> JobFileError:
        parts = [shown] + ([where] if where else []) + ([f"field {field!r}"] if field else [])
        return JobFileError(": ".join(parts + [msg]), path=shown, run=run, run_name=run_name, field=field)

    defaults, runs = _top_level(read_yaml(abspath, shown), fail)
    seen: dict[str, dict[str, int]] = {"name": {}, "output": {}}
    specs = [_run_spec(index, raw, defaults, abspath.parent, fail, seen) for index, raw in enumerate(runs, 1)]
    return Job(path=abspath, runs=tuple(specs))


_Fail = Callable[..., JobFileError]  # load_job's fail(where, field, msg, run=None, run_name=None)
_RunFail = Callable[[str | None, str], JobFileError]  # one run's fail(field, msg): names the run


def _top_level(data: Any, fail: _Fail) -> tuple[dict, list]:
    """The file's ``defaults:`` (each field checked) and its ``runs:`` list, or the error for the file's shape."""
    if data is None:
        raise fail(None, None, "file is empty; expected a mapping with a 'runs:' list")
    if not isinstance(data, dict):
        raise fail(None, None, f"expected a mapping with 'defaults:' and 'runs:', got {_show(data)}")
    for key in data:
        if key not in ("defaults", "runs"):
            raise fail(None, None, f"unknown top-level key {str(key)!r}; expected 'defaults' "
                                   f"or 'runs'{_suggest(key, ('defaults', 'runs'))}")

    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise fail("defaults", None, f"expected a mapping of field: value, got {_show(defaults)}")
    for key, value in defaults.items():
        key = str(key)
        if key in _PER_RUN_ONLY:
            raise fail("defaults", key, "must be set per run, not in defaults")
        _check_field(key, value, lambda f, m: fail("defaults", f, m))

    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise fail(None, None, f"'runs:' must be a non-empty list of runs, got {_show(runs)}")
    return defaults, runs


def _run_spec(index: int, raw: Any, defaults: dict, base: Path, fail: _Fail,
              seen: dict[str, dict[str, int]]) -> RunSpec:
    """Run ``index`` of the file: its fields over ``defaults``, each checked, paths resolved against ``base``, its
    name and output unique among the runs read so far (``seen``: value -> run index)."""
    if not isinstance(raw, dict):
        raise fail(f"run {index}", None, f"expected a mapping of field: value, got {_show(raw)}", index)
    raw = {str(k): v for k, v in raw.items()}
    label = f"run {index}"
    name = None

    def run_fail(field: str | None, msg: str) -> JobFileError:  # names the run as far as it is known by then
        return fail(label, field, msg, index, name)

    # The run's own model or models replace the defaults' (a run that says models: over a default model: was
    # refused as giving both, and model: null did not clear it); both in one place are still refused.
    own = {k for k in ("model", "models") if raw.get(k) is not None}
    merged = {**({k: v for k, v in defaults.items() if k not in ("model", "models")} if own else defaults),
              **{k: v for k, v in raw.items() if k not in ("model", "models") or k in own}}
    if "models" in merged:  # a sweep (mpitp.jobs.sweep): one run, one results file per checkpoint
        _merge_models(merged, base, run_fail)
    name = _check_field("name", raw["name"], run_fail) if "name" in raw else _guess_name(merged)
    if name is not None:
        label = f"run {index} ({name!r})"
    values = _run_values(raw, merged, run_fail)
    values["name"] = name
    _sweep_fields(values, name, base, run_fail)
    for field in _PATH_FIELDS + _MAYBE_PATH_FIELDS:
        if values.get(field) is not None:
            try:
                values[field] = _resolve(field, values[field], base)
            except _Bad as exc:
                raise run_fail(field, str(exc)) from None
    _lm_eval_paths(values, base, run_fail)
    _pretrained(values, base, run_fail)
    from mpitp.errors import UsageError
    from mpitp.parallel import check_ep

    try:  # the file's own arithmetic: refused here, not at the run's turn on the compute nodes
        check_ep(values.get("ep", 1), values.get("tp", 1))
    except UsageError as exc:
        raise run_fail("ep", str(exc)) from None
    for key, fix in (("name", "give each run a unique 'name:'"), ("output", "give each run its own 'output:'")):
        other = seen[key].setdefault(values[key], index)
        if other != index:
            raise run_fail(key, f"{values[key]!r} is already used by run {other}; {fix}")
    return RunSpec(**values)


def _lm_eval_paths(values: dict, base: Path, run_fail: _RunFail) -> None:
    """``output_path``, ``use_cache`` and a ``samples`` file relative to the job file, as its other paths are: left
    as written, they resolved against whatever directory the scheduler started the job in (lm-eval's files and the
    response store written there), where ``hf_assets``, also a folder, did too."""
    lm_eval = values.get("lm_eval") or {}
    paths = {k: lm_eval[k] for k in _LM_EVAL_PATHS if isinstance(lm_eval.get(k), str)}
    if isinstance(lm_eval.get("samples"), str) and not lm_eval["samples"].lstrip().startswith("{"):
        paths["samples"] = lm_eval["samples"]  # a JSON file's path, as --samples takes one
    for field, value in paths.items():
        try:
            paths[field] = _resolve(field, value, base)
        except _Bad as exc:
            raise run_fail(field, str(exc)) from None
    if paths:
        values["lm_eval"] = FrozenDict({**lm_eval, **paths})


def _pretrained(values: dict, base: Path, run_fail: _RunFail) -> None:
    """``model_args``' ``pretrained=`` names the run's model or is refused, as ``mpitp eval --model A --model_args
    pretrained=B`` is: it replaced the model in the model_args lm-eval records while ``model:`` was loaded, so the
    results file named a model that was never evaluated. The same model (as written, or relative to the job file) is
    dropped from model_args: ``model:`` resolved is the one recorded. A dtype, revision or max_length there that
    disagrees with the run's field is refused here too, not at the run's turn on the compute nodes."""
    from mpitp.evaluation.model_args import model_args_dict

    lm_eval = values.get("lm_eval") or {}
    if lm_eval.get("model_args") is None:
        return
    args = model_args_dict(lm_eval["model_args"])  # read once already by _check_lm_eval
    for key in ("dtype", "revision", "max_length"):  # the shorthands that are no path, as --dtype ... are merged
        if key in args and values.get(key) not in (None, "auto") and str(values[key]) != str(args[key]):
            raise run_fail("model_args", f"{key}={args[key]} and {key}: {values[key]} disagree: give it once")
    if "pretrained" not in args:
        return
    given = str(args.pop("pretrained"))
    try:
        same = values["model"] in (given, _resolve("model", given, base))
    except _Bad as exc:
        raise run_fail("model_args", f"pretrained={given}: {exc}") from None
    if not same:
        raise run_fail("model_args", f"pretrained={given} and model: {values['model']} name different models: "
                                     "give the model once, as 'model:'")
    values["lm_eval"] = FrozenDict({**lm_eval, "model_args": FrozenDict(args)})


def _merge_models(merged: dict, base: Path, run_fail: _RunFail) -> None:
    """A sweep's ``models:`` list into ``model`` (comma-joined; globs kept, relative to the job file)."""
    if "model" in merged:
        raise run_fail("models", "give either 'model' or 'models', not both")
    merged["model"] = ",".join(_model_entry(m, base) for m in _check_field("models", merged.pop("models"), run_fail))


def _model_entry(m: str, base: Path) -> str:
    """One entry of ``models:``: a glob kept as a pattern relative to the job file, unless a folder has that name."""
    if glob.has_magic(m):
        path = os.path.normpath(base / _expand(m))
        if not os.path.isdir(path):
            return path
    return _resolve("model", m, base)


def _guess_name(merged: dict) -> str | None:
    """The name a run without ``name:`` gets, or None while its model or tasks are not valid (best effort, so that
    later messages can name the run; the invalid field itself is reported by its check)."""
    try:
        return _derive_name(_string(merged.get("model")), _tasks(merged.get("tasks")))
    except _Bad:
        return None


def _run_values(raw: dict, merged: dict, run_fail: _RunFail) -> dict:
    """Every field of a run checked: unknown and missing ones refused, lm-eval-named ones gathered in ``lm_eval``."""
    for key in raw:  # defaults' keys were checked already
        if key not in _CHECKS and key not in _LM_EVAL_FIELDS:
            raise run_fail(key, f"unknown field{_suggest(key, [*_CHECKS, *_LM_EVAL_FIELDS])}")
    for field in _REQUIRED:
        if merged.get(field) is None:
            raise run_fail(field, "required field is missing")
    values = {field: _check_field(field, value, run_fail) for field, value in merged.items()}
    extras = {k: values.pop(k) for k in list(values) if k not in _CHECKS}
    if extras:
        try:
            _check_lm_eval(extras)
        except _Bad as exc:
            raise run_fail("model_args", str(exc)) from None
        if extras.get("samples") is not None and values.get("limit") is not None:
            raise run_fail("samples", f"limit: {values['limit']} and samples exclude each other (lm-eval scores "
                                      "either each task's first documents or the listed ones): give one of them")
        if extras.get("fewshot_as_multiturn") and not values.get("apply_chat_template"):
            raise run_fail("fewshot_as_multiturn", "true needs apply_chat_template: true (few-shot examples as turns "
                                                   "of a chat), as lm-eval refuses --fewshot_as_multiturn without "
                                                   "--apply_chat_template")
        values["lm_eval"] = FrozenDict(extras)
    return values


def _sweep_fields(values: dict, name: str | None, base: Path, run_fail: _RunFail) -> None:
    """``peft`` resolved (paths or globs, relative to the job file as the models' are) and ``output`` defaulted; a
    sweep (of checkpoints or of adapters, never both) writes one file per member, so its output needs ``{name}``."""
    from mpitp.jobs.sweep import is_sweep  # a glob or a comma list, unless an existing folder has that name

    models_sweep = is_sweep(values["model"])
    peft = values.get("peft")
    if peft is not None:
        try:
            values["peft"] = ",".join(os.path.normpath(base / _expand(p.strip())) for p in peft.split(","))
        except _Bad as exc:
            raise run_fail("peft", str(exc)) from None
    adapters_sweep = is_sweep(values.get("peft"))
    if models_sweep and adapters_sweep:
        raise run_fail("peft", "a sweep of checkpoints ('models') and of adapters ('peft' list) together is not "
                               "supported: sweep one of them per run")
    sweep = models_sweep or adapters_sweep
    values.setdefault("output", f"results/{name}/{{name}}.h5" if sweep else f"results/{name}.h5")
    if sweep and "{name}" not in values["output"]:
        what = "('peft' list) writes one file per adapter" if adapters_sweep else \
            "('models') writes one file per checkpoint"
        raise run_fail("output", f"a sweep {what}: use a pattern with {{name}}, e.g. results/{name}/{{name}}.h5")


def _check_field(field: str, value: Any, fail: Callable[[str, str], JobFileError]) -> Any:
    if field not in _CHECKS:
        if field not in _LM_EVAL_FIELDS:
            raise fail(field, f"unknown field{_suggest(field, [*_CHECKS, *_LM_EVAL_FIELDS])}")
        if value is None:
            return None
        try:
            return _LM_EVAL_FIELDS[field](value)
        except _Bad as exc:
            raise fail(field, str(exc)) from None
    if value is None and field in _NULLABLE:
        return None
    try:
        return _CHECKS[field](value)
    except _Bad as exc:
        raise fail(field, str(exc)) from None


def _check_lm_eval(extras: dict) -> None:
    """Refuse model_args mpitp cannot honour (by name) while reading the file, not on the compute nodes."""
    args = extras.get("model_args")
    if args is None:
        return
    from mpitp.errors import UsageError
    from mpitp.evaluation.model_args import model_args_dict, split_model_args

    try:
        split_model_args(model_args_dict(args))
    except UsageError as exc:
        raise _Bad(str(exc)) from None
