"""The evaluation settings, declared once: :class:`EvalConfig`'s fields and :data:`RUNTIME`.

Each setting says here, and nowhere else, its name, type and default, whether it enters the resume identity, how a
job file's YAML value is read (``job=``), and which of mpitp's own command-line options sets it (``cli=``). From this
declaration come the job-file schema (:mod:`mpitp.jobs.jobfile`: its fields, checkers, nullability and ``RunSpec``),
a job run's :class:`EvalConfig` (:mod:`mpitp.jobs.jobrun`), mpitp's options of ``mpitp eval``
(:mod:`mpitp.evaluation.lmeval_args`; lm-eval's own flags come from lm-eval's parser) and the resume identity
(:meth:`EvalConfig.identity`). A new setting is one field here, with a one-line ``doc``: the help of its option in
``mpitp eval --help`` (mpitp's own option, or lm-eval's flag of that name), or, for the few set only through
``--model_args``, a line of the help's epilog; a test fails on a setting without one.

The rules a value follows, and their YAML and command-line readers, are in :mod:`mpitp.evaluation.setting_values`.
This module imports no heavy library: a job file is checked on a login node in well under a second.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

from mpitp.evaluation.setting_values import (
    DTYPES,
    cli_int_at_least,
    cli_positive_float,
    yaml_batch_size,
    yaml_bool,
    yaml_cache_requests,
    yaml_device,
    yaml_dtype,
    yaml_gen_kwargs,
    yaml_int_at_least,
    yaml_limit,
    yaml_mapping,
    yaml_output,
    yaml_seed,
    yaml_string,
    yaml_string_list,
    yaml_tasks,
    yaml_timeout,
    yaml_verbosity,
)

ALWAYS = "always"
"""In the resume identity always (the settings older files were written with)."""
IF_SET = "if_set"
"""In the resume identity only when set: later settings, so files written before them still resume."""


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


def setting(default: Any = None, *, doc: str, factory: Callable[[], Any] | None = None, identity: str | None = None,
            job: Callable[[Any], Any] | None = None, lm_eval: bool = False, cli: dict | None = None) -> Any:
    """A field of :class:`EvalConfig` with what the rest of mpitp derives from it.

    ``doc``: one line saying what the setting means, shown in ``mpitp eval --help`` (see :func:`help_for`).
    ``identity``: :data:`ALWAYS` or :data:`IF_SET` when the setting changes results (resume compares it).
    ``job``: the job-file field of that name and its YAML reader. ``lm_eval``: an lm-eval ``EvaluatorConfig`` field of
    that name, taken over with its meaning: ``mpitp eval`` copies it from lm-eval's parsed command line, a job file
    names it so and it is applied as ``--FIELD`` is (``mpitp.evaluation.lmeval_args.apply_lm_eval_settings``:
    model_args split and refused, predict_only implying log_samples ...; its YAML reader follows the field's type).
    ``cli``: mpitp's own ``mpitp eval`` option for it (lm-eval's flags come from lm-eval's parser, so they are not
    declared again here).
    """
    meta = dict(doc=doc, identity=identity, job=job, lm_eval=lm_eval, cli=cli)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class EvalConfig:
    """Everything that defines an evaluation (lm-eval's vocabulary). Resume compares the ``identity`` part.

    The fields after ``skip_head_check`` are lm-eval's settings that ``mpitp eval`` took over from ``lm_eval`` (see
    :mod:`mpitp.evaluation.lmeval_args`); their defaults are lm-eval's, so older results files still resume.
    """

    model: str | None = setting(identity=ALWAYS, job=yaml_string, doc=(
        "The model: a local directory or hub id (--model PATH, or --model hf --model_args pretrained=PATH); a glob "
        "or comma list of checkpoints is a sweep."))
    tasks: list[str] = setting(factory=list, identity=ALWAYS, job=yaml_tasks, doc=(
        "lm-eval task or group names, space- or comma-separated (task YAMLs of your own: --include_path)."))
    tokenizer: str | None = setting(identity=ALWAYS, job=yaml_string,
                                    doc="Tokenizer to load (default: the model's own).",
                                    cli=cli("--tokenizer", group=SHORTHANDS, shorthand=True))
    revision: str | None = setting(identity=ALWAYS, job=yaml_string,
                                   doc="Hub revision (branch, tag or commit) of the model.",
                                   cli=cli("--revision", group=SHORTHANDS, shorthand=True))
    dtype: str = setting("auto", identity=ALWAYS, job=yaml_dtype,
                         doc="Weights' dtype (auto: as the checkpoint says).",
                         cli=cli("--dtype", group=SHORTHANDS, shorthand=True, choices=DTYPES))
    num_fewshot: int | None = setting(identity=ALWAYS, job=yaml_int_at_least(0, "a non-negative integer"),
                                      doc="Few-shot examples in each prompt (default: each task's own).")
    limit: int | float | None = setting(identity=ALWAYS, job=yaml_limit, doc=(
        "Documents per task: a count from 1 (1.0 is one document), a fraction of each task below 1."))
    batch_size: int | str = setting(1, job=yaml_batch_size, doc=(
        "Batch size per DP group: an integer, 'auto' or 'auto:N' (default 1)."))
    max_length: int | None = setting(identity=ALWAYS, job=yaml_int_at_least(2, "an integer >= 2 (tokens)"),
                                     doc="Longest context in tokens (default: the model's).",
                                     cli=cli("--max-length", group=SHORTHANDS, shorthand=True,
                                             type=cli_int_at_least(2)))
    gen_kwargs: str | dict | None = setting(identity=ALWAYS, job=yaml_gen_kwargs, doc=(
        "Generation arguments for generate_until tasks, as `temperature=0,until=[...]`, `key=val` `key2=val2` or "
        "a mapping."))
    apply_chat_template: bool | str = setting(False, identity=ALWAYS, job=yaml_bool, doc=(
        "Wrap prompts in the tokenizer's chat template (optionally a template name)."))
    include_path: str | list[str] | None = setting(job=yaml_string,
                                                   doc="Additional directory of lm-eval task YAMLs.")
    seed: int | list | None = setting(identity=ALWAYS, job=yaml_seed, doc=(
        "Random seeds (python, numpy, torch, few-shot): one integer for all four or four values (default "
        "0,1234,1234,1234)."))
    output: str | None = setting(job=yaml_output, cli=cli("--output", group=RESULTS), doc=(
        "HDF5 results file (default: beside --output_path's files, else results/<model>-<time>.h5)."))
    resume: bool = setting(False, cli=cli("--resume", group=RESULTS, action="store_true"),
                           doc="Continue an existing --output file.")
    overwrite: bool = setting(False, cli=cli("--overwrite", group=RESULTS, action="store_true"),
                              doc="Replace an existing --output file.")
    data_dir: str | None = setting(identity=ALWAYS, job=yaml_string, cli=cli("--data-dir", group=RESULTS),
                                   doc=("Serve any lm-eval task offline from DIR/<dataset_path>/[<dataset_name>/]"
                                        "<split>.<jsonl|parquet> (or DIR/<task>/<split>.jsonl for the six stock "
                                        "tasks); mpitp tasks --data-dir DIR lists what is there."))
    log_samples: bool = setting(False, job=yaml_bool, doc=(
        "Keep every document's prompt, model output and scores (lm-eval's samples), in the results file too."))
    demo: bool = setting(False, cli=cli("--demo", group=RESULTS, action="store_true"),
                         doc="Built-in offline demo: tiny random Llama, three small tasks.")
    bootstrap_iters: int = setting(100000, job=yaml_int_at_least(0, "an integer >= 0"), cli=cli(
        "--bootstrap-iters", group=RESULTS, type=cli_int_at_least(0)),
        doc="Bootstrap iterations for stderr (default 100000, as lm-eval).")
    trust_remote_code: bool = setting(False, identity=IF_SET, lm_eval=True, doc=(  # the model's code runs: recorded
        "Allow remote code from the Hugging Face Hub to run (a model's own Python, a dataset's script)."))
    no_prefix_sharing: bool = setting(False, job=yaml_bool, cli=cli(  # see mpitp.replica.prefix
        "--no-prefix-sharing", group=RESULTS, action="store_true"), doc=(
        "Score every row on its own, even where rows share their context (by default such rows are scored as one "
        "tree, the context read once; same log-likelihoods up to rounding)."))
    skip_head_check: bool = setting(False, cli=cli(  # see mpitp.replica.headcheck: what it risks is said when used
        "--skip-head-check", group=RESULTS, action="store_true"), doc=(
        "Do not compare the vocab-parallel head with the model's own logits on a probe after loading (saves one "
        "small forward; risks wrong log-likelihoods for a model whose forward changes its logits in a way mpitp "
        "does not apply)."))
    model_source: str = setting("hf", doc=(
        "lm-eval's name of the model backend, recorded in lm-eval's output files (hf; from --model)."))
    model_args: dict | None = setting(lm_eval=True, doc=(
        "HFLM arguments as 'key=val,key2=val2', `key=val` `key2=val2` or JSON (pretrained=, dtype=, ...)."))
    hflm_args: dict | None = setting(identity=IF_SET, doc=(
        "The --model_args keys passed on to lm-eval's HFLM as they are (tokenisation, prompts, post-processing)."))
    attn_implementation: str | None = setting(identity=IF_SET, doc=(
        "transformers' attention implementation to load the model with (--model_args attn_implementation=)."))
    peft: str | None = setting(identity=IF_SET, job=yaml_string_list, doc=(
        "A local LoRA adapter folder (adapter_config.json, adapter_model.safetensors) merged into the base "
        "weights, each rank into its own shard; a glob or comma list (a list in job files) sweeps the adapters "
        "over one load of the base model, one results file each."), cli=cli("--peft", group=SHORTHANDS, shorthand=True))
    hf_assets: str | None = setting(identity=IF_SET, job=yaml_string, cli=cli(
        "--hf-assets", group=SWEEPS, metavar="DIR"), doc=(
        "For a torch DCP checkpoint folder as --model (torchtitan's checkpoint/step-N): the folder with the model's "
        "config.json and tokenizer files (torchtitan's hf_assets; default: a config.json in the checkpoint folder "
        "or its parent)."))
    subfolder: str | None = setting(identity=IF_SET, doc=(
        "Subfolder of the model repository or directory holding the checkpoint (--model_args subfolder=)."))
    max_batch_size: int | None = setting(lm_eval=True,
                                         doc="Largest batch size --batch_size auto may pick (default 64, as lm-eval).")
    device: str | None = setting(doc="Device kind for every rank: cpu or cuda (default: cuda when available).")
    output_path: str | None = setting(lm_eval=True, doc=(
        "Write lm-eval's own results (and samples) files under this path, the HDF5 file beside them."))
    samples: dict | None = setting(identity=IF_SET, lm_eval=True, doc=(
        "Documents to evaluate per task, as JSON mapping task names to document indices (instead of --limit)."))
    use_cache: str | None = setting(lm_eval=True, doc=(
        "Reuse model responses across runs: mpitp's own HDF5 request store at <path>.h5."))
    cache_requests: dict | None = setting(lm_eval=True, doc=(
        "lm-eval's cache of built requests: true, refresh or delete."))
    check_integrity: bool = setting(False, lm_eval=True, doc="Run each task's own test suite first.")
    write_out: bool = setting(False, lm_eval=True, doc="Print the prompts of the first few documents.")
    system_instruction: str | None = setting(identity=IF_SET, lm_eval=True,
                                             doc="System instruction put before every prompt.")
    fewshot_as_multiturn: bool | None = setting(identity=IF_SET, lm_eval=True, doc=(
        "Few-shot examples as a multi-turn conversation (on by default with --apply_chat_template)."))
    show_config: bool = setting(False, lm_eval=True, doc="Print every task's full configuration at the end.")
    verbosity: str | None = setting(lm_eval=True, doc="Log level: DEBUG, INFO, WARNING or ERROR.")
    wandb_args: dict | None = setting(lm_eval=True, doc="Weights & Biases init arguments (rank 0 logs the run).")
    wandb_config_args: dict | None = setting(lm_eval=True, doc="Weights & Biases config arguments.")
    hf_hub_log_args: dict | None = setting(lm_eval=True, doc=(
        "lm-eval's EvaluationTracker arguments (pushes to the Hub are refused: they need the network)."))
    trackio_args: dict | None = setting(lm_eval=True, doc="Trackio init arguments (needs trackio installed).")
    predict_only: bool = setting(False, identity=IF_SET, lm_eval=True, doc=(
        "Keep the model's outputs only, without computing metrics (implies --log_samples)."))
    confirm_run_unsafe_code: bool = setting(False, lm_eval=True, doc=(
        "Confirm that tasks which execute generated code may run it."))
    metadata: dict | None = setting(identity=IF_SET, lm_eval=True, doc=(
        "Task metadata as `key=val` pairs or JSON, merged with model_args (some tasks need it, e.g. RULER)."))

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
        """``from_pretrained`` arguments from ``--model_args`` beyond model, revision, dtype and remote code, and
        ``--hf-assets`` (taken by the loaders of :mod:`mpitp.replica.loading` for a torch DCP checkpoint)."""
        return {k: getattr(self, k) for k in ("attn_implementation", "subfolder", "hf_assets") if getattr(self, k)}

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

    def sampling_seed(self) -> list:
        """The base of each sampled generation's own seed (:func:`mpitp.evaluation.lm.sample_seed`): the four seeds
        as one list, one spelling per meaning. The raw ``seed`` was hashed as given, so ``mpitp eval`` (lm-eval's
        parser always gives a list, ``[0, 1234, 1234, 1234]`` by default) and ``mpitp.evaluate`` or a job file
        (``None``, ``42``, a tuple) sampled different texts for the same setting."""
        return list(self.seeds().values())

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
    from mpitp.parallel import DEFAULT_TIMEOUT

    return DEFAULT_TIMEOUT


@dataclass(frozen=True)
class RuntimeSetting:
    """How a run is laid out and watched (not part of :class:`EvalConfig`): a job-file field and/or an option."""

    name: str
    default: Any = None
    job: Callable[[Any], Any] | None = None
    cli: dict | None = None
    doc: str = ""
    """One line, shown in ``mpitp eval --help`` (a test fails on a setting without one)."""


RUNTIME = (
    RuntimeSetting("tp", 1, yaml_int_at_least(1, "a positive integer"), cli(
        "--tp", group=LAYOUT, type=cli_int_at_least(1), default=1),
        doc="Tensor-parallel degree; dp = world size / (tp x pp)."),
    RuntimeSetting("pp", 1, yaml_int_at_least(1, "a positive integer"), cli(
        "--pp", group=LAYOUT, type=cli_int_at_least(1), default=1),
        doc="Pipeline stages per model replica (TP inside each stage)."),
    RuntimeSetting("ep", 1, yaml_int_at_least(1, "a positive integer"), cli(
        "--ep", group=LAYOUT, type=cli_int_at_least(1), default=1),
        doc="Expert parallelism for mixture-of-experts models: 1, or the --tp value to spread each layer's experts "
            "over the TP group, each rank holding 1/tp of them whole (transformers' expert-parallel plan)."),
    RuntimeSetting("threads", None, None, cli(
        "--threads", group=LAYOUT, type=cli_int_at_least(1), default=None),
        doc="Torch threads per rank (default: cores per node / ranks per node)."),
    RuntimeSetting("timeout", None, yaml_timeout, cli(
        "--timeout", group=LAYOUT, type=cli_positive_float, default=lambda: float(_default_timeout()),
        help=lambda: f"Seconds any rank waits for its peers while work is handed out (default "
                     f"{_default_timeout()})."),
        doc="Seconds any rank waits for its peers while work is handed out."),
    RuntimeSetting("log_all_ranks", False, None, cli(
        "--log-all-ranks", group=LAYOUT, action="store_true"), doc="Log from every rank, each line with its rank."),
    RuntimeSetting("iface", None, yaml_string, cli(
        "--iface", group=LAYOUT, default=None, metavar="NAME"), doc=(
        "Network interface between nodes (gloo, NCCL, the rendezvous); sets MPITP_IFACE (default: the host name's "
        "address unless loopback, else the first physical interface).")),
    RuntimeSetting("stage_dir", None, yaml_string, cli(
        "--stage-dir", group=LAYOUT, default=None, metavar="DIR"), doc=(
        "Node-local directory: one rank per node copies a local model there before loading, the node's other ranks "
        "wait, every rank loads the copy; reused while the model is unchanged. ~, $VARS and {node} are expanded on "
        "each node (default: MPITP_STAGE_DIR, else load in place).")),
    RuntimeSetting("device", None, yaml_device,  # on the command line: lm-eval's own --device
                   doc="Device kind for every rank: cpu or cuda (default: cuda when available)."),
    RuntimeSetting("watch", None, None, cli(
        "--watch", group=SWEEPS, default=None, metavar="DIR"),
        doc="Evaluate checkpoints (subdirectories of DIR) as they appear; resumable."),
    RuntimeSetting("watch_idle", 600.0, None, cli(
        "--watch-idle", group=SWEEPS, type=cli_positive_float, default=600.0),
        doc="With --watch: stop after this many seconds without a new complete checkpoint (default 600)."),
)


@dataclass(frozen=True)
class RuntimeOptions:
    """One ``mpitp eval`` launch's :data:`RUNTIME` settings, typed (what the command line gave; the defaults are the
    declarations'). ``tests/test_settings.py`` keeps the two in step: a field per setting, the same defaults."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    threads: int | None = None
    timeout: float | None = None
    log_all_ranks: bool = False
    iface: str | None = None
    stage_dir: str | None = None
    device: str | None = None
    watch: str | None = None
    watch_idle: float = 600.0


