"""Issue 37: mpitp's two caches hold what a run trusts, so a cache entry someone else could have written is ignored.

- lm-eval's request cache (:mod:`mpitp.evaluation.requestcache`, ``~/.cache/mpitp/requests``): ``dill`` pickles,
  loaded by ``lm_eval.caching.cache.load_from_cache``; a planted one is code run as the user. The attack is built
  for real (a pickle whose loading makes a marker folder, at the name lm-eval loads) and driven the way the runner
  drives it: ``cache_dir`` decides, ``used`` points lm-eval at it, lm-eval's own loader reads.
- the task-index cache (:mod:`mpitp.tasks.index`): JSON that names the YAML a task name runs; a planted one ran
  another task under a name.

Each cache is used only from a folder of this user's that nobody else can write, and each file in it must be this
user's and unwritable by others; anything else is one warning line and a rebuild (or the cache off).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import dill
import pytest
from lm_eval.caching import cache as lm_cache

from mpitp.evaluation.checks import task_manager
from mpitp.evaluation.requestcache import cache_dir, used
from mpitp.evaluation.settings import EvalConfig
from mpitp.tasks import index

OTHER_UID = 65534  # nobody: a file of another user's can be made only as root
NAME = "requests-arc_easy_local-0shot-rank0-world_size1"


class Payload:
    """Unpickling this runs ``os.mkdir(marker)``: the stand-in for any code a planted pickle runs."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _plant(folder: Path, marker: Path, mode: int = 0o644) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / os.path.basename(lm_cache._cache_file_path(NAME))  # the name lm-eval loads NAME from
    target.write_bytes(dill.dumps(Payload(str(marker))))
    os.chmod(target, mode)
    return target


def _as_the_runner(cfg, tm):
    """What the runner does (``_lm_eval_kwargs`` then ``_simple_evaluate``), down to lm-eval's own loader."""
    path = cache_dir(cfg, tm, "tok")
    if path is not None:
        with used(path):
            lm_cache.load_from_cache(NAME, cache=True)
    return path


@pytest.fixture
def setup(test_tasks, tmp_path, monkeypatch, caplog):
    cfg = EvalConfig(tasks=["arc_easy_local"], num_fewshot=0, seed=1)
    tm = task_manager(cfg.tasks, [test_tasks])
    root = tmp_path / "requests"
    monkeypatch.setenv("MPITP_REQUEST_CACHE", str(root))
    caplog.set_level(logging.INFO, logger="mpitp")
    from mpitp.evaluation.requestcache import request_key

    return cfg, tm, root, root / request_key(cfg, tm, "tok"), tmp_path / "code-ran"


def test_request_cache_in_a_folder_others_can_write_is_not_used(setup, caplog):
    """A group-writable cache root (a shared ``MPITP_REQUEST_CACHE``) with a pickle planted where lm-eval loads: the
    cache is off for the run (one warning line) and the pickle is never loaded. Before: loaded, its code ran."""
    cfg, tm, root, keyed, marker = setup
    _plant(keyed, marker)
    os.chmod(root, 0o777)
    assert _as_the_runner(cfg, tm) is None
    assert not marker.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"request cache off: the folder {root} is writable by its group and others (mode 777); "
                        "lm-eval's cache files are pickles, and loading one runs its code"], warnings


@pytest.mark.parametrize("owner", ["group-writable", "another user"])
def test_request_cache_file_not_ours_alone_is_removed_and_rebuilt(setup, caplog, owner):
    """A private folder, but a cache file writable by others (or another user's: only as root): removed before
    lm-eval looks (one warning line), so lm-eval builds it again; a good file of ours beside it stays."""
    cfg, tm, root, keyed, marker = setup
    if owner == "another user" and os.geteuid() != 0:
        pytest.skip("making another user's file needs root")
    os.makedirs(keyed, mode=0o700)
    os.chmod(root, 0o700)
    planted = _plant(keyed, marker, 0o666 if owner == "group-writable" else 0o644)
    if owner == "another user":
        os.chown(planted, OTHER_UID, -1)
    good = keyed / "requests-other.pickle"
    good.write_bytes(dill.dumps([1, 2]))
    os.chmod(good, 0o644)
    assert _as_the_runner(cfg, tm) == str(keyed)
    assert not marker.exists() and not planted.exists() and good.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    why = "is writable by its group and others (mode 666)" if owner == "group-writable" else \
        f"belongs to uid {OTHER_UID}, not to this user (uid {os.geteuid()})"
    assert warnings == [f"request cache: cache file {planted} {why}: removed (lm-eval's cache files are pickles, "
                        "and loading one runs its code), lm-eval builds it again"], warnings


