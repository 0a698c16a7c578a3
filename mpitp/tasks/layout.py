"""Any lm-eval task from local files: the generic ``--data-dir`` layout, derived from lm-eval's own task configs.

:mod:`mpitp.tasks.offline` describes six stock tasks by hand. Every other ConfigurableTask names its data the same
way (``dataset_path``, ``dataset_name`` and the split keys of its YAML), so a data directory laid out with those names
serves any of them without a hand-written table::

    DATA/<dataset_path>/<dataset_name>/<split>.<jsonl|parquet>    e.g. DATA/cais/mmlu/abstract_algebra/test.parquet
    DATA/<dataset_path>/<split>.<jsonl|parquet>                   when the task has no dataset_name

The names asked for (tasks, groups, tags) are expanded through lm-eval's index (:mod:`mpitp.tasks.index`: cached,
no 15 s walk) to their leaf tasks; each leaf's config is its YAML with includes resolved, as lm-eval parsed it. Each
override YAML ``include``s the stock one and only replaces where the data comes from (``dataset_path: json`` or
``parquet`` with absolute ``data_files``), as :mod:`mpitp.tasks.offline` does and for the same reasons (tags
dropped, absolute include, ``!function`` hooks kept).

Which splits a task needs (the others are set to ``null`` when DATA lacks them, as lm-eval would otherwise ask for a
split that is not there): the split it evaluates (``test_split`` when the YAML names one, else ``validation_split``:
lm-eval's ``eval_docs`` order; evaluating on validation because test is missing would be another benchmark), and
with few-shot examples (the YAML's ``num_fewshot`` or ``--num_fewshot`` > 0) the split they are drawn from
(``fewshot_split``, else ``training_split``, else ``validation_split``, lm-eval's ``fewshot_docs`` order).

A task whose dataset folder ``DATA/<dataset_path>`` does not exist is left to lm-eval (a warm HF cache may have it;
``mpitp check`` says whether it does); one whose folder exists but lacks a needed split is an error naming the file.
Tasks that read no Hub dataset (a local ``json``/``csv``/... loader, a ``custom_dataset``, a Python task class) are
left as they are.

**Group members given as inline dicts** (a group YAML whose ``task:`` list holds ``{task: X, dataset_name: Y, ...}``
or a whole inline task config): lm-eval builds such a member with the dict's keys (and the group's own non-group
keys) laid over task ``X``'s config, so the member reads ``DATA/<its dataset_path>/<its dataset_name>/``, and an
override of ``X`` alone would be overridden again by the group's dict. Such members are served by an override of the
*group*: a YAML of the same group name that ``include``s the stock group YAML and replaces its ``task:`` list with
the same list, the served dicts' data keys pointing at DATA. An inline member (a name not in the index) is named
``<group>::<task>``, as lm-eval names it. An inline member whose dict holds a ``!function`` hook cannot be moved out
of its folder and is reported, not served.

A data directory is untrusted input (see :mod:`mpitp.tasks.offline`): the override YAMLs are written by
``yaml.safe_dump`` alone, and a data directory or split file whose path holds a control character is refused by name
(:func:`mpitp.tasks.offline.refuse_unsafe`).

nltk data (``punkt_tab`` for ifeval, ...) lives in ``DATA/nltk_data`` (:data:`NLTK_FOLDER`): ``mpitp prefetch`` puts
it there, and ``mpitp check``, ``mpitp eval --data-dir`` and ``mpitp submit``'s scripts put that folder first on
``NLTK_DATA`` (:func:`use_nltk_data`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mpitp.tasks.offline import SPLIT_KEYS, DataDirError, UnsafeName, refuse_unsafe, resolved, safe_data_dir

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

EXTENSIONS = ("jsonl", "parquet")
"""File formats of the generic layout, in the order tried: ``<split>.jsonl`` wins over ``<split>.parquet``."""
_LOADER = {"jsonl": "json", "parquet": "parquet"}
_LOCAL_LOADERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "imagefolder", "audiofolder"}
DATA_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset", *SPLIT_KEYS)
"""The task-config keys that decide what a task reads: the ones an inline group member's dict may override."""
NLTK_FOLDER = "nltk_data"


