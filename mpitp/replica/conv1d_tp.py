"""Tensor-parallel styles for transformers' ``Conv1D`` (GPT-2, OpenAI GPT), which its own styles cannot shard.

``Conv1D`` is a linear layer with its weight stored transposed (``[in, out]``, ``x @ W + b``) and its output width in
``nf`` rather than ``out_features``: transformers' ``colwise``/``rowwise`` shard the wrong dimension of it and refuse
it for want of ``in_features``/``out_features``. These styles are the same splits written for that storage, in
transformers' own style interface, and registered under new names (nothing of transformers' is replaced):

- :data:`COLWISE`: the output features split (weight ``Shard(1)``, bias ``Shard(0)``): each rank computes its own
  heads' or hidden units' outputs from the whole input;
- :data:`PACKED_QKV`: the same for a fused ``[q | k | v]`` output (GPT-2's ``c_attn``): each rank takes its share of
  each of the three parts (``_StridedShard``, the placement transformers' ``packed_colwise`` uses, on weight and bias);
- :data:`ROWWISE`: the input features split (weight ``Shard(0)``); the partial products summed over the TP group
  (``tensor_parallel.dist.all_reduce``, the call mpitp routes over MPI on CPU) and the bias added once, after.

``shard_param`` and ``install_forward`` take transformers' keyword context (``config=``, ``mesh_manager=`` since 5.25,
nothing in 5.24) and need none of it: ``**_context`` accepts whichever the installed release passes.

Inference only: inputs and outputs stay plain local tensors, as transformers' own fast path for ``nn.Linear`` keeps
them (no DTensor per forward, no gradient bookkeeping).
"""

from __future__ import annotations

from mpitp import compat
from mpitp.replica.channel_tp import place

COLWISE = "mpitp_conv1d_colwise"
PACKED_QKV = "mpitp_conv1d_packed_colwise_3"
ROWWISE = "mpitp_conv1d_rowwise"

_TP = "transformers.distributed.tensor_parallel"


def styles() -> dict[str, object]:
    """The three styles by name, built on transformers' ``TensorParallelLayer`` (imported here, not at import)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    strided = compat.attribute("torch.distributed.tensor.placement_types._StridedShard")
    base = compat.attribute(f"{_TP}.TensorParallelLayer")
    local_params = compat.attribute("transformers.distributed.parallel_utils._use_local_dtensor_params")

    class Conv1DColwise(base):
        """Output features split; ``split_factor`` > 1: a fused output of that many equal parts, each split."""

        def __init__(self, split_factor: int = 1):
            self.split_factor = split_factor

        def shard_param(self, module, param, mesh, **_context) -> None:
            dim = 1 if param == "weight" else 0  # weight [in, out], bias [out]
            place(module, param, mesh,
                  Shard(dim) if self.split_factor == 1 else strided(dim=dim, split_factor=self.split_factor))

        def install_forward(self, module, mesh, **_context):
            def forward(x):  # Conv1D.forward on this rank's columns (its own reads the full width from nf)
                with local_params(module):
                    w, b = module.weight, module.bias
                    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[-1])

            module.forward = forward
            return module

    class Conv1DRowwise(base):
        """Input features split, the partial outputs summed over the group, the bias added once after the sum."""

        def shard_param(self, module, param, mesh, **_context) -> None:
            place(module, param, mesh, Replicate() if param == "bias" else Shard(0))

        def install_forward(self, module, mesh, **_context):
            group = mesh.get_group()

            def forward(x):
                with local_params(module):
                    w, b = module.weight, module.bias
                    out = (x.reshape(-1, x.shape[-1]) @ w).view(*x.shape[:-1], w.shape[-1])
                # read at every call: mpitp routes it over MPI on CPU
                compat.attribute(compat.TP_DIST).all_reduce(out, group=group)
                return out if b is None else out + b

            module.forward = forward
            return module

    return {COLWISE: Conv1DColwise(), PACKED_QKV: Conv1DColwise(split_factor=3), ROWWISE: Conv1DRowwise()}