# ------------------------------------------------------------------------------------------------- derived views


def eval_settings() -> tuple[Field, ...]:
    """:class:`EvalConfig`'s fields (``dataclasses.Field``: name, type, default and the metadata above)."""
    return fields(EvalConfig)


def default(f: Field) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def job_fields() -> dict[str, Callable[[Any], Any]]:
    """Job-file fields read as themselves, with their YAML readers: the settings' and the runtime ones."""
    out = {f.name: f.metadata["job"] for f in eval_settings() if f.metadata.get("job")}
    out.update({s.name: s.job for s in RUNTIME if s.job})
    return out


def lm_eval_named() -> list[Field]:
    """The settings named as lm-eval's ``EvaluatorConfig`` fields that mpitp takes over as they are (``lm_eval``):
    a job file names them so, and ``mpitp eval`` copies them from lm-eval's parsed command line."""
    return [f for f in eval_settings() if f.metadata.get("lm_eval")]


def _hint(f):
    """Setting ``f``'s annotation as a real type (``typing.get_type_hints``: this module's annotations are strings)."""
    return typing.get_type_hints(EvalConfig)[f.name]


def _types(f) -> tuple[type, ...]:
    """The types setting ``f`` may hold, in declared order, None left out (``int | float | None`` -> ``(int,
    float)``; ``list[str]`` -> ``(list,)``), from the real annotation: matching the annotation's text would take
    ``FrozenDict`` for ``dict`` and depend on how a union happens to be spelt."""
    hint = _hint(f)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return tuple(typing.get_origin(t) or t for t in (typing.get_args(hint) if union else (hint,))
                 if t is not type(None))