def test_request_cache_folders_are_made_private_and_files_kept_private_under_umask_002(setup, caplog):
    """The folders mpitp makes are 0o700 (lm-eval's makedirs would give 0o775 under ``umask 002``), and the files
    lm-eval writes there lose group write after the run, so the next run keeps them instead of rebuilding."""
    cfg, tm, root, keyed, _ = setup
    old = os.umask(0o002)
    try:
        path = cache_dir(cfg, tm, "tok")
        with used(path):
            lm_cache.save_to_cache(NAME, ["built"])
    finally:
        os.umask(old)
    assert path == str(keyed) and (root.stat().st_mode & 0o777, keyed.stat().st_mode & 0o777) == (0o700, 0o700)
    (written,) = keyed.iterdir()
    assert written.stat().st_mode & 0o777 == 0o664 & ~0o020
    assert cache_dir(cfg, tm, "tok") == str(keyed) and written.exists()
    with used(path):
        assert lm_cache.load_from_cache(NAME, cache=True) == ["built"]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_request_cache_temporaries_of_killed_writes_go_once_old_and_a_live_one_stays(setup, caplog):
    """A write killed between its temporary and the rename leaves ``.NAME.XXXXXXXX.tmp`` in the cache folder, and
    nothing else ever removed it. The next run's check removes the ones older than ``TEMP_AGE_S`` and keeps a younger
    one (another run of the same job may be writing it now), the cache file itself, and an old file whose name is not
    a temporary's."""
    from mpitp.evaluation.requestcache import TEMP_AGE_S
    from mpitp.results.safefile import temp_beside

    cfg, tm, root, keyed, _ = setup
    path = cache_dir(cfg, tm, "tok")
    with used(path):
        lm_cache.save_to_cache(NAME, ["built"])
    (written,) = keyed.iterdir()
    temps = []
    for age in (TEMP_AGE_S + 60, TEMP_AGE_S - 60):
        fd, temp = temp_beside(str(written), 0o600)
        os.write(fd, b"half a pickle")
        os.close(fd)
        os.utime(temp, (time.time() - age,) * 2)
        temps.append(Path(temp))
    other = keyed / "notes.old.tmp"  # not of temp_beside's pattern: stays, whatever its age
    other.write_bytes(b"")
    os.utime(other, (0, 0))
    assert cache_dir(cfg, tm, "tok") == str(keyed)
    assert sorted(keyed.iterdir()) == sorted([written, temps[1], other])
    with used(path):
        assert lm_cache.load_from_cache(NAME, cache=True) == ["built"]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------------------------ task index

@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    """An include path of 64 one-line task YAMLs (the smallest tree that is cached), and a fresh cache folder."""
    root = tmp_path / "tree"
    root.mkdir()
    for i in range(index.MIN_FILES):
        (root / f"t{i}.yaml").write_text(f"task: t{i}\ndataset_path: json\noutput_type: loglikelihood\n")
    monkeypatch.setenv("MPITP_TASK_INDEX_CACHE", str(tmp_path / "task-index"))
    monkeypatch.setattr(index, "_tree_memo", {})
    index.counters.clear()
    return root