@dataclass(frozen=True)
class LeafTask:
    """One task lm-eval would build, with what it reads: ``splits`` are (task-config key, split name) pairs."""

    name: str
    yaml_path: Path | None
    dataset_path: str | None
    dataset_name: str | None
    splits: tuple[tuple[str, str], ...]
    num_fewshot: int
    hub: bool
    """Whether it reads a Hub dataset by name (the only kind the generic layout serves)."""
    group: str | None = None
    """The group whose ``task:`` list defines this member inline (its data keys in a dict), else None."""
    position: int = -1
    """Its index in that group's ``task:`` list."""

    def folder(self, data_dir: Path) -> Path:
        """Where its split files live under ``data_dir``."""
        base = data_dir / str(self.dataset_path)
        return base / self.dataset_name if self.dataset_name else base

    def needed(self, num_fewshot: int | None = None) -> tuple[str, ...]:
        """The split names without which the task cannot run as the stock one does (see the module docstring)."""
        named = dict(self.splits)
        out = []
        evaluated = named.get("test_split") or named.get("validation_split")
        if evaluated:
            out.append(evaluated)
        shots = self.num_fewshot if num_fewshot is None else num_fewshot
        if shots > 0:
            source = named.get("fewshot_split") or named.get("training_split") or named.get("validation_split")
            if source:
                out.append(source)
        return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class MissingSplit:
    """A split ``task`` needs that DATA lacks: ``file`` is where it should be (``.jsonl``; ``.parquet`` does as
    well), None when the reason is another (one of the six tasks' own folders: ``reason`` says it)."""

    task: str
    split: str | None
    file: Path | None
    reason: str = ""
    fetchable: bool = True
    """Whether ``mpitp prefetch`` can fix it (not so for a file name holding a control character)."""

    def __str__(self) -> str:
        if self.file is None or self.reason:
            return f"task {self.task} {self.reason}"
        return f"task {self.task} needs its {self.split} split: {self.file} (or .parquet) is missing"


@dataclass
class Resolution:
    """The outcome of :func:`resolve`: the override configs to write, what is missing, and what was left alone."""

    configs: dict[str, dict] = field(default_factory=dict)
    missing: list[MissingSplit] = field(default_factory=list)
    """Every needed split absent from DATA."""
    untouched: list[LeafTask] = field(default_factory=list)
    """Leaf tasks not served from DATA (no folder there, or not reading a Hub dataset)."""
    leaves: list[LeafTask] = field(default_factory=list)
    files: dict[str, dict[str, Path]] = field(default_factory=dict)
    """``{leaf task: {split: file}}`` for every leaf DATA serves (through its own override or its group's)."""


