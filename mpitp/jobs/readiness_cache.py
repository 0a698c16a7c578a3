"""A kept "ready" verdict of ``mpitp check``'s model half (:mod:`mpitp.jobs.readiness_model`).

Why: the model half is a child interpreter that imports torch and transformers' config and model code to read a
config and a tokenizer of a few kilobytes and, for a split layout, to build the model on the meta device: 3.5-4 s
on a 2-core node, the longest part of a check, for files that rarely change between two checks of one job (a sweep
resubmitted, ``submit`` after ``check``). So a verdict of "ready" is kept, keyed by the spec's model settings (model,
tokenizer, revision, assets, tp, pp, ep, whether an adapter is merged), the working directory, the installation
(Python, the modification times of the package folders on ``sys.path``, every mpitp source file's) and the
environment variables the Hub and transformers read, and it holds only while every folder the check read from
(found with an audit hook in the child: each file it opened, each folder it listed, and the model, tokenizer and
assets folders named) has the same entries with the same ``stat`` (type, size, modification and change times, inode;
links followed): a file added, removed, replaced or written there sends the check to the child again. Problems are
never kept (a fix shows at once), nor a model with ``trust_remote_code`` (its own code could read anything).

A sweep's checkpoints mostly share one architecture and tokenizer: checkpoints whose files the check reads are
byte for byte the same (:func:`content_key`) share one check, and one kept verdict serves them all: each is kept
for its own folder (:func:`keep_shared`), and one of them kept and unchanged answers for the others.

Where: this user's cache (``<mpitp cache>/check``; ``MPITP_CHECK_CACHE=DIR`` moves it, ``=0`` turns it off), the
folder and its files this user's alone, as for the task index: a verdict others could write would send a job to the
queue unchecked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import sys
from pathlib import Path

from mpitp.digest import update_file, update_tree_stat
from mpitp.jobs.readiness_spec import CheckSpec

log = logging.getLogger("mpitp")

FORMAT = 2
#: Folders with more entries than this are not stat'ed on every check: such a verdict is not kept.
MAX_ENTRIES = 4096
_MAX_BYTES = 1 << 20
#: Environment variables that decide where transformers and the Hub look for a model's files, or whether they may
#: fetch them (a list, not a prefix: libraries set others of theirs while the check runs).
_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "XDG_CACHE_HOME", "HOME")


def _mpitp_sources() -> str:
    """A digest of every mpitp source file's path, size and modification time: an edited check is a new key."""
    h = hashlib.sha256()
    update_tree_stat(h, Path(__file__).resolve().parents[1], suffix=".py")
    return h.hexdigest()


def _key(spec: CheckSpec) -> list:
    from mpitp.evaluation.envinfo import installation

    named = [spec.model, spec.tokenizer, spec.hf_assets]
    key = [FORMAT, named, [os.path.realpath(os.path.expanduser(p)) if p else None for p in named], spec.revision,
           spec.tp, spec.pp, spec.ep, bool(spec.peft), os.getcwd(), installation(), _mpitp_sources(),
           [os.environ.get(k) for k in _ENV]]
    return json.loads(json.dumps(key))  # as read back from the file


def _skipped_roots() -> tuple[str, ...]:
    """Where the check's own code lives (keyed by :func:`installation` instead), transformers' kept model scans (a
    function of that installation: a scan another installation keeps there is no input of this check) and the
    kernel's files."""
    from mpitp.importpolicy import kept_folder

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[1])}
    kept = kept_folder()
    if kept is not None:
        roots.update((os.path.abspath(kept), os.path.realpath(kept)))
    # A Python installed at the root ("/") would skip everything: its prefix is then no root to skip.
    return tuple(os.path.join(r, "") for r in roots if os.path.dirname(r) != r) + ("/proc/", "/sys/", "/dev/")


def watch() -> set[str]:
    """From now on, collect into the returned set each file this process opens and each folder it lists, outside the
    Python installation and mpitp (an audit hook: it cannot be removed, so only the model check's child calls
    this)."""
    seen: set[str] = set()
    skip = _skipped_roots()
    path_entries = set(sys.path)

    def hook(event: str, args: tuple) -> None:
        if event not in ("open", "os.listdir", "os.scandir") or not args or isinstance(args[0], int):
            return
        try:
            path = os.path.abspath(os.fsdecode(args[0] if args[0] is not None else "."))
        except (TypeError, ValueError):
            return
        if path not in path_entries and not os.path.join(path, "").startswith(skip):  # a skipped folder itself too
            seen.add(path)

    sys.addaudithook(hook)
    return seen


def folders_read(spec: CheckSpec, seen: set[str]) -> list[str]:
    """The folders a verdict depends on: each folder :func:`watch` saw listed, the folder of each file it saw opened
    that is still there (a temporary file is gone: its folder, ``/tmp``, holds none of the check's input and changes
    all the time), and the model, tokenizer and assets folders the spec names."""
    named = [os.path.expanduser(p) for p in (spec.model, spec.tokenizer, spec.hf_assets) if p]
    folders = [p if os.path.isdir(p) else os.path.dirname(p) for p in seen if os.path.exists(p)]
    return sorted({os.path.realpath(p) for p in [*folders, *named] if os.path.isdir(p)})


