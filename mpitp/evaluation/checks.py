"""Checks of an evaluation's input, all on rank 0 and all before any model loads.

Each failure is a one-line :class:`UsageError` that spells out what is wrong (``tp=3 does not divide ...``,
``unknown task 'arc_esy'; did you mean: arc_easy?``, ``cannot resume X: different settings: limit 2 in the file,
3 now``); :func:`mpitp.parallel.runtime.agree` shares the verdict so every rank exits together.
"""

from __future__ import annotations

import difflib
import errno
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.results.untrusted import shown

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager
    from transformers import GenerationConfig

    from mpitp.evaluation.settings import EvalConfig
    from mpitp.parallel.runtime import Launch
    from mpitp.results.claim import OutputClaim

log = logging.getLogger("mpitp")


def _paths(include_path) -> list[str]:
    return [include_path] if isinstance(include_path, str) else list(include_path or [])


def task_manager(tasks: list[str], include_path: str | Sequence[str] | None,
                 metadata: dict | None = None) -> TaskManager:
    """lm-eval's TaskManager for ``tasks``; refuses unknown names before the slow part.

    lm-eval's index of its ~14.7k stock task YAMLs takes 8-16 s to build, so it is kept in a cache
    (:mod:`mpitp.tasks.index`, a fraction of a second to read) and skipped altogether when the include path can build
    every task by itself (:func:`mpitp.tasks.index.self_contained`). Before a build (no cache yet), a name that no
    stock file can declare (:mod:`mpitp.tasks.names`, under a second) is refused without it.
    """
    from mpitp.tasks import index

    included: list[str] = []
    if include_path:
        tm = index.task_manager(include_path, include_defaults=False, metadata=metadata)
        if index.self_contained(tm, tasks):
            return tm
        included = tm.all_tasks
    if not index.is_cached():
        from mpitp.tasks.names import stock_task_names

        _refuse_unknown(tasks, set(included) | stock_task_names())
    return index.task_manager(include_path or None, metadata=metadata)


def _refuse_unknown(tasks: list[str], known: set[str]) -> None:
    from mpitp.tasks.names import task_file_hint

    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, sorted(known), n=5, cutoff=0.6)
            hint = f"; did you mean: {', '.join(close)}?" if close else ""
            raise UsageError(f"unknown task '{t}'{task_file_hint(t) or hint}")


def offline_include(cfg: EvalConfig) -> list[str]:
    """With ``--data-dir``, write override YAMLs for the tasks it serves (:mod:`mpitp.tasks.layout`: any lm-eval task,
    groups expanded) and put them on the include path; its ``nltk_data`` folder goes first on nltk's path.

    Offline (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``, as on compute nodes), a task reading a Hub dataset that is
    neither in DATA (when given) nor in the HF cache is refused here, in seconds on rank 0, naming the file and the
    prefetch command: lm-eval would fail on it only when it loads the tasks, after the launch and the model load."""
    if not cfg.data_dir:
        from mpitp.tasks.layout import offline, require_cached

        if offline():
            require_cached(cfg.tasks, _paths(cfg.include_path), cfg.num_fewshot)
        return _paths(cfg.include_path)
    import tempfile

    from mpitp.tasks.layout import offline, use_nltk_data, write_overrides
    from mpitp.tasks.offline import data_dir_problem

    problem = data_dir_problem(cfg.data_dir)
    if problem:
        raise UsageError(problem)
    use_nltk_data(cfg.data_dir)
    out = tempfile.mkdtemp(prefix="mpitp-tasks-")
    try:
        write_overrides(cfg.tasks, cfg.data_dir, out, _paths(cfg.include_path) or None,
                        cfg.num_fewshot, strict=offline())
    except BaseException:
        remove_generated([out])
        raise
    return _paths(cfg.include_path) + [out]


def remove_generated(include: list[str] | None) -> None:
    """Remove the override YAMLs :func:`offline_include` wrote (rank 0, after the run)."""
    import shutil
    import tempfile

    for path in include or []:
        if os.path.basename(path).startswith("mpitp-tasks-") and os.path.dirname(path) == tempfile.gettempdir():
            shutil.rmtree(path, ignore_errors=True)