def _int(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def leaf_task(name: str, entry) -> LeafTask:
    """The :class:`LeafTask` of one index entry (a TASK or PY_TASK)."""
    from mpitp import compat

    Kind = compat.attribute(f"{compat.TASK_INDEX}.Kind")  # noqa: N806 - lm-eval's enum, under its own name

    cfg = (entry.cfg or {}) if entry.kind == Kind.TASK else {}
    return _leaf(name, cfg, entry.yaml_path, entry.kind == Kind.TASK)


def _leaf(name: str, cfg: dict, yaml_path, configurable: bool, group: str | None = None,
          position: int = -1) -> LeafTask:
    path, dname = cfg.get("dataset_path"), cfg.get("dataset_name")
    hub = (configurable and isinstance(path, str) and path not in _LOCAL_LOADERS
           and not Path(path).is_absolute() and cfg.get("custom_dataset") is None)
    splits = tuple((k, str(cfg[k])) for k in SPLIT_KEYS if cfg.get(k) is not None)
    return LeafTask(name, yaml_path, path, dname if isinstance(dname, str) else None, splits,
                    _int(cfg.get("num_fewshot")), hub, group, position)


def _members(entry) -> list:
    members = (entry.cfg or {}).get("task") or []
    return members if isinstance(members, list) else [members]


def expand(names: Iterable[str], index: dict) -> list[LeafTask]:
    """The leaf tasks of ``names`` (tasks, groups, tags; nested), each once, in order; unknown names are skipped
    (the caller's name check reports them). A group member given as a dict that changes what it reads (or an inline
    task config) is a leaf of its own, with the dict's keys laid over the task's (see the module docstring)."""
    from mpitp import compat

    Kind = compat.attribute(f"{compat.TASK_INDEX}.Kind")  # noqa: N806 - lm-eval's enum, under its own name

    out: dict[tuple, LeafTask] = {}
    seen: set[str] = set()

    def walk(name: str) -> None:
        if name in seen or name not in index:
            return
        seen.add(name)
        entry = index[name]
        if entry.kind in (Kind.TASK, Kind.PY_TASK):
            out[(None, name)] = leaf_task(name, entry)
        elif entry.kind == Kind.TAG:
            for member in sorted(entry.tags):
                walk(member)
        else:  # a group: its `task` list names tasks, groups and tags, or dicts (a task with overrides, inline)
            shared = {k: v for k, v in (entry.cfg or {}).items() if k in DATA_KEYS}  # group-level task overrides
            for pos, item in enumerate(_members(entry)):
                member = item.get("task") if isinstance(item, dict) else item
                if not isinstance(member, str):
                    continue  # an inline sub-group ({group: ...}) not in the index: lm-eval's own business
                over = {**shared, **{k: v for k, v in item.items() if k in DATA_KEYS}} if isinstance(item, dict) \
                    else {}
                base = index.get(member)
                if base is None and isinstance(item, dict):  # an inline task: the dict is its whole config
                    full = f"{name}::{member}"
                    out[(name, full)] = _leaf(full, {**shared, **item}, None, "class" not in item, name, pos)
                elif over and base is not None and base.kind == Kind.TASK:
                    out[(name, member)] = _leaf(member, {**(base.cfg or {}), **over}, base.yaml_path, True, name,
                                                pos)
                else:
                    walk(member)

    for n in names:
        walk(n)
    return list(out.values())


def split_file(folder: Path, split: str) -> Path | None:
    """``folder/<split>.jsonl`` or ``folder/<split>.parquet``, whichever exists first, else None."""
    for ext in EXTENSIONS:
        f = folder / f"{split}.{ext}"
        if f.is_file():
            return f
    return None


def data_keys(leaf: LeafTask, files: dict[str, Path]) -> dict:
    """The task-config keys that make ``leaf`` read ``files`` (``{split: file}``, all of one format)."""
    ext = next(iter(files.values())).suffix.lstrip(".")
    cfg: dict = {"dataset_path": _LOADER[ext], "dataset_name": None,
                 "dataset_kwargs": {"data_files": {s: str(f) for s, f in files.items()}}}
    for key, split in leaf.splits:
        cfg[key] = split if split in files else None
    return cfg


def override(leaf: LeafTask, files: dict[str, Path]) -> dict:
    """The override config of ``leaf`` reading ``files`` (``{split: file}``, all of one format)."""
    return {"include": str(leaf.yaml_path), "task": leaf.name, "tag": None, **data_keys(leaf, files)}


def _function_hook(value, folder: str) -> bool:
    """Whether ``value`` (a member dict as the index parsed it, ``!function`` hooks as paths under the YAML's
    folder) holds a ``!function`` hook."""
    if isinstance(value, dict):
        return any(_function_hook(v, folder) for v in value.values())
    if isinstance(value, list):
        return any(_function_hook(v, folder) for v in value)
    return isinstance(value, str) and value.startswith(folder)


def group_override(group: str, entry, served: dict[int, dict]) -> dict:
    """The override of ``group`` (an index entry) whose members at the positions of ``served`` read DATA: its YAML
    included, its ``task:`` list as lm-eval parsed it with those dicts' data keys replaced."""
    members = []
    for pos, item in enumerate(_members(entry)):
        members.append({**item, **served[pos]} if pos in served else item)
    return {"include": str(entry.yaml_path), "group": group, "task": members}


def resolve(names: Iterable[str], data_dir: str | Path, index: dict, num_fewshot: int | None = None) -> Resolution:
    """What DATA serves for ``names``: an override config per leaf task found there (see the module docstring)."""
    data = safe_data_dir(data_dir)
    res = Resolution(leaves=expand(names, index))
    in_groups: dict[str, dict[int, tuple[str, dict]]] = {}
    for leaf in res.leaves:
        if not leaf.hub or not (data / str(leaf.dataset_path)).is_dir():
            res.untouched.append(leaf)
            continue
        folder = leaf.folder(data)
        found = {s: f for s in dict.fromkeys(s for _, s in leaf.splits) if (f := split_file(folder, s)) is not None}
        absent = [s for s in leaf.needed(num_fewshot) if s not in found]
        try:  # its folder's names come from the task's YAML; checked all the same, as every path written out
            for f in found.values():
                refuse_unsafe(f, "data file")
        except UnsafeName as exc:
            res.missing.append(MissingSplit(leaf.name, None, None, str(exc), fetchable=False))
            continue
        if absent:
            res.missing += [MissingSplit(leaf.name, s, folder / f"{s}.jsonl") for s in absent]
            continue
        if len({f.suffix for f in found.values()}) > 1:  # one loader per task: keep the format of the needed splits
            keep = split_file(folder, leaf.needed(num_fewshot)[0]).suffix
            found = {s: f for s, f in found.items() if f.suffix == keep}
        res.files[leaf.name] = found
        if leaf.group is None:
            res.configs[leaf.name] = override(leaf, found)
            continue
        in_groups.setdefault(leaf.group, {})[leaf.position] = (leaf.name, data_keys(leaf, found))
    for group, served in in_groups.items():
        entry = index[group]
        folder = str(Path(entry.yaml_path or ".").parent) + os.sep
        if entry.yaml_path is not None and not _function_hook(_members(entry), folder):
            res.configs[group] = group_override(group, entry, {pos: keys for pos, (_, keys) in served.items()})
            continue
        for name, _ in served.values():  # its list cannot be written elsewhere: the hooks are relative to its folder
            del res.files[name]
            res.missing.append(MissingSplit(name, None, None, f"is defined inline in group {group}, whose task list "
                                            f"has a !function hook: mpitp cannot rewrite it elsewhere (copy the "
                                            f"group into --include_path with dataset_path: json)"))
    return res


def prefetch_command(tasks: Iterable[str], data_dir: str | Path,
                     include_path: list[str] | tuple[str, ...] | None = ()) -> str:
    """The ``mpitp prefetch`` command that fetches ``tasks`` into ``data_dir``."""
    import shlex

    argv = ["mpitp", "prefetch", "--tasks", ",".join(dict.fromkeys(tasks)), "--data-dir", str(data_dir)]
    for path in include_path or ():
        argv += ["--include_path", str(path)]
    return shlex.join(argv)


def require(res: Resolution, data_dir: str | Path, include_path: list[str] | tuple[str, ...] | None = ()) -> None:
    """Raise :class:`DataDirError` listing every missing split (the run's check: all of them, not the first), with
    the command that fetches them."""
    if res.missing:
        from mpitp.results.untrusted import shown

        more = f" (and {len(res.missing) - 3} more)" if len(res.missing) > 3 else ""
        fetchable = [m.task for m in res.missing if m.fetchable]
        fetch = f"; fetch: {prefetch_command(fetchable, data_dir, include_path)}" if fetchable else ""
        raise DataDirError(f"--data-dir {shown(data_dir)}: " + "; ".join(map(str, res.missing[:3])) + more + fetch)


def _truthy(var: str) -> bool:
    return os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether ``datasets`` may not download (``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE``: compute nodes)."""
    return _truthy("HF_DATASETS_OFFLINE") or _truthy("HF_HUB_OFFLINE")


def in_hf_cache(leaf: LeafTask) -> bool:
    """Whether the HF caches hold anything of ``leaf``'s dataset (``datasets``' own cache, ``<org>___<name>``, or the
    Hub cache, ``datasets--<org>--<name>``), or the name is a local path (``datasets`` reads it from the working
    directory): then lm-eval may well read it offline, which only ``mpitp check`` can tell (it builds the task). Folder
    names only: no import of ``datasets`` on the way to the launch."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    ds_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    path = str(leaf.dataset_path)
    folders = (os.path.join(ds_cache, path.replace("/", "___")),
               os.path.join(hub_cache, "datasets--" + path.replace("/", "--")))
    return any(os.path.isdir(os.path.expanduser(f)) for f in folders) or os.path.exists(path)  # or a local folder


