"""Stock lm-eval tasks run offline on the real benchmark files in ../shared/data.

Two routes to the same tasks are checked against the JSONL files and against each other:

- the hand-written ``*_local`` tasks of ``tests/tasks/`` (materialized by ``tests/support/tasks.py``), and
- :func:`mpitp.tasks.offline.write_task_yamls`, whose overrides keep the stock names (``arc_easy`` ...).

Then a real single-process ``lm_eval.simple_evaluate`` on the stories260K Llama proves the tasks run end to end.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mpitp.tasks.offline import (  # noqa: E402
    SPLIT_KEYS,
    STOCK_TASKS,
    DataDirError,
    offline_status,
    split_files,
    stock_tasks_dir,
    write_task_yamls,
)
from support.tasks import LOCAL_TASKS, materialize_test_tasks  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
DATA = SHARED / "data"
MODEL = SHARED / "models" / "stories260K"

pytestmark = pytest.mark.skipif(not DATA.is_dir(),
                                reason=f"shared data not found at {DATA} (../shared beside the repo)")

# stock task -> {split: file under ../shared/data}: the real files, in the DIR/<task>/<split>.jsonl layout's terms.
SHARED_FILES = {
    "arc_easy": {s: f"arc_easy/{s}.jsonl" for s in ("train", "validation", "test")},
    "hellaswag": {"validation": "hellaswag/hellaswag_val.jsonl"},
    "piqa": {"validation": "piqa/piqa_validation.jsonl"},
    "lambada_openai": {"test": "lambada_openai/lambada_test.jsonl"},
    "wikitext": {"test": "wikitext2/wikitext-2-raw-v1_test_documents.jsonl"},
    "gsm8k": {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"},
}
# the split each stock task evaluates on
EVAL_SPLIT = {"arc_easy": "test", "hellaswag": "validation", "piqa": "validation", "lambada_openai": "test",
              "wikitext": "test", "gsm8k": "test"}


def first_row(path: Path) -> dict:
    with path.open() as fh:
        return json.loads(fh.readline())


def n_rows(path: Path) -> int:
    with path.open() as fh:
        return sum(1 for line in fh if line.strip())


def eval_file(stock: str) -> Path:
    return DATA / SHARED_FILES[stock][EVAL_SPLIT[stock]]


@pytest.fixture(scope="module")
def local_path(tmp_path_factory) -> str:
    return materialize_test_tasks(tmp_path_factory.mktemp("local_tasks"))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, str]:
    """Overrides for ../shared/data as it is: its file names are the downloads' (hellaswag_val.jsonl, wikitext2/...)."""
    return write_task_yamls(DATA, tmp_path_factory.mktemp("offline_yamls"))


@pytest.fixture(scope="module")
def task_manager(local_path, written):
    """One TaskManager (indexing the stock tasks takes seconds): stock tasks, then the _local ones, then the
    overrides."""
    from lm_eval.tasks import TaskManager

    out_dir = str(Path(next(iter(written.values()))).parent)
    return TaskManager(include_path=[local_path, out_dir])


@pytest.fixture(scope="module")
def tasks(task_manager):
    """Every _local task and every stock-named override, built (datasets loaded) once."""
    return task_manager.load(list(LOCAL_TASKS) + list(STOCK_TASKS))["tasks"]


# ---------------------------------------------------------------- the table agrees with the installed lm-eval


class _FunctionTagLoader(yaml.SafeLoader):
    pass


_FunctionTagLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


@pytest.mark.parametrize("task", list(STOCK_TASKS))
def test_stock_table_matches_installed_yaml(task):
    entry = STOCK_TASKS[task]
    cfg = yaml.load((stock_tasks_dir() / entry.yaml).read_text(), Loader=_FunctionTagLoader)  # noqa: S506
    assert cfg["task"] == task
    named = {k: cfg[k] for k in SPLIT_KEYS if cfg.get(k) is not None}
    assert named == dict(entry.splits), "STOCK_TASKS must list every split the stock YAML names"
    assert set(entry.required) <= set(entry.split_names)


# ---------------------------------------------------------------- the hand-written _local tasks