def check_tasks(tasks: list[str], include_path: str | Sequence[str] | None,
                metadata: dict | None = None) -> TaskManager:
    """Every task name must be known to lm-eval (with the extra include path); suggest close matches."""
    for path in _paths(include_path):
        if not os.path.isdir(path):
            raise UsageError(f"--include-path {path}: no such directory")
    if not tasks:
        raise UsageError("no tasks given: pass --tasks a,b (or --demo)")
    tm = task_manager(tasks, include_path, metadata)
    _refuse_unknown(tasks, set(tm.all_tasks))  # the scan's few extra names are not tasks: lm-eval's index decides
    return tm


def default_output(model: str) -> str:
    name = os.path.basename(os.path.normpath(model)) or "model"
    return os.path.join("results", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.h5")


def check_output(cfg: EvalConfig) -> str:
    """Resolve the output path; refuse to overwrite silently and fail early when it cannot be written."""
    out = cfg.output or default_output(cfg.model)
    if cfg.resume and cfg.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: pick one")
    if os.path.exists(out):
        if os.path.isdir(out):
            raise UsageError(f"output {out} is a directory")
        if not (os.path.islink(out) or os.path.isfile(out)):  # --overwrite renames over it: /dev/null became a file
            raise UsageError(f"output {out} is not a regular file (a device, FIFO or socket): choose another --output")
        if not (cfg.resume or cfg.overwrite):
            raise UsageError(f"output {out} already exists: pass --resume to continue it or --overwrite to replace it")
        if cfg.resume:
            check_resumable(out, cfg)
    elif cfg.resume:
        log.info("%s does not exist yet: starting a new run", shown(out))
    check_writable(out)
    return out


def check_writable(out: str) -> None:
    """Refuse, in one line, an output whose folder cannot be made or written (before any work is done for it)."""
    probe_dir = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(probe_dir):  # lexists: a dangling or looping link is found (makedirs then failed)
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        link = " (a link to nothing)" if os.path.islink(probe_dir) else ""
        raise UsageError(f"cannot write output {out}: {probe_dir} is not a directory{link}")
    try:  # os.access says yes to root on read-only mounts: try for real
        import tempfile

        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".mpitp-probe-"):
            pass
    except OSError as exc:  # ENOENT for a folder that exists: a filesystem that makes no files (/proc, /sys)
        reason = "no files can be created there" if exc.errno == errno.ENOENT else exc.strerror or exc
        raise UsageError(f"cannot write output {out}: {probe_dir}: {reason}") from None


def check_resumable(path: str, cfg: EvalConfig) -> None:
    """A run may only continue a file made with the same model, tokenizer, dtype, tasks and settings.

    The file may come from anyone: its settings, fingerprint and every stored row are read and checked here (types,
    links, sizes: :mod:`mpitp.results.untrusted`), so that a malformed file ends as one line, not a traceback. Its
    rows are then this run's results, which no check can vouch for: a file another user made (a planted one in a
    shared output folder, its settings copied from a public run) is refused, and copying it makes it one's own."""
    from mpitp.evaluation.fingerprint import resume_differences, stored_fingerprint
    from mpitp.evaluation.provenance import redact
    from mpitp.results.rows import load_rows
    from mpitp.results.schema import open_h5
    from mpitp.results.untrusted import load_json, mapping

    uid = next((st.st_uid for st in (os.lstat(path), os.stat(path)) if st.st_uid not in (os.geteuid(), 0)), None)
    if uid is not None:
        raise UsageError(f"cannot resume {shown(path)}: it belongs to uid {uid}, not to this user "
                         f"(uid {os.geteuid()}), and --resume takes its stored rows as this run's results: copy it to "
                         "a file of yours to continue it, or choose another --output")
    try:
        with open_h5(path) as f:
            stored = mapping(load_json(f.attrs["config_json"], "config_json"), "config_json")
            on_disk = stored_fingerprint(load_json(f.attrs["fingerprint_json"], "fingerprint_json")) \
                if "fingerprint_json" in f.attrs else None
        load_rows(path)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:  # TypeError: an attribute not text
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise UsageError(f"cannot resume {path}: not an mpitp results file ({shown(reason)})") from None
    now = json.loads(json.dumps(redact(cfg.identity())))  # as recorded: secrets left out
    diffs = [f"{k} {stored.get(k)!r} in the file, {now.get(k)!r} now" for k in sorted(set(stored) | set(now))
             if stored.get(k) != now.get(k)]
    diffs += resume_differences(on_disk, stored, now, cfg)
    if diffs:
        raise UsageError(f"cannot resume {path}: different settings: " + "; ".join(diffs))


