"""lm-eval's own request cache (``simple_evaluate(cache_requests=True)``), keyed by everything that shapes requests.

Building requests (documents, few-shot contexts, ``construct_requests``) is serial work on global rank 0 before any
DP group gets a chunk: about 2.8 s per 10k hellaswag requests. lm-eval can pickle the built ``Instance`` lists and
reuse them, but its cache file name holds only the task name, few-shot count, rank/world size and (with chat
templates) the tokenizer: an edited task YAML, another data file, seed or lm-eval version would be served stale
requests. So mpitp points lm-eval's cache directory (``lm_eval.caching.cache.PATH``) at a folder named by a hash of
all of those, and lm-eval keeps doing the building, pickling and slicing itself.

On only for full runs (no ``--limit``): with a limit lm-eval builds *every* document once to fill the cache, which
would make a small run slower. ``MPITP_REQUEST_CACHE`` = a directory (default ``~/.cache/mpitp/requests``) or ``0``
(off). Only plain tasks are cached (a group's subtasks live in other YAMLs than the name asked for).

lm-eval's cache files are ``dill`` pickles, and loading a pickle runs whatever code it names: a cache file someone
else could write is their code running as this user. So the cache is used only from folders of this user's that
nobody else can write (the root and the keyed folder, created ``0o700``; otherwise the cache is off for the run, one
warning line), and a file in the keyed folder that is not a regular file of this user's, unwritable by others, is
removed (one warning line) before lm-eval looks, so lm-eval builds and writes it again. The files lm-eval writes
get the umask's mode; group and world write are taken off them after the run (:func:`used`), so ``umask 002`` does
not make the next run throw them away.

Writing the file is serial work too, and lm-eval's was most of it: ``dill.dumps`` pickles with Python's pure-Python
pickler (2.4 s for full hellaswag's 40,168 requests on this project's 2-core VM, while every DP group waits), the C
pickler makes a file of the same size in 0.15 s, and lm-eval's ``dill.loads`` reads either. So inside :func:`used`
lm-eval's ``save_to_cache`` is :func:`_save`: the C pickler (lm-eval's own save where it cannot pickle an object,
such as a function defined in a task's code), the file written atomically and private to this user.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import logging
import os
import re
import stat
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

    from mpitp.evaluation.settings import EvalConfig

log = logging.getLogger("mpitp")

_PATH_RE = re.compile(r"(/[^\s'\"\],}]+)")


def cache_root() -> str | None:
    v = os.environ.get("MPITP_REQUEST_CACHE", "")
    if v in ("0", "off", "false", "False"):
        return None
    return v or os.path.join(os.path.expanduser("~"), ".cache", "mpitp", "requests")


def _file_digest(h, path: str) -> None:
    """Name and content (not the folder: ``--data-dir`` writes its YAMLs to a new temporary folder every run)."""
    name = os.path.basename(path).encode()
    try:
        with open(path, "rb") as f:
            h.update(name + b"\0" + hashlib.sha256(f.read()).digest())
    except OSError:
        h.update(name + b"\0missing")


def _stat_digest(h, label: str, path: str) -> None:
    """``label`` with the size and modification time of the data file at ``path``: an edit changes the key, and
    reading the file (often large) is not needed for that."""
    st = os.stat(path)
    h.update(f"{label}\0{st.st_size}\0{st.st_mtime_ns}".encode())


def tokenizer_identity(tokenizer: object, name: str) -> str:
    """The tokenizer's part of the key: its name and its chat template (an edited template in the same folder
    renders other prompts under ``--apply_chat_template``; lm-eval's cache file name holds only the name)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return name
    text = json.dumps(template, sort_keys=True, default=str)
    return f"{name}\0chat_template:{hashlib.sha256(text.encode()).hexdigest()}"


