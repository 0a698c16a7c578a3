"""Results files (and journals, sweep summaries, caches) are untrusted input: they are shared between people and
teams, and reading one must never read another file, hang, allocate what the file merely declares, recurse without
bound or print terminal control codes.

- :func:`open_regular` / :func:`read_regular` open only regular files (a FIFO, device or socket is one line, never a
  hang): ``O_NONBLOCK`` and ``fstat`` of the opened descriptor, so the check cannot be raced.
- :func:`check_h5` walks an open HDF5 file once, before anything in it is read, and refuses (:class:`BadInput`, one
  line) every way HDF5 has of pulling in other files or data: external links (another file's objects), soft links
  (an object reached by two names: refused too, mpitp never writes one), external storage (a dataset whose bytes live
  in a named raw file, e.g. ``~/.ssh/id_rsa``), virtual datasets (a dataset mapped onto other files' datasets), and
  datasets whose declared sizes add up to more than the file can hold (:data:`MAX_DATASET_BYTES`, or
  :data:`EXPANSION` times the file's size, for all its datasets together): a chunked dataset with no chunks written
  reads as fill values, so a 10 kB file can declare 2^50 rows and make a reader allocate them. Variable-length
  strings, datasets' and attributes', are measured too (:mod:`mpitp.results.h5_strings`): many references to one
  stored string read as that many copies, so all of them together must fit in the file.
  :func:`mpitp.results.schema.open_h5` calls it on every read-only open, so every reader path (``inspect`` and its
  ``--requests`` and ``--samples``, ``diff``, ``rescore``, ``--resume``, ``report``, sweeps) goes through it.
- :func:`load_json` parses JSON from a file within a size and a depth (checked without recursing), as one line.
- :func:`shown` (:mod:`mpitp.escape`, re-exported here) escapes what a file says before it reaches a terminal:
  control characters (``\\x1b]0;...``, ``\\x1b[2J``, C1 codes, bidi overrides) as ``\\x1b``-style escapes.
- :func:`private_dir` / :func:`private_problem`: a cache folder or file only this user can have written.
- :func:`int_attr` and :func:`mapping` read a value of the expected type or raise :class:`BadInput`.
"""

from __future__ import annotations

import os
import re
import stat
from typing import TYPE_CHECKING

from mpitp.escape import shown

if TYPE_CHECKING:
    from collections.abc import Iterable

    import h5py

__all__ = ["EXPANSION", "MAX_DATASET_BYTES", "MAX_JSON_CHARS", "MAX_JSON_DEPTH", "SMALL_DATASET_BYTES", "BadInput",
           "check_h5", "int_attr", "json_depth", "kind", "load_json", "mapping", "open_regular", "own_folders",
           "planted_by_other", "private_dir", "private_problem", "read_regular", "shown"]


class BadInput(ValueError):
    """The input (a file, an option) cannot be used: printed as one line on stderr, exit status 2. Raised only for
    what is wrong with the input: a bug of ours surfaces as itself. A ValueError, so that a reader's existing
    ``except ValueError`` turns it into its own one line too."""


class MissingFile(BadInput, FileNotFoundError):
    """No file at the path: bad input for a reader that prints it (``except ValueError``), and still the
    ``FileNotFoundError`` that code treating a missing file as "not there yet" catches (``except OSError``)."""


class UnopenableFile(BadInput, OSError):
    """A path that cannot be opened (permissions, a link refused, a socket): one line, and still an ``OSError``."""


#: No results file is read beyond this many bytes of datasets (declared shapes times item sizes, all datasets of the
#: file together): 8 GiB holds a billion request rows' float64 column, far beyond any evaluation.
MAX_DATASET_BYTES = 8 << 30

#: The datasets of a file may declare at most this many times the file's size in all (plus
#: :data:`SMALL_DATASET_BYTES`): gzip does not compress the columns mpitp writes by more than about 1000:1, and an
#: attacker's file gets no more data to read than that. The bound is on the sum, not on each dataset: a chunk never
#: written costs nothing in the file, so a 65 kB file could otherwise declare nine columns each just under its own
#: bound (5M rows each; ``mpitp report`` then peaked at 626 MB).
EXPANSION = 1024
SMALL_DATASET_BYTES = 1 << 20