# generate modes that reorder or fork the KV cache (beams, contrastive search) or run a second model / a lookup that
# rewinds it (assisted and speculative decoding, prompt lookup, DoLa's early exits): only the leader's cache would
# change, the TP workers' and stages' shards would not, and the text would silently be wrong.
_CACHE_FORKING = {
    "num_beams": lambda v: v is not None and int(v) > 1,
    "num_beam_groups": lambda v: v is not None and int(v) > 1,
    "penalty_alpha": lambda v: v is not None and float(v) > 0,
    "assistant_model": lambda v: v is not None,
    "assistant_early_exit": lambda v: v is not None,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "dola_layers": lambda v: v is not None,
    "constraints": lambda v: v is not None,
    "force_words_ids": lambda v: v is not None,
}


def unsupported_generation(kwargs: dict, generation_config: GenerationConfig | None = None) -> str | None:
    """The first setting (from ``kwargs``, else the model's generation config) that makes ``generate`` reorder or
    fork the KV cache, as ``name=value``; None when generation is a plain left-to-right decode."""
    for name, bad in _CACHE_FORKING.items():
        value = kwargs.get(name, getattr(generation_config, name, None))
        try:
            if bad(value):
                return f"{name}={value}"
        except (TypeError, ValueError):
            return f"{name}={value!r}"
    return None


def refuse_unsupported_generation(kwargs: dict, generation_config: GenerationConfig | None, where: str,
                                  layout_desc: str) -> None:
    found = unsupported_generation(kwargs, generation_config)
    if found:
        raise UsageError(f"{where}: {found} is not supported with {layout_desc}: that generate mode reorders or "
                         f"forks the KV cache, which only the leader would do (its TP workers' and pipeline stages' "
                         f"caches would not follow); run with --tp 1 --pp 1 or drop it")


def check_gen_kwargs(gen_kwargs, tp: int, pp: int) -> dict:
    """``--gen_kwargs`` as lm-eval reads it, each value checked without torch (:mod:`mpitp.evaluation.gen_kwargs_check`;
    :func:`check_all`'s and ``mpitp.evaluate``'s), the ``generate`` arguments then built by its ``check_generation``
    (torch); ``use_cache`` refused, and with TP workers or pipeline stages a generate mode that forks the KV cache."""
    if not gen_kwargs:
        return {}
    if "use_cache" in str(gen_kwargs):
        raise UsageError("--gen-kwargs use_cache is not supported: lm-eval's HF model always generates with the "
                         "KV cache (it passes use_cache=True itself)")
    from mpitp.evaluation.gen_kwargs_check import parse_gen_kwargs

    parsed = parse_gen_kwargs(gen_kwargs)
    if tp > 1 or pp > 1:
        refuse_unsupported_generation(parsed, None, "--gen-kwargs", f"tp={tp} pp={pp}")
    return parsed


@dataclass
class CheckedTasks:
    """The tasks, checked: the include path (with the YAMLs :func:`offline_include` wrote) and lm-eval's TaskManager.
    A sweep checks them once and passes them to every checkpoint's :func:`check_all`."""

    include: list[str]
    task_manager: object


@dataclass
class Checked:
    """What :func:`check_all` found, for the steps after it. Rank 0's owns the claim on the output (released by
    :meth:`release` or on leaving a ``with`` block); on the other ranks only ``output`` and ``tokenizer`` are set."""

    output: str
    tokenizer: str
    config: object = None  # the model's transformers config (rank 0)
    tasks: CheckedTasks | None = None
    claim: OutputClaim | None = None

    @property
    def task_manager(self) -> TaskManager | None:
        return self.tasks.task_manager if self.tasks is not None else None

    def release(self) -> None:
        """Give back the claim on the output (a sweep's next checkpoint claims its own); idempotent."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    def __enter__(self) -> Checked:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def run_task_names(names: list[str], tm: TaskManager) -> list[str]:
    """The leaf tasks ``names`` score (groups and tags expanded), by the names lm-eval gives them."""
    from mpitp.tasks.layout import expand

    return [leaf.name.rsplit("::", 1)[-1] for leaf in expand(names, tm.task_index)]


def check_tasks_once(cfg: EvalConfig) -> CheckedTasks:
    """Write the offline task YAMLs (``--data-dir``) and check every task name: lm-eval's TaskManager."""
    include = offline_include(cfg)
    try:
        return CheckedTasks(include, check_tasks(cfg.tasks, include, cfg.metadata))
    except BaseException:
        remove_generated(include)
        raise


