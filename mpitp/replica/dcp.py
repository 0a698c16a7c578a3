"""torch Distributed Checkpoint (DCP) folders, as torchtitan writes them, evaluated at any layout with no conversion.

A training run saves ``checkpoint/step-N/`` folders: a ``.metadata`` file (every tensor's name, global shape, dtype
and where its saved chunks lie) and ``__R_0.distcp`` shards, in the framework's own parameter names. Converting each
step to a Hugging Face folder costs a full read and write of the model per step; here the folder is read in place:

* the architecture (``config.json``) and tokenizer come from ``--hf-assets DIR`` (torchtitan's own name for that
  folder), else from a ``config.json`` in the checkpoint folder or its parent;
* names: torchtitan's Llama 3 / Qwen 3 names (verified against torchtitan's ``state_dict_adapter.py``), bare or
  under a ``model.`` prefix, or plain HF names (a DCP saved from an HF model's own ``state_dict()``, e.g.
  accelerate's FSDP ``SHARDED_STATE_DICT`` under ``model.``); a full training checkpoint's ``optimizer``,
  ``lr_scheduler``, ``dataloader`` and ``train_state`` entries are ignored. An unknown name, a missing parameter
  or a shape that differs from the config's model is refused naming the parameter, before any rank loads: a
  checkpoint is never loaded wrong;
* torchtitan keeps Llama's q/k rows in Meta's interleaved rotary order; HF's ``convert_llama_weights_to_hf.py``
  permutes them per head (``w.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2)``). That permutation moves rows
  only inside a head, and TP shards q/k by whole heads, so each rank permutes its own rows after loading;
* loading: transformers builds the model from the config with the same TP/PP plan as a safetensors load (every
  parameter this rank's shard, a DTensor under tp; other stages' layers never created), then :class:`SliceReader`
  fills the local parameters from the chunk index of ``.metadata``, ``pread``-ing only the bytes of each rank's
  region of each tensor it holds (chunks it cannot parse go to DCP's own ``load``, one chunk at a time): never the
  whole model in one process.

Formats we do not read (Megatron ``torch_dist``, FSDP1 flat-parameter shards) are refused with the conversion to
use. This module imports torch only inside functions: :func:`is_dcp`, :func:`assets_dir` and the fingerprint's
helpers serve checks on a login node.
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import os
import pickle
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass

from mpitp.errors import UsageError

log = logging.getLogger("mpitp")

METADATA = ".metadata"
IGNORED_SECTIONS = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""Top-level entries of a torchtitan full-state checkpoint that are not model weights."""