def test_local_yamls_are_absolute_and_complete(local_path):
    names = sorted(p.stem for p in Path(local_path).glob("*.yaml"))
    assert names == sorted(LOCAL_TASKS)
    for name in LOCAL_TASKS:
        cfg = yaml.safe_load((Path(local_path) / f"{name}.yaml").read_text())
        assert cfg["task"] == name and cfg["tag"] is None and cfg["dataset_path"] == "json"
        assert Path(cfg["include"]).is_absolute() and Path(cfg["include"]).is_file()
        for f in cfg["dataset_kwargs"]["data_files"].values():
            # CI may lay shared/ out as a tree of symlinks: compare where the files really are.
            assert Path(f).is_absolute() and Path(f).is_file()
            assert any(Path(f).resolve() == p.resolve() for p in DATA.rglob("*.jsonl")), f


@pytest.mark.parametrize("stock", list(STOCK_TASKS))
def test_local_task_first_doc_is_first_jsonl_row(tasks, stock):
    task = tasks[f"{stock}_local"]
    docs = task.eval_docs
    path = eval_file(stock)
    assert len(docs) == n_rows(path)
    row, doc = first_row(path), docs[0]
    if stock == "hellaswag":
        # the stock process_docs (a !function in the included YAML) rewrites `query` and adds choices/gold
        assert doc["gold"] == row["label"] and doc["choices"] == row["endings"]
        assert doc["query"] == "Roof shingle removal: A man is sitting on a roof. he"
        row = {k: v for k, v in row.items() if k != "query"}
    assert {k: doc[k] for k in row} == row


def test_local_tasks_use_stock_prompts_and_functions(tasks):
    arc = tasks["arc_easy_local"]
    row = first_row(DATA / "arc_easy/test.jsonl")
    assert arc.doc_to_text(arc.eval_docs[0]) == f"Question: {row['question']}\nAnswer:"
    assert arc.doc_to_target(arc.eval_docs[0]) == row["choices"]["label"].index(row["answerKey"])

    # wikitext's doc_to_target is the stock preprocess_wikitext.wikitext_detokenizer, resolved through the include
    wiki = tasks["wikitext_local"]
    target = wiki.doc_to_target(wiki.eval_docs[0])
    page = first_row(eval_file("wikitext"))["page"]
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    assert target == wikitext_detokenizer({"page": page}) != page
    assert " @-@ " in page and " @-@ " not in target and target.startswith(" = Robert Boulter =\n\nRobert Boulter is")

    lam = tasks["lambada_openai_local"]
    text = first_row(eval_file("lambada_openai"))["text"]
    assert lam.doc_to_text(lam.eval_docs[0]) + lam.doc_to_target(lam.eval_docs[0]) == text


def test_local_fewshot_and_optional_splits(tasks):
    gsm = tasks["gsm8k_local"]
    assert gsm.config.num_fewshot == 5  # the stock default, drawn from train
    assert gsm.fewshot_docs()[0] == first_row(DATA / "gsm8k/train.jsonl")
    arc = tasks["arc_easy_local"]
    assert arc.training_docs()[0] == first_row(DATA / "arc_easy/train.jsonl")
    assert arc.validation_docs()[0] == first_row(DATA / "arc_easy/validation.jsonl")
    for name in ("hellaswag_local", "piqa_local"):
        assert not tasks[name].has_training_docs() and not tasks[name].has_test_docs()


# ---------------------------------------------------------------- mpitp.tasks.offline.write_task_yamls


def test_write_task_yamls_content(written):
    assert set(written) == set(STOCK_TASKS)
    for task, path in written.items():
        assert Path(path).name == f"{task}.yaml"
        cfg = yaml.safe_load(Path(path).read_text())
        assert cfg["task"] == task and cfg["tag"] is None
        assert cfg["include"] == str(stock_tasks_dir() / STOCK_TASKS[task].yaml)
        files = cfg["dataset_kwargs"]["data_files"]
        assert files == {split: str((DATA / rel).resolve()) for split, rel in SHARED_FILES[task].items()}, task
        # every split key the stock task names is set: to a split we have, else null
        for key, split in STOCK_TASKS[task].splits:
            assert cfg[key] == (split if split in files else None)


