"""lm-eval's task index, built once per task tree and kept as JSON under the user's cache dir.

``TaskManager()`` YAML-parses every file of lm-eval's task tree (~14.7k in 0.4.13, includes resolved) to learn which
name is a task, a group or a tag and where it lives: 8-16 s on one core, paid by every launch, ``mpitp rescore`` and
sweep while the other ranks wait. The outcome is small (name, kind, YAML path, tags per name), so it is stored, one
file per tree:

- **lm-eval's own tree**, keyed by lm-eval's version and install path; a source (editable) install, whose YAMLs change
  without a new version, is keyed like an include path.
- **an include path**, keyed by its path and the size, modification time and inode of every file under it, and of
  every file outside it that its YAMLs ``include`` (the ``--data-dir`` overrides include the stock YAMLs). A tree of
  fewer than :data:`MIN_FILES` YAMLs is indexed directly every time (milliseconds): ``--data-dir`` writes its
  overrides to a new temporary folder per run, which would otherwise leave a cache file behind each time.

Each tree is indexed by lm-eval itself (``TaskIndex.build([tree])``) and the trees are merged as ``TaskIndex.build``
merges them (a later tree's name replaces an earlier one's, with lm-eval's warning), so a cached index names the same
tasks, groups and tags as a fresh ``TaskManager``. The lm-eval internals used (how a ``TaskManager`` holds its index,
``lm_eval.tasks._index``'s classes) are :mod:`mpitp.compat` targets, checked against the installed version; without
them lm-eval's own ``TaskManager`` builds the index. An entry's parsed config (``Entry.cfg``, which lm-eval itself
reads only for entries without a YAML) is read from its YAML on first use, as lm-eval parsed it.

The cache files are plain JSON, and a cache file names which YAML of the tree a task name runs: one planted by
someone else would quietly run another task under a name. So the cache folder must be this user's and writable by
nobody else (created ``0o700``; otherwise the cache is not used, with one warning line), each cache file a regular
file of this user's that nobody else can write (otherwise ignored with one warning line and rebuilt), and each is
validated on load (size, depth, shape, kinds, every YAML path a ``.yaml`` file inside its tree): anything unexpected
is rebuilt, never trusted (the reading and writing are :mod:`mpitp.results.privatefile`'s, shared with the
environment record). Writes go to an ``O_EXCL`` temporary file in the same folder (mode ``0o644`` less the
umask, never group-writable), then ``os.replace``. ``MPITP_TASK_INDEX_CACHE`` = a
directory (default ``<mpitp cache>/task-index``) or ``0`` (off: lm-eval builds the index every time).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

log = logging.getLogger("mpitp")

FORMAT = 1
MIN_FILES = 64
"""Trees with fewer YAML files are indexed directly, never cached."""
_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # lm-eval's own (lm_eval.tasks._index._IGNORE_DIRS)
_KINDS = ("TASK", "PY_TASK", "GROUP", "TAG")

counters: collections.Counter = collections.Counter()
"""``walks``: trees lm-eval indexed; ``hits``: trees read from the cache; ``rebuilt``: cache files refused on load;
``listed``: folders mpitp wrote, indexed from their listing."""


def cache_dir() -> Path | None:
    from mpitp.tasks.demo import cache_folder

    return cache_folder("MPITP_TASK_INDEX_CACHE", "task-index")


def _lm_eval_version() -> str:
    import lm_eval

    return str(getattr(lm_eval, "__version__", "?"))


def _stock_dir() -> Path:
    from mpitp.tasks.offline import stock_tasks_dir

    return stock_tasks_dir()


def _installed(path: Path) -> bool:
    """Whether ``path`` is inside an installed distribution (its files change only with its version)."""
    return any(part in ("site-packages", "dist-packages") for part in path.parts)


# ------------------------------------------------------------------------------------------------ fingerprints
def _walk(root: Path):
    """(relative path, absolute path) of every file under ``root``, lm-eval's ignored folders left out (and, as
    ``Path.glob("**/*.yaml")`` in lm-eval's walk, folders reached through a symlink)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _IGNORE_DIRS)
        for fn in sorted(filenames):
            full = os.path.join(dirpath, fn)
            yield os.path.relpath(full, root), full