def check_all(cfg: EvalConfig, tp: int, pp: int = 1, tasks: CheckedTasks | None = None, ep: int = 1) -> Checked:
    """Every check of one evaluation, on rank 0 before any rank loads the model; the last one claims the output.
    ``tasks`` skips checking the tasks again (a sweep checks them once for every checkpoint)."""
    from mpitp.replica.loading import check_decoder_mode, check_dtype, check_ep, check_tp, load_config

    compat.check(packages=("lm-eval",))  # lm-eval still has every attribute mpitp replaces (torch's: below)
    if cfg.data_dir:
        from mpitp.tasks.offline import data_dir_problem

        problem = data_dir_problem(cfg.data_dir)
        if problem:
            raise UsageError(problem)
    if str(cfg.batch_size).isdigit() and int(cfg.batch_size) < 1:
        raise UsageError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.limit is not None and not cfg.limit > 0:
        raise UsageError(f"--limit must be > 0, got {cfg.limit:g}")
    if cfg.seed is not None:  # NumPy's range: --seed 5000000000 was its ValueError on rank 0 after the load
        from mpitp.evaluation.setting_values import BadValue, seeds_value

        try:
            seeds_value(cfg.seed)
        except BadValue as exc:
            raise UsageError(f"--seed: {exc}") from None
    check_dtype(cfg.dtype)
    gen_kwargs = check_gen_kwargs(cfg.gen_kwargs, tp, pp)
    own = tasks is None  # YAMLs written here are removed here if a later check refuses
    tasks = tasks or check_tasks_once(cfg)
    try:
        from mpitp.evaluation.lmeval_args import check_lm_eval_settings
        from mpitp.evaluation.picked import check_samples

        check_lm_eval_settings(cfg)
        check_samples(cfg.samples, run_task_names(cfg.tasks, tasks.task_manager), tasks.task_manager.all_tasks,
                      cached=cfg.requests_cache()["cache_requests"])
        if cfg.trust_remote_code:  # from model_args or a job file's defaults: the user may not know it is on
            log.warning("trust_remote_code is on: %s's own Python code (from its repository) runs on every rank",
                        shown(cfg.model))
        config = load_config(cfg.model, cfg.revision, cfg.trust_remote_code, cfg.hf_assets)
        _check_dcp(cfg, config)
        check_tokenizer(cfg, config)
        if cfg.peft:
            from mpitp.replica.adapters import check_config

            check_config(cfg.peft)
        check_tp(config, tp)
        check_ep(config, ep, pp, cfg.peft)
        from mpitp.replica.pipeline import check_plans_apply, check_pp  # imports torch: after the others

        check_pp(config, pp)
        check_plans_apply(config, tp, pp, ep)
        check_decoder_mode(config)
        from mpitp.evaluation.gen_kwargs_check import check_generation, check_model_kwargs

        check_generation(gen_kwargs)  # transformers' generation checks: torch is imported by now
        check_model_kwargs(gen_kwargs, config)
        # Resolving these imports torch and transformers' model code (seconds on a loaded node): after the input
        # checks, so that bad input is refused without them.
        compat.check(packages=("transformers", "torch"))
        out = check_output(cfg)
        from mpitp.results.claim import claim_output

        claim = claim_output(out)  # last: a refused check must not leave a claim behind
    except BaseException:
        if own:
            remove_generated(tasks.include)
        raise
    from mpitp.replica.dcp import tokenizer_source

    return Checked(out, tokenizer_source(cfg.model, cfg.tokenizer, cfg.hf_assets), config, tasks,
                   claim)


