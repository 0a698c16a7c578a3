"""``mpitp eval``'s command line: lm-eval's own ``run`` parser, plus the layout and HDF5 options.

The lm-eval flags are not re-declared here: :func:`build_parser` takes the parser lm-eval's CLI builds
(``lm_eval._cli.run.Run``, a private module: a :mod:`mpitp.compat` target, as are the two argparse internals that add
the ``-`` spellings), so every flag keeps lm-eval's spelling, short form, ``nargs`` and parsing (``--tasks a b`` or
``a,b``, ``--model_args k=v,k2=v2`` or a JSON object, ``--seed 0,None,8,52``), and lm-eval's ``EvaluatorConfig`` turns
the result into settings (``--config`` YAML, ``--predict_only`` implying ``--log_samples``, the few-shot multi-turn
default, seeds, ``--samples`` files). Every long option is accepted with ``_`` or ``-`` alike. What this module adds:
mpitp's own options (declared with the settings in :mod:`mpitp.evaluation.settings`), the translation to
:class:`mpitp.evaluation.settings.EvalConfig`, and refusals of what cannot apply here (another backend, HFLM arguments
that mean another way of placing the model: :mod:`mpitp.evaluation.model_args`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, NoReturn

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.evaluation.model_args import HFLM_REFUSED, model_args_dict, resolve_model, split_model_args
from mpitp.evaluation.setting_values import (
    BadValue,
    batch_size_value,
    cli_batch_size,
    cli_int_at_least,
    cli_limit,
    limit_value,
    yaml_tasks,
)
from mpitp.evaluation.settings import (
    EvalConfig,
    RuntimeOptions,
    cli_options,
    cli_runtime_dests,
    cli_setting_dests,
    from_evaluator_config,
    lm_eval_named,
    setting_docs,
)

if TYPE_CHECKING:
    from lm_eval.config.evaluate_config import EvaluatorConfig

NETWORK_ONLY = {
    "push_results_to_hub": "--hf_hub_log_args push_results_to_hub: pushing to the Hugging Face Hub needs the "
                           "network; the files are written under --output_path, push them from a login node",
    "push_samples_to_hub": "--hf_hub_log_args push_samples_to_hub: pushing to the Hugging Face Hub needs the "
                           "network; the files are written under --output_path, push them from a login node",
}

HELP_DETAILS = {
    "model": "Backends: hf (also hf-auto, huggingface); other lm-eval backends (vllm, openai-completions, ...) are "
             "refused.",
    "model_args": "Accepted: pretrained, revision, dtype, tokenizer, trust_remote_code, max_length, add_bos_token, "
                  "prefix_token_id, attn_implementation, subfolder, peft (a local LoRA adapter folder), truncation, "
                  "logits_cache, use_fast_tokenizer, "
                  "think_end_token, enable_thinking, chat_template_args, softmax_dtype (float32: mpitp's log-softmax "
                  "is float32). Refused by name: " + ", ".join(HFLM_REFUSED) + ".",
    "tasks": "Groups and tags as in lm-eval ('lm-eval ls tasks' lists them).",
    "batch_size": "'auto' is the largest size that fits, found per task and request-length bucket, agreed by every "
                  "rank of a TP/PP group; 'auto:N' re-detects N times over the run.",
    "device": "Each rank takes its node-local GPU; cuda:N means the same under MPI.",
    "use_cache": "Resumed when it exists (its settings must match), instead of lm-eval's per-rank sqlite files.",
    "output_path": "Files: <path>/<model>/results_<time>.json (and samples_<task>_<time>.jsonl with --log_samples), "
                   "or <stem>_<time>.json for a .json path; --output puts the HDF5 file elsewhere.",
    "verbosity": "By default lm-eval's and transformers' messages about mpitp's own integration are hidden; DEBUG "
                 "shows everything.",
    "wandb_args": "As key=val key2=val2, through lm-eval's WandbLogger (WANDB_MODE=offline works without network).",
    "seed": "Pass 'None' in a slot to leave that seed unset (e.g. --seed 0,None,8,52).",
    "gen_kwargs": "Values are read with ast.literal_eval.",
    "samples": "For example '{\"task1\": [0,1,2]}'; incompatible with --limit.",
}
"""What ``mpitp eval --help`` says after a setting's one-line description (:func:`settings.setting_docs`) for
lm-eval's flag of that name: the details of mpitp's reading of it."""


class _Exit(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status, self.text = status, text


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so rank 0 can decide and share the outcome."""

    def error(self, message: str) -> NoReturn:
        # "argument --batch_size/-b/--batch-size: must be >= 1" -> "--batch_size: must be >= 1"; and argparse's name
        # for the value's reader, "invalid functools.partial(<function _int_or_none_list_arg_type at 0x..>, 3, 4,
        # '0,1234,1234,1234') value: 'a,b'" (--seed a,b), as "invalid value: 'a,b'"
        message = re.sub(r"^argument (--?[\w-]+)(/\S+)*:", r"\1:", message)
        raise UsageError(re.sub(r"invalid (functools\.partial\(.*\)|[\w.]+) value:", "invalid value:", message))

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise _Exit(status, message or "")

    def print_help(self, file: IO[str] | None = None) -> NoReturn:
        raise _Exit(0, self.format_help())