def _data_files(value: object) -> list[str]:
    """The files the strings in a task's ``dataset_path`` and ``dataset_kwargs`` name, as absolute paths: a file, the
    files under a folder (``data_dir:``, a local ``dataset_path``) and a glob's matches (``data_files: data/*.jsonl``),
    relative ones against the working directory (as ``datasets`` resolves them). Only a plain file was keyed: a
    changed file under a folder or glob kept the key, and a full run was served the requests of the old documents
    (0.0 acc where lm-eval scores 1.0, or a traceback when the count of documents or choices changed)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _data_files(v)]
    if not isinstance(value, str) or not value or "://" in value:
        return []
    path = os.path.abspath(value)
    found = sorted(glob.glob(path, recursive=True)) if glob.has_magic(path) else [path]
    files = []
    for p in found:
        if os.path.isdir(p):
            files += sorted(os.path.join(top, fn) for top, _, names in os.walk(p) for fn in names)
        elif os.path.isfile(p):
            files.append(p)
    return files


def request_key(cfg: EvalConfig, task_manager: TaskManager, tokenizer_name: str) -> str | None:
    """A hash of everything that shapes the requests of ``cfg.tasks``, or None when they cannot be keyed."""
    import lm_eval

    from mpitp.evaluation.picked import picked_docs
    from mpitp.version import __version__

    h = hashlib.sha256()
    ident = dict(mpitp=__version__, lm_eval=getattr(lm_eval, "__version__", "?"), python=sys.version_info[:2],
                 tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, seed=cfg.seed,
                 apply_chat_template=cfg.apply_chat_template, tokenizer=tokenizer_name, max_length=cfg.max_length,
                 gen_kwargs=cfg.gen_kwargs, **{k: getattr(cfg, k, None) for k in (
                     "system_instruction", "fewshot_as_multiturn", "metadata", "hflm_args")})
    # the documents lm-eval builds: [7, 3] and [3, 7, 7] are one set of requests (None as before: other keys kept)
    ident["samples"] = None if cfg.samples is None else picked_docs(cfg.samples)
    h.update(json.dumps(ident, sort_keys=True, default=str).encode())
    index = getattr(task_manager, "task_index", {}) or {}
    for name in cfg.tasks:
        entry = index.get(name)
        if entry is None or getattr(entry.kind, "name", "") not in ("TASK", "PY_TASK") or entry.yaml_path is None:
            return None
        h.update(json.dumps(entry.cfg, sort_keys=True, default=str).encode())
        folder = os.path.dirname(os.path.abspath(entry.yaml_path))
        for fn in sorted(os.listdir(folder)):  # the task's YAMLs and its utils.py (doc_to_text, process_docs)
            path = os.path.join(folder, fn)
            if fn.endswith((".yaml", ".yml", ".py", ".jinja")):
                _file_digest(h, path)
            elif not fn.startswith(".") and os.path.isfile(path):  # data beside them (a custom_dataset's file)
                _stat_digest(h, fn, path)
        paths = set(_PATH_RE.findall(json.dumps(entry.cfg, default=str)))
        paths.update(_data_files([(entry.cfg or {}).get(k) for k in ("dataset_path", "dataset_kwargs")]))
        for path in sorted(paths):
            if os.path.isfile(path):  # local data files (--data-dir)
                _stat_digest(h, path, path)
            elif "." in os.path.basename(path) and os.path.isfile(code := path.rpartition(".")[0] + ".py"):
                # ``!function helpers.f`` of a YAML included from another folder (lm-eval names it by the module's
                # path, ``/dir/helpers.f``): an edit of helpers.py there kept the key and served stale requests
                _file_digest(h, code)
    return h.hexdigest()[:24]


def cache_dir(cfg: EvalConfig, task_manager: TaskManager, tokenizer_name: str) -> str | None:
    """This run's request cache folder (None when the cache is off for it)."""
    root = cache_root()
    if root is None or cfg.limit is not None:
        return None
    try:
        key = request_key(cfg, task_manager, tokenizer_name)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be keyed is simply not used
        log.info("request cache off: %s", exc)
        return None
    if key is None:
        return None
    path = os.path.join(root, key)
    return path if _private(path) else None


