"""Will this evaluation run without network? ``mpitp check``, answered in seconds on the login node.

Compute nodes usually have no network, and what an lm-eval run fetches is scattered: the task's dataset, an
``evaluate`` metric module (rouge, bleu, ...), nltk data, tokenizer files, remote code. Each surfaces only on the
compute node, after the queue. So the check does what the run does, as far as it can without the model's weights,
with the network off: the offline variables set and every connection to a non-local address refused in this process
(:func:`block_network`; the refused hosts are reported), then

1. the model's config and tokenizer loaded with ``local_files_only``;
2. every task built as the run builds it (``--data-dir`` overrides of :mod:`mpitp.tasks.layout` included, groups
   expanded to their tasks, one task at a time so that one failure names its task), and its requests for a few docs
   (few-shot and chat template as asked);
3. each task's filters, ``process_results`` and aggregations run once on stand-in model outputs.

Every problem is one :class:`Problem`: what is missing and the command that fetches it. What ``mpitp prefetch`` can
fetch by itself is named in the problem's fields: an ``evaluate`` metric module (found from ``evaluate``'s "Couldn't
find a module script" error) and nltk data (found from nltk's ``LookupError``, whose text names the package to
``nltk.download``: no hand list of which task needs what). nltk data is looked for in ``DATA/nltk_data`` first
(:func:`mpitp.tasks.layout.use_nltk_data`), where prefetch puts it and where the run looks.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import shlex
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from mpitp.errors import UsageError

log = logging.getLogger("mpitp")

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
EVALUATE_OFFLINE = "HF_EVALUATE_OFFLINE"
"""``evaluate`` asks the Hub for a metric's script before it looks in its cache unless this is set (read when
``evaluate`` is imported); the batch scripts set it as well."""
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
CHECK_LIMIT = 2
"""Docs per task whose requests and metrics are built: the code paths, not the numbers, are checked."""


@dataclass(frozen=True)
class CheckSpec:
    """What one evaluation needs: the settings of ``mpitp eval`` that decide what it reads."""

    tasks: tuple[str, ...]
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    data_dir: str | None = None
    include_path: tuple[str, ...] = ()
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    trust_remote_code: bool = False
    hf_assets: str | None = None
    """A torch DCP checkpoint's config and tokenizer folder (``--hf-assets``)."""
    label: str = ""
    """The run's name in a job file (prefixed to its problems)."""


@dataclass(frozen=True)
class Problem:
    """One thing the run would miss offline, and the command that fetches it (None when none can)."""

    what: str
    fetch: str | None = None
    metric: str | None = None
    """The ``evaluate`` metric module it lacks (``mpitp prefetch`` downloads it), if that is the problem."""
    nltk: str | None = None
    """The nltk package it lacks (``mpitp prefetch`` downloads it into ``DATA/nltk_data``), if that is it."""

    def line(self) -> str:
        return self.what + (f"; fetch it: {self.fetch}" if self.fetch else "")


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    """The leaf tasks built and scored."""
    model_beside: bool = False
    """Whether the model was checked in a child process beside the tasks (:func:`_start_model_check`)."""

    @property
    def ready(self) -> bool:
        return not self.problems


# ------------------------------------------------------------------------------------------------ the network guard
def _local(host) -> bool:
    if host is None:
        return True
    host = str(host).strip("[]")
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return addr.is_loopback or addr.is_unspecified