MPITP_DESTS = tuple(dest for dest, _ in cli_options())
"""mpitp's own options (declared with the settings, :mod:`mpitp.evaluation.settings`), apart from lm-eval's."""


def _add_mpitp_options(p: argparse.ArgumentParser) -> None:
    groups: dict = {}  # group title -> argparse's argument group
    for _dest, spec in cli_options():
        if spec["group"] not in groups:
            groups[spec["group"]] = p.add_argument_group(spec["group"])
        groups[spec["group"]].add_argument(*spec["flags"], **spec["kwargs"])


def _add_dash_aliases(p: argparse.ArgumentParser) -> None:
    """Accept ``--batch-size`` for ``--batch_size`` and ``--data_dir`` for ``--data-dir``: both spellings."""
    for action in compat.parser_actions(p):
        for opt in list(action.option_strings):
            if not opt.startswith("--"):
                continue
            for alias in (opt.replace("_", "-"), opt.replace("-", "_").replace("__", "--", 1)):
                if alias != opt:
                    compat.add_option_alias(p, action, alias)


def build_parser() -> argparse.ArgumentParser:
    holder = _Parser(prog="mpitp")
    subparsers = holder.add_subparsers(parser_class=_Parser)
    compat.attribute("lm_eval._cli.run.Run")(subparsers)  # adds its "run" parser to ``subparsers``
    p = subparsers.choices["run"]
    p.prog = "mpitp eval"
    p.usage = ("mpirun -n N mpitp eval --model hf --model_args pretrained=M --tasks T [lm-eval options] "
               "[--tp N] [--pp N] [--output F.h5]")
    p.description = ("Every lm_eval --model hf command line runs unchanged (either spelling: --batch_size or "
                     "--batch-size), with --tp/--pp for the layout and an HDF5 results file on top.")
    p.epilog = ("examples:\n  mpirun -n 4 mpitp eval --model hf --model_args pretrained=gpt2,dtype=float32 "
                "--tasks hellaswag --batch_size auto --output_path out/ --log_samples --tp 2\n"
                "  mpirun -n 2 mpitp eval --model ./my-model --tasks arc_easy --num-fewshot 5 --output arc.h5")
    docs = setting_docs()
    for action in compat.parser_actions(p):
        if action.dest in docs:  # lm-eval's flag for a setting: the setting's description, then mpitp's details
            action.help = " ".join(filter(None, (docs[action.dest], HELP_DETAILS.get(action.dest))))
        if action.dest == "batch_size":
            action.type = cli_batch_size
        elif action.dest == "limit":
            action.type = cli_limit
        elif action.dest == "max_batch_size":
            action.type = cli_int_at_least(1)
        elif action.dest == "num_fewshot":
            action.type = cli_int_at_least(0)
    _add_mpitp_options(p)
    _add_dash_aliases(p)
    p.epilog += _no_option_help(p, docs)
    return p


def _no_option_help(p: argparse.ArgumentParser, docs: dict[str, str]) -> str:
    """The settings no option sets by itself (taken from --model and --model_args, recorded in the results file),
    each with its description, so that ``--help`` describes every setting."""
    dests = {a.dest for a in compat.parser_actions(p)}
    rest = [name for name in docs if name not in dests]
    head = "\n\nsettings without an option of their own (from --model/--model_args; kept in the results file):"
    return "".join([head] + [f"\n  {name}: {docs[name]}" for name in rest]) if rest else ""


def help_text() -> str:
    return build_parser().format_help()


@contextlib.contextmanager
def _captured_stdout():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield buf


@dataclass(frozen=True)
class ParsedRun:
    """``mpitp eval ARGV`` to run: the evaluation, the launch's runtime options, and the settings lm-eval printed
    while reading a ``--config`` file (shown once, by rank 0)."""

    cfg: EvalConfig
    runtime: RuntimeOptions
    shown: str = ""


