"""Stage folders that are this user's alone: opened without following links, checked, verified, written atomically.

A stage's name and key are computed from public facts, so on a shared node (``DIR`` on a sticky 1777 ``/tmp``)
anyone can create ``DIR/<name>-<key>/`` first, with a marker and zeroed weights (or a ``modeling_*.py`` for
``trust_remote_code``) of the right sizes. Every name in a stage is used relative to a descriptor opened
``O_NOFOLLOW`` (a symlink in DIR, to a folder elsewhere or in place of a file, is passed over or replaced, never
followed), and checked by ``fstat`` on the descriptors read:

- **A stage is used only if it is yours and private**: the folder (opened ``O_NOFOLLOW``), any subfolder, the marker
  and every file, checked by ``fstat`` on the descriptors read, must belong to this user and be writable by nobody
  else. A stage is never shared between users: each stages their own copy.
- **Anything else is passed over, not refused**: one warning line (logged by rank 0 for every node) names it and the
  stage goes beside it, into ``<name>-<key>-u<uid>``, else a fresh folder with a random suffix (used by this run only).
  Refusing would let anyone stop your runs by creating one folder in ``/tmp``, and you cannot remove another user's
  folder from a sticky directory.
- **``DIR`` itself** must belong to you or root, and be sticky (like ``/tmp``) if group or others can write to it;
  else one line refuses it: another user could rename your checked stage away and put theirs in its place before the
  ranks load it. That includes a sticky ``DIR`` of another user's (anyone can create ``/tmp/mpitp`` first, and a
  sticky folder's owner may still rename what is in it), and a ``DIR`` reached through a link another user made (in
  a group's folder, pointing at a private folder of yours). A ``DIR`` mpitp creates is 0700.
- **Modes**: stage folders are 0700 (an older stage of yours is tightened to 0700 when reused) and files 0600, whatever
  the source's modes and the umask: a model kept in a private folder stays private on the node.
- **Writes**: temp files are created with ``O_EXCL | O_NOFOLLOW`` inside the stage folder, fsync'd and
  ``os.replace``'d into place (:func:`write_atomic`): a reader sees the old file or the whole new one, and a crash
  leaves at most temp files (:func:`remove_temps`).
- **Reuse** (:func:`is_complete`): the marker :data:`MARKER` must match the plan and every staged file must hash to
  the SHA-256 the marker recorded when it was copied (read again through the checked descriptors).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from mpitp import digest
from mpitp.replica.stage_plan import SMALL, StagePlan

if TYPE_CHECKING:
    from collections.abc import Callable

_T = TypeVar("_T")

MARKER = ".mpitp-stage-complete"
"""Written last into a stage folder: JSON with the key, each file's size and the SHA-256 of the bytes copied into it
(``sha256``). A folder without it is incomplete."""
TEMP_PREFIX = ".mpitp-tmp-"
FOLDER_MODE, FILE_MODE = 0o700, 0o600
HASH_THREADS = 4
"""Staged files re-hashed at once on a reuse (hashlib releases the GIL: a sharded checkpoint is read in parallel)."""


def _not_private(st: os.stat_result) -> str | None:
    """Why a stage entry with this ``fstat`` is not this user's alone, or None: it must belong to this user and be
    writable by nobody else (a folder others can write to may hold anything by the time it is loaded)."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _open_root(root: str) -> int:
    """A descriptor of ``DIR`` (created 0700 if missing), refused when another user could swap a stage inside it: its
    owner (other than you or root: anyone can create ``/tmp/mpitp`` first, and a sticky folder's owner may still
    rename what is in it), or anyone when it is writable by group or others without the sticky bit."""
    link = _foreign_link(root)
    if link:  # its target passes the checks below (a folder of yours): the stage went where another user pointed
        raise OSError(f"{link} is a link made by uid {os.lstat(link).st_uid}, not by you (uid {os.geteuid()}) or "
                      f"root: mpitp does not stage through it; give the folder it names yourself")
    os.makedirs(root, FOLDER_MODE, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    mode, uid = stat.S_IMODE(st.st_mode), os.geteuid()
    why = None
    if st.st_uid not in (uid, 0):
        why = f"belongs to uid {st.st_uid}, not to you (uid {uid}) or root: its owner"
    elif mode & 0o022 and not mode & stat.S_ISVTX:
        why = f"can be written by other users and is not sticky (mode {mode:04o}): one of them"
    if why:
        os.close(fd)
        raise OSError(f"{root} {why} could put their own stage in place of yours after mpitp checks it; use a folder "
                      f"of your own (such as '$TMPDIR/mpitp') or one under a sticky folder of root's such as /tmp")
    return fd


def _foreign_link(root: str) -> str | None:
    """The first symbolic link on the way to ``root`` that neither this user nor root made (planted in a folder others
    may write, such as ``project/shared/stage`` pointing at a private folder of yours), or None."""
    path = "/"
    for part in os.path.abspath(root).split(os.sep)[1:]:
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except OSError:
            return None  # missing from here on: created below, 0700
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.geteuid(), 0):
            return path
    return None


