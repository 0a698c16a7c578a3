"""Loading a torch DCP checkpoint into the model transformers builds from its config, each rank its own shard.

transformers builds the model from the config with the same TP/PP plan as a safetensors load (every parameter this
rank's shard, a DTensor under tp; other stages' layers never created), with its random initialisation skipped; then
:func:`fill` reads each local parameter's region with :class:`~mpitp.replica.dcp_read.SliceReader` (DCP's own
``load`` for chunks it cannot parse) and puts torchtitan's q/k rows into HF's rotary order on the local rows: TP
shards q/k by whole heads, so each rank permutes its own rows. A tensor saved twice under tied names is loaded
once and its twin compared with it (:func:`check_twin`). Never the whole model in one process.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.replica.dcp_names import Entry, Params, Plan
from mpitp.replica.dcp_read import SliceReader, is_strided, local_regions, read_metadata, storage_reader

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from torch.distributed.checkpoint.metadata import Metadata
    from transformers import PreTrainedConfig, PreTrainedModel

log = logging.getLogger("mpitp")

TWIN_BLOCK = 4 << 20
"""Bytes of a tied tensor's twin read at a time to compare it (all the memory :func:`check_twin` adds)."""


def config_params(config: PreTrainedConfig, trust_remote_code: bool = False) -> Params:
    """``{name: shape}`` of every parameter of the causal LM ``config`` builds, on the meta device (no memory), with
    the second names of its tied parameters (the model ties them as it is built: any architecture's own ties)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    first: dict[int, str] = {}
    tied = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[n] = first[id(p)]
        else:
            first[id(p)] = n
    return Params({n: tuple(p.shape) for n, p in model.named_parameters()}, tied)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers warns that every weight of a model built without a checkpoint is "newly initialized": here they
    are all filled from the DCP folder right after, so the warning would be false."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def without_weight_init(cls: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """``cls`` whose ``from_pretrained`` skips the random initialisation of its parameters (every one is read from
    the checkpoint right after; random init of DTensor shards also warns on a CPU mesh), not of its non-persistent
    buffers (rotary frequencies), which the config defines: every parameter is marked initialised first, as
    transformers marks the ones it loaded."""

    class Filled(cls):
        def _initialize_missing_keys(self, *args, **kwargs):
            compat.mark_initialised(self.parameters())
            return super()._initialize_missing_keys(*args, **kwargs)  # an override compat declares and checks

    Filled.__name__, Filled.__qualname__, Filled.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    return Filled


def fill(model: PreTrainedModel, path: str, plan: Plan, config: PreTrainedConfig,
         metadata: Metadata | None = None) -> None:
    """Read each parameter this rank holds from ``path`` (DCP's own ``load``: a DTensor gets only its local slice),
    compare a tied tensor's saved twin with it (:func:`check_twin`), then put torchtitan's q/k rows into HF's rotary
    order, head by head on the local rows."""
    import torch
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    metadata = metadata if metadata is not None else read_metadata(path)
    reader = SliceReader(path, metadata)
    try:
        rest = {}
        for name, p in params.items():
            entry = plan.entries.get(name)
            if entry is None:
                raise UsageError(f"model path {path}: the checkpoint has no tensor for {name}")
            if not reader.fill(entry.key, p.detach()):
                if is_strided(p):
                    _fill_strided(p.detach(), entry.key, path, metadata)
                else:
                    rest[entry.key] = p.detach()
        if rest:  # chunks SliceReader does not parse (compressed, another serialisation): DCP's reader, by chunk
            _dcp_load(rest, path, metadata)
        for name, p in params.items():
            if plan.entries[name].twin is not None:
                check_twin(reader, path, metadata, plan.entries[name], p.detach())
    finally:
        reader.close()
    log.debug("%s: %.1f MiB read for %d local tensors (%d through DCP's reader)", path, reader.nbytes / 2**20,
              len(params), len(rest))
    permuted = [name for name in params if plan.entries[name].permute is not None]
    if not permuted:  # only torchtitan's q/k rows need a head width (Mamba's config has no attention heads)
        return
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    with torch.no_grad():
        for name in permuted:
            p = params[name]
            local = p.to_local() if isinstance(p, DTensor) or isinstance(p.data, DTensor) else p.data
            heads = local.shape[0] // head_dim
            local.copy_(local.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(local.shape))



def _dcp_load(state: dict, path: str, metadata: Metadata) -> None:
    """DCP's own ``load`` of ``state`` (its tensors, or DTensors: their local slices) from ``path``."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is, on each rank
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, storage_reader=storage_reader(path, metadata), no_dist=True)