# torchtitan name -> (HF name, rotary permutation of rows: "q" / "k" / None), per HF model type. The layer number is
# ``{}``. From torchtitan's models/llama3/model/state_dict_adapter.py and models/qwen3/model/state_dict_adapter.py
# (Qwen 3 keeps HF's rotary layout: no permutation).
_LLAMA = {
    "tok_embeddings.weight": ("model.embed_tokens.weight", None),
    "layers.{}.attention.wq.weight": ("model.layers.{}.self_attn.q_proj.weight", "q"),
    "layers.{}.attention.wk.weight": ("model.layers.{}.self_attn.k_proj.weight", "k"),
    "layers.{}.attention.wv.weight": ("model.layers.{}.self_attn.v_proj.weight", None),
    "layers.{}.attention.wo.weight": ("model.layers.{}.self_attn.o_proj.weight", None),
    "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_proj.weight", None),
    "layers.{}.feed_forward.w2.weight": ("model.layers.{}.mlp.down_proj.weight", None),
    "layers.{}.feed_forward.w3.weight": ("model.layers.{}.mlp.up_proj.weight", None),
    "layers.{}.attention_norm.weight": ("model.layers.{}.input_layernorm.weight", None),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.post_attention_layernorm.weight", None),
    "norm.weight": ("model.norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
_QWEN3 = {**{k: (hf, None) for k, (hf, _) in _LLAMA.items()},
          "layers.{}.attention.q_norm.weight": ("model.layers.{}.self_attn.q_norm.weight", None),
          "layers.{}.attention.k_norm.weight": ("model.layers.{}.self_attn.k_norm.weight", None)}
TITAN_NAMES = {"llama": _LLAMA, "qwen3": _QWEN3}


# ------------------------------------------------------------------------------------------------ the folder


def is_dcp(path: str | None) -> bool:
    """A local folder holding a DCP ``.metadata`` file (and no HF weights, which win: transformers' own loader)."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, METADATA)):
        return False
    return not any(n.endswith((".safetensors", ".bin")) for n in os.listdir(path))


def refuse_foreign(path: str) -> None:
    """One line naming the conversion for checkpoint formats that look like DCP but are not read here."""
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                text = f.read(1 << 20)
        except OSError:
            text = ""
        if "sharded_backend" in text:
            raise UsageError(f"model path {path} is a Megatron-LM distributed checkpoint (metadata.json names a "
                             f"sharded_backend), which mpitp does not read: convert it to a Hugging Face folder "
                             f"first (Megatron-LM tools/checkpoint/convert.py --saver hf, or Megatron-Bridge's "
                             f"export)")
    try:
        names = os.listdir(path)
    except OSError:
        return
    if any(re.fullmatch(r"(pytorch_model|model)_fsdp_(rank)?\d+\.(bin|pt)", n) or re.fullmatch(r".*_rank\d+\.pt", n)
           for n in names):
        raise UsageError(f"model path {path} holds FSDP1 per-rank state files, which mpitp does not read: merge "
                         f"them into a Hugging Face folder first (accelerate merge-weights {path} OUT_DIR)")


def assets_dir(model: str, hf_assets: str | None = None) -> str:
    """The folder with the ``config.json`` (and tokenizer) of DCP checkpoint ``model``: ``--hf-assets``, else the
    checkpoint folder itself, else its parent (torchtitan's ``checkpoint/step-N`` beside a run's ``config.json``)."""
    if hf_assets:
        if not os.path.isfile(os.path.join(os.path.expanduser(hf_assets), "config.json")):
            raise UsageError(f"--hf-assets {hf_assets}: no config.json there (torchtitan's hf_assets folder: the "
                             f"model's config.json and tokenizer files)")
        return os.path.expanduser(hf_assets)
    for d in (model, os.path.dirname(os.path.normpath(model))):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise UsageError(f"model path {model} is a torch DCP checkpoint without a config.json beside it: give "
                     f"--hf-assets DIR (the folder with the model's config.json and tokenizer files)")


def tokenizer_source(model: str | None, tokenizer: str | None, hf_assets: str | None) -> str | None:
    """Where lm-eval reads the tokenizer: ``--tokenizer``, else a DCP checkpoint's assets, else the model."""
    if tokenizer:
        return tokenizer
    if model and is_dcp(model):
        try:
            return assets_dir(model, hf_assets)
        except UsageError:
            return model  # refused by the checks with its reason; here only a name is needed
    return model


# ------------------------------------------------------------------------------------------------ names


@dataclass(frozen=True)
class Entry:
    key: str  # the name in the checkpoint
    permute: str | None  # "q" / "k": torchtitan's rotary row order, permuted to HF's after loading


@dataclass
class Plan:
    """Which checkpoint tensor fills each HF parameter, found from the ``.metadata`` alone."""

    entries: dict[str, Entry]
    naming: str  # "torchtitan" or "hf"
    prefix: str  # "" or "model."
    dtype: object  # the checkpoint's dtype (of its embedding): what --dtype auto loads


class _MetadataPickle(pickle.Unpickler):
    """``.metadata`` is a pickle (torch's ``FileSystemReader`` reads it with plain ``pickle.load``, so a crafted file
    runs code as it is read). This one builds only what DCP's metadata holds: the classes of
    ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts and paths."""

    def find_class(self, module, name):
        import torch

        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as md

            obj = getattr(md, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            return _StorageInfo
        elif (module, name) in (("torch", "Size"), ("torch.serialization", "_get_layout")):
            import torch.serialization

            return torch.Size if name == "Size" else torch.serialization._get_layout
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib

            return getattr(pathlib, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata does not hold (refused: "
                                     f"unpickling it could run code)")


def read_metadata(path: str):
    """The checkpoint's ``Metadata``, read with :class:`_MetadataPickle`; a :class:`UsageError` line otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


def _reader(path: str, metadata):
    """torch's ``FileSystemReader`` for ``path`` that uses ``metadata`` (read by :func:`read_metadata`) instead of
    unpickling ``.metadata`` itself."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def model_tensors(metadata) -> dict[str, tuple[tuple[int, ...], object]]:
    """``{name: (global shape, dtype)}`` of the checkpoint's tensors, training state (optimizer, ...) left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.split(".", 1)[0] in IGNORED_SECTIONS or not isinstance(md, TensorStorageMetadata):
            continue
        out[key] = (tuple(md.size), md.properties.dtype)
    return out


def _titan_to_hf(name: str, table: dict) -> tuple[str, str | None] | None:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        hit = table.get("layers.{}." + m.group(2))
        return (hit[0].format(m.group(1)), hit[1]) if hit else None
    return table.get(name)


def plan_loading(tensors: dict, config, params: dict[str, tuple[int, ...]], where: str) -> Plan:
    """Map every checkpoint tensor onto the parameters ``params`` (``{HF name: global shape}``, of the model the
    config builds); a :class:`UsageError` naming the first unknown, missing or mis-shaped parameter."""
    flat = [k for k in tensors if "_flat_param" in k or "_fsdp_wrapped_module" in k]
    if flat:
        raise UsageError(f"{where}: {flat[0]} is an FSDP1 flat parameter, which mpitp does not read: save the "
                         f"model with a SHARDED_STATE_DICT or FULL_STATE_DICT, or merge it into a Hugging Face "
                         f"folder (accelerate merge-weights)")
    if not tensors:
        raise UsageError(f"{where}: the DCP checkpoint holds no model tensors (only training state)")
    model_type = config.model_type
    table = TITAN_NAMES.get(model_type)
    # torchtitan's names first: its ``norm.weight`` under a ``model.`` prefix is also HF's ``model.norm.weight``.
    candidates = [("torchtitan", prefix) for prefix in ("", "model.")
                  if table and prefix + "tok_embeddings.weight" in tensors]
    candidates += [("hf", prefix) for prefix in ("", "model.")
                   if 2 * sum(prefix + n in tensors for n in params) > len(params)]
    if not candidates:
        if "tok_embeddings.weight" in tensors or "model.tok_embeddings.weight" in tensors:
            raise UsageError(f"{where}: torchtitan parameter names are read for model types "
                             f"{', '.join(sorted(TITAN_NAMES))}, and the config's model type is '{model_type}'")
        raise UsageError(f"{where}: {sorted(tensors)[0]} is neither a torchtitan nor a Hugging Face parameter name "
                         f"of a '{model_type}' model")
    naming, prefix = candidates[0]
    entries: dict[str, Entry] = {}
    for key in sorted(tensors):
        if not key.startswith(prefix):
            raise UsageError(f"{where}: unknown entry {key} (the model's weights are under '{prefix}')")
        name = key[len(prefix):]
        if naming == "torchtitan":
            hit = _titan_to_hf(name, table)
            if hit is None:
                raise UsageError(f"{where}: unknown torchtitan parameter {key} for a '{model_type}' model")
            hf, permute = hit
        else:
            hf, permute = name, None
        if hf not in params:
            why = (" (the config ties the head to the embedding: tie_word_embeddings)"
                   if hf == "lm_head.weight" and getattr(config.get_text_config(), "tie_word_embeddings", False)
                   else "")
            raise UsageError(f"{where}: {key} names no parameter of the config's {model_type} model "
                             f"({hf} does not exist){why}")
        shape = tensors[key][0]
        if tuple(shape) != tuple(params[hf]):
            raise UsageError(f"{where}: {key} has shape {list(shape)} in the checkpoint, but the config's model "
                             f"has {hf} of shape {list(params[hf])}")
        entries[hf] = Entry(key, permute)
    missing = [n for n in params if n not in entries]
    if missing:
        raise UsageError(f"{where}: the checkpoint has no tensor for {missing[0]}"
                         + (f" (and {len(missing) - 1} more parameters)" if len(missing) > 1 else ""))
    embed = next((e.key for n, e in entries.items() if "embed" in n), next(iter(entries.values())).key)
    return Plan(entries, naming, prefix, tensors[embed][1])


def config_params(config, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter of the causal LM ``config`` builds, on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def check(model: str, config, trust_remote_code: bool = False) -> Plan:
    """Rank 0, before loading: the checkpoint's names and shapes against the config's model, from ``.metadata``."""
    tensors = model_tensors(read_metadata(model))
    return plan_loading(tensors, config, config_params(config, trust_remote_code), f"model path {model}")


# ------------------------------------------------------------------------------------------------ loading


@contextlib.contextmanager
def _quiet_transformers():
    """transformers warns that every weight of a model built without a checkpoint is "newly initialized": here they
    are all filled from the DCP folder right after, so the warning would be false."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def from_pretrained(path: str, hf_assets: str | None, distributed_config=None, dtype="auto",
                    trust_remote_code: bool = False, **load_kwargs):
    """This rank's part of DCP checkpoint ``path``: what ``AutoModelForCausalLM.from_pretrained`` gives for an HF
    folder with the same ``distributed_config`` (TP shards as DTensors, only this pipeline stage's layers).

    The model is built by transformers from the config with an empty state dict (its TP/PP plan applied, each rank's
    shards materialised), then :func:`fill` reads each local parameter's slice from the checkpoint.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    if load_kwargs.pop("subfolder", None):
        raise UsageError(f"model path {path}: subfolder= does not apply to a torch DCP checkpoint folder")
    assets = assets_dir(path, hf_assets)
    config = AutoConfig.from_pretrained(assets, trust_remote_code=trust_remote_code)
    metadata = read_metadata(path)
    plan = plan_loading(model_tensors(metadata), config, config_params(config, trust_remote_code),
                        f"model path {path}")
    torch_dtype = plan.dtype if dtype == "auto" else (getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    cls = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    kwargs = dict(config=config, state_dict={}, dtype=torch_dtype, **load_kwargs)
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
    with _quiet_transformers():
        model = _without_weight_init(cls).from_pretrained(None, **kwargs)
    model.__class__ = cls  # the subclass only changed how it was built
    model.config.name_or_path = path
    fill(model, path, plan, config, metadata)
    return model


def _without_weight_init(cls):
    """``cls`` whose ``from_pretrained`` skips the random initialisation of its parameters (every one is read from
    the checkpoint right after; random init of DTensor shards also warns on a CPU mesh), not of its non-persistent
    buffers (rotary frequencies), which the config defines: every parameter is marked initialised first, as
    transformers marks the ones it loaded."""

    class Filled(cls):
        def _initialize_missing_keys(self, *args, **kwargs):
            for p in self.parameters():
                p._is_hf_initialized = True
            return super()._initialize_missing_keys(*args, **kwargs)

    Filled.__name__, Filled.__qualname__, Filled.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    return Filled


def fill(model, path: str, plan: Plan, config, metadata=None) -> None:
    """Read each parameter this rank holds from ``path`` (DCP's own ``load``: a DTensor gets only its local slice),
    then put torchtitan's q/k rows into HF's rotary order, head by head on the local rows."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    metadata = metadata if metadata is not None else read_metadata(path)
    reader = SliceReader(path, metadata)
    rest = {}
    for name, p in params.items():
        entry = plan.entries.get(name)
        if entry is None:
            raise UsageError(f"model path {path}: the checkpoint has no tensor for {name}")
        if not reader.fill(entry.key, p.detach()):
            rest[entry.key] = p.detach()
    reader.close()
    if rest:  # chunks SliceReader does not parse (compressed, another serialisation): DCP's reader, chunk by chunk
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is, on each rank
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(rest, storage_reader=_reader(path, metadata), no_dist=True)
    log.debug("%s: %.1f MiB read for %d local tensors (%d through DCP's reader)", path, reader.nbytes / 2**20,
              len(params), len(rest))
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    with torch.no_grad():
        for name, p in params.items():
            if plan.entries[name].permute is None:
                continue
            local = p.to_local() if isinstance(p, DTensor) or isinstance(p.data, DTensor) else p.data
            heads = local.shape[0] // head_dim
            local.copy_(local.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(local.shape))


# ------------------------------------------------------------------------------------------------ slice reads


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable file of their own (one saved chunk)."""

    def __init__(self, f, offset: int, length: int):
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, buf):
        n = max(0, min(len(buf), self.length - self.pos))
        data = os.pread(self.f.fileno(), n, self.offset + self.pos)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


class _TensorPickle(pickle.Unpickler):
    """Reads a ``torch.save``'d tensor's ``data.pkl`` for its layout only: dtype, storage offset, size, stride.
    Nothing but the tensor-rebuild call, its storage type and an empty OrderedDict is accepted (no code runs)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, int(offset), tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a DCP tensor record")

    def persistent_load(self, pid):
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

    def __init__(self, path: str, metadata):
        self.path, self.metadata = path, metadata
        self.files: dict[str, object] = {}
        self.layouts: dict = {}
        self.nbytes = 0

    def close(self):
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

    def fill(self, key: str, target) -> bool:
        """Fill ``target`` (a parameter's local tensor, or a DTensor: its local shard) with its region of checkpoint
        tensor ``key``; False (nothing written) when a chunk it needs is not one this reader parses."""
        from torch.distributed.tensor import DTensor

        if isinstance(target, DTensor):
            regions = target.__create_chunk_list__()
            local = target.to_local()
            if len(regions) != 1 or tuple(regions[0].sizes) != tuple(local.shape) or not local.is_contiguous():
                return False
            lo = tuple(regions[0].offsets)
        else:
            local, lo = target, (0,) * target.dim()
        return self.read_region(key, local, lo)

    def read_region(self, key: str, local, lo: tuple) -> bool:
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


def _bytes(t):
    """The bytes of contiguous host tensor ``t`` as a writable numpy array (any dtype: bfloat16 too)."""
    import torch

    return t.view(-1).view(torch.uint8).numpy()


# ------------------------------------------------------------------------------------------------ permutations


def titan_to_hf_rows(w, heads: int):
    """torchtitan's (Meta's interleaved) q/k rows in HF's rotate-half order: HF's conversion ``permute``."""
    rows, dim = w.shape
    return w.view(heads, rows // heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


def hf_to_titan_rows(w, heads: int):
    """The inverse of :func:`titan_to_hf_rows` (torchtitan's ``from_hf``): what a torchtitan checkpoint holds."""
    rows, dim = w.shape
    return w.view(heads, 2, rows // heads // 2, dim).transpose(1, 2).reshape(rows, dim)


def hf_to_titan_names(state: dict, config) -> dict:
    """An HF Llama/Qwen3 state dict in torchtitan's names and row order (the tests' checkpoints; torchtitan's
    ``from_hf``)."""
    text = config.get_text_config()
    table = TITAN_NAMES[config.model_type]
    reverse = {hf: (titan, perm) for titan, (hf, perm) in table.items()}
    out = {}
    for name, t in state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        templ = "model.layers.{}." + m.group(2) if m else name
        if templ not in reverse:
            raise KeyError(name)
        titan, perm = reverse[templ]
        if perm == "q":
            t = hf_to_titan_rows(t, text.num_attention_heads)
        elif perm == "k":
            t = hf_to_titan_rows(t, text.num_key_value_heads or text.num_attention_heads)
        out[titan.format(m.group(1)) if m else titan] = t.contiguous()
    return out