def _stat(path: str) -> list:
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, [st.st_size, st.st_mtime_ns, st.st_ino]]


def _tree_state(root: Path) -> tuple[str, set[str]]:
    """(hash of every file's relative path, size, modification time and inode; the relative ``.yaml`` paths)."""
    h = hashlib.sha256()
    yamls = set()
    for rel, full in _walk(root):
        h.update(json.dumps([rel, _stat(full)[1]]).encode())
        if rel.endswith(".yaml"):
            yamls.add(rel)
    return h.hexdigest(), yamls


def _external_includes(root: Path, yamls: set[str]) -> list[str]:
    """Files outside ``root`` that its YAMLs include, directly or through each other (read as text, not parsed)."""
    from mpitp.tasks.names import key_values

    seen: set[str] = set()
    todo = [str(root / rel) for rel in sorted(yamls)]
    inside = str(root.resolve()) + os.sep
    outside = []
    while todo:
        path = todo.pop()
        for inc in sorted(key_values(path, ("include",))):
            target = os.path.normpath(os.path.join(os.path.dirname(path), os.path.expanduser(inc)))
            real = os.path.realpath(target)
            if real.startswith(inside) or real in seen:
                continue
            seen.add(real)
            outside.append(real)
            if os.path.isfile(real):
                todo.append(real)
    return sorted(outside)


# ------------------------------------------------------------------------------------------------ the cache file
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """One warning line per problem per process (every tree of every TaskManager would repeat it)."""
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _cache_file(root: Path) -> Path | None:
    """The cache file of ``root``; None when the cache is off, or its folder is not this user's alone."""
    from mpitp.results.untrusted import private_dir

    folder = cache_dir()
    if folder is None:
        return None
    problem = private_dir(str(folder))
    if problem:
        _warn_once(str(folder), f"task index cache not used: {problem}; a cache file others can write could name "
                                f"another YAML for a task (lm-eval indexes the tasks itself)")
        return None
    ident = json.dumps([str(root.resolve()), _lm_eval_version(), sys.version_info[:2]])
    return folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


def _load(path: Path, root: Path, key: dict, yamls: set[str] | None) -> tuple[list, list] | None:
    """(deps, entries) stored in ``path`` for ``root`` under ``key``, or None when it is missing, stale or not
    ours."""
    from mpitp.results.privatefile import NotPrivate, read_private_json
    from mpitp.results.untrusted import BadInput

    try:
        data = read_private_json(path, "task index cache")
    except NotPrivate as exc:
        _warn_once(str(path), f"{exc}: ignored, rebuilding it")
        counters["rebuilt"] += 1
        return None
    except BadInput as exc:  # not a regular file, too large, too deep or not JSON
        log.info("task index cache %s refused (%s): rebuilding it", path, exc)
        counters["rebuilt"] += 1
        return None
    except OSError as exc:
        log.info("task index cache %s unreadable (%s): rebuilding it", path, exc)
        counters["rebuilt"] += 1
        return None
    if data is None:
        return None
    try:
        entries = _valid(data, root, key, yamls)
    except (TypeError, ValueError, KeyError) as exc:
        log.info("task index cache %s refused (%s): rebuilding it", path, exc)
        counters["rebuilt"] += 1
        return None
    return entries