@dataclass(frozen=True)
class ParsedExit:
    """``mpitp eval ARGV`` ends at parsing (``--help``): the status and the text to print."""

    status: int
    text: str


def parse_eval_args(argv: list[str]) -> ParsedRun | ParsedExit:
    """What ``mpitp eval ARGV`` asks for; raises :class:`UsageError` on bad input. Runs on rank 0 (its verdict is
    shared), so a ``--config`` or ``--samples`` file is read once.
    """
    p = build_parser()
    try:
        ns = p.parse_args(argv)
    except _Exit as exc:
        return ParsedExit(exc.status, exc.text)
    except ValueError as exc:  # lm-eval's MergeDictAction (--model_args, --gen_kwargs, --metadata) reads JSON as it
        # stores the value, outside argparse's own error handling: a traceback and MPI_Abort for --metadata '{bad'
        bad = re.match(r"Invalid JSON: (.*)\. Hint", str(exc))  # lm-eval's try_parse_json names the value
        flag = next((a for a, v in zip(argv, argv[1:]) if bad and a.startswith("-") and v == bad.group(1)), None)
        raise UsageError(f"{flag}: {_first_line(exc)}" if flag else _first_line(exc)) from None
    values = vars(ns)
    mine = {k: values.pop(k) for k in MPITPLM_KEYS if k in values}
    lm_ns = argparse.Namespace(**values)
    from lm_eval.config.evaluate_config import EvaluatorConfig

    yaml_device = None
    if getattr(lm_ns, "config", None):
        try:
            yaml_cfg = EvaluatorConfig.load_yaml_config(lm_ns.config)
        except (FileNotFoundError, ValueError, TypeError) as exc:
            raise UsageError(f"--config {lm_ns.config}: {_first_line(exc)}") from None
        yaml_device = yaml_cfg.get("device")
        for key in yaml_cfg:
            if key not in EvaluatorConfig.__dataclass_fields__:
                raise UsageError(f"--config {lm_ns.config}: unknown key {key!r} (lm-eval's EvaluatorConfig has no "
                                 "such field)")
    try:
        with _captured_stdout() as shown:
            try:
                ec = EvaluatorConfig.from_cli(lm_ns)
            except ValueError as exc:
                if "Specify --output_path" not in str(exc):
                    raise
                # lm-eval needs --output_path for samples because it has nowhere else to keep them; mpitp's HDF5
                # file holds them (as it always did), so lm-eval's files are then simply not written.
                lm_ns.output_path = _NO_OUTPUT_PATH
                ec = EvaluatorConfig.from_cli(lm_ns)
                ec.output_path = None
    except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
        if isinstance(exc, json.JSONDecodeError) and getattr(lm_ns, "samples", None):  # lm-eval reads a --samples
            raise UsageError(f"--samples {lm_ns.samples}: not JSON: {_first_line(exc)}") from None  # file's text
        raise UsageError(_first_line(exc)) from None
    if ns.device is None and yaml_device is None:
        ec.device = None  # lm-eval's default is cuda:0; mpitp picks each rank's device itself
    if isinstance(ec.batch_size, str) or ec.batch_size is not None:
        try:
            ec.batch_size = batch_size_value(ec.batch_size)
        except BadValue as exc:
            raise UsageError(f"--batch_size: {exc}") from None
    cfg = to_eval_config(ec, mine)
    runtime = RuntimeOptions(**{k: mine[k] for k in cli_runtime_dests()}, device=runtime_device(ec.device))
    return ParsedRun(cfg, runtime, shown.getvalue())


MPITPLM_KEYS = MPITP_DESTS
_NO_OUTPUT_PATH = "<mpitp: samples go to the HDF5 file>"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().strip('"').strip()
    return text.splitlines()[0] if text else type(exc).__name__


def runtime_device(device: str | None) -> str | None:
    """lm-eval's ``--device`` as the device kind each rank uses: ``cuda:0`` under MPI means "this rank's GPU"."""
    if device is None:
        return None
    kind = str(device).split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: mpitp runs on cpu or cuda")
    return kind


def _merge_shorthand(model_args: dict, key: str, value) -> None:
    if value is None:
        return
    if key in model_args and str(model_args[key]) != str(value):
        raise UsageError(f"--{key.replace('_', '-')} {value} and --model_args {key}={model_args[key]} disagree")
    model_args[key] = value


