"""lm-eval's task index kept as JSON (:mod:`mpitp.tasks.index`): read back on the second build, rebuilt when lm-eval's
version, a YAML of the tree or a file it includes changes, or when the cache file is corrupt or foreign; the same
names, kinds, paths, tags and configs as a fresh ``TaskManager``. The counters say whether lm-eval walked a tree
(no timings)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mpitp.tasks import index
from mpitp.tasks.demo import demo_tasks_dir
from mpitp.tasks.offline import stock_tasks_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "task-index"
    monkeypatch.setenv("MPITP_TASK_INDEX_CACHE", str(folder))
    monkeypatch.setattr(index, "_tree_memo", {})
    index.counters.clear()
    return folder


@pytest.fixture(scope="module")
def mmlu_tree(tmp_path_factory) -> Path:
    """A copy of lm-eval's mmlu folder: 410 YAMLs, groups, tags and includes, with no other tree's names."""
    root = tmp_path_factory.mktemp("trees") / "mmlu"
    shutil.copytree(stock_tasks_dir() / "mmlu", root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _walks() -> int:
    return index.counters["walks"]


def _fresh(include_path, include_defaults=False):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def _same_index(cached, fresh, configs: list[str] = ()) -> None:
    assert cached.all_tasks == fresh.all_tasks
    assert cached.all_subtasks == fresh.all_subtasks
    assert cached.all_groups == fresh.all_groups
    assert cached.all_tags == fresh.all_tags
    for name, entry in fresh.task_index.items():
        got = cached.task_index[name]
        assert (got.name, got.kind, got.yaml_path, got.tags) == (entry.name, entry.kind, entry.yaml_path, entry.tags)
    for name in configs:  # parsed on first use, as lm-eval's index parsed it
        assert cached.task_index[name].cfg == fresh.task_index[name].cfg


def test_second_build_reads_the_cache_and_matches_lm_eval(cache, mmlu_tree):
    trees = [str(mmlu_tree), demo_tasks_dir()]  # the demo folder is small: indexed directly, never cached
    first = index.task_manager(trees, include_defaults=False)
    assert _walks() == 2 and index.counters["hits"] == 0
    assert len(list(cache.glob("*.json"))) == 1
    index._tree_memo.clear()  # a new process: the file is read again
    second = index.task_manager(trees, include_defaults=False)
    assert _walks() == 3 and index.counters["hits"] == 1  # the demo folder again, mmlu from the cache
    fresh = _fresh(trees)
    _same_index(first, fresh)
    _same_index(second, fresh, configs=["mmlu", "mmlu_stem", "mmlu_abstract_algebra", "mpitp_demo_mc"])
    assert second.include_path == trees
    # tasks resolved through the cached index are lm-eval's: the demo tag (local data) loads the same tasks
    got, want = second.load(["mpitp_demo"]), fresh.load(["mpitp_demo"])
    assert sorted(got["tasks"]) == sorted(want["tasks"])
    assert {k: t.config.to_dict() for k, t in got["tasks"].items()} == \
        {k: t.config.to_dict() for k, t in want["tasks"].items()}


def test_check_tasks_uses_the_cache(cache, mmlu_tree):
    from mpitp.evaluation.checks import check_tasks

    check_tasks(["mmlu_stem"], [str(mmlu_tree)])
    tm = check_tasks(["mmlu_stem"], [str(mmlu_tree)])
    assert _walks() == 1 and index.counters["hits"] == 1
    assert "mmlu_abstract_algebra" in tm.all_subtasks


def test_a_new_lm_eval_version_rebuilds(cache, mmlu_tree, monkeypatch):
    import lm_eval

    index.task_manager(str(mmlu_tree), include_defaults=False)
    monkeypatch.setattr(lm_eval, "__version__", f"{lm_eval.__version__}.post9", raising=False)
    index.task_manager(str(mmlu_tree), include_defaults=False)
    assert _walks() == 2
    index.task_manager(str(mmlu_tree), include_defaults=False)
    assert _walks() == 2


def test_an_edited_yaml_rebuilds(cache, mmlu_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(mmlu_tree, tree)
    index.task_manager(str(tree), include_defaults=False)
    yaml = tree / "default" / "mmlu_anatomy.yaml"
    yaml.write_text(yaml.read_text().replace('"mmlu_anatomy"', '"mmlu_anatomy_renamed"'))
    tm = index.task_manager(str(tree), include_defaults=False)
    assert _walks() == 2
    assert "mmlu_anatomy_renamed" in tm.all_subtasks and "mmlu_anatomy" not in tm.all_tasks
    (tree / "default" / "extra.yaml").write_text("task: mmlu_extra\ninclude: _default_template_yaml\n")
    tm = index.task_manager(str(tree), include_defaults=False)
    assert _walks() == 3 and "mmlu_extra" in tm.all_subtasks
    _same_index(tm, _fresh(str(tree)))


def test_a_changed_include_outside_the_tree_rebuilds(cache, tmp_path, monkeypatch):
    """An include path's YAML may include a file elsewhere (``--data-dir`` overrides include the stock YAMLs)."""
    monkeypatch.setattr(index, "MIN_FILES", 1)
    base = tmp_path / "elsewhere" / "base.yaml"
    base.parent.mkdir()
    base.write_text("task: from_base\ntag: [t1]\ndataset_path: json\noutput_type: loglikelihood\n")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "mine.yaml").write_text(f"include: {base}\n")
    tm = index.task_manager(str(tree), include_defaults=False)
    assert tm.all_subtasks == ["from_base"] and tm.all_tags == ["t1"]
    index.task_manager(str(tree), include_defaults=False)
    assert _walks() == 1
    base.write_text("task: renamed_in_base\ndataset_path: json\noutput_type: loglikelihood\n")
    tm = index.task_manager(str(tree), include_defaults=False)
    assert _walks() == 2 and tm.all_subtasks == ["renamed_in_base"] and tm.all_tags == []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign path", "absolute path", "bad kind", "not ours"])