def _valid(data, root: Path, key: dict, yamls: set[str] | None) -> tuple[list, list] | None:
    """(deps, entries) if ``data`` is a well-formed index of ``root`` under ``key``; None when stale; raises when
    malformed."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not an mpitp task index")
    if data.get("root") != str(root.resolve()) or data.get("key") != key:
        return None  # another tree or another state of it: stale, not broken
    deps = data.get("deps")
    if not isinstance(deps, list):
        raise ValueError("deps is not a list")
    if not _current(deps):
        return None
    entries = data["entries"]
    if not isinstance(entries, list):
        raise ValueError("entries is not a list")
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and e[0] and e[1] in _KINDS
                and isinstance(e[3], list) and all(isinstance(t, str) for t in e[3])):
            raise ValueError(f"bad entry {str(e)[:80]}")
        rel = e[2]
        if rel is None:
            if e[1] != "TAG":
                raise ValueError(f"{e[0]}: a {e[1]} without a YAML")
            continue
        if not isinstance(rel, str) or not rel.endswith(".yaml") or os.path.isabs(rel) or \
                ".." in Path(rel).parts or (yamls is not None and rel not in yamls):
            raise ValueError(f"{e[0]}: {str(rel)[:80]} is not a YAML of the tree")
    return deps, entries


def _save(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically, never group- or world-writable whatever the umask (the next load
    refuses such a file): :func:`mpitp.results.privatefile.write_private_json`."""
    from mpitp.results.privatefile import write_private_json

    write_private_json(path, data, "task index cache", make_folder=True)


# ------------------------------------------------------------------------------------------------ one tree
def _to_json(index: dict, root: Path) -> list:
    out = []
    for name, e in index.items():
        rel = None if e.yaml_path is None else os.path.relpath(e.yaml_path, root)
        out.append([name, e.kind.name, rel, sorted(e.tags)])
    return out


def _from_json(entries: list, root: Path) -> dict:
    """Fresh entries (lm-eval may set an entry's ``cfg``), over YAML paths built once per cached list: a process
    that builds the index twice (``mpitp check`` resolves the ``--data-dir`` overrides, then makes its
    TaskManager) spends most of the second build on 14,000 ``Path`` joins otherwise."""
    from mpitp import compat

    kind = compat.attribute(f"{compat.TASK_INDEX}.Kind")
    cls = _lazy_entry_class()
    held = _paths_memo.get(id(entries))
    if held is None or held[0] is not entries or held[1] != root:
        held = (entries, root, [None if rel is None else root / rel for _, _, rel, _ in entries])
        _paths_memo[id(entries)] = held
    return {name: cls(name=name, kind=kind[k], yaml_path=path, tags=set(tags))
            for (name, k, _, tags), path in zip(entries, held[2])}


_paths_memo: dict = {}  # id(entries) -> (entries, root, their YAML paths); holding entries keeps the id theirs


_tree_memo: dict = {}  # (root, key) -> entries: a process that builds several TaskManagers reads each file once


def _state(root: Path, stock: bool) -> tuple[Path | None, dict, set[str] | None]:
    """(the cache file for ``root`` or None when it is not cached, the key it must hold, the tree's YAMLs when they
    were listed)."""
    if stock and _installed(root.resolve()):
        return _cache_file(root), {"lm_eval": _lm_eval_version(), "tree": "installed"}, None
    digest, yamls = _tree_state(root)
    path = _cache_file(root) if len(yamls) >= MIN_FILES else None
    return path, {"lm_eval": _lm_eval_version(), "tree": digest}, yamls


def _cached(root: Path, path: Path | None, key: dict, yamls: set[str] | None) -> list | None:
    if path is None:
        return None
    memo_key = (str(root.resolve()), json.dumps(key, sort_keys=True))
    deps, entries = _tree_memo.get(memo_key, (None, None))
    if entries is not None and _current(deps):
        return entries
    data = _load(path, root, key, yamls)
    if data is None:
        return None
    _tree_memo[memo_key] = data
    return data[1]


def _current(deps: list) -> bool:
    """Whether every file outside the tree that it includes is as it was when the tree was indexed."""
    return all(_stat(str(d[0])) == d for d in deps)


LISTING = ".mpitp-listing.json"
"""Beside the task YAMLs mpitp writes itself (the ``--data-dir`` overrides, one folder per run): each YAML's name and
kind, known when it was written, so the folder is indexed without lm-eval parsing every YAML (and its includes)
again. Checked against the folder's YAMLs; anything else and lm-eval indexes the folder as usual."""


