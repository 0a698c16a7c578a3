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

The parts, each its own module: what is checked and found (:mod:`~mpitp.jobs.readiness_spec`), the network guard
and quiet logs (:mod:`~mpitp.jobs.readiness_guard`), the model (:mod:`~mpitp.jobs.readiness_model`; a "ready"
kept while the folders it read are unchanged: :mod:`~mpitp.jobs.readiness_cache`), the tasks
(:mod:`~mpitp.jobs.readiness_tasks`), a sweep's models (:mod:`~mpitp.jobs.readiness_sweep`); this module runs
them (:func:`check`) and answers for job files (:func:`job_specs`, :func:`require_ready`).
"""

from __future__ import annotations

import os

from mpitp.errors import UsageError
from mpitp.jobs.readiness_guard import block_network, quiet_libraries
from mpitp.jobs.readiness_model import check_model, join_model_check, start_model_check
from mpitp.jobs.readiness_spec import CheckSpec, Problem, Report
from mpitp.jobs.readiness_sweep import any_kept, model_groups, settle
from mpitp.jobs.readiness_tasks import check_tasks

__all__ = ["NO_CHECK_RISK", "CheckSpec", "NotReady", "Problem", "Report", "block_network", "check", "job_specs",
           "require_ready"]


def check(spec: CheckSpec) -> Report:
    """Whether ``spec`` runs offline: a :class:`Report` of its problems (none when ready). A sweep's checkpoints are
    each checked (:mod:`~mpitp.jobs.readiness_sweep`: those with the same config and tokenizer files once), its tasks
    once."""
    report = Report()
    tried: list[str] = []
    with quiet_libraries(), block_network(tried):
        if spec.data_dir:
            from mpitp.tasks.layout import use_nltk_data

            use_nltk_data(spec.data_dir)
        groups = model_groups(spec, report)
        apart = groups and spec.tasks and not spec.apply_chat_template  # the tasks need no tokenizer
        todo = [g for g in groups if not (apart and any_kept(g))]
        if apart and not todo:
            report.model_kept = True  # checked before, every folder it read unchanged: the tasks alone
            check_tasks(spec, report, None)
        elif apart and (child := start_model_check([g[0] for g in todo])):
            report.model_beside = True
            try:
                check_tasks(spec, report, None)  # the tokenizer is read only for a chat template
            finally:
                report.problems[:0] = settle(spec, todo, join_model_check(child, [g[0] for g in todo], tried))
        else:
            tokenizer, answers = None, []
            for group in todo:
                found = Report()
                loaded = check_model(group[0], found)
                tokenizer = loaded if tokenizer is None else tokenizer  # a chat template's: the first checkpoint's
                answers.append((found.problems, None))
            report.problems += settle(spec, todo, answers)
            check_tasks(spec, report, tokenizer)
    report.problems += [Problem(f"tried to reach {host} (no network on compute nodes)") for host in tried]
    return report


def job_specs(job_file: str | os.PathLike[str]) -> list[CheckSpec]:
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
                             trust_remote_code=trust, hf_assets=getattr(run, "hf_assets", None), label=run.name,
                             tp=run.tp, pp=run.pp, ep=run.ep, peft=run.peft))
    return out


class NotReady(UsageError):
    """A job file that would not run offline: ``str()`` is ``mpitp check``'s report, one line per problem."""


NO_CHECK_RISK = ("--no-check: not checked whether the job runs offline; a missing dataset, metric module, nltk "
                 "data or tokenizer file will fail the job on the compute node, after the queue wait")


def require_ready(job_file: str | os.PathLike[str]) -> None:
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
