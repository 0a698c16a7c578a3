"""Creating files in a directory other people may write to (a group's project space, a shared job folder).

Why: a name mpitp writes to that others can predict (``.NAME.claim``, ``NAME.tmp<pid>``, the batch script) is a name
they can plant first, as a symbolic link to a file of the user's; a plain ``open(..., "w")`` then truncates and
overwrites that file, and a ``chmod`` after it changes that file's mode. So every file mpitp creates is new by
construction: ``O_CREAT | O_EXCL | O_NOFOLLOW`` (``mkstemp`` for a temporary, with a random name beside the target),
its mode set with ``fchmod`` on the open descriptor (never on a path), and a replaced target takes the temporary's
place by ``os.replace``, which swaps the directory entry (a link planted at the target is replaced, not followed).

A replacement keeps the mode of the file it replaces (a user's ``chmod 600`` on a results file survives a resume or
a snapshot); a file without a predecessor gets ``0o666`` (``0o700`` for a script, see :func:`script_mode`) less the
umask, as ``open`` would give it.

No mpitp imports: the results writer, the job tools and rescoring all use it.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import time

#: O_NOFOLLOW/O_CLOEXEC are POSIX; 0 where a platform lacks them (then O_EXCL alone still refuses a planted link).
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_SUFFIX = ".tmp"
#: the random part and suffix of :func:`temp_beside`'s names (``mkstemp``'s 8 characters; 12 in files of older versions)
_TEMP_BODY = r"[A-Za-z0-9_]{6,12}" + re.escape(_SUFFIX)


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (``os.umask`` sets it, racing threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def new_mode(target: str | None = None) -> int:
    """The mode for a file that replaces ``target``: the existing regular file's own mode, else ``0o666 & ~umask``.

    A link at ``target`` does not count (``lstat``): its target's mode is not ours to copy.
    """
    if target is not None:
        try:
            st = os.lstat(target)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode) & 0o777  # permissions only: no set-id or sticky bit carried over
    return 0o666 & ~umask()


def script_mode() -> int:
    """``0o700 & ~umask`` for a batch script: executable by its owner only.

    sbatch and qsub read the script as the submitting user and keep their own copy, so nobody else needs to read it,
    and ``--env-setup`` often carries tokens (``export HF_TOKEN=...``); the umask may narrow it further, never widen.
    """
    return 0o700 & ~umask()


def create_new(path: str, mode: int, flags: int = os.O_WRONLY) -> int:
    """Create ``path``, which must not exist (a link there, even a dangling one, counts as existing), and return its
    open descriptor with ``mode`` set on it. Raises :class:`FileExistsError` for anything already at ``path``."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _prefix(target: str) -> tuple[str, str]:
    folder, name = os.path.split(os.path.abspath(target))
    return folder, f".{name}."


def temp_beside(target: str, mode: int | None = None) -> tuple[int, str]:
    """(descriptor, path) of a new temporary in ``target``'s directory, named ``.NAME.XXXXXXXX.tmp`` (random), with
    ``mode`` (default: :func:`new_mode` of ``target``) set on the descriptor, open for reading and writing."""
    folder, prefix = _prefix(target)
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=_SUFFIX, dir=folder)  # O_EXCL | O_NOFOLLOW, mode 0600
    try:
        os.fchmod(fd, new_mode(target) if mode is None else mode)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd, path


def remove_temp(path: str) -> None:
    """Remove the temporary ``path`` a writer created (:func:`write_replace`), after its write failed: left there it
    would hold the very space whose lack may be why the write failed. Only a regular file of this user is removed
    (never a link); one that cannot be removed (a read-only file system) stays, since the write's own error is the
    one to report."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass


#: The errnos of a file system refusing a write (full, over quota, over the file size limit, failing, read-only; the
#: folder removed or its permissions taken away while the run wrote there, a stale NFS handle): a fault of where the
#: file is, not a bug of the writer (the output's folder was checked writable at the start).
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.ENOENT, errno.EACCES,
                          errno.EPERM, errno.ESTALE})
#: How HDF5 quotes the failed system call in the messages h5py raises (as OSError or RuntimeError, errno unset).
_HDF5_ERRNO = re.compile(r"errno = (\d+), error message = '([^']*)'")


def write_failure(exc: BaseException | None) -> tuple[int, str] | None:
    """(errno, its text) where ``exc`` is the operating system refusing a write (:data:`WRITE_ERRNOS`): an
    ``OSError`` carrying it, or h5py's error quoting HDF5's failed write; None for anything else (a bug stays one)."""
    if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:
        return exc.errno, exc.strerror or os.strerror(exc.errno)
    if isinstance(exc, (OSError, RuntimeError)):
        found = _HDF5_ERRNO.search(str(exc))
        if found and int(found.group(1)) in WRITE_ERRNOS:
            return int(found.group(1)), found.group(2) or os.strerror(int(found.group(1)))
    return None


def remove_own_temps(target: str) -> list[str]:
    """Remove the temporaries a killed writer of ``target`` left: only names of :func:`temp_beside`'s pattern that are
    regular files (not links) owned by this user. Call it holding the output's claim (no live writer of ours).

    Anything else beside ``target`` (``NAME.tmpl``, another user's file, a link) is not provably ours and stays.
    """
    folder, prefix = _prefix(target)
    return _remove_own(folder, re.compile(re.escape(prefix) + _TEMP_BODY), 0.0)


def remove_old_temps(folder: str, older_than_s: float) -> list[str]:
    """Remove from ``folder`` the temporaries of :func:`temp_beside` (any target's) that are this user's regular
    files last written more than ``older_than_s`` seconds ago: those of writers killed mid-write, in a folder where
    no claim says whether a writer is still live (a cache several runs write), so only age tells."""
    return _remove_own(folder, re.compile(r"\..+\." + _TEMP_BODY), older_than_s)


def _remove_own(folder: str, pattern: re.Pattern, older_than_s: float) -> list[str]:
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not pattern.fullmatch(name):
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime >= older_than_s:
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in ``path``'s directory durable (a no-op where directories cannot be opened)."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_problem(target: str) -> str | None:
    """Why :func:`write_replace` cannot or must not put a new file at ``target`` (None when it can): asked before the
    work whose product it writes, so that a mistyped ``-o`` costs no traceback and nothing computed. A device, FIFO
    or socket there is refused: the rename would replace it (as root, ``-o /dev/stdout`` replaced the system's)."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return exc.strerror or str(exc)
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        return "is not a regular file (a device, FIFO or socket)"
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        return f"{folder} is not a directory" if os.path.exists(folder) else f"no such directory {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot create files in {folder}"
    return None


def write_replace(target: str, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``target`` atomically: a new temporary beside it (:func:`temp_beside`), fsync'd, then
    ``os.replace`` and the directory fsync'd. ``mode`` defaults to the replaced file's (or the umask's)."""
    fd, tmp = temp_beside(target, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        remove_temp(tmp)
        raise
    fsync_dir(target)
