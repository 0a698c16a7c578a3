"""Variable-length strings in an untrusted HDF5 file: what reading them would allocate, known before any is read.

Why: :func:`mpitp.results.untrusted.check_h5` bounds what a file's datasets declare (shape times item size), but a
variable-length string's item is a 16-byte reference into the file's global heap, and any number of references can
name one large string stored once. A 1.1 MB file whose 3,000-row ``generation`` column named one 1 MiB string made
``inspect`` allocate 6 GB (HDF5 copies the string out for every row); 1,000 attribute strings naming one made plain
``inspect`` and ``report`` take 3 GB. Written honestly, every string is stored once, so all of a file's strings
together fit in the file: that is the budget.

A stored element of a variable-length string is its length (4 bytes, little-endian: HDF5's file format) and then its
heap reference, so a dataset's strings are measured from its raw storage -- the bytes at its offset (contiguous), or
each chunk through the filters h5py writes (deflate, shuffle, Fletcher-32) -- and no string is read. An attribute has
no raw access: a variable-length attribute must be one string (mpitp writes no other), read to be measured, one at a
time against the same budget. Variable-length data of any other shape (sequences, strings inside compound or array
types), and a string column whose unwritten rows would read as a string (a fill value: unmeasured copies), are
refused: mpitp writes none.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

#: The largest chunk of a variable-length column decoded to measure it (HDF5 allows 4 GiB): mpitp writes 64 KiB.
MAX_CHUNK_BYTES = 64 << 20

FIXED, STRING, OTHER = "fixed", "string", "other"


class Unmeasurable(ValueError):
    """A variable-length column whose strings cannot be measured without reading them: refused."""


def type_kind(t) -> str:
    """:data:`FIXED` (no variable-length data), :data:`STRING` (a variable-length string) or :data:`OTHER`
    (variable-length data in another shape) for a low-level h5py type ``t``."""
    from h5py import h5t

    cls = t.get_class()
    if cls == h5t.STRING:
        return STRING if t.is_variable_str() else FIXED
    if cls == h5t.VLEN:
        return OTHER
    if cls == h5t.COMPOUND:
        members = (type_kind(t.get_member_type(i)) for i in range(t.get_nmembers()))
        return OTHER if any(k != FIXED for k in members) else FIXED
    if cls == h5t.ARRAY:
        return FIXED if type_kind(t.get_super()) == FIXED else OTHER
    return FIXED


def stored_size(fid) -> int:
    """Bytes of one stored variable-length element in the file ``fid`` (a low-level h5py FileID): its length, then a
    heap reference (an address of the file's own width, then an index). Not ``H5Tget_size``: that is the size of
    the element in memory (a pointer)."""
    return 4 + fid.get_create_plist().get_sizes()[0] + 4


def dataset_bytes(d, fd: int, file_size: int, size: int) -> int:
    """The bytes of the variable-length strings of dataset ``d`` (a low-level h5py DatasetID of a variable-length
    string type in the file open as ``fd``; each element stored in ``size`` bytes: :func:`stored_size`), summed
    from their stored lengths. :class:`Unmeasurable` where they cannot be."""
    from h5py import h5d, h5z

    plist = d.get_create_plist()
    if plist.fill_value_defined() == h5d.FILL_VALUE_USER_DEFINED:  # what unwritten rows read as: one copy each
        import h5py

        fill = np.zeros((1,), dtype=h5py.string_dtype())
        plist.get_fill_value(fill)
        if fill[0]:
            raise Unmeasurable(f"variable-length strings whose unwritten rows read as a {len(fill[0])}-byte string")
    layout = plist.get_layout()
    space = d.get_space()
    n = space.get_simple_extent_npoints()
    if layout == h5d.CONTIGUOUS:
        offset = d.get_offset()
        return 0 if offset is None else _lengths(_read(fd, offset, n * size, file_size), size, n)  # None: unwritten
    if layout != h5d.CHUNKED:
        raise Unmeasurable("variable-length strings in a compact dataset")
    if space.get_simple_extent_ndims() != 1:
        raise Unmeasurable("variable-length strings in a chunked dataset of several dimensions")
    rows = plist.get_chunk()[0]
    if rows * size > MAX_CHUNK_BYTES:
        raise Unmeasurable(f"variable-length strings in chunks of {rows * size} bytes")
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    unknown = [f for f in filters if f not in (h5z.FILTER_DEFLATE, h5z.FILTER_SHUFFLE, h5z.FILTER_FLETCHER32)]
    if unknown:
        raise Unmeasurable(f"variable-length strings stored through HDF5 filter {unknown[0]}")
    total = [0]

    def chunk(info) -> None:
        raw = _read(fd, info.byte_offset, info.size, file_size)
        data = _unfiltered(raw, filters, info.filter_mask, rows * size, size)
        total[0] += _lengths(data, size, max(0, min(rows, n - info.chunk_offset[0])))

    d.chunk_iter(chunk)
    return total[0]


def _read(fd: int, offset: int, length: int, file_size: int) -> bytes:
    if offset < 0 or offset + length > file_size:
        raise Unmeasurable(f"variable-length strings stored past the file's end ({offset} + {length} bytes)")
    parts = []
    while length > 0:
        part = os.pread(fd, length, offset)
        if not part:
            raise Unmeasurable("variable-length strings stored past the file's end")
        parts.append(part)
        offset, length = offset + len(part), length - len(part)
    return b"".join(parts)


def _unfiltered(raw: bytes, filters: list[int], mask: int, expected: int, size: int) -> bytes:
    """A chunk's stored bytes through its filters backwards (those ``mask`` marks were skipped when it was written),
    never inflated past the ``expected`` bytes of a whole chunk."""
    from h5py import h5z

    data = raw
    for i in reversed(range(len(filters))):
        if mask & (1 << i):
            continue
        if filters[i] == h5z.FILTER_FLETCHER32:
            data = data[:-4]
        elif filters[i] == h5z.FILTER_DEFLATE:
            try:
                data = zlib.decompressobj().decompress(data, expected)
            except zlib.error as exc:
                raise Unmeasurable(f"a chunk of variable-length strings does not inflate ({exc})") from None
        elif filters[i] == h5z.FILTER_SHUFFLE and len(data) == expected:  # byte j of every element together
            data = np.frombuffer(data, dtype=np.uint8).reshape(size, -1).T.tobytes()
    if len(data) != expected:
        raise Unmeasurable(f"a chunk of variable-length strings holds {len(data)} bytes, not {expected}")
    return data


def _lengths(data: bytes, size: int, n: int) -> int:
    """The sum of the first ``n`` stored elements' lengths (each ``size`` bytes, the length first)."""
    if n <= 0:
        return 0
    heads = np.frombuffer(data, dtype=np.uint8, count=n * size).reshape(n, size)[:, :4]
    return int(np.ascontiguousarray(heads).view("<u4").sum(dtype=np.int64))


def attribute_bytes(attr) -> int:
    """The bytes of a variable-length string attribute (a low-level h5py AttrID), read to be measured: it must be
    one string (:class:`Unmeasurable` otherwise), so reading it costs at most what the file holds."""
    from h5py import h5t

    n = attr.get_space().get_simple_extent_npoints()
    if n != 1:
        raise Unmeasurable(f"{n} variable-length strings")
    value = np.zeros(attr.shape, dtype=attr.dtype)
    attr.read(value, mtype=h5t.py_create(attr.dtype))
    item = value.reshape(-1)[0]
    if isinstance(item, str):
        return len(item.encode("utf-8", "surrogateescape"))
    return len(item) if isinstance(item, bytes) else 0


_NOT_STRINGS = "holds variable-length data other than strings, which mpitp does not write"


class StringBudget:
    """The variable-length strings of one open file, measured as :func:`mpitp.results.untrusted.check_h5` walks it:
    all of them together within ``limit`` (the file's size and a little), each object's problems as one-line texts."""

    def __init__(self, f, size: int, limit: int):
        self.size, self.limit = size, limit
        self.fd, self.stored = f.id.get_vfd_handle(), stored_size(f.id)  # where the columns' raw bytes are read
        self.bytes = 0

    def _add(self, measure, where: str) -> list[str]:
        try:
            self.bytes += measure()
        except Unmeasurable as exc:
            return [f"{where} holds {exc}, which mpitp does not write"]
        if self.bytes > self.limit:
            return [f"its variable-length strings come to {self.bytes} bytes or more (at {where}), over the "
                    f"{self.limit} a file of this size holds: strings named more than once"]
        return []

    def dataset(self, d, where: str) -> list[str]:
        """Dataset ``d`` (a low-level DatasetID) at ``where``: its strings counted, or why they cannot be."""
        kind = type_kind(d.get_type())
        if kind == OTHER:
            return [f"{where} {_NOT_STRINGS}"]
        if kind == FIXED:
            return []
        return self._add(lambda: dataset_bytes(d, self.fd, self.size, self.stored), where)

    def attributes(self, obj, where: str) -> list[str]:
        """The attributes of ``obj`` (a low-level object ID) at ``where``: their strings counted, one at a time."""
        from h5py import h5a

        from mpitp.escape import shown

        for i in range(h5a.get_num_attrs(obj)):
            attr = h5a.open(obj, index=i)
            at = f"{where} attribute {shown(attr.get_name().decode('utf-8', 'replace'))}"
            kind = type_kind(attr.get_type())
            if kind == OTHER:
                return [f"{at} {_NOT_STRINGS}"]
            problems = [] if kind == FIXED else self._add(lambda a=attr: attribute_bytes(a), at)
            if problems:
                return problems
        return []