def test_overrides_keep_stock_names_and_tags(task_manager, written):
    index = task_manager.task_index
    for task, path in written.items():
        assert index[task].yaml_path == Path(path), f"--include-path {task} should override the stock {task}"
    # with `tag: null` the stock tags stay whole (an inherited tag would have replaced ai2_arc by {arc_easy})
    assert index["ai2_arc"].tags == {"arc_easy", "arc_challenge"}
    assert {"hellaswag"} < index["multiple_choice"].tags


@pytest.mark.parametrize("stock", list(STOCK_TASKS))
def test_overrides_read_the_same_docs_as_local_tasks(tasks, stock):
    ours, local = tasks[stock], tasks[f"{stock}_local"]
    assert ours.config.dataset_path == "json"
    assert ours.eval_docs.to_list() == local.eval_docs.to_list()
    doc = ours.eval_docs[0]
    assert ours.doc_to_text(doc) == local.doc_to_text(doc)
    assert ours.doc_to_target(doc) == local.doc_to_target(doc)
    assert ours.has_training_docs() == local.has_training_docs()
    if ours.has_training_docs():
        assert ours.training_docs().to_list() == local.training_docs().to_list()


def test_offline_status_and_partial_data_dir(tmp_path):
    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy" / "test.jsonl").symlink_to(DATA / "arc_easy/test.jsonl")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").symlink_to(DATA / "gsm8k/test.jsonl")
    status = {row.task: (row.runnable, row.missing) for row in offline_status(tmp_path)}
    assert list(status) == list(STOCK_TASKS)
    assert status["arc_easy"] == (True, [])  # train/validation are optional
    assert status["gsm8k"] == (False, ["gsm8k/train.jsonl"])  # its 5-shot prompt needs train
    assert status["wikitext"] == (False, ["wikitext/test.jsonl"])

    out = tmp_path / "yamls"
    assert list(write_task_yamls(tmp_path, out)) == ["arc_easy"]
    cfg = yaml.safe_load((out / "arc_easy.yaml").read_text())
    assert (cfg["training_split"], cfg["validation_split"], cfg["test_split"]) == (None, None, "test")

    from lm_eval.tasks import TaskManager

    arc = TaskManager(include_path=str(out), include_defaults=False).load(["arc_easy"])["tasks"]["arc_easy"]
    assert arc.eval_docs[0] == first_row(DATA / "arc_easy/test.jsonl") and not arc.has_training_docs()

    with pytest.raises(DataDirError, match="task gsm8k needs gsm8k/train.jsonl"):
        write_task_yamls(tmp_path, out, tasks=["gsm8k"])
    with pytest.raises(DataDirError, match="no offline version of mmlu"):
        write_task_yamls(tmp_path, out, tasks=["arc_easy", "mmlu"])


def test_missing_data_dir_is_a_usage_error(tmp_path):
    from mpitp.errors import UsageError

    missing = tmp_path / "nope"
    with pytest.raises(UsageError, match=f"^--data-dir {missing}: no such directory$"):
        offline_status(missing)
    with pytest.raises(DataDirError, match="no such directory"):
        write_task_yamls(missing, tmp_path / "out")
    (tmp_path / "file").write_text("")
    with pytest.raises(DataDirError, match="not a directory"):
        offline_status(tmp_path / "file")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.skipif(not MODEL.is_dir(), reason=f"model not found at {MODEL}")
