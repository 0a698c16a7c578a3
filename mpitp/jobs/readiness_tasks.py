"""The task half of ``mpitp check`` (:mod:`mpitp.jobs.readiness`): every task built as the run builds it
(``--data-dir`` overrides included, groups expanded, one task at a time so that one failure names its task), its
requests for a few docs, and its filters, ``process_results`` and aggregations run once on stand-in model outputs.

What a failure means is read from the library's own error: an ``evaluate`` metric module from "Couldn't find a module
script", nltk data from nltk's ``LookupError`` (which names the package to ``nltk.download``); no hand list of which
task needs what."""

from __future__ import annotations

import re
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.jobs.readiness_spec import CheckSpec, Problem, Report, prefetch_command, why
from mpitp.tasks.names import task_file_hint
from mpitp.tasks.offline import data_dir_problem

if TYPE_CHECKING:
    from lm_eval.api.task import Task
    from transformers import PreTrainedTokenizerBase

CHECK_LIMIT = 2
"""Docs per task whose requests and metrics are built: the code paths, not the numbers, are checked."""

_METRIC_SCRIPT = re.compile(r"Couldn't find a module script at \S*?([\w-]+)\.py")
_NLTK_PACKAGE = re.compile(r"nltk\.download\('([\w.-]+)'")
_STAND_IN = {"loglikelihood": (-1.0, False), "loglikelihood_rolling": -1.0, "generate_until": "A",
             "multiple_choice": (-1.0, False)}


def score_stand_ins(task: Task) -> None:
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

    def apply(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    return apply


def check_tasks(spec: CheckSpec, report: Report, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Build each task and its requests, score stand-ins (see the module docstring)."""
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
            problem = data_dir_problem(spec.data_dir)
            if problem:
                report.problems.append(Problem(problem))
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
        tm = _task_manager(spec.tasks, include)
        known = set(tm.all_tasks)
        for name in spec.tasks:
            if name not in known:
                report.problems.append(Problem(f"unknown task '{name}'" + (task_file_hint(name) or (
                    f" (not in lm-eval's index{' nor --include_path' if spec.include_path else ''})"))))
        groups: dict = {}
        for leaf in leaves if leaves is not None else expand(spec.tasks, tm.task_index):
            if leaf.name not in broken:
                _check_leaf(spec, report, tm, leaf, tokenizer, groups)


def _task_manager(tasks: tuple[str, ...], include: list[str]):
    """lm-eval's TaskManager as the run builds it (:func:`mpitp.evaluation.checks.task_manager`): without lm-eval's
    own 14.7k tasks when the include path can build every task named by itself (0.4 s of reading their index saved),
    else with them."""
    from mpitp.tasks import index

    if include:
        tm = index.task_manager(include, include_defaults=False)
        if index.self_contained(tm, tasks):
            return tm
    return index.task_manager(include or None)


def _check_leaf(spec: CheckSpec, report: Report, tm, leaf, tokenizer, groups: dict) -> None:
    where = f"dataset {leaf.dataset_path}" + (f"/{leaf.dataset_name}" if leaf.dataset_name else "")
    step = "build"
    try:
        task = _load(tm, leaf, groups)
        unloaded = unloaded_metrics(task)
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
        report.problems.append(Problem(f"task {leaf.name}: needs the Python module {exc.name or why(exc)} "
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
            what = f"task {leaf.name}: {where} not available offline ({why(exc)})"
            report.problems.append(Problem(what, prefetch_command(spec, tasks=[leaf.name])))
        else:
            report.problems.append(Problem(f"task {leaf.name}: {step} failed ({why(exc)})"))
        return
    report.tasks.append(leaf.name)


def _metric_missing(task: str, name: str) -> str:
    return f"task {task}: the evaluate metric module {name} is not in the HF cache (HF_HOME's modules)"


def unloaded_metrics(task: Task) -> list[str]:
    """The metrics of ``task``'s ``metric_list`` that lm-eval wanted from ``evaluate`` (``hf_evaluate: true``, or a
    name lm-eval does not know) and could not load: lm-eval logs the failure and keeps None in their place. A task
    with its own ``process_results`` keeps None for every metric by design: none then."""
    if getattr(getattr(task, "config", None), "process_results", None) is not None:
        return []
    return [name for name, fn in compat.metric_functions(task).items()
            if fn is None and isinstance(name, str)]


def _load(tm, leaf, groups: dict):
    """The built task of ``leaf``: by its name, or, for a member defined inline in a group (its data keys in the
    group's dict: :mod:`mpitp.tasks.layout`), from the built group (once per group: ``groups``), as the run builds
    it."""
    from mpitp.evaluation.eval_docs import fewshot_listed

    if leaf.group is None:
        with fewshot_listed():
            return tm.load([leaf.name])["tasks"][leaf.name]
    if leaf.group not in groups:
        with fewshot_listed():
            groups[leaf.group] = tm.load([leaf.group])["tasks"]
    tasks = groups[leaf.group]
    if leaf.name in tasks:
        return tasks[leaf.name]
    raise KeyError(f"group {leaf.group} built no task {leaf.name} (built: {', '.join(sorted(tasks))})")