def _state(folders: list[str]) -> str | None:
    """A digest of each folder's own ``stat`` and every entry's (links followed); None when one has too many."""
    h = hashlib.sha256()
    for folder in folders:
        try:
            st = os.stat(folder)
            names = sorted(os.listdir(folder))
        except OSError:
            h.update(f"{folder}: gone\n".encode())
            continue
        if len(names) > MAX_ENTRIES:
            return None
        h.update(f"{folder}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}\n".encode())
        for name in names:
            try:
                e = os.stat(os.path.join(folder, name))
                line = f"{stat.S_IFMT(e.st_mode)}:{e.st_size}:{e.st_mtime_ns}:{e.st_ctime_ns}:{e.st_ino}"
            except OSError:
                line = "dangling"
            h.update(f" {name}={line}\n".encode())
    return h.hexdigest()


def _file(spec: CheckSpec) -> tuple[Path, list] | None:
    from mpitp.results.privatefile import keyed_file
    from mpitp.tasks.demo import cache_folder

    if spec.trust_remote_code or not spec.model:
        return None
    try:
        key = _key(spec)
    except OSError:  # the working directory or an mpitp source file gone meanwhile: nothing kept, nothing believed
        return None
    path = keyed_file(cache_folder("MPITP_CHECK_CACHE", "check"), key, "model check verdicts")
    return None if path is None else (path, key)


def kept_ready(spec: CheckSpec) -> bool:
    """Whether a "ready" verdict for ``spec``'s model is kept and every folder it read is as it was."""
    from mpitp.results.privatefile import NotPrivate, read_private_json
    from mpitp.results.untrusted import BadInput

    found = _file(spec)
    if found is None:
        return False
    path, key = found
    try:
        data = read_private_json(path, "model check verdict", max_bytes=_MAX_BYTES)
    except NotPrivate as exc:
        log.warning("%s: ignored, checking the model again", exc)
        return False
    except (BadInput, OSError):
        return False
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("folders"), list) or \
            not all(isinstance(f, str) for f in data["folders"]):
        return False
    state = _state(data["folders"])
    return state is not None and state == data.get("state")


def keep_ready(spec: CheckSpec, folders: list[str]) -> None:
    """Keep "ready" for ``spec``'s model, valid while ``folders`` stay as they are now."""
    from mpitp.results.privatefile import write_private_json

    found = _file(spec)
    state = _state(folders) if found is not None else None
    if state is not None:
        path, key = found
        write_private_json(path, {"key": key, "folders": folders, "state": state}, "model check verdict")


def content_key(spec: CheckSpec) -> str | None:
    """A digest of what the model check reads from ``spec``'s local checkpoint folder: its ``config.json`` and
    tokenizer files (:data:`mpitp.evaluation.fingerprint.TOKENIZER_FILES`), which are present and their bytes, and
    for a torch DCP checkpoint its ``.metadata`` and the assets folder its config comes from. Two checkpoints of one
    spec with the same digest get the same verdict (the weights are not read). None where that cannot be said: not a
    local folder, or ``trust_remote_code`` (the model's own code may read anything)."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.fingerprint import TOKENIZER_FILES
    from mpitp.replica import dcp

    folder = os.path.expanduser(spec.model) if spec.model else None
    if spec.trust_remote_code or folder is None or not os.path.isdir(folder):
        return None
    h = hashlib.sha256()
    names = ["config.json", *TOKENIZER_FILES]
    if dcp.is_dcp(folder):
        try:
            assets = os.path.realpath(dcp.assets_dir(folder, spec.hf_assets))
        except UsageError:  # no config beside it nor in its parent: refused alike, with its own path
            assets = None
        names.append(dcp.METADATA)
        if assets != os.path.realpath(folder):  # a folder all the checkpoints read (or none)
            h.update(f"assets {assets}\n".encode())
    try:
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                h.update(f"{name}\n".encode())
                update_file(h, path)
                h.update(b"\n")
    except OSError:
        return None
    return h.hexdigest()


def keep_shared(checked: CheckSpec, others: list[CheckSpec], folders: list[str]) -> None:
    """Keep "ready" for ``checked`` (whose check read ``folders``) and for each of ``others`` (checkpoints with its
    :func:`content_key`, not checked themselves), each valid while its own folder, in place of ``checked``'s, and the
    other folders read stay as they are now."""
    keep_ready(checked, folders)
    own = os.path.realpath(os.path.expanduser(str(checked.model)))
    for spec in others:
        mine = os.path.realpath(os.path.expanduser(str(spec.model)))
        keep_ready(spec, sorted({mine if f == own else f for f in folders}))
