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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mpitp.tasks.offline import SPLIT_KEYS, DataDirError

EXTENSIONS = ("jsonl", "parquet")
"""File formats of the generic layout, in the order tried: ``<split>.jsonl`` wins over ``<split>.parquet``."""
_LOADER = {"jsonl": "json", "parquet": "parquet"}
_LOCAL_LOADERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "imagefolder", "audiofolder"}


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

    def __str__(self) -> str:
        if self.file is None:
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


def _int(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def leaf_task(name: str, entry) -> LeafTask:
    """The :class:`LeafTask` of one index entry (a TASK or PY_TASK)."""
    from lm_eval.tasks._index import Kind

    cfg = (entry.cfg or {}) if entry.kind == Kind.TASK else {}
    path, dname = cfg.get("dataset_path"), cfg.get("dataset_name")
    hub = (entry.kind == Kind.TASK and isinstance(path, str) and path not in _LOCAL_LOADERS
           and not Path(path).is_absolute() and cfg.get("custom_dataset") is None)
    splits = tuple((k, str(cfg[k])) for k in SPLIT_KEYS if cfg.get(k) is not None)
    return LeafTask(name, entry.yaml_path, path, dname if isinstance(dname, str) else None, splits,
                    _int(cfg.get("num_fewshot")), hub)


def expand(names, index: dict) -> list[LeafTask]:
    """The leaf tasks of ``names`` (tasks, groups, tags; nested), each once, in order; unknown names are skipped
    (the caller's name check reports them)."""
    from lm_eval.tasks._index import Kind

    out: dict[str, LeafTask] = {}
    seen: set[str] = set()

    def walk(name: str) -> None:
        if name in seen or name not in index:
            return
        seen.add(name)
        entry = index[name]
        if entry.kind in (Kind.TASK, Kind.PY_TASK):
            out[name] = leaf_task(name, entry)
        elif entry.kind == Kind.TAG:
            for member in sorted(entry.tags):
                walk(member)
        else:  # a group: its `task` list names tasks, groups and tags, or inline configs with a `task` name
            members = (entry.cfg or {}).get("task") or []
            for item in members if isinstance(members, list) else [members]:
                member = item.get("task") if isinstance(item, dict) else item
                if isinstance(member, str):
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


def override(leaf: LeafTask, files: dict[str, Path]) -> dict:
    """The override config of ``leaf`` reading ``files`` (``{split: file}``, all of one format)."""
    ext = next(iter(files.values())).suffix.lstrip(".")
    cfg: dict = {"include": str(leaf.yaml_path), "task": leaf.name, "tag": None, "dataset_path": _LOADER[ext],
                 "dataset_name": None, "dataset_kwargs": {"data_files": {s: str(f) for s, f in files.items()}}}
    for key, split in leaf.splits:
        cfg[key] = split if split in files else None
    return cfg


def resolve(names, data_dir: str | Path, index: dict, num_fewshot: int | None = None) -> Resolution:
    """What DATA serves for ``names``: an override config per leaf task found there (see the module docstring)."""
    data = Path(data_dir).expanduser().resolve()
    res = Resolution(leaves=expand(names, index))
    for leaf in res.leaves:
        if not leaf.hub or not (data / str(leaf.dataset_path)).is_dir():
            res.untouched.append(leaf)
            continue
        folder = leaf.folder(data)
        found = {s: f for s in dict.fromkeys(s for _, s in leaf.splits) if (f := split_file(folder, s)) is not None}
        absent = [s for s in leaf.needed(num_fewshot) if s not in found]
        if absent:
            res.missing += [MissingSplit(leaf.name, s, folder / f"{s}.jsonl") for s in absent]
            continue
        if len({f.suffix for f in found.values()}) > 1:  # one loader per task: keep the format of the needed splits
            keep = split_file(folder, leaf.needed(num_fewshot)[0]).suffix
            found = {s: f for s, f in found.items() if f.suffix == keep}
        res.configs[leaf.name] = override(leaf, found)
    return res


def require(res: Resolution, data_dir) -> None:
    """Raise :class:`DataDirError` listing every missing split (the run's check: all of them, not the first)."""
    if res.missing:
        more = f" (and {len(res.missing) - 3} more)" if len(res.missing) > 3 else ""
        raise DataDirError(f"--data-dir {data_dir}: " + "; ".join(map(str, res.missing[:3])) + more)


def resolve_all(names, data_dir, include_path=None, num_fewshot: int | None = None) -> Resolution:
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
        except DataDirError as exc:
            res.missing.append(MissingSplit(t, None, None, str(exc).split(f"task {t} ", 1)[-1]))
        res.missing = [m for m in res.missing if m not in generic_missing]
        res.untouched = [leaf for leaf in res.untouched if leaf.name != t]
    return res


def write_overrides(names, data_dir, out_dir, include_path=None, num_fewshot: int | None = None) -> dict[str, str]:
    """Write one override YAML per task DATA serves into ``out_dir``; ``{task: yaml_path}``. Raises
    :class:`DataDirError` naming every needed split that is missing, before writing anything."""
    import yaml

    res = resolve_all(names, data_dir, include_path, num_fewshot)
    require(res, data_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for task, cfg in res.configs.items():
        target = out / f"{task}.yaml"
        files = ", ".join(f"{s}: {f}" for s, f in cfg["dataset_kwargs"]["data_files"].items())
        target.write_text(f"# Written by mpitp: stock lm-eval task {task} reading {files}.\n"
                          + yaml.safe_dump(cfg, sort_keys=False))
        written[task] = str(target)
    return written
