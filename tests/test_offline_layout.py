"""The generic ``--data-dir`` layout (:mod:`mpitp.tasks.layout`): any lm-eval task from
``DATA/<dataset_path>/<dataset_name>/<split>.<jsonl|parquet>``, derived from lm-eval's own task configs.

Made-up ARC-Challenge, BoolQ, COPA and MMLU files (real field names) and the real ARC-Easy file are built by the
installed lm-eval through the written overrides; the docs it reads must be the files' rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mpitp.tasks.layout import resolve_all, write_overrides  # noqa: E402
from mpitp.tasks.offline import DataDirError  # noqa: E402
from support.offline_data import mmlu_dir, mmlu_rows, small_tasks_dir, write_jsonl  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = small_tasks_dir(tmp_path_factory.mktemp("data"))
    easy = root / "allenai/ai2_arc/ARC-Easy"
    easy.mkdir(parents=True)
    (easy / "test.jsonl").symlink_to(SHARED / "data/arc_easy/test.jsonl")
    return root


@pytest.fixture(scope="module")
def built(data, tmp_path_factory):
    from mpitp.tasks.index import task_manager

    out = tmp_path_factory.mktemp("yamls")
    written = write_overrides(["arc_challenge", "boolq", "copa", "arc_easy"], data, out)
    tm = task_manager(include_path=[str(out)])
    return written, tm.load(list(written))["tasks"]


def test_overrides_name_the_generic_files(built, data):
    written, _ = built
    assert sorted(written) == ["arc_challenge", "arc_easy", "boolq", "copa"]
    boolq = yaml.safe_load(Path(written["boolq"]).read_text())
    assert boolq["include"].endswith("super_glue/boolq/default.yaml") and boolq["tag"] is None
    assert (boolq["dataset_path"], boolq["dataset_name"]) == ("json", None)
    boolq_dir = data / "aps/super_glue/boolq"
    assert boolq["dataset_kwargs"] == {"data_files": {"train": str(boolq_dir / "train.jsonl"),
                                                      "validation": str(boolq_dir / "validation.jsonl")}}
    arc = yaml.safe_load(Path(written["arc_challenge"]).read_text())
    assert (arc["training_split"], arc["validation_split"], arc["test_split"]) == (None, None, "test")


def test_lm_eval_reads_the_files_rows(built, data):
    _, tasks = built
    cases = {"arc_challenge": "allenai/ai2_arc/ARC-Challenge/test.jsonl",
             "arc_easy": "allenai/ai2_arc/ARC-Easy/test.jsonl",
             "boolq": "aps/super_glue/boolq/validation.jsonl", "copa": "aps/super_glue/copa/validation.jsonl"}
    for name, rel in cases.items():
        assert tasks[name].eval_docs.to_list() == rows(data / rel), name
    assert tasks["boolq"].training_docs().to_list() == rows(data / "aps/super_glue/boolq/train.jsonl")
    assert not tasks["copa"].has_training_docs()
    copa = tasks["copa"]
    assert copa.doc_to_text(copa.eval_docs[0]) == "The man dropped glass 0 because"  # the stock !function hook
    boolq = tasks["boolq"]
    assert boolq.doc_to_text(boolq.eval_docs[1]) == "On day 1 the sky was clear and bright.\nQuestion: is the sky " \
                                                    "blue on day 1?\nAnswer:"


def test_needed_splits_missing_are_named(data, tmp_path):
    # boolq evaluates on validation; with shots its examples come from train: needed then, optional at 0 shots
    d = small_tasks_dir(tmp_path / "d")
    (d / "aps/super_glue/boolq/train.jsonl").unlink()
    assert resolve_all(["boolq"], d).missing == []
    assert list(map(str, resolve_all(["boolq"], d, num_fewshot=2).missing)) == [
        f"task boolq needs its train split: {d}/aps/super_glue/boolq/train.jsonl (or .parquet) is missing"]
    (d / "aps/super_glue/copa/validation.jsonl").unlink()
    with pytest.raises(DataDirError, match=r"task copa needs its validation split: .*/aps/super_glue/copa/"
                                           r"validation.jsonl \(or .parquet\) is missing"):
        write_overrides(["copa"], d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a dataset folder absent altogether is left to lm-eval (a warm HF cache may hold it; `mpitp check` says)
    res = resolve_all(["sciq"], d)
    assert not res.configs and not res.missing and [leaf.name for leaf in res.untouched] == ["sciq"]


def test_mmlu_group_expands_to_57_subjects_jsonl_and_parquet(tmp_path):
    d = mmlu_dir(tmp_path / "d", rows=1, fmt="parquet")
    write_jsonl(d / "cais/mmlu/anatomy/test.jsonl", mmlu_rows("anatomy", 1))  # jsonl wins over parquet
    res = resolve_all(["mmlu"], d, num_fewshot=1)
    assert len(res.configs) == 57 and not res.missing
    algebra = res.configs["mmlu_abstract_algebra"]
    assert algebra["dataset_path"] == "parquet" and algebra["fewshot_split"] == "dev"
    folder = d / "cais/mmlu/abstract_algebra"
    assert algebra["dataset_kwargs"]["data_files"] == {"test": str(folder / "test.parquet"),
                                                       "dev": str(folder / "dev.parquet")}
    anatomy = res.configs["mmlu_anatomy"]
    assert anatomy["dataset_path"] == "json" and anatomy["dataset_kwargs"]["data_files"] == {
        "test": str(d / "cais/mmlu/anatomy/test.jsonl")}  # one loader per task: the dev parquet is dropped ...
    assert anatomy["fewshot_split"] is None
    import shutil

    shutil.rmtree(d / "cais/mmlu/virology")
    res = resolve_all(["mmlu"], d)
    assert list(map(str, res.missing)) == [
        f"task mmlu_virology needs its test split: {d}/cais/mmlu/virology/test.jsonl (or .parquet) is missing"]


def test_tasks_command_lists_any_task_in_the_layout(data):
    from click.testing import CliRunner

    from mpitp.cli.tasks import tasks_command

    out = CliRunner().invoke(tasks_command, ["--data-dir", str(data), "--tasks", "ai2_arc,boolq,copa,sciq,gsm8k",
                                             "--num_fewshot", "1"])
    assert out.exit_code == 0, out.output
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.output.splitlines()}
    assert rows == {
        "arc_challenge": "missing allenai/ai2_arc/ARC-Challenge/train.jsonl",  # 1 shot: from train
        "arc_easy": "missing allenai/ai2_arc/ARC-Easy/train.jsonl",
        "boolq": "runnable  [train=aps/super_glue/boolq/train.jsonl validation=aps/super_glue/boolq/validation.jsonl]",
        "copa": "missing aps/super_glue/copa/train.jsonl",
        "sciq": "not in DIR (expected allenai/sciq/<split>.<jsonl|parquet>; `mpitp prefetch` fetches it)",
        "gsm8k": "missing gsm8k/train.jsonl, gsm8k/test.jsonl",  # the six: their own folder's message
    }, out.output
    bad = CliRunner().invoke(tasks_command, ["--data-dir", str(data), "--tasks", "no_such_task"])
    assert bad.exit_code == 2 and "no task, group or tag named no_such_task" in bad.output


INLINE_GROUP = """group: mpitp_inline_group
task:
  - task: copa            # a stock task given other data keys in the group's dict
    dataset_path: mpitp/inline
    dataset_name: copa_copy
  - task: mpitp_inline_boolq   # an inline task: not in the index, its whole config here
    dataset_path: mpitp/inline
    dataset_name: boolq_copy
    validation_split: validation
    output_type: multiple_choice
    doc_to_text: "{{passage}}\\nQuestion: {{question}}?\\nAnswer:"
    doc_to_target: label
    doc_to_choice: ["no", "yes"]
    metric_list:
      - metric: acc
  - arc_challenge
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
"""


def test_group_members_given_as_inline_dicts_read_their_own_folders(tmp_path):
    """A group whose task list gives members their own dataset_path/dataset_name: each reads
    DATA/<its dataset_path>/<its dataset_name>/ through an override of the group, built by lm-eval and checked."""
    from mpitp.evaluation.checks import task_manager as run_task_manager
    from mpitp.jobs.readiness import CheckSpec, check
    from mpitp.tasks.index import self_contained, task_manager
    from support.offline_data import boolq_rows, copa_rows

    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "mpitp_inline_group.yaml").write_text(INLINE_GROUP)
    d = small_tasks_dir(tmp_path / "d")
    copa = write_jsonl(d / "mpitp/inline/copa_copy/validation.jsonl", copa_rows(3)[::-1])
    boolq = write_jsonl(d / "mpitp/inline/boolq_copy/validation.jsonl", boolq_rows(2))
    inline = "mpitp_inline_group::mpitp_inline_boolq"
    res = resolve_all(["mpitp_inline_group"], d, [str(inc)])
    assert [leaf.name for leaf in res.leaves] == ["copa", inline, "arc_challenge"] and not res.missing
    assert res.files["copa"] == {"validation": copa} and res.files[inline] == {"validation": boolq}
    assert sorted(res.configs) == ["arc_challenge", "mpitp_inline_group"]  # copa itself is not overridden

    out = tmp_path / "out"
    written = write_overrides(["mpitp_inline_group"], d, out, [str(inc)])
    tasks = task_manager(include_path=[str(inc), str(out)]).load(["mpitp_inline_group"])["tasks"]
    assert sorted(tasks) == ["arc_challenge", "copa", inline], sorted(tasks)
    assert tasks["copa"].eval_docs.to_list() == copa_rows(3)[::-1]
    assert tasks["copa"].doc_to_text(tasks["copa"].eval_docs[0]) == "The man dropped glass 2 because"
    assert tasks[inline].eval_docs.to_list() == boolq_rows(2)
    assert tasks["arc_challenge"].eval_docs.to_list() == rows(d / "allenai/ai2_arc/ARC-Challenge/test.jsonl")
    assert yaml.safe_load(Path(written["mpitp_inline_group"]).read_text())["include"] == str(
        inc / "mpitp_inline_group.yaml")

    # The run's own TaskManager (and the check's): the group names a stock task (copa), so lm-eval's index is read
    # too. Found in session 12: both used the include path alone whenever it held every name given, and lm-eval then
    # built the group's copa as nothing (a TypeError: "build failed" in `mpitp check`, the run failing likewise).
    include_only = task_manager(include_path=[str(inc), str(out)], include_defaults=False)
    assert "mpitp_inline_group" in include_only.all_tasks and not self_contained(include_only, ["mpitp_inline_group"])
    run_tm = run_task_manager(["mpitp_inline_group"], [str(inc), str(out)])
    assert sorted(run_tm.load(["mpitp_inline_group"])["tasks"]) == ["arc_challenge", "copa", inline]
    alone = task_manager(include_path=[str(out)], include_defaults=False)  # plain tasks: the include path suffices
    assert self_contained(alone, ["arc_challenge"]) and not self_contained(alone, ["copa"])
    report = check(CheckSpec(tasks=("mpitp_inline_group",), data_dir=str(d), include_path=(str(inc),)))
    assert report.ready and report.tasks == ["copa", inline, "arc_challenge"], [p.line() for p in report.problems]

    boolq.unlink()  # a member's needed split missing: named with its own folder
    res = resolve_all(["mpitp_inline_group"], d, [str(inc)])
    assert list(map(str, res.missing)) == [
        f"task {inline} needs its validation split: {d}/mpitp/inline/boolq_copy/validation.jsonl (or .parquet) is "
        f"missing"]


def test_offline_without_data_dir_a_hub_dataset_must_be_cached_or_local(tmp_path, monkeypatch):
    """Offline and no --data-dir: a task whose Hub dataset is neither in the HF caches nor a local path is refused
    before the launch (it was datasets' ConnectionError traceback after the model load); one in the HF cache, or whose
    dataset_path is a folder beside the working directory, is left to lm-eval."""
    from mpitp.tasks.layout import require_cached

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_ds.yaml").write_text(yaml.safe_dump({
        "task": "mpitp_local_ds", "dataset_path": "my_ds", "test_split": "test", "output_type": "multiple_choice",
        "doc_to_text": "{{q}}", "doc_to_target": 0, "doc_to_choice": ["a", "b"]}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataDirError, match=r"^task arc_easy reads the Hub dataset allenai/ai2_arc/ARC-Easy, which is "
                                           r"not in the HF cache, .* \(and 1 more task\(s\)\): on a node with network, "
                                           r"mpitp prefetch --tasks arc_easy,mpitp_local_ds --data-dir DATA"):
        require_cached(["arc_easy", "mpitp_local_ds"], [str(tasks)])
    (tmp_path / "my_ds").mkdir()  # datasets reads a local folder of that name
    (tmp_path / "hf" / "datasets" / "allenai___ai2_arc").mkdir(parents=True)  # datasets' own cache holds it
    require_cached(["arc_easy", "mpitp_local_ds"], [str(tasks)])