def test_a_corrupt_or_foreign_cache_is_rebuilt(cache, mmlu_tree, damage):
    fresh = index.task_manager(str(mmlu_tree), include_defaults=False)
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x80\x04 not json")
    elif damage == "truncated":
        path.write_text(path.read_text()[:1000])
    else:
        entry = next(e for e in data["entries"] if e[2] is not None)
        if damage == "foreign path":
            entry[2] = "../../../../etc/evil.yaml"
        elif damage == "absolute path":
            entry[2] = "/etc/evil.yaml"
        elif damage == "bad kind":
            entry[1] = "PICKLE"
        else:
            data = {"format": 99, "entries": data["entries"]}
        path.write_text(json.dumps(data))
    index._tree_memo.clear()
    tm = index.task_manager(str(mmlu_tree), include_defaults=False)
    assert _walks() == 2 and index.counters["rebuilt"] == 1
    _same_index(tm, fresh)
    index._tree_memo.clear()
    index.task_manager(str(mmlu_tree), include_defaults=False)  # the rebuilt file is good again
    assert _walks() == 2 and index.counters["hits"] == 1


def test_written_atomically_and_off_when_asked(cache, mmlu_tree, monkeypatch):
    index.task_manager(str(mmlu_tree), include_defaults=False)
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    (path,) = cache.glob("*.json")
    assert json.loads(path.read_text())["root"] == str(mmlu_tree.resolve())
    os.chmod(cache, 0o500)  # a cache dir that cannot be written costs a rebuild, never a failure
    try:
        index.task_manager(str(mmlu_tree / "default"), include_defaults=False)
    finally:
        os.chmod(cache, 0o700)
    monkeypatch.setenv("MPITP_TASK_INDEX_CACHE", "0")
    tm = index.task_manager(str(mmlu_tree), include_defaults=False)
    assert _walks() == 3 and "mmlu" in tm.all_groups
    assert not index.is_cached(mmlu_tree)


@pytest.mark.slow
def test_stock_tree_through_the_cache_equals_lm_eval(cache):
    """The whole stock tree (two index builds: about 30 s): the cached index is lm-eval's, mmlu resolves the same."""
    first = index.task_manager()
    assert _walks() == 1 and index.is_cached()
    index._tree_memo.clear()
    second = index.task_manager()
    assert _walks() == 1 and index.counters["hits"] == 1
    fresh = _fresh(None, include_defaults=True)
    _same_index(first, fresh)
    _same_index(second, fresh, configs=["mmlu", "hellaswag", "arc_easy", "ai2_arc"])


def test_a_folder_of_written_overrides_is_indexed_from_its_listing(cache, tmp_path):
    """The --data-dir overrides are indexed from the listing written with them, as lm-eval would index them; a
    listing that does not match the folder is ignored."""
    from mpitp.tasks.layout import write_overrides
    from support.offline_data import mmlu_dir, small_tasks_dir

    data = small_tasks_dir(mmlu_dir(tmp_path / "data", rows=1))
    out = tmp_path / "out"
    written = write_overrides(["mmlu_stem", "boolq", "copa"], data, out)
    assert len(written) == 21 and (out / index.LISTING).is_file()  # 19 stem subjects + boolq + copa
    walks = _walks()  # lm-eval's own tree, indexed to resolve the names
    listed = index.task_manager([str(out)], include_defaults=False)
    assert index.counters["listed"] == 1 and _walks() == walks
    fresh = _fresh([str(out)])
    _same_index(listed, fresh, configs=["boolq", "mmlu_anatomy"])
    (out / "extra.yaml").write_text((out / "boolq.yaml").read_text().replace("task: boolq", "task: boolq_extra"))
    again = index.task_manager([str(out)], include_defaults=False)  # an unlisted YAML: lm-eval indexes the folder
    assert index.counters["listed"] == 1 and _walks() == walks + 1 and "boolq_extra" in again.all_tasks
