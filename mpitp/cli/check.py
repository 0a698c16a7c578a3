"""``mpitp check``: will these tasks (or every run of a job file) run offline? (:mod:`mpitp.jobs.readiness`)"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeVar

import click

from mpitp.cli.options import task_names

if TYPE_CHECKING:
    from collections.abc import Callable

_F = TypeVar("_F", bound="Callable[..., object]")


def spec_options(f: _F) -> _F:
    """The options ``mpitp check`` and ``mpitp prefetch`` share: the settings that decide what a run reads."""
    for decl, kw in reversed([
        (("--tasks",), {"help": "Comma-separated tasks, groups or tags.", "callback": task_names}),
        (("--data-dir", "--data_dir", "data_dir"), {"help": "Local data: DATA/<dataset_path>/[<dataset_name>/]"
                                                            "<split>.<jsonl|parquet> (or the six tasks' folders)."}),
        (("--include_path", "--include-path", "include_path"), {"multiple": True, "help": "Extra task YAMLs."}),
        (("--model",), {"help": "HF model id or path (its config and tokenizer are checked)."}),
        (("--tokenizer",), {"help": "Tokenizer, when not the model's."}),
        (("--hf-assets", "--hf_assets", "hf_assets"), {"help": "A torch DCP --model's config.json and tokenizer "
                                                                "folder (as mpitp eval --hf-assets)."}),
        (("--revision",), {"help": "Model revision."}),
        (("--num_fewshot", "--num-fewshot", "num_fewshot"), {"type": click.IntRange(min=0)}),
        (("--apply_chat_template", "--apply-chat-template", "apply_chat_template"), {"is_flag": True}),
        (("--trust_remote_code", "--trust-remote-code", "trust_remote_code"), {"is_flag": True}),
    ]):
        f = click.option(*decl, **kw)(f)
    return f


def specs_from(job_file: str | None, tasks: tuple[str, ...] | None, model: str | None, tokenizer: str | None,
               revision: str | None, data_dir: str | None, include_path: tuple[str, ...], num_fewshot: int | None,
               apply_chat_template: bool, trust_remote_code: bool, hf_assets: str | None = None,
               peft: str | None = None) -> list:
    """The :class:`CheckSpec` of the options, or one per (distinct) run of ``job_file``."""
    from mpitp.jobs.readiness import CheckSpec

    if job_file:
        if tasks:
            raise click.UsageError("pass a job file or --tasks, not both")
        from mpitp.jobs.jobfile import JobFileError
        from mpitp.jobs.readiness import job_specs

        try:
            return job_specs(job_file)
        except JobFileError as exc:
            raise click.UsageError(str(exc)) from None
    if not tasks and not model:
        raise click.UsageError("nothing to check: pass --tasks a,b (and/or --model M) or a job file")
    return [CheckSpec(tasks=tuple(tasks or ()), model=model, tokenizer=tokenizer,
                      revision=revision, data_dir=data_dir, include_path=tuple(include_path), num_fewshot=num_fewshot,
                      apply_chat_template=apply_chat_template, trust_remote_code=trust_remote_code,
                      hf_assets=hf_assets, peft=peft)]


def run_checks(specs: list) -> tuple[list, set[str], dict[str, str]]:
    """Check every spec once (runs differing only in what the check does not read share one check): the problems,
    the models whose "ready" was kept from an earlier check (:mod:`mpitp.jobs.readiness_cache`), not checked
    again, and what each sweep's ``--model`` stands for ("3 checkpoints", "2 adapters"), for the ready line."""
    from dataclasses import replace

    from mpitp.jobs.readiness import check
    from mpitp.jobs.sweep import is_sweep

    problems, done = [], {}
    for spec in specs:
        key = replace(spec, label="")
        if key not in done:
            done[key] = check(key)
        problems += [p if not spec.label else replace(p, what=f"run {spec.label}: {p.what}")
                     for p in done[key].problems]
    swept = {key.model: f"{report.swept} {'adapters' if is_sweep(key.peft) else 'checkpoints'}"
             for key, report in done.items() if report.swept}
    return problems, {key.model for key, report in done.items() if report.model_kept}, swept


def _shown_model(model: str, kept: set[str], swept: dict[str, str]) -> str:
    """``model`` in the ready line, with what its sweep stood for and whether its "ready" was kept (said, so that a
    user who changed something the check does not look at knows it was not re-read)."""
    notes = [swept[model]] if model in swept else []
    if model in kept:
        notes.append("ready kept from an earlier check: every folder it read is unchanged")
    return f"{model} ({'; '.join(notes)})" if notes else model