def write_listing(root: str | Path, entries: dict[str, tuple[str, str]]) -> None:
    """Write the :data:`LISTING` of ``root``: ``{name: (kind, file name)}`` of every YAML in it."""
    from mpitp.results.safefile import write_replace

    data = {"format": FORMAT, "entries": [[n, kind, rel] for n, (kind, rel) in sorted(entries.items())]}
    write_replace(str(Path(root) / LISTING), json.dumps(data).encode())


def _listed(root: Path) -> dict | None:
    """The index of ``root`` from its :data:`LISTING`, or None when there is none or it does not match the folder
    (every entry a ``TASK`` or ``GROUP`` naming a ``.yaml`` file directly in it, every such file listed once)."""
    from mpitp.results.untrusted import load_json, read_regular

    if not os.path.lexists(root / LISTING):
        return None
    try:
        data = load_json(read_regular(str(root / LISTING), "the listing", follow=False), str(root / LISTING))
        entries = data["entries"]
        yamls = {f for f in os.listdir(root) if f.endswith(".yaml")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(entries, list):
        return None
    ok = all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and e[0] and e[1] in ("TASK", "GROUP")
             and isinstance(e[2], str) and e[2] in yamls for e in entries)
    if not ok or sorted(e[2] for e in entries) != sorted(yamls):
        return None
    counters["listed"] += 1
    return _from_json([[name, kind, rel, []] for name, kind, rel in entries], root)


def tree_index(root: str | os.PathLike, *, stock: bool = False) -> dict:
    """``{name: Entry}`` of one tree, as ``TaskIndex.build([root])`` returns it, from the cache when it is current
    (or from the :data:`LISTING` of a folder mpitp wrote)."""
    from mpitp import compat

    root = Path(root)
    if not stock and (listed := _listed(root)) is not None:
        return listed
    path, key, yamls = _state(root, stock)
    entries = _cached(root, path, key, yamls)
    if entries is not None:
        counters["hits"] += 1
        return _from_json(entries, root)
    counters["walks"] += 1
    deps = [] if path is None or yamls is None else [_stat(p) for p in _external_includes(root, yamls)]
    index = compat.attribute(f"{compat.TASK_INDEX}.TaskIndex").build([root])
    if path is not None:
        entries = _to_json(index, root)
        _save(path, {"format": FORMAT, "root": str(root.resolve()), "key": key, "deps": deps, "entries": entries})
        _tree_memo[(str(root.resolve()), json.dumps(key, sort_keys=True))] = (deps, entries)
    return index


def is_cached(root: str | os.PathLike | None = None) -> bool:
    """Whether lm-eval's tree (``root=None``) or ``root`` would be read from the cache now (the read is kept: the
    next :func:`task_manager` does not read the file again)."""
    stock = root is None
    root = Path(_stock_dir() if stock else root)
    if cache_dir() is None or not _supported():
        return False
    return _cached(root, *_state(root, stock)) is not None


# ------------------------------------------------------------------------------------------------ the manager
def merged_index(include_path: str | list[str] | tuple[str, ...] | None = None, include_defaults: bool = True) -> dict:
    """``TaskIndex.build`` of lm-eval's tree (unless ``include_defaults`` is false) then each include path, merged
    as lm-eval merges them: a later tree's name replaces an earlier one's, with lm-eval's own warning."""
    from mpitp import compat

    lm_index_log = compat.attribute(f"{compat.TASK_INDEX}.log")
    trees = ([(_stock_dir(), True)] if include_defaults else []) + [(Path(p), False) for p in _paths(include_path)]
    index: dict = {}
    for root, stock in trees:
        for name, entry in tree_index(root, stock=stock).items():
            if name in index:
                lm_index_log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                     index[name].yaml_path)
            index[name] = entry
    return index


def _paths(include_path) -> list:
    if not include_path:
        return []
    return list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]