def uncached_hub(leaf: LeafTask, num_fewshot: int | None = None) -> bool:
    """Whether ``leaf`` reads a Hub dataset for splits it needs that nothing local holds (:func:`in_hf_cache`): what
    an offline run cannot read, with or without ``--data-dir``."""
    return leaf.hub and bool(leaf.needed(num_fewshot)) and not in_hf_cache(leaf)


def absent(res: Resolution, data_dir: str | Path) -> list[MissingSplit]:
    """The Hub-reading leaves of ``res`` that are neither in DATA nor in the HF cache: offline, lm-eval would fail on
    them only when it loads the tasks, after the launch."""
    out = []
    for leaf in res.untouched:
        if uncached_hub(leaf):
            where = leaf.folder(resolved(data_dir))
            out.append(MissingSplit(leaf.name, leaf.needed()[0], where / f"{leaf.needed()[0]}.jsonl",
                                    f"reads the Hub dataset {leaf.folder(Path('.')).as_posix()}, which is neither in "
                                    f"--data-dir ({where}/{leaf.needed()[0]}.jsonl or .parquet) nor in the HF cache"))
    return out


def require_cached(names: Sequence[str], include_path: list[str] | tuple[str, ...] | None = None,
                   num_fewshot: int | None = None) -> None:
    """Offline with no ``--data-dir``: raise :class:`DataDirError` naming the tasks whose Hub dataset the HF cache does
    not hold (:func:`in_hf_cache`) and how to fetch them. lm-eval found out only when it loaded the tasks, after the
    launch and the model load: a ``ConnectionError`` traceback ("Couldn't reach 'allenai/ai2_arc' on the Hub
    (OfflineModeIsEnabled)") and an abort, 11 s into a 2-rank run of stories260K."""
    from mpitp.tasks import index as task_index

    lacking = [leaf for leaf in expand(names, task_index.merged_index(include_path)) if uncached_hub(leaf, num_fewshot)]
    if lacking:
        from mpitp.results.untrusted import shown

        first = lacking[0]
        more = f" (and {len(lacking) - 1} more task(s))" if len(lacking) > 1 else ""
        raise DataDirError(shown(
            f"task {first.name} reads the Hub dataset {first.folder(Path('.')).as_posix()}, which is not in the HF "
            f"cache, and datasets may not download (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE){more}: on a node with "
            f"network, {prefetch_command([leaf.name for leaf in lacking], 'DATA', include_path)}, then pass "
            f"--data-dir DATA"))


