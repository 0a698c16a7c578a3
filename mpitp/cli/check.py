"""``mpitp check``: will these tasks (or every run of a job file) run offline? (:mod:`mpitp.evaluation.readiness`)"""

from __future__ import annotations

import sys

import click


def _spec_options(f):
    """The options ``mpitp check`` and ``mpitp prefetch`` share: the settings that decide what a run reads."""
    for decl, kw in reversed([
        (("--tasks",), {"help": "Comma-separated tasks, groups or tags."}),
        (("--data-dir", "--data_dir", "data_dir"), {"help": "Local data: DATA/<dataset_path>/[<dataset_name>/]"
                                                            "<split>.<jsonl|parquet> (or the six tasks' folders)."}),
        (("--include_path", "--include-path", "include_path"), {"multiple": True, "help": "Extra task YAMLs."}),
        (("--model",), {"help": "HF model id or path (its config and tokenizer are checked)."}),
        (("--tokenizer",), {"help": "Tokenizer, when not the model's."}),
        (("--revision",), {"help": "Model revision."}),
        (("--num_fewshot", "--num-fewshot", "num_fewshot"), {"type": click.IntRange(min=0)}),
        (("--apply_chat_template", "--apply-chat-template", "apply_chat_template"), {"is_flag": True}),
        (("--trust_remote_code", "--trust-remote-code", "trust_remote_code"), {"is_flag": True}),
    ]):
        f = click.option(*decl, **kw)(f)
    return f


def specs_from(job_file, tasks, model, tokenizer, revision, data_dir, include_path, num_fewshot,
               apply_chat_template, trust_remote_code) -> list:
    """The :class:`CheckSpec` of the options, or one per (distinct) run of ``job_file``."""
    from mpitp.evaluation.readiness import CheckSpec

    if job_file:
        if tasks:
            raise click.UsageError("pass a job file or --tasks, not both")
        from mpitp.evaluation.readiness import job_specs
        from mpitp.jobs.jobfile import JobFileError

        try:
            return job_specs(job_file)
        except JobFileError as exc:
            raise click.UsageError(str(exc)) from None
    if not tasks:
        raise click.UsageError("no tasks given: pass --tasks a,b or a job file")
    return [CheckSpec(tasks=tuple(t for t in tasks.split(",") if t), model=model, tokenizer=tokenizer,
                      revision=revision, data_dir=data_dir, include_path=tuple(include_path), num_fewshot=num_fewshot,
                      apply_chat_template=apply_chat_template, trust_remote_code=trust_remote_code)]


def run_checks(specs: list) -> list:
    """Check every spec once (runs differing only in what the check does not read share one check)."""
    from dataclasses import replace

    from mpitp.evaluation.readiness import check

    problems, done = [], {}
    for spec in specs:
        key = replace(spec, label="")
        if key not in done:
            done[key] = check(key)
        problems += [p if not spec.label else type(p)(f"run {spec.label}: {p.what}", p.fetch)
                     for p in done[key].problems]
    return problems


@click.command(name="check")
@click.argument("job_file", required=False, metavar="[JOB.yaml]", type=click.Path(dir_okay=False, exists=True))
@_spec_options
def check_command(job_file, tasks, data_dir, include_path, model, tokenizer, revision, num_fewshot,
                  apply_chat_template, trust_remote_code):
    """Will these tasks (or every run of JOB.yaml) run with no network? Exit 0 when ready, 2 listing what is
    missing and how to fetch it."""
    specs = specs_from(job_file, tasks, model, tokenizer, revision, data_dir, include_path, num_fewshot,
                       apply_chat_template, trust_remote_code)
    problems = run_checks(specs)
    if problems:
        sys.stderr.write(f"mpitp check: not ready offline: {len(problems)} problem(s)\n")
        for p in problems:
            sys.stderr.write(f"  {p.line()}\n")
        raise click.exceptions.Exit(2)
    what = ", ".join(sorted({t for s in specs for t in s.tasks})) or "nothing to check"
    models = sorted({s.model for s in specs if s.model})
    click.echo(f"mpitp check: ready offline: {what}" + (f"; model {', '.join(models)}" if models else ""))
