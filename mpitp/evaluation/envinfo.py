"""lm-eval's environment record (torch's ``collect_env``), computed early and away from the working directory, and
kept per machine and installation.

``collect_env`` starts ``python -mpip list``, ``lscpu`` and more: 5 s of CPU here (13 s of wall on a loaded 2-core
node) taken from the ranks at every launch, for a text that changes when packages or the machine change. So the text
is kept in this user's cache (``<mpitp cache>/env-info``, one JSON file per key, the folder and the file this user's
alone as for the task index: :mod:`mpitp.tasks.index`), keyed by the host name, the Python executable and version, and
the modification time of every package folder on ``sys.path`` (installing or removing a package changes it), and
recomputed after :data:`MAX_AGE_S` (drivers). ``MPITP_ENV_INFO_CACHE=DIR`` moves it, ``=0`` computes it every time.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

log = logging.getLogger("mpitp")

FORMAT = 1
MAX_AGE_S = 24 * 3600.0
#: The record is a few KB (torch's text with its package list); a larger cache file is not ours.
_MAX_BYTES = 1 << 20


def installation() -> list:
    """This Python and its packages: the executable, its version and the modification time of every package folder
    on ``sys.path`` (installing, upgrading or removing a package changes it). Not the working directory (first on
    ``sys.path`` under ``python -m``), whose modification time changes with every file a run writes there."""
    def mtime(path: str) -> int | None:
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return None

    return [os.path.realpath(sys.executable), sys.version,
            [[p, mtime(p)] for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]]


def _key() -> list:
    return [FORMAT, socket.gethostname(), *installation()]


def cache_file() -> Path | None:
    """This installation's cache file on this machine; None when the cache is off or its folder is not this user's
    alone (a record others can write would be stored in results as this run's environment)."""
    from mpitp.results.privatefile import keyed_file
    from mpitp.tasks.demo import cache_folder

    return keyed_file(cache_folder("MPITP_ENV_INFO_CACHE", "env-info"), _key(), "environment record")


def cached(path: Path | None) -> str | None:
    """The text kept in ``path`` for this key, or None when missing, stale, not this user's alone, or malformed."""
    from mpitp.results.privatefile import NotPrivate, read_private_json
    from mpitp.results.untrusted import BadInput

    if path is None:
        return None
    try:
        data = read_private_json(path, "environment record cache", max_bytes=_MAX_BYTES, max_age_s=MAX_AGE_S)
    except NotPrivate as exc:
        log.warning("%s: ignored, recomputing it", exc)
        return None
    except (BadInput, OSError):
        return None
    if not isinstance(data, dict) or data.get("key") != _key() or not isinstance(data.get("text"), str):
        return None
    return data["text"]


def _save(path: Path | None, text: str) -> None:
    """Keep ``text`` for this key (:func:`mpitp.results.privatefile.write_private_json`: this user's alone)."""
    from mpitp.results.privatefile import write_private_json

    if path is not None:
        write_private_json(path, {"key": _key(), "text": text}, "environment record cache")


def env_info() -> str:
    """The cached text when there is one, otherwise :func:`env_info_isolated` (then kept)."""
    path = cache_file()
    text = cached(path)
    if text is None:
        text = env_info_isolated()
        if not text.startswith("(collect_env failed"):
            _save(path, text)
    return text


def env_info_isolated() -> str:
    """torch's ``collect_env`` text, computed in an isolated child (:mod:`mpitp.isolated`) that runs in an empty
    private folder: ``collect_env`` starts ``python -mpip list``, which puts its working directory first on
    ``sys.path``, so from a shared job folder a planted ``pip.py`` would run as the user."""
    import subprocess
    import tempfile

    from mpitp.isolated import python_argv

    code = "import sys, torch.utils.collect_env as c; sys.stdout.write(c.get_pretty_env_info())"
    with tempfile.TemporaryDirectory(prefix="mpitp-env-") as empty:
        done = subprocess.run(python_argv(code), cwd=empty, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    return done.stdout if done.returncode == 0 else f"(collect_env failed: exit {done.returncode})"


def _git(*args: str) -> str | None:
    """git's one-line answer, or None: its stderr discarded, no stdin, 10 s at most."""
    import subprocess

    try:
        done = subprocess.run(["git", *args], capture_output=True, stdin=subprocess.DEVNULL, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = done.stdout.decode("utf-8", "replace").strip()
    return text if done.returncode == 0 and text else None


def git_hash_quietly() -> str | None:
    """lm-eval's ``get_git_commit_hash`` (the results' ``git_hash``: ``git describe --always`` in the working
    directory) without its noise and without its fallback: git's stderr reached the terminal (outside a repository,
    as most job folders are, every run printed "fatal: not a git repository"), and where git failed lm-eval read the
    folder's ``.git/HEAD`` and the file it names by hand, so a planted ``.git/HEAD`` naming a FIFO held rank 0
    forever (git itself refuses a repository another user owns). None where git cannot say."""
    return _git("describe", "--always")


def folder_commit_quietly(path) -> str | None:
    """lm-eval's ``get_commit_from_path`` (``add_env_info``'s ``upper_git_hash``: the commit of the working
    directory's parent where it holds a ``.git``), asked of git instead of read by hand: the same FIFO otherwise."""
    if not os.path.lexists(os.path.join(path, ".git")):
        return None
    return _git("-C", str(path), "rev-parse", "HEAD")


class EnvInfoEarly:
    """lm-eval's ``simple_evaluate`` ends with ``add_env_info``, which runs torch's ``collect_env`` (``pip list``,
    ``lscpu`` and more as subprocesses: 1-14 s measured here) on rank 0 after the last request, while every other
    rank waits. Start it in a thread as the evaluation starts (rank 0 mostly waits for chunks then) and hand lm-eval
    that same text when it asks; the stored environment info is unchanged (computed in an isolated child:
    :func:`env_info_isolated`, and kept: :func:`env_info`). The record's commits come from git, quietly
    (:func:`git_hash_quietly`, :func:`folder_commit_quietly`)."""

    def __enter__(self):
        import concurrent.futures

        from mpitp import compat

        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mpitp-env-info")
        self.future = self.pool.submit(env_info)
        self.patches = [compat.replaced("torch.utils.collect_env.get_pretty_env_info", lambda: self.future.result()),
                        compat.replaced("lm_eval.evaluator.get_git_commit_hash", git_hash_quietly),
                        compat.replaced("lm_eval.loggers.utils.get_commit_from_path", folder_commit_quietly)]
        for patch in self.patches:
            patch.__enter__()
        return self

    def __exit__(self, *exc):
        for patch in reversed(self.patches):
            patch.__exit__(*exc)
        self.pool.shutdown(wait=False)
