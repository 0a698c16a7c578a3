"""The model half of ``mpitp check`` (:mod:`mpitp.jobs.readiness`): the model's config and tokenizer from local
files only (a torch DCP checkpoint's from its assets, its ``.metadata`` checked as ``mpitp eval`` checks it), run
here or in a child interpreter beside the task checks (:func:`start_model_check`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mpitp.errors import UsageError
from mpitp.jobs.readiness_guard import block_network, quiet_libraries
from mpitp.jobs.readiness_spec import CheckSpec, Problem, Report, prefetch_command, why

if TYPE_CHECKING:
    import subprocess


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
        report.problems.append(Problem(f"model {spec.model}: config not available offline ({why(exc)})", fetch))
        return None
    if is_dcp:
        try:
            dcp.check(dcp_path, config, spec.trust_remote_code)
        except UsageError as exc:
            report.problems.append(Problem(str(exc)))
    check_layout(spec, config, report)
    try:
        return transformers.AutoTokenizer.from_pretrained(tokenizer, **kw)
    except Exception as exc:  # noqa: BLE001
        report.problems.append(Problem(f"tokenizer {tokenizer}: not available offline ({why(exc)})", fetch))
        return None


def check_layout(spec: CheckSpec, config: object, report: Report) -> None:
    """The run's tp, pp and ep against the model's type, as ``mpitp eval`` checks them before loading: a type that
    has no plan for the layout (or heads the tp does not divide), or a BERT-family decoder whose config lacks
    ``is_decoder``, is refused here, so ``submit`` refuses it before the queue instead of the job on the compute
    node."""
    from mpitp.parallel import check_ep as check_ep_size
    from mpitp.replica.loading import check_decoder_mode, check_ep, check_tp

    try:
        check_ep_size(spec.ep, spec.tp)
    except UsageError as exc:
        report.problems.append(Problem(str(exc)))
        return
    checks = [lambda: check_tp(config, spec.tp), lambda: check_ep(config, spec.ep, spec.pp, spec.peft),
              lambda: check_decoder_mode(config)]
    if spec.pp > 1 or spec.tp > 1:
        from mpitp.replica.pipeline import check_plans_apply, check_pp  # imports torch: only for a split layout

        checks += [lambda: check_pp(config, spec.pp), lambda: check_plans_apply(config, spec.tp, spec.pp, spec.ep)]
    for check in checks:
        try:
            check()
        except UsageError as exc:
            report.problems.append(Problem(str(exc)))


def start_model_check(specs: list[CheckSpec]) -> subprocess.Popen[str] | None:
    """:func:`check_model` of each of ``specs`` in one child interpreter (:func:`model_check_child`), beside the task
    checks: importing transformers' config code is about 2.5 s of a 6 s ``mpitp check --tasks mmlu`` on a 2-core
    machine, building the tasks as long, and the tasks need the tokenizer only for a chat template. One child for
    every checkpoint of a sweep: the imports are paid once. A new interpreter, not a fork: by now this process has
    MPI's and other libraries' threads, which a fork would not copy. Isolated from the working directory
    (:mod:`mpitp.isolated`: a ``json.py`` there must not run). The ``subprocess.Popen``, or None on one core (nothing
    to gain)."""
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
    code = "from mpitp.jobs.readiness_model import model_check_child; model_check_child()"  # this process's path
    try:
        proc = subprocess.Popen(python_argv(code), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    except OSError:
        return None
    try:
        with proc.stdin:
            proc.stdin.write(json.dumps([asdict(spec) for spec in specs]))
    except OSError:  # it died at once: check the model here instead
        proc.kill()
        proc.communicate()
        return None
    return proc


def model_check_child() -> None:
    """The child of :func:`start_model_check`: a JSON list of :class:`CheckSpec` on stdin, :func:`check_model` of
    each under the same network guard, a list of ``{"problems": [...], "tried": [...], "read": [...]}`` (one per
    spec, each with the hosts and folders of its own check) as the last line on stdout. A process of its own,
    importing torch and transformers: the collector and the deferred imports as the console command sets them
    (:mod:`mpitp.gcpolicy`, :mod:`mpitp.importpolicy`)."""
    import json
    import sys

    from mpitp import gcpolicy, importpolicy
    from mpitp.jobs import readiness_cache

    gcpolicy.start_up()
    importpolicy.start_up()

    found = []
    seen = readiness_cache.watch()
    with quiet_libraries():
        for fields in json.loads(sys.stdin.read()):
            spec = CheckSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
            report, tried = Report(), []
            seen.clear()  # what this spec's check reads: the imports of the first are outside every check folder
            with block_network(tried):
                check_model(spec, report)
            found.append({"problems": [[p.what, p.fetch] for p in report.problems], "tried": tried,
                          "read": readiness_cache.folders_read(spec, seen)})
    sys.stdout.write("\n" + json.dumps(found) + "\n")
    sys.stdout.flush()
    gcpolicy.leaving()


def join_model_check(proc: subprocess.Popen[str], specs: list[CheckSpec],
                     tried: list[str]) -> list[tuple[list[Problem], list[str] | None]]:
    """The child's answer for each of ``specs``: its problems, and the folders it read when it found nothing wrong
    and tried no host (a verdict that may be kept: :mod:`mpitp.jobs.readiness_cache`), else None. The hosts it tried
    are added to ``tried``. :func:`check_model` here when the child failed to say."""
    import json

    with proc.stdout:
        out = proc.stdout.read()
    proc.wait()
    answers = []
    try:
        if proc.returncode != 0:
            raise ValueError(f"exit status {proc.returncode}")
        data = json.loads(out.strip().splitlines()[-1])
        if not isinstance(data, list) or len(data) != len(specs):
            raise ValueError("not one answer per spec")
        for one in data:
            found = [Problem(str(what), None if fetch is None else str(fetch)) for what, fetch in one["problems"]]
            hosts = [str(h) for h in one["tried"]]
            read = [str(f) for f in one["read"]]
            answers.append((found, hosts, read))
    except (ValueError, TypeError, KeyError, IndexError):  # the child died before answering: ask again here
        again = []
        for spec in specs:
            report = Report()
            check_model(spec, report)
            again.append((report.problems, None))
        return again
    for _, hosts, _ in answers:
        tried += [h for h in hosts if h not in tried]
    return [(found, read if not found and not hosts else None) for found, hosts, read in answers]