def _plant_swap(cache: Path) -> Path:
    """The cache file as lm-eval would have it, with t0 and t1 naming each other's YAML (both inside the tree:
    the old validation accepted it)."""
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    rows = {e[0]: e for e in data["entries"]}
    rows["t0"][2], rows["t1"][2] = rows["t1"][2], rows["t0"][2]
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("planted", ["folder others can write", "file others can write", "another user's file"])
def test_task_index_cache_others_could_write_is_ignored(tree, planted, caplog):
    """A planted index that sends task t0 to t1.yaml: ignored (one warning line) and the tree indexed by lm-eval,
    so t0 runs t0.yaml; a cache file that is ours alone again is read (a hit)."""
    if planted == "another user's file" and os.geteuid() != 0:
        pytest.skip("making another user's file needs root")
    cache = tree.parent / "task-index"
    index.task_manager(str(tree), include_defaults=False)
    assert index.counters["walks"] == 1
    made = cache.stat().st_mode & 0o777
    path = _plant_swap(cache)
    if planted == "folder others can write":
        os.chmod(cache, 0o777)
    elif planted == "file others can write":
        os.chmod(path, 0o666)
    else:
        os.chown(path, OTHER_UID, -1)
    index._tree_memo.clear()
    caplog.set_level(logging.INFO, logger="mpitp")
    tm = index.task_manager(str(tree), include_defaults=False)
    assert tm.task_index["t0"].yaml_path == tree / "t0.yaml" and tm.task_index["t1"].yaml_path == tree / "t1.yaml"
    assert index.counters["walks"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = {
        "folder others can write": f"task index cache not used: the folder {cache} is writable by its group and "
                                   "others (mode 777); a cache file others can write could name another YAML for a "
                                   "task (lm-eval indexes the tasks itself)",
        "file others can write": f"task index cache file {path} is writable by its group and others (mode 666): "
                                 "ignored, rebuilding it",
        "another user's file": f"task index cache file {path} belongs to uid {OTHER_UID}, not to this user (uid "
                               f"{os.geteuid()}): ignored, rebuilding it"}[planted]
    assert warnings == [expected], warnings
    assert made == 0o700  # the folder mpitp made: nobody else's to write
    if planted != "folder others can write":  # rebuilt as ours, 0o644 whatever the umask: read back next time
        assert path.stat().st_uid == os.geteuid() and path.stat().st_mode & 0o777 == 0o644
        index._tree_memo.clear()
        index.task_manager(str(tree), include_defaults=False)
        assert index.counters["walks"] == 2 and index.counters["hits"] == 1


# ------------------------------------------------------------------------------------------------ environment record
@pytest.fixture()
def env_cache(tmp_path, monkeypatch):
    """An empty mpitp cache; the child that computes torch's ``collect_env`` counted (it is what the cache saves)."""
    from mpitp.evaluation import envinfo

    monkeypatch.setenv("MPITP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MPITP_ENV_INFO_CACHE", raising=False)
    started = []
    real = envinfo.env_info_isolated
    monkeypatch.setattr(envinfo, "env_info_isolated", lambda: started.append(1) or real())
    return envinfo, started


def test_environment_record_is_kept_and_a_copy_others_could_write_is_not_stored(env_cache):
    """lm-eval stores torch's ``collect_env`` text in the results; mpitp keeps it per machine and installation
    (5 s of CPU a launch otherwise). Kept: the second run starts no child and stores the same text. A cache file
    others can write, another key, a link, or an old one: recomputed, never stored as this run's environment."""
    envinfo, started = env_cache
    first = envinfo.env_info()
    assert "PyTorch version" in first and started == [1]
    path = envinfo.cache_file()
    assert path.is_file() and not path.stat().st_mode & 0o022
    assert envinfo.env_info() == first and started == [1]  # kept: no child

    planted = json.dumps({"key": envinfo._key(), "text": "PyTorch version: PLANTED"})
    for make in ("group-writable", "another key", "a link", "old"):
        path.unlink()
        if make == "a link":
            target = path.with_name("elsewhere.json")
            target.write_text(planted)
            path.symlink_to(target)
        else:
            path.write_text(planted if make != "another key" else planted.replace('"key": [', '"key": [0, '))
            os.chmod(path, 0o664 if make == "group-writable" else 0o644)
            if make == "old":
                os.utime(path, (0, 0))
        assert envinfo.cached(path) is None, make
    assert envinfo.cached(path.with_name("elsewhere.json")) == "PyTorch version: PLANTED"  # the check can pass
