"""lm-eval's request cache under mpitp (:mod:`mpitp.evaluation.requestcache`): keyed by what shapes requests, reused by
a second full run with the same results, off with ``--limit``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpitp.evaluation.checks import task_manager
from mpitp.evaluation.requestcache import enable, request_key, tokenizer_identity
from mpitp.evaluation.settings import EvalConfig
from support import OFFLINE_ENV
from support.mpi import explain, run_mpi


def test_key_follows_what_shapes_requests(test_tasks, tmp_path):
    """Same settings, same key (also from another copy of the YAMLs: ``--data-dir`` writes them to a new temporary
    folder every run); another few-shot count, seed, tokenizer, task YAML or data file, another key."""
    cfg = EvalConfig(tasks=["arc_easy_local"], num_fewshot=0, seed=1)
    tm = task_manager(cfg.tasks, [test_tasks])
    base = request_key(cfg, tm, "tok")
    assert base == request_key(cfg, tm, "tok")
    copy = tmp_path / "copy"
    shutil.copytree(test_tasks, copy)
    assert request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok") == base
    assert request_key(EvalConfig(tasks=["arc_easy_local"], num_fewshot=1, seed=1), tm, "tok") != base
    assert request_key(EvalConfig(tasks=["arc_easy_local"], num_fewshot=0, seed=2), tm, "tok") != base
    assert request_key(cfg, tm, "other-tok") != base
    picked = request_key(EvalConfig(tasks=["arc_easy_local"], samples={"arc_easy_local": [7, 3]}), tm, "tok")
    assert picked not in (None, base)  # the same documents, however listed: one set of requests
    assert request_key(EvalConfig(tasks=["arc_easy_local"], samples={"arc_easy_local": [3, 7, 7]}), tm, "tok") == picked
    yaml = copy / "arc_easy_local.yaml"
    yaml.write_text(yaml.read_text() + "\n# edited\n")
    assert request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok") != base
    data = tmp_path / "data.jsonl"  # a local data file named in the config: its size and mtime count
    data.write_text("{}\n")
    text = yaml.read_text()
    yaml.write_text(text + f"\n# {data}\n")
    entry_cfg = task_manager(cfg.tasks, [str(copy)]).task_index["arc_easy_local"].cfg
    if str(data) in str(entry_cfg):  # only when the YAML parser keeps the path (comments are dropped)
        k1 = request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok")
        data.write_text("{}\n{}\n")
        assert request_key(cfg, task_manager(cfg.tasks, [str(copy)]), "tok") != k1
    assert enable(EvalConfig(tasks=["arc_easy_local"], limit=5), tm, "tok") == {}  # --limit: off


def test_key_follows_data_beside_the_task(tmp_path):
    """A custom_dataset's data file named relative to its code (the demo tasks' JSONL): editing it changes the key,
    else a full run would be served the requests built from the old documents (lm-eval would score the new ones)."""
    import mpitp.tasks.demo as demo

    folder = tmp_path / "tasks"
    shutil.copytree(Path(demo.__file__).parent / "tasks", folder, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = EvalConfig(tasks=["mpitp_demo_mc"], num_fewshot=0, seed=1)
    base = request_key(cfg, task_manager(cfg.tasks, [str(folder)]), "tok")
    (folder / ".mpitp-listing.json").write_text("{}")  # mpitp's own index of the folder: not data
    assert request_key(cfg, task_manager(cfg.tasks, [str(folder)]), "tok") == base
    data = folder / "mpitp_demo_mc.jsonl"
    data.write_text(data.read_text().replace("What color is the sky on a clear day?", "What color is grass?"))
    assert request_key(cfg, task_manager(cfg.tasks, [str(folder)]), "tok") != base


def test_cache_file_written_with_the_c_pickler(tmp_path):
    """Inside ``used`` lm-eval's ``save_to_cache`` writes the C pickler's bytes (dill's pure-Python pickler took 2.4
    s of rank 0 for full hellaswag), at lm-eval's own file name, private, read back by lm-eval's ``load_from_cache``;
    an object only dill can pickle is lm-eval's own dill file; lm-eval's function is back after the block."""
    import pickle

    import dill
    import lm_eval.api.task as lm_task
    from lm_eval.api.instance import Instance
    from lm_eval.caching.cache import load_from_cache

    from mpitp.evaluation.requestcache import used

    original = lm_task.save_to_cache
    instances = [[Instance("loglikelihood", {"ctx": f"doc {i}"}, (f"doc {i}", f" ending {j}"), j, ("t", i, 1))
                  for j in range(4)] for i in range(3)]
    odd = [{"fn": lambda x: x + 1}]  # a function the C pickler refuses: lm-eval's dill
    folder = tmp_path / "keyed"
    with used(str(folder)):
        assert lm_task.save_to_cache is not original
        lm_task.save_to_cache(file_name="requests-a", obj=instances)
        lm_task.save_to_cache(file_name="requests-b", obj=odd)
        back = load_from_cache(file_name="requests-a", cache=True)
        assert load_from_cache(file_name="requests-b", cache=True)[0]["fn"](1) == 2
    assert lm_task.save_to_cache is original
    a, b = (next(folder.glob(f"requests-{k}.*.pickle")) for k in "ab")  # lm-eval's suffix: a hash of its own
    assert a.read_bytes() == pickle.dumps(instances, protocol=pickle.HIGHEST_PROTOCOL)
    assert b.read_bytes() == dill.dumps(odd)
    assert a.stat().st_mode & 0o777 == 0o600 and sorted(p.name for p in folder.iterdir()) == [a.name, b.name]
    assert [[(r.arguments, r.idx, r.doc) for r in g] for g in back] == \
        [[(r.arguments, r.idx, r.doc) for r in g] for g in instances]


@pytest.mark.slow
@pytest.mark.mpi
def test_second_full_run_reuses_built_requests(tmp_path):
    """Two full runs of the demo's multiple-choice task with one cache folder: the first writes lm-eval's cache
    file, the second reads it (the file is not rewritten) and gives the same results."""
    cache = tmp_path / "cache"
    env = {"MPITP_REQUEST_CACHE": str(cache)}
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}.h5"
        proc = run_mpi(2, ["eval", "--demo", "--tasks", "mpitp_demo_mc", "--bootstrap-iters", "0", "--output",
                           str(out)], env=env, timeout=600)
        assert proc.returncode == 0, explain(proc)
        assert "request cache: " in proc.stderr, proc.stderr[-2000:]
        files = sorted(cache.rglob("*.pickle"))
        assert len(files) == 1, files
        if i == 0:
            stamp = files[0].stat().st_mtime_ns
        else:
            assert files[0].stat().st_mtime_ns == stamp  # read, not built and written again
        outs.append(out)
    diff = subprocess.run([sys.executable, "-m", "mpitp", "inspect", "diff", str(outs[0]), str(outs[1])],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE_ENV})
    assert diff.returncode == 0, diff.stdout + diff.stderr
    print(f"request cache file {files[0].name} ({files[0].stat().st_size} B) reused by the second run; same results")
    assert Path(files[0]).parent.parent == cache


def test_a_cache_that_cannot_be_written_does_not_end_the_run(tmp_path, monkeypatch, caplog):
    """A request cache on a full disk: lm-eval's save raised ENOSPC out of simple_evaluate (a traceback, exit 1, the
    requests already built); the run goes on with one warning."""
    import errno

    import lm_eval.api.task as lm_task

    from mpitp.evaluation import requestcache
    from mpitp.results import safefile

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safefile, "write_replace", full)
    monkeypatch.setattr(requestcache, "_unsaved", [])
    with requestcache.used(str(tmp_path / "keyed")), caplog.at_level("WARNING", logger="mpitp"):
        lm_task.save_to_cache(file_name="requests-a", obj=[1, 2])
        lm_task.save_to_cache(file_name="requests-b", obj=[3])
    said = [r.getMessage() for r in caplog.records if "cannot save" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0], said


@pytest.mark.parametrize("named", ["data_files:\n    test: data/mc.jsonl", "data_files:\n    test: data/*.jsonl",
                                   "data_dir: data", "data_files: data/**"])
def test_key_follows_data_files_relative_to_the_working_directory(tmp_path, monkeypatch, named):
    """``data_files: data/mc.jsonl``, ``data/*.jsonl`` or ``data_dir: data`` (datasets resolves them against the
    working directory): editing a file they name or hold, or adding one, changes the key, else a full run would be
    served the requests built from the old documents (only a plain file was keyed: with a glob, 0.0 acc where lm-eval
    scores 1.0)."""
    import mpitp.tasks.demo as demo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    data = tmp_path / "data" / "mc.jsonl"
    shutil.copy(Path(demo.__file__).parent / "tasks" / "mpitp_demo_mc.jsonl", data)
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "relmc.yaml").write_text(
        f"task: relmc\ndataset_path: json\ndataset_kwargs:\n  {named}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\n")
    cfg = EvalConfig(tasks=["relmc"], num_fewshot=0, seed=1)
    base = request_key(cfg, task_manager(cfg.tasks, [str(folder)]), "tok")
    data.write_text(data.read_text().replace("What color is the sky on a clear day?", "What color is grass?"))
    edited = request_key(cfg, task_manager(cfg.tasks, [str(folder)]), "tok")
    assert edited != base
    (tmp_path / "data" / "more.jsonl").write_text(data.read_text())
    assert (request_key(cfg, task_manager(cfg.tasks, [str(folder)]), "tok") != edited) == ("mc.jsonl" not in named)


def test_key_follows_the_functions_of_a_yaml_included_from_another_folder(tmp_path):
    """``include: ../../common/tmpl.yaml`` whose ``process_docs: !function helpers.process_docs`` lives beside the
    template, not the task: editing ``common/helpers.py`` changes the key (it kept it: the old documents' requests,
    acc 0.0 where lm-eval scores 1.0)."""
    import mpitp.tasks.demo as demo

    (tmp_path / "common").mkdir()
    (tmp_path / "tasks" / "sub").mkdir(parents=True)
    data = Path(demo.__file__).parent / "tasks" / "mpitp_demo_mc.jsonl"
    (tmp_path / "common" / "tmpl.yaml").write_text(
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\noutput_type: multiple_choice\n"
        "test_split: test\nprocess_docs: !function helpers.process_docs\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: answer\n")
    helpers = tmp_path / "common" / "helpers.py"
    helpers.write_text("def process_docs(ds):\n    return ds\n")
    (tmp_path / "tasks" / "sub" / "inc.yaml").write_text("include: ../../common/tmpl.yaml\ntask: incmc\n")
    cfg = EvalConfig(tasks=["incmc"], num_fewshot=0, seed=1)
    folder = str(tmp_path / "tasks")
    base = request_key(cfg, task_manager(cfg.tasks, [folder]), "tok")
    helpers.write_text("def process_docs(ds):\n    return ds.select(range(2))\n")
    assert request_key(cfg, task_manager(cfg.tasks, [folder]), "tok") != base


def test_key_follows_the_chat_template(test_tasks):
    """The same tokenizer folder with an edited chat template renders other prompts under --apply_chat_template:
    another key (the name alone kept serving the old template's requests)."""
    from types import SimpleNamespace

    cfg = EvalConfig(tasks=["arc_easy_local"], num_fewshot=0, seed=1, apply_chat_template=True)
    tm = task_manager(cfg.tasks, [test_tasks])

    def key(template):
        return request_key(cfg, tm, tokenizer_identity(SimpleNamespace(chat_template=template), "/m/chat"))

    assert key("Q: {{ m }}") == key("Q: {{ m }}") != key("Question: {{ m }}")
    assert key(None) == request_key(cfg, tm, "/m/chat")  # no template: the name, as before