def nltk_folder(data_dir: str | Path) -> Path:
    """Where nltk data lives in a data directory (``mpitp prefetch`` puts it there)."""
    return resolved(data_dir) / NLTK_FOLDER


def use_nltk_data(data_dir: str | Path) -> str | None:
    """Put ``DATA/nltk_data`` first on nltk's search path: ``NLTK_DATA`` (read by nltk at import) and, when nltk is
    imported already, its documented ``nltk.data.path`` list. The folder, or None when DATA has none."""
    import sys

    folder = nltk_folder(data_dir)
    if not folder.is_dir():
        return None
    parts = [p for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p]
    if str(folder) not in parts:
        os.environ["NLTK_DATA"] = os.pathsep.join([str(folder), *parts])
    data = sys.modules.get("nltk.data")
    if data is not None and str(folder) not in data.path:
        data.path.insert(0, str(folder))
    return str(folder)


def resolve_all(names: Sequence[str], data_dir: str | Path, include_path: list[str] | tuple[str, ...] | None = None,
                num_fewshot: int | None = None) -> Resolution:
    """:func:`resolve` over lm-eval's index plus ``include_path``, the six hand-described tasks of
    :mod:`mpitp.tasks.offline` read from their own folders (``DATA/arc_easy/...``, names as downloaded) first."""
    from mpitp.tasks import index as task_index
    from mpitp.tasks.offline import STOCK_TASKS, split_files, task_config

    res = resolve(names, data_dir, task_index.merged_index(include_path), num_fewshot)
    for t in [n for n in dict.fromkeys(names) if n in STOCK_TASKS and n not in res.configs]:
        generic_missing = [m for m in res.missing if m.task == t]
        try:
            if not split_files(data_dir, t) and generic_missing:
                continue  # its generic folder is there, its own is not: the generic layout's message stands
            # its own folder has files, or neither layout has any: as before the generic layout, named stock tasks
            # are served from their own folders or refused (never left to the Hub)
            res.configs[t] = task_config(t, data_dir)
            res.files[t] = {s: Path(f) for s, f in res.configs[t]["dataset_kwargs"]["data_files"].items()}
        except DataDirError as exc:
            res.missing.append(MissingSplit(t, None, None, str(exc).split(f"task {t} ", 1)[-1],
                                            fetchable=not isinstance(exc, UnsafeName)))
        res.missing = [m for m in res.missing if m not in generic_missing]
        res.untouched = [leaf for leaf in res.untouched if leaf.name != t]
    return res


