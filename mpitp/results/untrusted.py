"""Results files (and journals, sweep summaries) are untrusted input: they are shared between people and teams, and
reading one must never read another file, allocate what the file merely declares, or print terminal control codes.

- :func:`check_h5` walks an open HDF5 file once, before anything in it is read, and refuses (:class:`BadInput`, one
  line) every way HDF5 has of pulling in other files or data: external links (another file's objects), soft links
  (an object reached by two names: refused too, mpitp never writes one), external storage (a dataset whose bytes live
  in a named raw file, e.g. ``~/.ssh/id_rsa``), virtual datasets (a dataset mapped onto other files' datasets), and
  datasets whose declared size is beyond what the file can hold (:data:`MAX_DATASET_BYTES`, or
  :data:`EXPANSION` times the file's size): a chunked dataset with no chunks written reads as fill values, so a
  10 kB file can declare 2^50 rows and make a reader allocate them.
  :func:`mpitp.results.schema.open_h5` calls it on every read-only open, so every reader path (``inspect`` and its
  ``--requests`` and ``--samples``, ``diff``, ``rescore``, ``--resume``, sweeps) goes through it.
- :func:`shown` escapes what a file says before it reaches a terminal: control characters (``\\x1b]0;...``,
  ``\\x1b[2J``, C1 codes, bidi overrides) as ``\\x1b``-style escapes.
- :func:`int_attr` and :func:`mapping` read a value of the expected type or raise :class:`BadInput`.
"""

from __future__ import annotations

import os


class BadInput(ValueError):
    """The input (a file, an option) cannot be used: printed as one line on stderr, exit status 2. Raised only for
    what is wrong with the input: a bug of ours surfaces as itself. A ValueError, so that a reader's existing
    ``except ValueError`` turns it into its own one line too."""


#: No dataset of a results file is read whole beyond this many bytes (declared shape times item size): 8 GiB holds a
#: billion request rows' float64 column, far beyond any evaluation.
MAX_DATASET_BYTES = 8 << 30

#: A dataset may declare at most this many times the file's size (plus :data:`SMALL_DATASET_BYTES`): gzip does not
#: compress the columns mpitp writes by more than about 1000:1, and an attacker's file gets no more memory than that.
EXPANSION = 1024
SMALL_DATASET_BYTES = 1 << 20


def _limit(path: str) -> int:
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return min(MAX_DATASET_BYTES, SMALL_DATASET_BYTES + EXPANSION * size)


def check_h5(f, path: str) -> None:
    """Refuse (one-line :class:`BadInput`) an open h5py file that links to other files or objects, keeps data
    outside itself, or declares a dataset bigger than it can hold. Walks every link once with HDF5's own visitor
    (links are looked at, never followed; low-level calls: a few microseconds per object, so every open can afford
    it)."""
    from h5py import h5d, h5l, h5o

    key = _identity(f)
    if key is not None and key in _CHECKED:
        return
    limit = _limit(path)
    problems: list[str] = []

    def look(name: bytes, info) -> None:
        where = shown("/" + name.decode("utf-8", "replace"))
        if info.type == h5l.TYPE_EXTERNAL:
            target = f.id.links.get_val(name)
            text = ":".join(t.decode("utf-8", "replace") for t in target) if isinstance(target, tuple) else target
            problems.append(f"{where} is an external link (to {shown(text)})")
        elif info.type == h5l.TYPE_SOFT:
            problems.append(f"{where} is a soft link (to {shown(f.id.links.get_val(name).decode('utf-8', 'replace'))})")
        elif info.type != h5l.TYPE_HARD:
            problems.append(f"{where} is a link of an unknown kind ({info.type})")
        elif h5o.get_info(f.id, name).type == h5o.TYPE_DATASET:
            problems.extend(_dataset_problems(h5d.open(f.id, name), where, limit))

    damaged: list[BaseException] = []

    def visit(name: bytes, info) -> int | None:
        try:
            look(name, info)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:  # an exception must not cross HDF5's C visitor
            damaged.append(exc)
        return 1 if problems or damaged else None  # non-None stops the walk

    try:
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


def _dataset_problems(d, where: str, limit: int) -> list[str]:
    """What is wrong with the dataset ``d`` (a low-level h5py DatasetID)."""
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
    if n * size > limit:
        return [f"{where} declares {shown(str(tuple(shape)))} x {size} B = {n * size} bytes, over the {limit} a file "
                f"of this size can hold"]
    return []


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def shown(text, keep_newlines: bool = False) -> str:
    """``text`` safe to print: every character that is not printable (C0/C1 controls, DEL, bidi overrides, line
    and paragraph separators...) as ``\\n``, ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``; newlines kept when asked
    (for text that is ours and spans lines). Plain printable text comes back unchanged."""
    text = str(text)
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or (keep_newlines and ch == "\n"):
            out.append(ch)
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def int_attr(attrs: dict, name: str, default: int = 0) -> int:
    """``attrs[name]`` as an int; a file that stores something else there (an array, a string) is bad input."""
    v = attrs.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(f"'{shown(name)}' is a {type(v).__name__}, not an integer")
    return v


def mapping(v, what: str) -> dict:
    """``v`` when it is a dict; else bad input naming ``what`` and the type found."""
    if not isinstance(v, dict):
        raise BadInput(f"{what} is a {type(v).__name__}, not a mapping")
    return v