def check_tokenizer(cfg: EvalConfig, config=None) -> None:
    """Rank 0, before any rank loads: the tokenizer lm-eval will load loads, and applies a chat template when
    ``--apply_chat_template`` asks for one; only then (a run without either reads the model's own, which
    ``mpitp check`` covers). Found after the load, ``--tokenizer ./nope`` was an OSError traceback on every rank
    (MPI_Abort, exit 1), and a tokenizer without a template a refusal on rank 0 alone
    (:meth:`mpitp.evaluation.lm.MPITPLM.check_chat_template`), which ended a job file's whole campaign, its later runs
    never started, where a refusal agreed here fails that run and the job goes on. A template chosen by name is still
    lm-eval's to pick, after the load. With the model's ``config``: a named tokenizer whose own vocabulary is larger
    than the model's embedding (GPT-2's 50257 ids for stories260K's 512) is refused; its ids past the embedding were
    an IndexError traceback on every rank at the first forward."""
    from mpitp.replica.dcp import tokenizer_source

    source = tokenizer_source(cfg.model, cfg.tokenizer, cfg.hf_assets)
    if source is None or (not cfg.tokenizer and cfg.apply_chat_template is not True):
        return
    if cfg.tokenizer and cfg.tokenizer.startswith(("/", "./", "../", "~")) and \
            not os.path.isdir(os.path.expanduser(cfg.tokenizer)):  # a path, not a hub id: transformers says neither
        raise UsageError(f"--tokenizer {shown(cfg.tokenizer)}: no such directory")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=cfg.revision or "main",
                                                  trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ... for one that does not load
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        what = f"--tokenizer {shown(source)}" if cfg.tokenizer else f"the tokenizer of {shown(source)}"
        raise UsageError(f"{what} cannot be loaded: {why}") from None
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    if cfg.tokenizer and isinstance(vocab, int) and tokenizer.vocab_size > vocab:
        raise UsageError(f"--tokenizer {shown(cfg.tokenizer)} has {tokenizer.vocab_size} token ids, the model "
                         f"{shown(cfg.model)} embeds {vocab} (config vocab_size): ids {vocab} to "
                         f"{tokenizer.vocab_size - 1} have no embedding; give the model's own tokenizer")
    if cfg.apply_chat_template is True:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        except ValueError as exc:
            why = " ".join(str(exc).split()[:40]) or type(exc).__name__
            raise UsageError(f"--apply_chat_template: the tokenizer cannot apply a chat template: {why}") from None


def _check_dcp(cfg: EvalConfig, config) -> None:
    """A torch DCP checkpoint's tensor names and shapes against the config's model, read from its ``.metadata``
    only (seconds, before any rank loads): an unknown name or a wrong shape is refused naming the parameter."""
    from mpitp.replica import dcp

    if not dcp.is_dcp(cfg.model):
        return
    if cfg.subfolder:
        raise UsageError(f"model path {cfg.model}: subfolder= does not apply to a torch DCP checkpoint folder")
    plan = dcp.check(cfg.model, config, cfg.trust_remote_code)
    log.info("%s: torch DCP checkpoint, %s names%s, %d tensors, config from %s", shown(cfg.model), plan.naming,
             f" under '{plan.prefix}'" if plan.prefix else "", len(plan.entries),
             dcp.assets_dir(cfg.model, cfg.hf_assets))


def check_on_root(cfg: EvalConfig, rt: Launch, timeout: float | None, phase: str,
                  tasks: CheckedTasks | None = None) -> Checked:
    """:func:`check_all` on rank 0, its verdict shared with every rank (:func:`mpitp.parallel.runtime.agree`).
    Rank 0 gets the whole :class:`Checked`; the other ranks its output path and tokenizer, the rest stays with rank 0
    (a TaskManager and a file lock do not travel)."""
    from mpitp.parallel.runtime import agree

    found: list[Checked] = []

    def check() -> tuple[str, str]:
        found.append(check_all(cfg, rt.layout.tp, rt.layout.pp, tasks, ep=rt.ep))
        return found[0].output, found[0].tokenizer

    out, tokenizer = agree(check, rt.world.comm, timeout, phase)
    return found[0] if found else Checked(out, tokenizer)