def _open_private(dir_fd: int, name: str, create: bool) -> tuple[int | None, str | None]:
    """(a descriptor of folder ``name`` in ``dir_fd``, None), created 0700 first when ``create``; (None, why) when it
    is not a folder of this user's alone (a symlink, not a folder, another user's, writable by others). Opened
    ``O_NOFOLLOW`` and checked by ``fstat`` on the descriptor: what is checked is what is used."""
    if create:
        try:
            os.mkdir(name, FOLDER_MODE, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        return None, "is a symlink" if link else f"is not a directory ({exc.strerror})"
    why = _not_private(os.fstat(fd))
    if why:
        os.close(fd)
        return None, why
    return fd, None


def _claim(rootfd: int, name: str) -> tuple[int | None, str | None]:
    """:func:`_open_private` for a stage folder ``DIR/name`` (created if missing), its mode made 0700."""
    fd, why = _open_private(rootfd, name, create=True)
    if fd is not None and stat.S_IMODE(os.fstat(fd).st_mode) != FOLDER_MODE:
        os.fchmod(fd, FOLDER_MODE)  # a stage of an older mpitp (0755), or a umask that took the owner's bits
    return fd, why


def open_stage(root: str, plan: StagePlan, notes: list[str]) -> tuple[int, str]:
    """(a descriptor of this user's stage folder in ``root``, its name): ``<folder>``, else ``<folder>-u<uid>``, else
    a fresh ``<folder>-<random>``; each one passed over adds a line to ``notes``."""
    rootfd = _open_root(root)
    try:
        for name in (plan.folder, f"{plan.folder}-u{os.geteuid()}"):
            dfd, why = _claim(rootfd, name)
            if dfd is not None:
                if name != plan.folder:
                    notes.append(f"staging into {os.path.join(root, name)} instead")
                return dfd, name
            notes.append(f"{os.path.join(root, name)} {why}: not used as a stage")
        for _ in range(100):
            name = f"{plan.folder}-{secrets.token_hex(4)}"
            try:
                os.mkdir(name, FOLDER_MODE, dir_fd=rootfd)
            except FileExistsError:
                continue
            dfd, why = _claim(rootfd, name)
            if dfd is None:
                raise OSError(f"{os.path.join(root, name)} {why} right after mpitp created it")
            notes.append(f"staging into {os.path.join(root, name)} instead, for this run only (remove the folders "
                         f"above, or choose another --stage-dir)")
            return dfd, name
        raise OSError(f"no free name for a stage folder {plan.folder}-<random> in {root}")
    finally:
        os.close(rootfd)


def _parent(dfd: int, rel: str, create: bool) -> int:
    """A descriptor of the folder holding ``rel`` inside the stage (``dfd`` itself for a top-level file; the caller
    closes any other). Each subfolder goes through :func:`_open_private`, as the stage folder does (``O_NOFOLLOW``,
    this user's alone; created 0700 when ``create``); an ``OSError`` names the first that is not."""
    pfd = dfd
    sub = os.path.dirname(rel)
    for part in sub.split("/") if sub else []:
        try:
            nfd, why = _open_private(pfd, part, create)
        finally:
            if pfd != dfd:
                os.close(pfd)
        if nfd is None:
            raise OSError(f"{sub} in the stage {why}")
        pfd = nfd
    return pfd


def _read_marker(dfd: int) -> dict | None:
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _not_private(st):
            return None
        try:
            marker = json.loads(f.read(SMALL))
        except ValueError:
            return None
    return marker if isinstance(marker, dict) else None


def _staged_sha(dfd: int, rel: str, size: int) -> str | None:
    """The SHA-256 of the staged ``rel``, read through the descriptor checked to be a regular file of this user's
    alone and of the planned size; None when it is not."""
    try:
        pfd = _parent(dfd, rel, create=False)
    except OSError:
        return None
    try:
        fd = os.open(os.path.basename(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=pfd)
    except OSError:
        return None
    finally:
        if pfd != dfd:
            os.close(pfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _not_private(st) or st.st_size != size:
            return None
        h = hashlib.sha256()
        digest.update_fileobj(h, f)
        return h.hexdigest()


def is_complete(dfd: int, plan: StagePlan) -> bool:
    """The marker matches the plan and every file is a regular file of this user's alone, of the planned size, whose
    bytes have the SHA-256 the marker recorded when they were copied (read again now)."""
    marker = _read_marker(dfd)
    if not marker or marker.get("key") != plan.key or not isinstance(marker.get("files"), list) \
            or [tuple(x) if isinstance(x, list) else x for x in marker["files"]] != list(plan.files):
        return False
    recorded = marker.get("sha256")
    if not isinstance(recorded, dict) or any(not isinstance(recorded.get(rel), str) for rel, _ in plan.files):
        return False
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(plan.files)))) as pool:
        found = list(pool.map(lambda f: _staged_sha(dfd, *f), plan.files))
    return all(recorded[rel] == sha for (rel, _), sha in zip(plan.files, found))