def to_eval_config(ec: EvaluatorConfig, mine: dict) -> EvalConfig:
    """lm-eval's ``EvaluatorConfig`` plus mpitp's options as an :class:`mpitp.evaluation.settings.EvalConfig`."""
    model_args = dict(ec.model_args or {})
    for key in cli_setting_dests(shorthand=True):
        _merge_shorthand(model_args, key, mine.get(key))
    source, pretrained = resolve_model(ec.model, model_args)
    if pretrained is not None:
        model_args.setdefault("pretrained", pretrained)
    loading, hflm = split_model_args(model_args)
    if "max_batch_size" in model_args and ec.max_batch_size is None:
        ec.max_batch_size = int(model_args["max_batch_size"])
    hflm.pop("max_batch_size", None)
    if "batch_size" in model_args and not isinstance(ec.batch_size, str) and ec.batch_size == 1:
        try:
            ec.batch_size = batch_size_value(model_args["batch_size"])
        except BadValue as exc:
            raise UsageError(f"--model_args batch_size={model_args['batch_size']}: {exc}") from None
    try:
        limit = None if ec.limit is None else limit_value(ec.limit)
    except BadValue as exc:
        raise UsageError(f"--limit: {exc}") from None
    trust = bool(ec.trust_remote_code or str(loading.get("trust_remote_code", "")).lower() in ("true", "1"))
    max_length = hflm.pop("max_length", None)
    given = ec.tasks if isinstance(ec.tasks, str) else ",".join(map(str, ec.tasks or []))
    try:  # as a job file's tasks: and mpitp check --tasks read them: blanks dropped, an empty or repeated name refused
        tasks = list(yaml_tasks(given)) if given else []
    except BadValue as exc:
        raise UsageError(f"--tasks: {exc}") from None
    for key, why in NETWORK_ONLY.items():
        if str((ec.hf_hub_log_args or {}).get(key, "")).lower() in ("true", "1"):
            raise UsageError(why)
    return EvalConfig(
        model=pretrained, tasks=tasks, tokenizer=_opt_str(loading.get("tokenizer")),
        revision=_opt_str(loading.get("revision")), dtype=str(loading.get("dtype", "auto")),
        num_fewshot=ec.num_fewshot, limit=limit, batch_size=ec.batch_size,
        max_length=_opt_int(max_length),
        gen_kwargs=ec.gen_kwargs or None, apply_chat_template=ec.apply_chat_template,
        include_path=ec.include_path, seed=ec.seed, log_samples=bool(ec.log_samples), trust_remote_code=trust,
        **{k: mine[k] for k in cli_setting_dests(shorthand=False) if k in mine},
        model_source=source, model_args=model_args, hflm_args=hflm,
        attn_implementation=_opt_str(loading.get("attn_implementation")),
        subfolder=_opt_str(loading.get("subfolder")), peft=_opt_str(loading.get("peft")), device=ec.device,
        metadata=_metadata(model_args, ec),
        **{f.name: from_evaluator_config(f, getattr(ec, f.name)) for f in lm_eval_named()
           if f.name not in ("model_args", "trust_remote_code", "metadata")})


def _metadata(model_args: dict, ec: EvaluatorConfig) -> dict:
    """The task metadata: lm-eval's (``--model_args`` merged under ``--metadata``) with what mpitp adds to model_args
    (``--model PATH``, the shorthands) merged the same way: babilong and RULER read ``pretrained`` there. Not the
    ``trust_remote_code`` lm-eval itself adds to model_args after its merge."""
    added = {k: v for k, v in model_args.items() if k not in (ec.model_args or {})}
    return {**added, **(ec.metadata or {})}


def _opt_str(v):
    return None if v is None else str(v)


def _opt_int(v):
    return None if v is None else int(v)


def check_lm_eval_settings(cfg: EvalConfig) -> None:
    """Rank 0, before any model loads: the lm-eval settings that would otherwise fail only after the evaluation."""
    import importlib.util

    for flag, module, package in (("wandb_args", "wandb", "wandb"), ("trackio_args", "trackio", "trackio")):
        if getattr(cfg, flag, None) and importlib.util.find_spec(module) is None:
            raise UsageError(f"--{flag} needs the {package} package: pip install {package}")
    if getattr(cfg, "output_path", None):
        probe = os.path.abspath(cfg.output_path)
        if probe.endswith(".json"):
            probe = os.path.dirname(probe)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise UsageError(f"--output_path {cfg.output_path}: {probe} is not a directory")
        if not os.access(probe, os.W_OK):
            raise UsageError(f"--output_path {cfg.output_path}: {probe} is not writable")
    if getattr(cfg, "check_integrity", False):
        check_integrity_runnable()