def _limit(size: int) -> int:
    return min(MAX_DATASET_BYTES, SMALL_DATASET_BYTES + EXPANSION * size)


def check_h5(f: h5py.File, path: str) -> None:
    """Refuse (one-line :class:`BadInput`) an open h5py file that links to other files or objects, keeps data
    outside itself, or whose datasets declare more data in all than the file can hold, or whose strings (datasets'
    and attributes') would read as more than it holds. Walks every link once with
    HDF5's own visitor (links are looked at, never followed; low-level calls: a few microseconds per object, so
    every open can afford it)."""
    from h5py import h5l, h5o

    key = _identity(f)
    if key is not None and key in _CHECKED:
        return
    size = key[2] if key is not None else _size(path)
    limit = _limit(size)
    problems: list[str] = []
    total = [0, 0, ""]  # declared bytes of every dataset so far, the largest one's bytes and its description
    from mpitp.results.h5_strings import StringBudget

    strings = StringBudget(f, size, SMALL_DATASET_BYTES + size)

    def look(name: bytes, info: h5py.h5l.LinkInfo) -> None:
        where = shown("/" + name.decode("utf-8", "replace"))
        if info.type == h5l.TYPE_EXTERNAL:
            target = f.id.links.get_val(name)
            text = ":".join(t.decode("utf-8", "replace") for t in target) if isinstance(target, tuple) else target
            problems.append(f"{where} is an external link (to {shown(text)})")
        elif info.type == h5l.TYPE_SOFT:
            problems.append(f"{where} is a soft link (to {shown(f.id.links.get_val(name).decode('utf-8', 'replace'))})")
        elif info.type != h5l.TYPE_HARD:
            problems.append(f"{where} is a link of an unknown kind ({info.type})")
        else:
            obj = h5o.open(f.id, name)
            if h5o.get_info(f.id, name).type == h5o.TYPE_DATASET:
                problems.extend(_dataset_problems(obj, where, limit, total))
                if not problems:
                    problems.extend(strings.dataset(obj, where))
            if not problems:
                problems.extend(strings.attributes(obj, where))

    damaged: list[BaseException] = []

    def visit(name: bytes, info: h5py.h5l.LinkInfo) -> int | None:
        try:
            look(name, info)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:  # an exception must not cross HDF5's C visitor
            damaged.append(exc)
        return 1 if problems or damaged else None  # non-None stops the walk

    try:
        problems.extend(strings.attributes(f.id, "/"))
        if not problems:
            f.id.links.visit(visit, info=True)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:  # what HDF5 says of a damaged file
        damaged.append(exc)
    if damaged:
        reason = " ".join(str(damaged[0]).split())[:200] or type(damaged[0]).__name__
        raise BadInput(f"{path}: not a readable HDF5 file ({shown(reason)})") from None
    if problems:
        raise BadInput(f"{path}: refused: {problems[0]}; a results file must not read other files or declare more "
                       f"data than it holds")
    if key is not None and _identity(f) == key:
        _CHECKED.add(key)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


#: Files already checked in this process, by :func:`_identity`: a reader opens one file many times (``diff``: twice
#: per task), and a file that changed in any way has another identity (``st_ctime`` moves with every write, rename
#: and ``utime``; a snapshot replaced by a running evaluation is a new inode).
_CHECKED: set[tuple] = set()


