"""Loading a torch DCP checkpoint into the model transformers builds from its config, each rank its own shard.

transformers builds the model from the config with the same TP/PP plan as a safetensors load (every parameter this
rank's shard, a DTensor under tp; other stages' layers never created), with its random initialisation skipped; then
:func:`fill` reads each local parameter's region with :class:`~mpitp.replica.dcp_read.SliceReader` (DCP's own
``load`` for chunks it cannot parse) and puts torchtitan's q/k rows into HF's rotary order on the local rows: TP
shards q/k by whole heads, so each rank permutes its own rows. Never the whole model in one process.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.replica.dcp_names import Plan
from mpitp.replica.dcp_read import SliceReader, read_metadata, storage_reader

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch.distributed.checkpoint.metadata import Metadata
    from transformers import PreTrainedConfig, PreTrainedModel

log = logging.getLogger("mpitp")


def config_params(config: PreTrainedConfig, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter of the causal LM ``config`` builds, on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


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
            dcp.load(rest, storage_reader=storage_reader(path, metadata), no_dist=True)
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