def check_integrity_runnable(option: str = "--check_integrity") -> None:
    """lm-eval's ``check_integrity`` runs its own test suite (``tests/test_version_stable.py``, found within three
    folders above the installed package): an installed lm-eval has none, and the run failed on rank 0 after the model
    load with a FileNotFoundError traceback ('Unable to find package root'). One line before any work instead."""
    import inspect
    import pathlib

    find_test_root = compat.attribute("lm_eval.evaluator_utils.find_test_root")
    try:  # from the file lm-eval starts at, its own module's
        find_test_root(start_path=pathlib.Path(inspect.getfile(find_test_root)))
    except FileNotFoundError:
        raise UsageError(f"{option} runs lm-eval's own test suite (tests/test_version_stable.py), which this lm-eval "
                         "installation does not include (a source checkout of lm-eval does): drop it") from None


def samples_dict(text: str) -> dict:
    """A job file's ``samples:`` string as lm-eval reads ``--samples``: a JSON object, else a JSON file's path (made
    absolute against the job file's folder when the file was read). The string reached the checks as it was."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        with open(text, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise UsageError(f"--samples {text}: neither JSON nor a readable file ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"--samples {text}: not JSON: {_first_line(exc)}") from None


def apply_lm_eval_settings(cfg: EvalConfig, settings: dict) -> None:
    """A job file's lm-eval fields (named as lm-eval's EvaluatorConfig fields) onto ``cfg``, with the flags' meaning:
    model_args split and refused as for ``--model_args`` (the job file's tokenizer, revision, dtype and max_length
    merged into it as ``--dtype`` ... are), ``predict_only`` implying ``log_samples``, ``metadata`` merged over
    model_args for the TaskManager, as lm-eval merges them (babilong and RULER read ``pretrained`` there)."""
    from lm_eval.config.evaluate_config import DICT_KEYS

    settings = {k: v for k, v in settings.items() if v is not None}
    for key in DICT_KEYS:
        if isinstance(settings.get(key), str):
            settings[key] = model_args_dict(settings[key], f"--{key}")  # as the flag reads it: JSON or key=value
        elif key in settings:
            settings[key] = dict(settings[key])
    if isinstance(settings.get("samples"), str):  # as lm-eval reads --samples: JSON, else a JSON file's path
        settings["samples"] = samples_dict(settings["samples"])
    if isinstance(cfg.gen_kwargs, str):
        cfg.gen_kwargs = model_args_dict(cfg.gen_kwargs, "--gen_kwargs") or None
    model_args = {**({"pretrained": cfg.model} if cfg.model else {}), **settings.pop("model_args", {})}
    for key in cli_setting_dests(shorthand=True):
        current = getattr(cfg, key)
        if key in model_args:
            if current not in (None, "auto") and str(current) != str(model_args[key]):
                raise UsageError(f"{key}: {current} and model_args {key}={model_args[key]} disagree")
            setattr(cfg, key, int(model_args[key]) if key == "max_length" else str(model_args[key]))
        elif current not in (None, "auto"):  # the job file's dtype: as --dtype, model_args dtype=
            model_args[key] = current
    if str(model_args.get("trust_remote_code", "")).lower() in ("true", "1"):
        cfg.trust_remote_code = True
    loading, hflm = split_model_args(model_args)
    hflm.pop("max_length", None)
    if "max_batch_size" in hflm:
        settings.setdefault("max_batch_size", int(hflm.pop("max_batch_size")))
    cfg.model_args, cfg.hflm_args = model_args, hflm
    cfg.attn_implementation = _opt_str(loading.get("attn_implementation"))
    cfg.subfolder = _opt_str(loading.get("subfolder"))
    cfg.peft = _opt_str(loading.get("peft"))
    if "cache_requests" in settings:
        to_dict = compat.attribute("lm_eval._cli.utils.request_caching_arg_to_dict")
        settings["cache_requests"] = to_dict(str(settings["cache_requests"]).lower())
    for key, value in settings.items():
        setattr(cfg, key, value)
    if cfg.predict_only:
        cfg.log_samples = True
    cfg.metadata = {**model_args, **(cfg.metadata or {})}  # as lm-eval merges them, for every run (see to_eval_config)
    for key, why in NETWORK_ONLY.items():
        if str((cfg.hf_hub_log_args or {}).get(key, "")).lower() in ("true", "1"):
            raise UsageError(why)