def task_manager(include_path: str | list[str] | tuple[str, ...] | None = None, include_defaults: bool = True,
                 metadata: dict | None = None) -> TaskManager:
    """lm-eval's ``TaskManager(include_path=..., include_defaults=..., metadata=...)`` with its index from the cache
    (lm-eval's own constructor when the cache is off or the installed lm-eval holds its index differently)."""
    from lm_eval.tasks import TaskManager

    from mpitp import compat

    if cache_dir() is None or not _supported():
        counters["walks"] += len(_paths(include_path)) + bool(include_defaults)
        return TaskManager(include_path=include_path or None, include_defaults=include_defaults, metadata=metadata)
    index = merged_index(include_path, include_defaults)
    tm = TaskManager(include_path=None, include_defaults=False, metadata=metadata)  # an empty index: no walk
    tm.include_path = include_path or None
    compat.adopt_task_index(tm, index)
    return tm


def self_contained(tm: TaskManager, names) -> bool:
    """Whether ``tm`` (built from an include path without lm-eval's own tasks) can build every task of ``names`` by
    itself: each a task or a tag in it (a tag gathers the include path's tasks that carry it: what mpitp has always
    run for a tag of an include path), or a group of it whose members are (recursively). Otherwise the run needs
    lm-eval's index too: a group may list a stock task by name (``- task: copa`` with other data keys), which
    without lm-eval's index builds as nothing (lm-eval's ``TypeError``)."""
    from mpitp import compat

    kind = compat.attribute(f"{compat.TASK_INDEX}.Kind")
    index, pending, seen = tm.task_index, list(names), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        entry = index.get(name)
        if entry is None or entry.kind not in (kind.TASK, kind.PY_TASK, kind.TAG, kind.GROUP):
            return False
        if entry.kind == kind.GROUP:
            members = (entry.cfg or {}).get("task")
            for m in members if isinstance(members, list) else [members]:
                member = m.get("task") if isinstance(m, dict) else m
                if not isinstance(member, str):
                    return False
                if isinstance(m, dict) and member not in index and "dataset_path" in m and "output_type" in m:
                    continue  # a task defined whole in the group's own list (data and output type its own)
                pending.append(member)
    return True


#: The lm-eval internals the cached index needs (:mod:`mpitp.compat`); without one, lm-eval builds the index.
_INTERNALS = ("lm_eval.tasks.TaskManager", "lm_eval.tasks._yaml_loader.load_yaml",
              *(f"lm_eval.tasks._index.{n}" for n in ("TaskIndex", "Entry", "Kind", "log")))


def _supported() -> bool:
    """lm-eval 0.4 with the ``TaskIndex`` / ``TaskManager._index`` layout (0.4.10 and later, checked on 0.4.13)."""
    from mpitp import compat

    if not _lm_eval_version().startswith("0.4.") or not compat.available(*_INTERNALS):
        return False
    entry = compat.attribute(f"{compat.TASK_INDEX}.Entry")
    return list(entry.__dataclass_fields__) == ["name", "kind", "yaml_path", "cfg", "tags"]


_LAZY = None


def _lazy_entry_class():
    """lm-eval's ``Entry`` whose ``cfg`` is parsed from its YAML on first use, as ``TaskIndex.build`` parsed it."""
    global _LAZY
    if _LAZY is None:
        from mpitp import compat

        entry, kind = compat.attribute(f"{compat.TASK_INDEX}.Entry"), compat.attribute(f"{compat.TASK_INDEX}.Kind")
        load_yaml = compat.attribute("lm_eval.tasks._yaml_loader.load_yaml")

        class CachedEntry(entry):
            @property
            def cfg(self) -> dict | None:
                if self._cfg is None and self.yaml_path is not None and self.kind != kind.TAG:
                    self._cfg = load_yaml(self.yaml_path, resolve_func=False, recursive=True)
                return self._cfg

            @cfg.setter
            def cfg(self, value: dict | None) -> None:
                self._cfg = value

        _LAZY = CachedEntry
    return _LAZY