@contextmanager
def block_network(tried: list[str]):
    """Refuse connections to non-local addresses in this process, recording ``host:port`` in ``tried``.

    Set in the ``mpitp check`` process only (our own process, not a library under test): the guard sits on the
    socket layer every HTTP client goes through, name resolution included, so a host is caught even when the
    library swallows the error (nltk's downloader does)."""
    saved = os.environ.copy()
    for var in (*OFFLINE_VARS, EVALUATE_OFFLINE, "TQDM_DISABLE"):  # TQDM_DISABLE: no progress bar per task built
        os.environ[var] = "1"
    for var in PROXY_VARS:  # a proxy on this host is a local address the guard would let through to the world
        os.environ.pop(var, None)
    os.environ["EVALUATE_VERBOSITY"] = "error"  # evaluate sets its logger's level when imported (here, by a task)
    real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, \
        socket.getaddrinfo

    def refuse(host, port):
        where = f"{host}:{port}" if port is not None else str(host)
        if where not in tried:
            tried.append(where)
        raise OSError(errno.ENETUNREACH, f"mpitp check: network blocked (compute nodes have none): {where}")

    def guarded(real):  # socket.connect and connect_ex: the same test before the real call
        def connect(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
                refuse(address[0], address[1])
            return real(sock, address)
        return connect

    connect, connect_ex = guarded(real_connect), guarded(real_connect_ex)

    def getaddrinfo(host, port, *args, **kwargs):
        if not _local(host.decode() if isinstance(host, bytes) else host):
            refuse(host, port)
        return real_getaddrinfo(host, port, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
    try:
        yield tried
    finally:
        socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = real_connect, real_connect_ex, \
            real_getaddrinfo
        os.environ.clear()
        os.environ.update(saved)


# ------------------------------------------------------------------------------------------------ the checks
def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def prefetch_command(spec: CheckSpec, *, tasks=None, model: bool = False) -> str:
    """The ``mpitp prefetch`` command that fetches ``tasks`` (or the model) for ``spec``."""
    argv = ["mpitp", "prefetch"]
    if model:
        argv += ["--model", str(spec.model)]
        if spec.revision:
            argv += ["--revision", spec.revision]
    elif spec.data_dir:
        from mpitp.tasks.layout import prefetch_command as tasks_command

        return tasks_command(tasks or spec.tasks, spec.data_dir, spec.include_path)
    else:
        argv += ["--tasks", ",".join(tasks or spec.tasks), "--data-dir", "DATA"]
        for path in spec.include_path:
            argv += ["--include_path", path]
    return shlex.join(argv)


def check_model(spec: CheckSpec, report: Report) -> object | None:
    """Config and tokenizer from local files only; the tokenizer, or None."""
    if not spec.model:
        return None
    import transformers

    kw = {"revision": spec.revision, "local_files_only": True, "trust_remote_code": spec.trust_remote_code}
    fetch = prefetch_command(spec, model=True)
    source, tokenizer = spec.model, spec.tokenizer or spec.model
    dcp_path = os.path.expanduser(spec.model)
    from mpitp.replica import dcp

    is_dcp = dcp.is_dcp(dcp_path)
    if is_dcp:  # torch DCP: config and tokenizer from its assets; its .metadata checked as mpitp eval checks it
        try:
            source = dcp.assets_dir(dcp_path, spec.hf_assets)
        except UsageError as exc:
            report.problems.append(Problem(str(exc)))
            return None
        tokenizer, fetch, kw = spec.tokenizer or source, None, {**kw, "revision": None}
    elif spec.hf_assets:
        report.problems.append(Problem(f"--hf-assets applies to torch DCP checkpoint folders only, and {spec.model} "
                                       f"is not one (no {dcp.METADATA} file, or Hugging Face weights beside it)"))
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(source, **kw)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding, spelled out
        report.problems.append(Problem(f"model {spec.model}: config not available offline ({_why(exc)})", fetch))
        return None
    if is_dcp:
        try:
            dcp.check(dcp_path, config, spec.trust_remote_code)
        except UsageError as exc:
            report.problems.append(Problem(str(exc)))
    try:
        return transformers.AutoTokenizer.from_pretrained(tokenizer, **kw)
    except Exception as exc:  # noqa: BLE001
        report.problems.append(Problem(f"tokenizer {tokenizer}: not available offline ({_why(exc)})", fetch))
        return None


_METRIC_SCRIPT = re.compile(r"Couldn't find a module script at \S*?([\w-]+)\.py")
_NLTK_PACKAGE = re.compile(r"nltk\.download\('([\w.-]+)'")
_STAND_IN = {"loglikelihood": (-1.0, False), "loglikelihood_rolling": -1.0, "generate_until": "A",
             "multiple_choice": (-1.0, False)}


def score_stand_ins(task) -> None:
    """Filters, ``process_results`` and every aggregation of ``task`` on stand-in outputs, as lm-eval's evaluator
    runs them; raises what they raise."""
    for inst in task.instances:
        inst.resps = [_STAND_IN.get(inst.request_type, (-1.0, False))] * max(1, int(inst.repeats or 1))
    task.apply_filters()
    by_doc: dict = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    aggregations = task.aggregation()
    for key in task.instances[0].filtered_resps:
        values: dict = {}
        for insts in by_doc.values():
            insts.sort(key=lambda i: i.idx)
            for metric, value in task.process_results(insts[0].doc, [i.filtered_resps[key] for i in insts]).items():
                values.setdefault(metric, []).append(value)
        for metric, items in values.items():
            if metric in aggregations:
                aggregations[metric](items)


def _chat(tokenizer):
    if tokenizer is None:
        return None

    def apply(messages, add_generation_prompt: bool = True):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    return apply


def check_tasks(spec: CheckSpec, report: Report, tokenizer) -> None:
    """Build each task and its requests, score stand-ins (see the module docstring)."""
    from mpitp.tasks import index
    from mpitp.tasks.layout import expand, resolve_all, write_configs
    from mpitp.tasks.offline import DataDirError

    if not spec.tasks:
        return
    if spec.apply_chat_template and not spec.model:
        report.problems.append(Problem("--apply_chat_template needs --model: the prompts are built with its "
                                       "tokenizer's chat template"))
        return
    include = list(spec.include_path)
    broken: set[str] = set()
    leaves = None
    with tempfile.TemporaryDirectory(prefix="mpitp-check-") as out:
        if spec.data_dir:
            if not os.path.isdir(spec.data_dir):
                report.problems.append(Problem(f"--data-dir {spec.data_dir}: no such directory"))
                return
            try:
                res = resolve_all(spec.tasks, spec.data_dir, include or None, spec.num_fewshot)
            except DataDirError as exc:  # DATA itself unusable (its resolved path holds a control character)
                report.problems.append(Problem(str(exc)))
                return
            for gap in res.missing:
                broken.add(gap.task)
                report.problems.append(Problem(f"dataset: {gap}", prefetch_command(spec, tasks=[gap.task])
                                               if gap.fetchable else None))
            write_configs(res.configs, out, spec.data_dir)
            include.append(out)
            # expanded once, not again from the overrides (3 YAML parses per subtask saved); DATA serves, not the Hub
            leaves = [replace(leaf, hub=False) if leaf.name in res.files else leaf for leaf in res.leaves]
        tm = index.task_manager(include or None)
        known = set(tm.all_tasks)
        for name in spec.tasks:
            if name not in known:
                report.problems.append(Problem(f"unknown task '{name}' (not in lm-eval's index"
                                               f"{' nor --include_path' if spec.include_path else ''})"))
        groups: dict = {}
        for leaf in leaves if leaves is not None else expand(spec.tasks, tm.task_index):
            if leaf.name not in broken:
                _check_leaf(spec, report, tm, leaf, tokenizer, groups)


def _check_leaf(spec: CheckSpec, report: Report, tm, leaf, tokenizer, groups: dict) -> None:
    where = f"dataset {leaf.dataset_path}" + (f"/{leaf.dataset_name}" if leaf.dataset_name else "")
    step = "build"
    try:
        task = _load(tm, leaf, groups)
        unloaded = _unloaded_metrics(task)
        if unloaded:  # lm-eval logs evaluate.load's failure and keeps None: the run would fail scoring, unnamed
            fetch = prefetch_command(spec, tasks=[leaf.name])
            report.problems += [Problem(_metric_missing(leaf.name, name), fetch, metric=name) for name in unloaded]
            return
        step = "requests"
        if spec.num_fewshot is not None:
            task.set_config(key="num_fewshot", value=spec.num_fewshot)
        task.build_all_requests(limit=CHECK_LIMIT, rank=0, world_size=1, apply_chat_template=spec.apply_chat_template,
                                chat_template=_chat(tokenizer) if spec.apply_chat_template else None,
                                tokenizer_name=spec.tokenizer or spec.model or "")
        if not task.instances:
            raise ValueError("no requests built (empty evaluation split?)")
        step = "metrics"
        score_stand_ins(task)
    except ModuleNotFoundError as exc:  # a task's own imports (ifeval: langdetect): no download fetches those
        report.problems.append(Problem(f"task {leaf.name}: needs the Python module {exc.name or _why(exc)} "
                                       f"(install it in this environment)"))
        return
    except Exception as exc:  # noqa: BLE001 - whatever the run would hit is the finding
        metric = _METRIC_SCRIPT.search(str(exc))
        package = _NLTK_PACKAGE.search(str(exc)) if isinstance(exc, LookupError) else None
        if metric:  # evaluate.load of a metric that is not in the HF cache (code_eval, bleurt, ...)
            name = metric.group(1)
            report.problems.append(Problem(_metric_missing(leaf.name, name), prefetch_command(spec, tasks=[leaf.name]),
                                           metric=name))
        elif package:  # nltk.data.find/load of a package no folder on nltk's path holds (ifeval: punkt_tab)
            name = package.group(1)
            folder = f"{spec.data_dir}/nltk_data" if spec.data_dir else "NLTK_DATA"
            report.problems.append(Problem(f"task {leaf.name}: needs the nltk data {name} (not in {folder})",
                                           prefetch_command(spec, tasks=[leaf.name]), nltk=name))
        elif step == "build" and leaf.hub:
            what = f"task {leaf.name}: {where} not available offline ({_why(exc)})"
            report.problems.append(Problem(what, prefetch_command(spec, tasks=[leaf.name])))
        else:
            report.problems.append(Problem(f"task {leaf.name}: {step} failed ({_why(exc)})"))
        return
    report.tasks.append(leaf.name)


def _metric_missing(task: str, name: str) -> str:
    return f"task {task}: the evaluate metric module {name} is not in the HF cache (HF_HOME's modules)"


def _unloaded_metrics(task) -> list[str]:
    """The metrics of ``task``'s ``metric_list`` that lm-eval wanted from ``evaluate`` (``hf_evaluate: true``, or a
    name lm-eval does not know) and could not load: lm-eval logs the failure and keeps None in their place. A task
    with its own ``process_results`` keeps None for every metric by design: none then."""
    if getattr(getattr(task, "config", None), "process_results", None) is not None:
        return []
    return [name for name, fn in (getattr(task, "_metric_fn_list", None) or {}).items()
            if fn is None and isinstance(name, str)]


def _load(tm, leaf, groups: dict):
    """The built task of ``leaf``: by its name, or, for a member defined inline in a group (its data keys in the
    group's dict: :mod:`mpitp.tasks.layout`), from the built group (once per group: ``groups``), as the run builds
    it."""
    if leaf.group is None:
        return tm.load([leaf.name])["tasks"][leaf.name]
    if leaf.group not in groups:
        groups[leaf.group] = tm.load([leaf.group])["tasks"]
    tasks = groups[leaf.group]
    if leaf.name in tasks:
        return tasks[leaf.name]
    raise KeyError(f"group {leaf.group} built no task {leaf.name} (built: {', '.join(sorted(tasks))})")


@contextmanager
def _quiet_libraries():
    """The libraries' own logging at ERROR while checking: what matters comes back as problems. lm-eval's metric
    registry logs an ``evaluate`` module it could not load as an error and keeps None, which the check reports as a
    problem with its fetch command (:func:`_unloaded_metrics`): that log line would say it twice, once unasked."""
    names = {"lm-eval": logging.ERROR, "lm_eval": logging.ERROR, "datasets": logging.ERROR, "evaluate": logging.ERROR,
             "transformers": logging.ERROR, "lm_eval.api.registry": logging.CRITICAL}
    quiet = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in quiet]
    for lg, level in zip(quiet, names.values()):
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


def check(spec: CheckSpec) -> Report:
    """Whether ``spec`` runs offline: a :class:`Report` of its problems (none when ready)."""
    report = Report()
    tried: list[str] = []
    with _quiet_libraries(), block_network(tried):
        if spec.data_dir:
            from mpitp.tasks.layout import use_nltk_data

            use_nltk_data(spec.data_dir)
        if spec.model and spec.tasks and not spec.apply_chat_template and (child := _start_model_check(spec)):
            report.model_beside = True
            try:
                check_tasks(spec, report, None)  # the tokenizer is read only for a chat template
            finally:
                report.problems[:0] = _join_model_check(child, spec, tried)
        else:
            tokenizer = check_model(spec, report)
            check_tasks(spec, report, tokenizer)
    report.problems += [Problem(f"tried to reach {host} (no network on compute nodes)") for host in tried]
    return report


def _start_model_check(spec: CheckSpec):
    """:func:`check_model` in a child interpreter (:func:`model_check_child`), beside the task checks: importing
    transformers' config code is about 2.5 s of a 6 s ``mpitp check --tasks mmlu`` on a 2-core machine, building
    the tasks as long, and the tasks need the tokenizer only for a chat template. A new interpreter, not a fork:
    by now this process has MPI's and other libraries' threads, which a fork would not copy. Isolated from the
    working directory (:mod:`mpitp.isolated`: a ``json.py`` there must not run). The ``subprocess.Popen``, or None on
    one core (nothing to gain)."""
    import json
    import subprocess
    from dataclasses import asdict

    from mpitp.isolated import python_argv

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    if cores < 2:
        return None
    code = "from mpitp.jobs.readiness import model_check_child; model_check_child()"  # this process's path
    try:
        proc = subprocess.Popen(python_argv(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    except OSError:
        return None
    try:
        with proc.stdin:
            proc.stdin.write(json.dumps(asdict(spec)))
    except OSError:  # it died at once: check the model here instead
        proc.kill()
        proc.communicate()
        return None
    return proc


def model_check_child() -> None:
    """The child of :func:`_start_model_check`: a :class:`CheckSpec` as JSON on stdin, :func:`check_model` under the
    same network guard, ``{"problems": [...], "tried": [...]}`` as the last line on stdout."""
    import json
    import sys

    fields = json.loads(sys.stdin.read())
    spec = CheckSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    report, tried = Report(), []
    with _quiet_libraries(), block_network(tried):
        check_model(spec, report)
    sys.stdout.write("\n" + json.dumps({"problems": [[p.what, p.fetch] for p in report.problems], "tried": tried})
                     + "\n")


def _join_model_check(proc, spec: CheckSpec, tried: list[str]) -> list[Problem]:
    """The child's problems (and the hosts it tried, added to ``tried``); :func:`check_model` here when the child
    failed to say."""
    import json

    with proc.stdout:
        out = proc.stdout.read()
    proc.wait()
    try:
        if proc.returncode != 0:
            raise ValueError(f"exit status {proc.returncode}")
        data = json.loads(out.strip().splitlines()[-1])
        found = [Problem(str(what), None if fetch is None else str(fetch)) for what, fetch in data["problems"]]
        hosts = [str(h) for h in data["tried"]]
    except (ValueError, TypeError, KeyError, IndexError):  # the child died before answering: ask again here
        report = Report()
        check_model(spec, report)
        return report.problems
    tried += [h for h in hosts if h not in tried]
    return found


def job_specs(job_file) -> list[CheckSpec]:
    """One :class:`CheckSpec` per run of a job file that is not the built-in demo (offline by construction)."""
    from mpitp.jobs.jobfile import DEMO_MODEL, load_job

    out = []
    for run in load_job(job_file).runs:
        if getattr(run, "demo", False) or run.model == DEMO_MODEL:
            continue
        inc = run.include_path
        trust = bool(getattr(run, "trust_remote_code", False) or (run.lm_eval or {}).get("trust_remote_code"))
        out.append(CheckSpec(tasks=tuple(run.tasks), model=run.model, tokenizer=run.tokenizer, revision=run.revision,
                             data_dir=run.data_dir, include_path=tuple([inc] if isinstance(inc, str) else inc or ()),
                             num_fewshot=run.num_fewshot, apply_chat_template=bool(run.apply_chat_template),
                             trust_remote_code=trust, hf_assets=getattr(run, "hf_assets", None), label=run.name))
    return out


class NotReady(UsageError):
    """A job file that would not run offline: ``str()`` is ``mpitp check``'s report, one line per problem."""


NO_CHECK_RISK = ("--no-check: not checked whether the job runs offline; a missing dataset, metric module, nltk "
                 "data or tokenizer file will fail the job on the compute node, after the queue wait")


def require_ready(job_file) -> None:
    """``mpitp check JOB`` in its own process (its network guard and offline variables stay there), before a job is
    queued; raises :class:`NotReady` with its report. A job of demo runs only needs no check. The process is isolated
    from the working directory (:mod:`mpitp.isolated`): people submit from shared job folders."""
    import subprocess

    from mpitp.isolated import mpitp_argv

    if not job_specs(job_file):
        return
    done = subprocess.run(mpitp_argv("check", job_file), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        report = done.stderr.strip() or done.stdout.strip() or f"mpitp check exited {done.returncode}"
        raise NotReady(f"{report}\nnothing queued (mpitp submit --no-check queues it anyway)")