def write_atomic(dfd: int, rel: str, fill: Callable[[int], _T]) -> _T:
    """Create a temp file (``O_EXCL``, no symlink followed, mode 0600) beside ``rel``, ``fill(fd)`` it, fsync, rename
    it into place: a reader sees the old file or the whole new one, never a part. Returns what ``fill`` returns."""
    pfd = _parent(dfd, rel, create=True)
    name = os.path.basename(rel)
    tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE, dir_fd=pfd)
        try:  # from here on the temp file is ours: removed if anything fails
            try:
                os.fchmod(fd, FILE_MODE)  # whatever the umask
                out = fill(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException:
            with _quiet():
                os.unlink(tmp, dir_fd=pfd)
            raise
    finally:
        if pfd != dfd:
            os.close(pfd)
    return out


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        return kind is not None and issubclass(kind, OSError)


def remove_temps(dfd: int) -> None:
    """Temp files a killed stage left (older than an hour: a live stage of another job may be writing its own)."""
    for name in os.listdir(dfd):
        if name.startswith(TEMP_PREFIX):
            with _quiet():
                if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime > 3600:
                    os.unlink(name, dir_fd=dfd)


def check_folder(path: str, same_as: os.stat_result | None = None) -> None:
    """Raise ``OSError`` unless ``path`` (not followed if a symlink) is a folder of this user's alone, and the very
    folder ``same_as`` describes when given: the check a rank makes before loading from a stage."""
    st = os.stat(path, follow_symlinks=False)
    why = "is not a directory" if not stat.S_ISDIR(st.st_mode) else _not_private(st)
    if not why and same_as is not None and (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino):
        why = "is no longer the folder mpitp staged into (replaced while it was staged)"
    if why:
        raise OSError(f"{path} {why}")