#: A temporary (:func:`_save` writes beside and renames) older than this has no live writer: writing the largest
#: request file takes seconds, and runs of the same job share the folder, so a younger one may be another's write.
TEMP_AGE_S = 3600.0


def _private(path: str) -> bool:
    """Whether ``path`` (the keyed folder) and its root are folders only this user can write (created so when
    missing), with every file in it this user's and unwritable by others; files that are not are removed (lm-eval
    rebuilds them), and so are the temporaries of writes killed more than :data:`TEMP_AGE_S` ago. False (one warning
    line: the cache is off for this run) when the folders are not private or a file cannot be removed."""
    from mpitp.results.safefile import remove_old_temps
    from mpitp.results.untrusted import private_dir, private_problem, shown

    why = "lm-eval's cache files are pickles, and loading one runs its code"
    problem = private_dir(path, levels=2)
    if problem:
        log.warning("request cache off: %s; %s", problem, why)
        return False
    remove_old_temps(path, TEMP_AGE_S)
    for name in sorted(os.listdir(path)):
        entry = os.path.join(path, name)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            continue
        problem = private_problem(st, f"cache file {shown(entry)}") if stat.S_ISREG(st.st_mode) else \
            f"{shown(entry)} is not a regular file"
        if problem:
            try:
                (os.rmdir if stat.S_ISDIR(st.st_mode) else os.unlink)(entry)
            except OSError as exc:
                log.warning("request cache off: %s and cannot be removed (%s); %s", problem, exc.strerror, why)
                return False
            log.warning("request cache: %s: removed (%s), lm-eval builds it again", problem, why)
    return True


def enable(cfg: EvalConfig, task_manager: TaskManager, tokenizer_name: str) -> dict:
    """``simple_evaluate`` keyword arguments for the request cache (empty when it is off for this run); lm-eval's
    cache directory is then set around the call by :func:`used`."""
    return {"cache_requests": True} if cache_dir(cfg, task_manager, tokenizer_name) else {}


@contextlib.contextmanager
def used(path: str | None) -> Iterator[None]:
    """Inside this block lm-eval's request cache (``lm_eval.caching.cache.PATH``) is ``path``; put back after, and
    the files lm-eval wrote there made unwritable by group and others (it creates them with the umask's mode)."""
    from mpitp import compat

    if path is None:
        yield
        return
    log.info("request cache: %s", path)
    save = functools.partial(_save, compat.attribute("lm_eval.api.task.save_to_cache"))
    try:
        with compat.replaced("lm_eval.caching.cache.PATH", path), compat.replaced("lm_eval.api.task.save_to_cache",
                                                                                   save):
            yield
    finally:
        _tighten(path)


def _save(lm_eval_save: Callable[..., None], file_name: str, obj: object) -> None:
    """lm-eval's ``save_to_cache`` with the C pickler (the module docstring says why): the same file name (lm-eval's
    own ``_cache_file_path``), written beside and renamed into place, mode 0o600; an object the C pickler refuses
    goes to ``lm_eval_save``, lm-eval's own."""
    import pickle

    from mpitp import compat
    from mpitp.results.safefile import write_replace

    try:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            lm_eval_save(file_name=file_name, obj=obj)
            return
        target = compat.attribute("lm_eval.caching.cache._cache_file_path")(file_name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        write_replace(target, data, mode=0o600)
    except OSError as exc:
        # The cache only saves the next run some work: a full disk or quota ended this run with a traceback, its
        # requests already built. The run goes on; one warning per run says why the next one builds them again.
        if not _unsaved:
            log.warning("request cache: cannot save %s (%s); this run goes on, the next builds its requests again",
                        file_name, exc.strerror or exc)
        _unsaved.append(file_name)


#: The requests this process could not save to the cache (:func:`_save`): warned about once.
_unsaved: list[str] = []


def _tighten(path: str) -> None:
    """Take group and world write off this user's regular files in ``path`` (a private folder: nobody else can have
    swapped them), so that the next run's check (:func:`_private`) keeps them."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        entry = os.path.join(path, name)
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
        except OSError:
            pass
        finally:
            os.close(fd)