def test_simple_evaluate_runs_local_tasks(task_manager):
    import lm_eval

    names = ["arc_easy_local", "wikitext_local", "gsm8k_local"]
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={MODEL},dtype=float32",
        tasks=names,
        limit=2,
        device="cpu",
        batch_size=1,
        bootstrap_iters=0,
        gen_kwargs={"max_gen_toks": 32},  # stories260K never writes the stop string; keep generation short
        log_samples=True,
        task_manager=task_manager,
    )
    res = out["results"]
    assert all(out["n-samples"][n]["effective"] == 2 for n in names)
    assert res["arc_easy_local"]["acc,none"] in (0.0, 0.5, 1.0)
    assert res["arc_easy_local"]["acc_norm,none"] in (0.0, 0.5, 1.0)
    for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(res["wikitext_local"][m]) and res["wikitext_local"][m] > 0
    assert res["wikitext_local"]["byte_perplexity,none"] > 1
    for f in ("strict-match", "flexible-extract"):
        assert res["gsm8k_local"][f"exact_match,{f}"] in (0.0, 0.5, 1.0)

    # the samples are the first rows of the real files, prompted the stock way
    arc_row = first_row(DATA / "arc_easy/test.jsonl")
    arc_sample = next(s for s in out["samples"]["arc_easy_local"] if s["doc_id"] == 0)
    assert arc_sample["doc"] == arc_row
    assert arc_sample["arguments"][0][0] == f"Question: {arc_row['question']}\nAnswer:"
    gsm_row = first_row(DATA / "gsm8k/test.jsonl")
    gsm_sample = next(s for s in out["samples"]["gsm8k_local"] if s["doc_id"] == 0)
    context = gsm_sample["arguments"][0][0]
    shots = context.split("Question: ")[1:]
    assert len(shots) == 6 and shots[-1] == f"{gsm_row['question']}\nAnswer:"  # 5 shots from train, then the doc
    train_questions = {json.loads(line)["question"] for line in (DATA / "gsm8k/train.jsonl").open()}
    assert all(s.split("\nAnswer:")[0] in train_questions for s in shots[:-1])


def test_documented_layout_is_read_as_named(tmp_path):
    """DIR/<task>/<split>.jsonl wins over any other file in the folder, even one that would also fit."""
    (tmp_path / "wikitext").mkdir()
    (tmp_path / "wikitext" / "test.jsonl").symlink_to(DATA / SHARED_FILES["wikitext"]["test"])
    (tmp_path / "wikitext" / "wiki_test_copy.jsonl").symlink_to(DATA / SHARED_FILES["wikitext"]["test"])
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "validation.jsonl").symlink_to(DATA / SHARED_FILES["hellaswag"]["validation"])
    assert split_files(tmp_path, "wikitext") == {"test": tmp_path / "wikitext" / "test.jsonl"}
    assert split_files(tmp_path, "hellaswag") == {"validation": tmp_path / "hellaswag" / "validation.jsonl"}


