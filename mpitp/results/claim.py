"""One writer per results file: rank 0 claims its output before it evaluates and releases it on exit.

Two evaluations aimed at one file (two singletons of a broken launch, a job started twice, two shells) must not both
write it: the later atomic snapshot would silently replace the earlier one's rows. The claim is an exclusive
``flock`` on ``.<name>.claim`` beside the output. The kernel drops a lock when its process dies, however it dies, so a
claim left by a killed run is stale by construction and is simply taken over. The claim file holds the owner's host
and pid, for the refusal message only.

The claim's name is predictable and its directory may be shared, so it is opened as :mod:`mpitp.results.safefile`
says: created with ``O_EXCL | O_NOFOLLOW``, or, left by a killed run, reopened with ``O_NOFOLLOW`` and taken only when
it is a plain file with no other name (a planted symbolic or hard link to a user's file is refused, never written).
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat

from mpitp.errors import UsageError
from mpitp.results.safefile import CLOEXEC, NOFOLLOW, create_new, new_mode


def claim_path(output: str) -> str:
    folder, name = os.path.split(os.path.abspath(output))
    return os.path.join(folder, f".{name}.claim")


class OutputClaim:
    """An exclusive claim on ``output``; :meth:`release` (or process exit) gives it back."""

    def __init__(self, output: str):
        self.output = output
        self.path = claim_path(output)
        self.fd: int | None = None

    def acquire(self) -> OutputClaim:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = self._open()
            if fd is None:
                continue  # the stale claim went away between our two opens
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read(fd)
                os.close(fd)
                raise UsageError(f"output {self.output} is being written by another mpitp process ({owner}); "
                                 f"wait for it to finish or choose another --output") from None
            except OSError as exc:  # a file system without flock: say so rather than go unguarded silently
                os.close(fd)
                raise UsageError(f"cannot claim output {self.output}: locking {self.path} failed "
                                 f"({exc.strerror or exc}); choose an --output on a file system with locks") from None
            # The previous owner may have unlinked the file between our open and our lock: then we hold a lock on a
            # name nobody else sees. Only a lock on the inode the path names right now counts.
            try:
                same = os.lstat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd
        return self

    def _open(self) -> int | None:
        """A descriptor on the claim file: a new one, or the existing plain file (None: it vanished meanwhile)."""
        try:
            return create_new(self.path, 0o644 & new_mode(), os.O_RDWR)
        except FileExistsError:
            pass
        try:
            fd = os.open(self.path, os.O_RDWR | NOFOLLOW | CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symbolic link; EACCES: someone else's file
            raise UsageError(f"cannot claim output {self.output}: {self.path} exists and cannot be opened as a plain "
                             f"file ({exc.strerror or exc}); something other than mpitp put it there: remove it or "
                             f"choose another --output") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names"
            raise UsageError(f"cannot claim output {self.output}: {self.path} is {what}, not a claim mpitp left; "
                             f"remove it or choose another --output")
        return fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked, so nobody takes a lock on a name about to disappear
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "owner unknown"


def claim_output(output: str) -> OutputClaim:
    """Claim ``output`` now or raise :class:`UsageError` naming the process that holds it."""
    return OutputClaim(output).acquire()