def _identity(f) -> tuple | None:
    """The open file's device, inode, size and times (``fstat`` of HDF5's own descriptor: the file that was read,
    whatever its path names now); None where the driver has no descriptor."""
    try:
        st = os.fstat(f.id.get_vfd_handle())
    except (OSError, ValueError, TypeError, RuntimeError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _dataset_problems(d, where: str, limit: int, total: list) -> list[str]:
    """What is wrong with the dataset ``d`` (a low-level h5py DatasetID); its declared bytes are added to
    ``total`` (``[sum, largest, its description]``), which must stay within ``limit`` for the whole file."""
    from h5py import h5d

    plist = d.get_create_plist()
    if plist.get_external_count():
        files = ", ".join(shown(plist.get_external(i)[0].decode("utf-8", "replace"))
                          for i in range(min(3, plist.get_external_count())))
        return [f"{where} keeps its data in other files ({files})"]
    if plist.get_layout() == h5d.VIRTUAL:
        return [f"{where} is a virtual dataset (its data lives in other files)"]
    shape = d.get_space().get_simple_extent_dims() or ()
    n = 1
    for s in shape:
        n *= int(s)
    size = d.get_type().get_size()
    what = f"{where} declares {shown(str(tuple(shape)))} x {size} B = {n * size} bytes"
    if n * size > limit:
        return [f"{what}, over the {limit} a file of this size can hold"]
    total[0] += n * size
    if n * size > total[1]:
        total[1], total[2] = n * size, what
    if total[0] > limit:
        return [f"its datasets declare {total[0]} bytes or more in all, over the {limit} a file of this size can "
                f"hold (the largest: {total[2]})"]
    return []


# ------------------------------------------------------------------------------------------------ regular files

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def kind(mode: int) -> str:
    """What a non-regular file is, in words (``a FIFO``, ``a character device``...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, what: str = "it", follow: bool = True) -> int:
    """An open read-only descriptor of the regular file at ``path``; anything else there is one-line bad input.

    Why a descriptor first: ``open`` of a FIFO blocks until someone writes to it (``mpitp report DIR`` hung on a
    ``*.h5`` FIFO), and a ``stat`` before opening by name can be raced. ``O_NONBLOCK`` makes the open itself return
    at once whatever is there, and ``fstat`` of that descriptor says what was opened: a check that cannot be raced.
    ``follow=False`` refuses a symbolic link too (files mpitp finds by name beside another, e.g. the journal)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MissingFile(f"{shown(path)}: no such file") from None
    except OSError as exc:  # EACCES, ELOOP (a link with follow=False), ENXIO (a socket)...
        raise UnopenableFile(f"{shown(path)}: {what} cannot be opened ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BadInput(f"{shown(path)}: refused: {what} is {kind(st.st_mode)}, not a regular file")
    return fd


def read_regular(path: str, what: str = "it", max_bytes: int | None = None, follow: bool = True) -> bytes:
    """The bytes of the regular file at ``path`` (:func:`open_regular`), no more than its size at open; a file over
    ``max_bytes`` is bad input, refused before it is read."""
    fd = open_regular(path, what, follow)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise BadInput(f"{shown(path)}: refused: {what} is {size} bytes, over the {max_bytes} mpitp reads")
        return f.read(size)


# ------------------------------------------------------------------------------------------------ caches

def private_problem(st: os.stat_result, what: str) -> str | None:
    """Why what ``st`` describes may hold another user's data (not this user's, or group- or world-writable);
    None when only this user can have written it.

    Why caches need it: lm-eval's request cache is a ``dill`` pickle (loading one runs code), and a task index names
    which YAML a task name runs; a cache folder on a shared or group-writable filesystem lets someone else plant
    either. A cache that fails this is ignored (one warning line) and rebuilt, or not used."""
    if st.st_uid != os.geteuid():
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = {0o022: "its group and others", 0o020: "its group", 0o002: "others"}[st.st_mode & 0o022]
        return f"{what} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(path: str, levels: int = 1) -> str | None:
    """Make ``path`` a folder only this user can write to, or say why it is not one (None when it is).

    Missing folders are created ``0o700`` (lm-eval's ``os.makedirs`` would give them the umask's mode, group-writable
    under the common ``umask 002``); ``levels`` folders, ``path`` and the ones above it, must be private (a cache's
    root and its keyed folder). A link to a folder counts as that folder (it is the folder that is written)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    try:
        for q in reversed(missing):
            os.mkdir(q, 0o700)
    except FileExistsError:
        pass  # another process made it at the same time: checked below like any existing folder
    except OSError as exc:
        return f"{shown(path)} cannot be created ({exc.strerror or exc})"
    q = os.path.abspath(path)
    for _ in range(levels):
        try:
            st = os.stat(q)
        except OSError as exc:
            return f"{shown(q)} cannot be read ({exc.strerror or exc})"
        if not stat.S_ISDIR(st.st_mode):
            return f"{shown(q)} is {kind(st.st_mode)}, not a folder"
        problem = private_problem(st, f"the folder {shown(q)}")
        if problem:
            return problem
        q = os.path.dirname(q)
    return None


# ------------------------------------------------------------------------------------------------ planted folders

def planted_by_other(path: str) -> str | None:
    """Why ``path``, an entry found in a folder (a ``--model``/``--peft`` glob's match, a ``--watch`` folder's
    subfolder), may be another user's plant and not a checkpoint of the run: the entry (a link itself, not followed)
    made by a user other than this one, root or the folder's owner (a colleague whose run is read). None when it is
    none. Such a folder's files decide what runs (its config and weights; with ``trust_remote_code``, its Python),
    and in a folder others may write (sticky scratch, a group's space) anyone can add one a pattern matches."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        uid, owner = os.lstat(path).st_uid, os.stat(folder).st_uid
    except OSError as exc:
        return f"{shown(path)} cannot be read ({exc.strerror})"
    if uid in (os.geteuid(), 0, owner):
        return None
    return (f"{shown(path)}: made by uid {uid}, neither this user (uid {os.geteuid()}), root nor the owner of "
            f"{shown(folder)} (uid {owner})")


def own_folders(paths: Iterable[str], what: str) -> list[str]:
    """The folders among ``paths`` less those :func:`planted_by_other`, each of which is skipped with one warning
    line naming ``what`` found it."""
    import logging

    out = []
    for p in paths:
        if os.path.isdir(p):
            why = planted_by_other(p)
            if why:
                logging.getLogger("mpitp").warning("%s: skipped %s; its files would decide what runs", what, why)
            else:
                out.append(p)
    return out


#: A JSON document from a file (results_json, the recorded settings, a logged sample, a sweep summary, a cache file)
#: is refused past this many characters: the largest mpitp writes (lm-eval's results of a few thousand tasks) is a
#: few MB, and parsing costs up to about 20 bytes of Python objects per character.
MAX_JSON_CHARS = 64 << 20
#: ... or nested deeper than this: Python's parser recurses per level and raises RecursionError (not a ValueError,
#: so it escaped every reader's one-line handling as a traceback) near 1000; lm-eval's documents nest under 10.
MAX_JSON_DEPTH = 100

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string: the tokenizer's rule
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


# ------------------------------------------------------------------------------------------------ JSON

def json_depth(text: str) -> int:
    """How deep the brackets of the JSON ``text`` nest, strings left out; a scan that does not itself recurse.

    Strings are cut out first (a JSON string is ``"`` up to the next ``"`` not escaped: the tokenizer's own rule,
    so within the part a parser accepts, the brackets counted are its brackets), then the depth is the running sum
    of ``+1`` per ``[``/``{`` and ``-1`` per ``]``/``}``."""
    import numpy as np

    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.translate(_STEPS), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max())


_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def load_json(text: object, what: str, max_chars: int | None = MAX_JSON_CHARS,
              max_depth: int = MAX_JSON_DEPTH) -> object:
    """``json.loads(text)`` of untrusted text, every failure one-line :class:`BadInput` naming ``what``: not text,
    over ``max_chars`` (None: bounded by the caller, e.g. a journal record by its frame), nested deeper than
    ``max_depth``, or not JSON. Every reader of JSON from a results file, journal, sweep summary or cache uses it."""
    import json

    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise BadInput(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(text, str):
        raise BadInput(f"{what} is a {type(text).__name__}, not JSON text")
    if max_chars is not None and len(text) > max_chars:
        raise BadInput(f"{what} is {len(text)} characters of JSON, over the {max_chars} mpitp reads")
    depth = json_depth(text) if text.count("[") + text.count("{") > max_depth else 0  # fewer opened: no deeper
    if depth > max_depth:
        raise BadInput(f"{what} nests {depth} levels deep, over the {max_depth} mpitp reads")
    try:
        return json.loads(text)
    except RecursionError:  # not reached within max_depth; kept so that no input can make it a traceback
        raise BadInput(f"{what} nests too deep to read") from None
    except ValueError as exc:
        raise BadInput(f"{what} is not valid JSON ({shown(' '.join(str(exc).split())[:200])})") from None


def int_attr(attrs: dict, name: str, default: int = 0) -> int:
    """``attrs[name]`` as an int; a file that stores something else there (an array, a string) is bad input."""
    v = attrs.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(f"'{shown(name)}' is a {type(v).__name__}, not an integer")
    return v


def mapping(v: object, what: str) -> dict:
    """``v`` when it is a dict; else bad input naming ``what`` and the type found."""
    if not isinstance(v, dict):
        raise BadInput(f"{what} is a {type(v).__name__}, not a mapping")
    return v
