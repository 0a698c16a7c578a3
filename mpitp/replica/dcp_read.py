"""Reading a torch DCP folder without running its pickles: the ``.metadata`` index and exact slices of its chunks.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` (a crafted file runs code as it is
read): :func:`read_metadata` builds only the classes DCP's metadata holds. :class:`SliceReader` then ``pread``s only
the bytes of this rank's region of each tensor, straight from the ``torch.save`` zip of each saved chunk (its layout
read from the zip directory and a restricted unpickler), where DCP's own reader reads and deserialises every chunk
that overlaps a request whole. Chunks it cannot parse are left to DCP's reader (:func:`storage_reader`, which reuses
the metadata read here). torch is imported only inside functions.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from typing import TYPE_CHECKING, Any, BinaryIO

from mpitp import compat
from mpitp.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"
IGNORED_SECTIONS = ("optimizer", "optim", "lr_scheduler", "dataloader", "train_state")
"""Entries of a full training checkpoint that are not model weights: torchtitan's top-level ones, and ``optim``
beside ``model`` (torch's ``get_state_dict(model, optimizer)`` saved as ``{"model": ..., "optim": ...}``, as torch's
DCP recipe's ``AppState`` does under ``app.``: a section's name is its first or second component)."""


_LEGACY_PACKAGE = "torch.distributed._shard.checkpoint."
"""Where DCP lived before torch 2.0: a ``.metadata`` saved then names its classes there, and torch still reads it."""


class _MetadataPickle(pickle.Unpickler):
    """``.metadata`` is a pickle (torch's ``FileSystemReader`` reads it with plain ``pickle.load``, so a crafted file
    runs code as it is read). This one builds only what DCP's metadata holds: the classes of
    ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts and paths."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module.startswith(_LEGACY_PACKAGE):  # torch 1.13's DCP (the same classes: torch aliases the package)
            module = "torch.distributed.checkpoint." + module[len(_LEGACY_PACKAGE):]
        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as md

            obj = getattr(md, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif (module, name) in (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                ("torch.serialization", "_get_layout")):  # private names the pickle itself holds
            return compat.attribute(f"{module}.{name}")
        elif (module, name) == ("torch", "Size"):
            return torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib

            return getattr(pathlib, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata does not hold (refused: "
                                     f"unpickling it could run code)")


def read_metadata(path: str) -> Metadata:
    """The checkpoint's ``Metadata``, read with :class:`_MetadataPickle`; a :class:`UsageError` line otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    compat.require("torch.distributed.checkpoint.filesystem._StorageInfo")  # checked here, not at start-up

    try:
        with open(os.path.join(path, METADATA), "rb") as f:
            metadata = _MetadataPickle(f).load()
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}, not a torch DCP Metadata")
    except Exception as exc:  # noqa: BLE001 - a damaged, foreign or hostile .metadata is the user's input
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"model path {path}: cannot read the torch DCP {METADATA} file: {first}") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def storage_reader(path: str, metadata: Metadata) -> FileSystemReader:
    """torch's ``FileSystemReader`` for ``path`` that uses ``metadata`` (read by :func:`read_metadata`) instead of
    unpickling ``.metadata`` itself."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def model_tensors(metadata: Metadata) -> dict[str, tuple[tuple[int, ...], object]]:
    """``{name: (global shape, dtype)}`` of the checkpoint's tensors, training state (optimizer, ...) left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if set(key.split(".", 2)[:2]) & set(IGNORED_SECTIONS) or not isinstance(md, TensorStorageMetadata):
            continue
        out[key] = (tuple(md.size), md.properties.dtype)
    return out


def check_shards(path: str, metadata: Metadata) -> None:
    """Refuse, one line, a step whose ``.metadata`` chunks do not cover each model tensor (:func:`_check_tiling`) or
    whose ``*.distcp`` files do not hold every model chunk it indexes: a file missing or shorter than its last
    chunk's end (a partial copy, a full disk). Found from a ``stat`` per file before
    any read, where the load's first read of such a chunk ended in a traceback (``FileNotFoundError``, or
    ``EOFError`` from DCP's reader). Training state's chunks (optimizer, ...) are not needed, so not checked."""
    tensors = model_tensors(metadata)
    for key, (shape, _) in tensors.items():
        _check_tiling(path, key, shape, metadata.state_dict_metadata[key].chunks)
    ends: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn in tensors:
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = os.stat(os.path.join(path, name)).st_size
        except OSError as exc:
            raise UsageError(f"model path {path}: cannot read {name}, which holds model tensors {METADATA} indexes "
                             f"({exc.strerror}): an incomplete save or copy of the checkpoint") from None
        if size < end:
            raise UsageError(f"model path {path}: {name} is {size} bytes, but {METADATA} indexes model tensors in it "
                             f"up to byte {end} ({end - size} bytes short): a truncated save or copy") from None


def _check_tiling(path: str, key: str, shape: tuple[int, ...], chunks: list) -> None:
    """Refuse a tensor whose saved chunks do not cover it: each inside its shape, their elements adding up to its
    (DCP's chunks never overlap). A chunk missing from ``.metadata`` left its region of the parameter unwritten
    (``torch.empty``'s memory: stories-size Qwen2 scored 0.39 off lm-eval, checked as ready)."""
    for c in chunks:
        if len(c.offsets) != len(shape) or any(o < 0 or o + m > n for o, m, n in zip(c.offsets, c.sizes, shape)):
            raise UsageError(f"model path {path}: {key} has a chunk at {list(c.offsets)} of {list(c.sizes)} in "
                             f"{METADATA}, outside its shape {list(shape)}: a damaged checkpoint")
    covered, numel = sum(math.prod(c.sizes) for c in chunks), math.prod(shape)
    if covered != numel:
        raise UsageError(f"model path {path}: {key}'s chunks in {METADATA} hold {covered} of its {numel} elements "
                         f"(shape {list(shape)}): a damaged or partly written checkpoint")


# ------------------------------------------------------------------------------------------------ slice reads


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable file of their own (one saved chunk)."""

    def __init__(self, f: BinaryIO, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, buf: bytearray | memoryview) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        data = os.pread(self.f.fileno(), n, self.offset + self.pos)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


class _TensorPickle(pickle.Unpickler):
    """Reads a ``torch.save``'d tensor's ``data.pkl`` for its layout only: dtype, storage offset, size, stride.
    Nothing but the tensor-rebuild call, its storage type and an empty OrderedDict is accepted (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, int(offset), tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a DCP tensor record")

    def persistent_load(self, pid: tuple) -> tuple:
        return pid  # ('storage', storage type name, key, location, numel)


_STORAGE_DTYPES = {"FloatStorage": "float32", "BFloat16Storage": "bfloat16", "HalfStorage": "float16",
                   "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
                   "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}
"""``torch.save``'s storage type names (a record's pickle) -> dtype names; any other dtype goes to DCP's reader."""


class SliceReader:
    """Reads a region of a checkpoint tensor with ``pread``: only the bytes of the rows (or row segments) it covers.

    DCP's ``FileSystemReader`` reads every saved chunk that overlaps a request whole and deserialises it
    (``torch.load``) before cutting the slice out: at tp=2 each rank reads every byte of a checkpoint saved by one
    process. A chunk saved in DCP's default format is a ``torch.save`` zip whose tensor data is one stored
    (uncompressed) record, row major; this reads its layout from the zip directory and the small pickle, then
    ``pread``s what the region needs straight into the parameter's local shard (for a shard of another dtype or on
    a GPU: into a buffer of the region's size, then copied and converted). A chunk it cannot parse (compressed,
    another serialisation, a non-contiguous layout) is left to DCP's reader.
    """

    def __init__(self, path: str, metadata: Metadata):
        self.path, self.metadata = path, metadata
        self.files: dict[str, object] = {}
        self.layouts: dict = {}
        self.nbytes = 0

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def _layout(self, info):
        """(absolute offset of the chunk's data, dtype, shape) or None when this chunk is not read here."""
        import torch

        key = (info.relative_path, info.offset)
        if key in self.layouts:
            return self.layouts[key]
        layout = None
        if not getattr(info, "transform_descriptors", None):
            f = self.files.get(info.relative_path)
            if f is None:
                f = self.files[info.relative_path] = open(os.path.join(self.path, info.relative_path), "rb")
            try:
                layout = self._parse(f, info, torch)
            except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, TypeError, AttributeError,
                    struct.error, EOFError):
                layout = None
        self.layouts[key] = layout
        return layout

    @staticmethod
    def _parse(f, info, torch):
        window = _Window(f, info.offset, info.length)
        with zipfile.ZipFile(window) as zf:  # unbuffered: exact reads (a buffer would read ~8 KiB per chunk)
            names = zf.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl")]
            records = [n for n in names if "/data/" in n]
            if len(pkl) != 1 or len(records) != 1:
                return None
            record = zf.getinfo(records[0])
            if record.compress_type != zipfile.ZIP_STORED:
                return None
            storage, start, size, stride = _TensorPickle(io.BytesIO(zf.read(pkl[0]))).load()
        dtype = _STORAGE_DTYPES.get(storage[1])
        if dtype is None:
            return None
        dtype = getattr(torch, dtype)
        numel = 1
        for n in size:
            numel *= n
        row_major = tuple(torch.empty(size, device="meta").stride()) if size else ()
        if start != 0 or tuple(stride) != row_major or record.file_size != numel * dtype.itemsize:
            return None
        header = os.pread(f.fileno(), 30, info.offset + record.header_offset)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.offset + record.header_offset + 30 + name_len + extra_len, dtype, size

    def fill(self, key: str, target: torch.Tensor) -> bool:
        """Fill ``target`` (a parameter's local tensor, or a DTensor: its local shard) with its region of checkpoint
        tensor ``key``; False (nothing written) when a chunk it needs is not one this reader parses."""
        boxes = local_regions(target)
        return boxes is not None and all([self.read_region(key, *box) for box in boxes])

    def read_region(self, key: str, local: torch.Tensor, lo: tuple) -> bool:
        """Fill ``local`` with the region of tensor ``key`` that starts at global offsets ``lo`` (see :meth:`fill`)."""
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.metadata.state_dict_metadata[key]
        shape = tuple(local.shape)
        if local.dim() == 0:
            return False
        reads = []
        for chunk in md.chunks:
            box = [(max(a, c), min(a + n, c + m)) for a, n, c, m in zip(lo, shape, chunk.offsets, chunk.sizes)]
            if any(b <= a for a, b in box):
                continue
            layout = self._layout(self.metadata.storage_data[MetadataIndex(key, chunk.offsets)])
            if layout is None or tuple(layout[2]) != tuple(chunk.sizes) or any(
                    a != c or b != c + m for (a, b), c, m in zip(box[2:], chunk.offsets[2:], chunk.sizes[2:])):
                return False  # not parsed, or cut along a dimension after the second: DCP's reader
            reads.append((chunk, box, layout))
        for chunk, box, (data_at, dtype, size) in reads:
            f = self.files[self.metadata.storage_data[MetadataIndex(key, chunk.offsets)].relative_path]
            dest = local
            for d, (a, b) in enumerate(box):
                dest = dest.narrow(d, a - lo[d], b - a)
            inner = dtype.itemsize
            for n in size[2:]:
                inner *= n
            cols = size[1] if len(size) > 1 else 1
            r0, r1 = box[0][0] - chunk.offsets[0], box[0][1] - chunk.offsets[0]
            c0, c1 = ((box[1][0] - chunk.offsets[1], box[1][1] - chunk.offsets[1]) if len(size) > 1 else (0, 1))
            row, whole_rows = cols * inner, c0 == 0 and c1 == cols
            # Straight into the shard when it is host memory of the saved dtype (each row segment contiguous): no
            # region buffer, whose transient copy was the load's peak RSS (the largest region: half the embedding).
            direct = dest.device.type == "cpu" and dest.dtype == dtype and (
                dest.is_contiguous() if whole_rows else all(dest[i].is_contiguous() for i in range(r1 - r0)))
            part = dest if direct else torch.empty([b - a for a, b in box], dtype=dtype)
            if whole_rows:  # one read
                self._pread_into(f, _bytes(part), data_at + r0 * row)
            else:
                for i in range(r1 - r0):
                    self._pread_into(f, _bytes(part[i]), data_at + (r0 + i) * row + c0 * inner)
            if not direct:
                with torch.no_grad():
                    dest.copy_(part)  # to the shard's dtype and device (a GPU's: read into host memory first)
        return True

    def _pread_into(self, f, buf, offset: int) -> None:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise UsageError(f"model path {self.path}: a .distcp shard ends early (truncated checkpoint)")
            done += n
        self.nbytes += done


def local_regions(target: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, ...]]] | None:
    """The boxes of the checkpoint tensor that a parameter (or its DTensor shard) holds, each (a view of the local
    tensor, its global offsets); None for a shard that is not made of such boxes (left to DCP's reader).

    A ``_StridedShard`` (a packed projection split part by part: GPT-2's ``Conv1D`` ``c_attn``, MPT's ``Wqkv``,
    Mamba's ``in_proj`` ...) holds one box per part: rank r of ``split_factor`` parts of ``part`` rows each holds rows
    ``[p * part + r * piece, + piece)`` of every part ``p``, ``piece = part / tp``. torch's chunk list says one box at
    the offset a plain ``Shard`` would have (rank 1 of a ``[q | k | v]`` split at tp=2: rows 1/6 to 4/6 of the whole,
    read as its q, k and v: GPT-2 at tp=2 scored 5% off lm-eval, MPT 16%), so the boxes are computed here."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return [(target, (0,) * target.dim())]
    local = target.to_local()
    if is_strided(target):
        from mpitp.replica.channel_tp import strided_rows

        found = strided_rows(target)  # None: parts or pieces not whole (not a split these boxes describe)
        if found is None:
            return None
        dim, piece, starts = found
        if local.shape[dim] != piece * len(starts) or not local.is_contiguous():
            return None
        return [(local.narrow(dim, i * piece, piece), tuple(start if d == dim else 0 for d in range(local.dim())))
                for i, start in enumerate(starts)]
    regions = target.__create_chunk_list__()
    if len(regions) != 1 or tuple(regions[0].sizes) != tuple(local.shape) or not local.is_contiguous():
        return None
    return [(local, tuple(regions[0].offsets))]


def is_strided(target: torch.Tensor) -> bool:
    """Whether ``target`` is a DTensor split part by part (``_StridedShard``: see :func:`local_regions`)."""
    strided = compat.attribute("torch.distributed.tensor.placement_types._StridedShard")
    return any(isinstance(p, strided) for p in getattr(target, "placements", ()))


def _bytes(t):
    """The bytes of contiguous host tensor ``t`` as a writable numpy array (any dtype: bfloat16 too)."""
    import torch

    return t.view(-1).view(torch.uint8).numpy()