def write_jsonl(path: Path, *rows: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_downloaded_names_split_words_fields_and_folders(tmp_path):
    # split words: "val"/"dev" are validation; the word must stand alone ("interval" is not "val")
    write_jsonl(tmp_path / "piqa" / "piqa_dev.jsonl", {"goal": "g", "sol1": "a", "sol2": "b", "label": 0})
    write_jsonl(tmp_path / "piqa" / "interval.jsonl", {"goal": "g", "sol1": "a", "sol2": "b", "label": 0})
    assert split_files(tmp_path, "piqa") == {"validation": tmp_path / "piqa" / "piqa_dev.jsonl"}
    # the fields decide between files that both say "test": wikitext reads documents ("page"), not lines ("text")
    write_jsonl(tmp_path / "wikitext-2" / "wiki-test.jsonl", {"text": " = Title = "})
    write_jsonl(tmp_path / "wikitext-2" / "wiki-test-docs.jsonl", {"page": " = Title = \n body"})
    assert split_files(tmp_path, "wikitext") == {"test": tmp_path / "wikitext-2" / "wiki-test-docs.jsonl"}
    # a file with the right name but the wrong schema is not used: the task stays missing, not half-run
    write_jsonl(tmp_path / "lambada" / "lambada_test.jsonl", {"context": "c", "continuation": "x"})
    status = {row.task: row for row in offline_status(tmp_path)}
    assert status["lambada_openai"].missing == ["lambada_openai/test.jsonl"]
    assert status["piqa"].runnable and status["wikitext"].runnable


def test_two_fitting_files_are_an_error_not_a_guess(tmp_path):
    for name in ("gsm8k_test.jsonl", "test-v2.jsonl"):
        write_jsonl(tmp_path / "gsm8k" / name, {"question": "q", "answer": "#### 1"})
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", {"question": "q", "answer": "#### 1"})
    with pytest.raises(DataDirError, match=r"^gsm8k test split: gsm8k/gsm8k_test.jsonl, gsm8k/test-v2.jsonl all fit; "
                                           r"keep one or name it gsm8k/test.jsonl$"):
        split_files(tmp_path, "gsm8k")
    status = {row.task: row for row in offline_status(tmp_path)}
    assert not status["gsm8k"].runnable and "all fit" in status["gsm8k"].missing[0]
    with pytest.raises(DataDirError, match="all fit"):
        write_task_yamls(tmp_path, tmp_path / "out", tasks=["gsm8k"])
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- mpitp.tasks.names: the fast unknown-task check


def test_name_scan_covers_lm_evals_stock_index(task_manager):
    """Every name lm-eval's own index knows is found by the text scan (else a real task would be refused)."""
    from mpitp.tasks.names import stock_task_names

    scanned = stock_task_names()
    indexed = set(task_manager.all_tasks) - set(LOCAL_TASKS)  # the overrides keep stock names
    assert indexed - scanned == set()
    assert len(scanned - indexed) < 0.01 * len(indexed), sorted(scanned - indexed)[:20]  # and not much more


def test_name_scan_reads_every_yaml_spelling(tmp_path):
    from mpitp.tasks.names import names_in_file, scan_task_names

    (tmp_path / "a.yaml").write_text(
        '"task": "quoted_task"\n"tag": "quoted_tag"\ngroup: grp  # a comment\ntask:\n  - member_a\n'
        "  - task: inline_dict_is_not_a_name\n  - member_b\ntag: [flow_a, 'flow_b']\n"
        "doc_to_text: !function utils.x\ntag:\n- col0_item\ndataset_name: not_a_name\n")
    (tmp_path / "_default_template_yaml").write_text("tag:\n  - from_template\n")
    (tmp_path / "utils.py").write_text("task: not_yaml\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.yaml").write_text("task: cached\n")
    assert names_in_file(tmp_path / "a.yaml") == {"quoted_task", "quoted_tag", "grp", "member_a", "member_b",
                                                  "flow_a", "flow_b", "col0_item"}
    assert scan_task_names(tmp_path) == names_in_file(tmp_path / "a.yaml") | {"from_template"}


def test_a_task_file_given_as_a_task_says_how_to_name_it(tmp_path, monkeypatch):
    """``--tasks my.yaml`` (lm_eval's form) was 'unknown task 'my.yaml'', as for a typo: now the folder to include
    and the file's task names, in mpitp eval's refusal and in mpitp check's problem alike."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import _refuse_unknown
    from mpitp.tasks.names import task_file_hint

    (tmp_path / "my.yaml").write_text("task: my_arc\ndoc_to_text: !function utils.x\n")
    (tmp_path / "grp.yml").write_text("group: my_group\ntask:\n  - my_arc\n")
    (tmp_path / "empty.yaml").write_text("dataset_path: json\n")
    monkeypatch.chdir(tmp_path)
    assert task_file_hint("my.yaml") == (
        f": a file, not a task name: pass its folder as --include_path {tmp_path} and its name (my_arc) to --tasks")
    assert task_file_hint(str(tmp_path / "grp.yml")).endswith("and its name (my_arc, my_group) to --tasks")
    assert task_file_hint("empty.yaml").endswith("and the name its task: line gives to --tasks")
    assert task_file_hint(str(tmp_path)) == (f": a folder, not a task name: pass it as --include_path {tmp_path} "
                                             "and the names its YAML files give (task: or group:) to --tasks")
    for other in ("arc_esy", "nope.yaml", "a/b"):  # a name, a file that is not there
        assert task_file_hint(other) == "", other
    with pytest.raises(UsageError, match=r"^unknown task 'my.yaml': a file, not a task name: pass its folder"):
        _refuse_unknown(["my.yaml"], {"my_ark"})
    with pytest.raises(UsageError, match=r"^unknown task 'my_ark2'; did you mean: my_ark\?$"):
        _refuse_unknown(["my_ark2"], {"my_ark"})