@click.command(name="check")
@click.argument("job_file", required=False, metavar="[JOB.yaml]", type=click.Path(dir_okay=False, exists=True))
@spec_options
@click.option("--peft", help="A LoRA adapter of --model, or an adapter sweep's glob or comma list (as mpitp eval "
                             "--peft): each adapter's config is checked.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Also write the problems as JSON to this file "
                                                                  "(what mpitp prefetch reads).")
def check_command(job_file: str | None, tasks: tuple[str, ...] | None, data_dir: str | None,
                  include_path: tuple[str, ...], model: str | None, tokenizer: str | None, hf_assets: str | None,
                  revision: str | None, num_fewshot: int | None, apply_chat_template: bool, trust_remote_code: bool,
                  peft: str | None, json_out: str | None) -> None:
    """Will these tasks (or every run of JOB.yaml) run with no network? Exit 0 when ready, 2 listing what is
    missing and how to fetch it."""
    if job_file and (hf_assets or peft):
        raise click.UsageError("pass a job file or --hf-assets/--peft, not both (a job file's runs say hf_assets:, "
                               "peft:)")
    if peft and not model:
        raise click.UsageError("--peft needs --model: the base model its adapters apply to")
    from mpitp.results.safefile import replace_problem, write_replace

    why = json_out and replace_problem(json_out)  # before the checks: a wrong path was a traceback after them
    if why:
        raise click.UsageError(f"--json-out {json_out}: {why}")
    specs = specs_from(job_file, tasks, model, tokenizer, revision, data_dir, include_path, num_fewshot,
                       apply_chat_template, trust_remote_code, hf_assets, peft)
    problems, kept, swept = run_checks(specs)
    if json_out:
        import json
        from dataclasses import asdict

        try:
            write_replace(json_out, json.dumps({"ready": not problems, "problems": [asdict(p) for p in problems]},
                                               indent=1).encode())
        except OSError as exc:
            raise click.UsageError(f"--json-out {json_out}: {exc.strerror or exc}") from None
    if problems:
        from mpitp.escape import shown  # a problem may quote lm-eval's exception text or a file's name

        sys.stderr.write(f"mpitp check: not ready offline: {len(problems)} problem(s)\n")
        for p in problems:
            sys.stderr.write(f"  {shown(p.line())}\n")
        raise click.exceptions.Exit(2)
    if job_file and not specs:  # every run is the built-in demo (job_specs leaves them out): nothing to fetch
        click.echo("mpitp check: ready offline: every run is the built-in demo (its model and tasks ship with mpitp)")
        return
    what = ", ".join(sorted({t for s in specs for t in s.tasks})) or "no tasks"
    models = sorted({s.model for s in specs if s.model})
    from mpitp.escape import shown

    models = [_shown_model(m, kept, swept) for m in models]
    click.echo(shown(f"mpitp check: ready offline: {what}" + (f"; model {', '.join(models)}" if models else "")))


@click.command(name="prefetch")
@spec_options
@click.option("--models-dir", type=click.Path(file_okay=False), help="Put the model in DIR/<model> (default: the "
                                                                     "HF cache).")
@click.option("--nltk-index", default=None, metavar="URL",
              help="nltk's data index (default: nltk's own, raw.githubusercontent.com); nltk data goes to "
                   "DATA/nltk_data.")
def prefetch_command(tasks: tuple[str, ...] | None, data_dir: str | None, include_path: tuple[str, ...],
                     model: str | None, tokenizer: str | None, hf_assets: str | None, revision: str | None,
                     num_fewshot: int | None, apply_chat_template: bool, trust_remote_code: bool,
                     models_dir: str | None, nltk_index: str | None) -> None:
    """On a node with network: fetch the datasets (into --data-dir, as plain parquet files), the model, the
    evaluate metric modules (into the HF modules cache) and the nltk data (into DATA/nltk_data) that a run of these
    tasks needs, write a manifest, then run `mpitp check` on the result."""
    import sys

    from mpitp.jobs.prefetch import fetch_until_ready, prefetch

    if tasks and not data_dir:
        raise click.UsageError("--tasks needs --data-dir: datasets are fetched into it as plain files")
    if not tasks and not model:
        raise click.UsageError("nothing to fetch: pass --tasks with --data-dir, and/or --model")
    spec = specs_from(None, tasks, model, tokenizer, revision, data_dir, include_path, num_fewshot,
                      apply_chat_template, trust_remote_code, hf_assets)[0]
    try:
        spec, _ = prefetch(spec, models_dir, echo=click.echo)
    except Exception as exc:  # noqa: BLE001 - a download failing is reported in one line, the check still says why
        click.echo(f"mpitp prefetch: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}", err=True)
    done = fetch_until_ready(spec, models_dir, nltk_index, echo=click.echo)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    raise click.exceptions.Exit(done.returncode)