def from_evaluator_config(f: Field, value: Any) -> Any:
    """``EvaluatorConfig``'s value for setting ``f`` in mpitp's spelling: a flag as a bool, an empty mapping as None."""
    if _hint(f) is bool:  # a plain flag; ``bool | None`` keeps None (lm-eval's "not given")
        return bool(value)
    if dict in _types(f):
        return value or None
    return value


_FLAG_READERS = {"cache_requests": yaml_cache_requests, "verbosity": yaml_verbosity}
"""lm-eval-named settings read by the flag's own rule rather than their type's: what lm-eval parses the flag into (a
mapping), or a word of a fixed set."""


def lm_eval_job_fields() -> dict[str, Callable[[Any], Any]]:
    """Job-file fields named as lm-eval's ``EvaluatorConfig`` fields, read with their meaning on the command line;
    the YAML reader follows the field's type (its first declared one, or a mapping where a dict is allowed), or the
    flag's own rule (:data:`_FLAG_READERS`)."""
    out = {}
    for f in lm_eval_named():
        kinds = _types(f)
        if f.name in _FLAG_READERS:
            out[f.name] = _FLAG_READERS[f.name]
        elif dict in kinds:
            out[f.name] = yaml_mapping
        elif kinds[0] is bool:
            out[f.name] = yaml_bool
        elif kinds[0] is int:
            out[f.name] = yaml_int_at_least(1, "a positive integer")
        else:
            out[f.name] = yaml_string
    return out