def _fill_strided(target: torch.Tensor, key: str, path: str, metadata: Metadata) -> None:
    """A packed split's shard (:func:`~mpitp.replica.dcp_read.local_regions`) whose chunks :class:`SliceReader` does
    not parse: DCP's reader would place it where a plain shard lies, so the tensor is read whole (one buffer of its
    size) and each box copied from it."""
    import torch

    boxes = local_regions(target)
    if boxes is None:
        raise UsageError(f"model path {path}: {key} of shape {list(target.shape)} is split part by part at this "
                         f"--tp, in parts or pieces that do not divide it; run it with --tp 1")
    whole = torch.empty(tuple(target.shape), dtype=boxes[0][0].dtype)
    _dcp_load({key: whole}, path, metadata)
    with torch.no_grad():
        for view, lo in boxes:
            view.copy_(whole[tuple(slice(a, a + n) for a, n in zip(lo, view.shape))])


def check_twin(reader: SliceReader, path: str, metadata: Metadata, entry: Entry, target: torch.Tensor) -> None:
    """Refuse, one line naming both, a checkpoint whose ``entry.twin`` (a tied parameter's second name: the head)
    differs from ``entry.key`` (what was loaded: the embedding) in the region ``target`` holds.

    Why read it: they are one tensor in a tied model's ``state_dict()``, so a difference means the checkpoint was
    saved from an untied model, and the config's tie would silently put the embedding where its trained head was.
    Each rank compares only its own region (one more read of the bytes it loaded for that tensor), ``TWIN_BLOCK``
    bytes at a time straight from the chunks, so the check adds a few MiB of memory, never a tensor; a chunk not
    parsed here is read by DCP's reader into one buffer of the shard's size (as a conversion's region buffer).
    Compared bit for bit in the loaded dtype: a difference that rounds away there changes nothing loaded."""
    import torch
    from torch.distributed.tensor import DTensor

    boxes = local_regions(target)
    if boxes is not None and len(boxes) == 1 and boxes[0][0].dim() > 0:
        local, lo = boxes[0]
        rows = max(1, TWIN_BLOCK // max(1, local[0].numel() * local.element_size()))
        for r in range(0, local.shape[0], rows):
            mine = local[r:r + rows]
            theirs = torch.empty(mine.shape, dtype=mine.dtype)
            if not reader.read_region(entry.twin, theirs, (lo[0] + r, *lo[1:])):
                break
            _same_bits(mine, theirs, path, entry)
        else:
            return
    theirs = torch.empty_like(target)
    _dcp_load({entry.twin: theirs}, path, metadata)
    local = target.to_local() if isinstance(target, DTensor) else target
    _same_bits(local, theirs.to_local() if isinstance(theirs, DTensor) else theirs, path, entry)


def _same_bits(mine: torch.Tensor, theirs: torch.Tensor, path: str, entry: Entry) -> None:
    import torch

    a, b = mine.detach().cpu().contiguous().reshape(-1), theirs.contiguous().reshape(-1)
    if not torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)):
        raise UsageError(f"model path {path}: {entry.twin} differs from {entry.key} in the checkpoint, but the "
                         f"config ties them (one tensor, e.g. tie_word_embeddings): it was not saved from a tied "
                         f"model; evaluate it with a config that does not tie them")