def write_overrides(names: Sequence[str], data_dir: str | Path, out_dir: str | Path,
                    include_path: list[str] | tuple[str, ...] | None = None, num_fewshot: int | None = None,
                    strict: bool = False) -> dict[str, str]:
    """Write one override YAML per task DATA serves into ``out_dir``; ``{task: yaml_path}``. Raises
    :class:`DataDirError` naming every needed split that is missing, before writing anything; with ``strict``, also
    every Hub dataset that is neither in DATA nor in the HF cache (:func:`absent`: a run that cannot download)."""
    res = resolve_all(names, data_dir, include_path, num_fewshot)
    if strict:
        res.missing += absent(res, data_dir)
    require(res, data_dir, include_path)
    return write_configs(res.configs, out_dir, data_dir)


def write_configs(configs: dict[str, dict], out_dir: str | Path, data_dir: str | Path) -> dict[str, str]:
    """Write ``configs`` (:attr:`Resolution.configs`) as YAMLs into ``out_dir``, with the listing of their names and
    kinds (:func:`mpitp.tasks.index.write_listing`: the folder is indexed without parsing them again);
    ``{name: yaml_path}``. ``data_dir`` is not written into them (no name from it outside ``yaml.safe_dump``'s
    quoting); kept so callers need not change."""
    from mpitp.tasks.index import write_listing
    from mpitp.tasks.offline import write_override

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for task, cfg in configs.items():  # yaml.safe_dump alone: no name is formatted into the file (offline.py)
        written[task] = write_override(out / f"{task.replace('::', '--')}.yaml", cfg)
    write_listing(out, {task: ("GROUP" if "group" in cfg else "TASK", Path(written[task]).name)
                        for task, cfg in configs.items()})
    return written