def setting_docs() -> dict[str, str]:
    """Every setting's one-line description by name (:class:`EvalConfig`'s fields, then :data:`RUNTIME`'s): the help
    of the option of that name in ``mpitp eval --help``, mpitp's own or lm-eval's (``device`` is both a field and a
    runtime setting, with one meaning)."""
    out = {f.name: f.metadata["doc"] for f in eval_settings()}
    for s in RUNTIME:
        out.setdefault(s.name, s.doc)
    return out


def cli_options() -> list[tuple[str, dict]]:
    """``(dest, cli(...))`` for each of mpitp's own ``mpitp eval`` options, in help-group order. The help is the
    setting's ``doc`` (a shorthand's says which model_args key it sets) unless the option gives its own; a default
    or help given as a function is computed now."""
    docs = setting_docs()
    found = [(s.name, s.cli) for s in RUNTIME if s.cli]
    for f in eval_settings():
        if f.metadata.get("cli"):  # a shorthand's absence must differ from its default: it is merged into model_args
            spec = f.metadata["cli"]
            found.append((f.name, {**spec, "kwargs": {"default": None if spec["shorthand"] else default(f),
                                                      **spec["kwargs"]}}))
    out = []
    for dest, spec in sorted(found, key=lambda item: CLI_GROUPS.index(item[1]["group"])):
        kwargs = {k: (v() if k in ("default", "help") and callable(v) else v) for k, v in spec["kwargs"].items()}
        if "help" not in kwargs:
            kwargs["help"] = docs[dest].rstrip(".") + (f" (model_args {dest}=)." if spec["shorthand"] else ".")
        out.append((dest, {**spec, "kwargs": kwargs}))
    return out


def cli_runtime_dests() -> tuple[str, ...]:
    return tuple(s.name for s in RUNTIME if s.cli)


def cli_setting_dests(*, shorthand: bool) -> tuple[str, ...]:
    """:class:`EvalConfig` fields set by mpitp's own options: directly, or (``shorthand``) through model_args."""
    return tuple(f.name for f in eval_settings() if f.metadata.get("cli")
                 and f.metadata["cli"]["shorthand"] == shorthand)
