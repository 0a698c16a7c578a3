"""Tensor-parallel styles transformers lacks, for layers split by channel or by packed part: state-space mixers
(Mamba, Falcon-Mamba), fused experts (DBRX, JetMoE), a ``Sequential`` MLP (CTRL), an RMS norm over a split width
(BitNet) and packed projections with a bias.

A Mamba mixer has no heads, but its inner channels (``intermediate_size``) are independent from the input projection
to the output projection: the depthwise convolution, the time step, the selective scan and the ``D`` skip are per
channel. Only ``x_proj`` mixes them (into the time-step rank and the state's ``B``/``C``), so it is split by rows and
its partial products summed over the group (transformers' ``rowwise``): every rank then holds the same ``B``, ``C``
and time-step input, exactly as one process computes them (one sum in another order). Each rank computes its
``1/tp`` of the channels; ``out_proj`` is ``rowwise`` again. What transformers' styles cannot express:

- :data:`ROWS`: every parameter of a module split along its first dimension, its forward left alone. The mixer
  reads ``conv1d.weight`` (``[channels, 1, kernel]``), ``dt_proj.weight``/``bias`` and its own ``A_log`` and ``D``
  directly instead of calling the modules: no forward hook would run, and ``colwise`` shards a 3-D weight on the
  wrong dimension and refuses a module without ``out_features``.
- :data:`LOCAL`: the mixer's forward run with every sharded parameter of the module and its children swapped for the
  rank's local tensor (transformers' own local-parameter swap, one module at a time): the direct reads above then see
  plain tensors of the rank's channels. Its own parameters are left whole unless a rule names them (``A_log`` and
  ``D`` are :data:`ROWS`).
- :data:`EXPERT_ROWS` and :data:`LOCAL_SUM`: DBRX keeps each layer's experts in three parameters of ``[experts *
  ffn, hidden]`` rows that its forward views per expert. :data:`EXPERT_ROWS` gives each rank ``1/tp`` of every
  expert's ``ffn`` rows (``_StridedShard`` with one part per expert: the count read from the module's
  ``moe_num_experts``), so every rank computes every routed token's expert on its part of the width; :data:`LOCAL_SUM`
  runs the experts module on the local shards and sums its output over the group (the partial sums of ``w2``), as
  ``rowwise`` does for a linear layer.
- :data:`DIM1`, :data:`DIM2`, :data:`PACKED_DIM1_2`: a parameter split along its second or third dimension (the
  second of two equal parts each: ``[experts, 2 * ffn, hidden]``), for JetMoE's experts, which keep
  ``[experts, out, in]`` weights in a module whose forward slices them per expert: ``out`` split where the next step
  works per head or channel, ``in`` where the partial products are summed after (``sum_after`` in
  :mod:`mpitp.replica.tp_plans`).
- :data:`SEQUENTIAL_MLP`: an MLP written as ``nn.Sequential(Linear, activation, Linear)`` (CTRL's ``ffn``). Its
  children are named ``0`` and ``2``, and transformers reads every number in a rule's name as a layer index, so no
  rule can tell them apart; this style sits on the ``Sequential`` itself and splits its first linear layer by output
  rows and its last by input columns (their placements set on the meta parameters, which the load then fills as for
  any sharded parameter), and sums the output over the group before adding the last bias once.
- :data:`RMS_NORM`: an RMS norm over a width the group splits (BitNet's ``attn_sub_norm`` over the attention output
  and ``ffn_sub_norm`` over the MLP width, between the column- and the row-split projections): each rank holds its
  part of the weight, sums the squares of its part, the sums are added over the group (O(tokens) numbers) and divided
  by the full width, as one process's mean over the whole row; then each rank scales its own part.
- :data:`PACKED_2` / :data:`PACKED_3`: transformers' ``packed_colwise`` (a fused output of 2 or 3 equal parts, each
  split) with the bias split the same way. transformers splits a 1-D bias of a packed projection contiguously (rank
  0 would add ``[x | first half of z]``'s bias to its ``x`` and ``z``): the weights' ``_StridedShard`` on the bias
  too. (Mamba's ``in_proj`` is ``[x | z]``; MPT's ``Wqkv`` ``[q | k | v]`` has a bias where ``no_bias`` is False.)

Registered under new names next to transformers' own (:func:`mpitp.replica.tp_plans._register_styles`), nothing of
transformers' replaced. ``**_context``: the keyword context transformers passes (``config=``, ``mesh_manager=`` since
5.25, nothing in 5.24).
"""

from __future__ import annotations

import contextlib

from mpitp import compat

ROWS = "mpitp_rows"
DIM1 = "mpitp_dim1"
DIM2 = "mpitp_dim2"
PACKED_DIM1_2 = "mpitp_packed_dim1_2"
LOCAL = "mpitp_local"
EXPERT_ROWS = "mpitp_expert_rows"
LOCAL_SUM = "mpitp_local_sum"
SEQUENTIAL_MLP = "mpitp_sequential_mlp"
RMS_NORM = "mpitp_sharded_rms_norm"
PACKED_2 = "mpitp_packed_colwise_2"
PACKED_3 = "mpitp_packed_colwise_3"

_TP = "transformers.distributed.tensor_parallel"

#: The styles that install a forward of their own on the module (the others only shard parameters).
FORWARDS = frozenset({LOCAL, LOCAL_SUM, SEQUENTIAL_MLP, RMS_NORM})


def strided_starts(size: int, split_factor: int, ranks: int, rank: int) -> tuple[int, list[int]] | None:
    """Where rank ``rank`` of ``ranks`` finds its rows of a dimension of ``size`` under ``_StridedShard(dim,
    split_factor)`` (a packed projection split part by part): ``(piece, starts)``, its ``piece`` rows at each start,
    one per part, in the order it holds them; None where parts or pieces are not whole. torch's chunk list reports
    such a shard as one block at a plain ``Shard``'s offset, which is not where its rows are."""
    part = size // split_factor
    if size % split_factor or part % ranks:
        return None
    piece = part // ranks
    return piece, [p * part + rank * piece for p in range(split_factor)]


def strided_rows(target) -> tuple[int, int, list[int]] | None:
    """``(dim, piece, starts)`` of a DTensor split part by part over a 1-D mesh (``_StridedShard``): its ``piece``
    rows of dimension ``dim`` at each start (:func:`strided_starts`); None for any other tensor, or a split whose
    parts or pieces are not whole. What a LoRA merge (:func:`strided_index`) and the DCP reader
    (:func:`mpitp.replica.dcp_read.local_regions`) both need to know of such a shard."""
    strided = compat.attribute("torch.distributed.tensor.placement_types._StridedShard")
    placements = getattr(target, "placements", ())
    if len(placements) != 1 or not isinstance(placements[0], strided):
        return None
    dim = placements[0].dim % target.dim()
    mesh = target.device_mesh
    found = strided_starts(target.shape[dim], placements[0].split_factor, mesh.size(), mesh.get_local_rank())
    return None if found is None else (dim, *found)


def strided_index(target) -> tuple | None:
    """For a DTensor split part by part over a 1-D mesh: the index (a row-number tensor on the split dimension,
    every other dimension whole) of the whole tensor that its local shard holds; None for any other tensor."""
    import torch

    found = strided_rows(target)
    if found is None:
        return None
    dim, piece, starts = found
    rows = torch.cat([torch.arange(s, s + piece) for s in starts])
    return tuple(rows if d == dim else slice(None) for d in range(target.dim()))


def place(module, param: str, mesh, placement) -> None:
    """Replace ``module``'s parameter ``param`` (where it has one) by a DTensor of ``placement`` over ``mesh``, as
    transformers' own styles do in ``shard_param`` (on the meta device: metadata only; the load fills each rank's
    shard)."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    meta = getattr(module, param, None)
    if meta is not None:
        module.register_parameter(param, torch.nn.Parameter(
            distribute_tensor(meta, mesh, [placement], src_data_rank=None), requires_grad=meta.requires_grad))


def styles() -> dict[str, object]:
    """The styles by name, built on transformers' classes (imported here, not at import)."""
    from torch.distributed.tensor import Shard

    strided = compat.attribute("torch.distributed.tensor.placement_types._StridedShard")
    base = compat.attribute(f"{_TP}.TensorParallelLayer")
    packed = compat.attribute(f"{_TP}.PackedColwiseParallel")
    local_params = compat.attribute("transformers.distributed.parallel_utils._use_local_dtensor_params")

    class Rows(base):
        """Every parameter ``Shard(dim)`` (``split`` > 1: that many equal parts, each split); the forward untouched
        (the parent reads the weights)."""

        def __init__(self, dim: int = 0, split: int = 1):
            self.dim, self.split = dim, split

        def shard_param(self, module, param, mesh, **_context) -> None:
            place(module, param, mesh, Shard(self.dim) if self.split == 1 else
                  strided(dim=self.dim, split_factor=self.split))

        def install_forward(self, module, mesh, **_context):
            return module

    @contextlib.contextmanager
    def local_subtree(module):
        """Every sharded parameter of ``module`` and its children swapped for the rank's local tensor meanwhile."""
        with contextlib.ExitStack() as stack:
            for m in module.modules():
                stack.enter_context(local_params(m))
            yield

    class Local(base):
        """The forward run on the local shards of the whole subtree; nothing sharded by this rule."""

        def install_forward(self, module, mesh, **_context):
            original = module.forward

            def forward(*args, **kwargs):
                with local_subtree(module):
                    return original(*args, **kwargs)

            module.forward = forward
            return module

    class ExpertRows(base):
        """``[experts * ffn, hidden]``: each expert's ``ffn`` rows split over the group."""

        def shard_param(self, module, param, mesh, **_context) -> None:
            place(module, param, mesh, strided(dim=0, split_factor=int(module.moe_num_experts)))

        def install_forward(self, module, mesh, **_context):
            return module

    class LocalSum(Local):
        """:class:`Local`, the output summed over the group."""

        def install_forward(self, module, mesh, **_context):
            super().install_forward(module, mesh)
            local_forward, group = module.forward, mesh.get_group()

            def forward(*args, **kwargs):
                out = local_forward(*args, **kwargs)
                compat.attribute(compat.TP_DIST).all_reduce(out, group=group)  # read per call: MPI on CPU
                return out

            module.forward = forward
            return module

    class SequentialMLP(base):
        """``Sequential(Linear, act, Linear)``: the first split by rows, the last by columns, the sum after."""

        def install_forward(self, module, mesh, **_context):
            first, last = module[0], module[len(module) - 1]
            for param in ("weight", "bias"):
                place(first, param, mesh, Shard(0))
            place(last, "weight", mesh, Shard(1))
            group = mesh.get_group()

            def forward(x):
                bias = last.bias
                with local_subtree(module):
                    last.bias = None
                    try:
                        out = module.__class__.forward(module, x)
                    finally:
                        last.bias = bias
                compat.attribute(compat.TP_DIST).all_reduce(out, group=group)  # read per call: MPI on CPU
                return out if bias is None else out + bias

            module.forward = forward
            return module

    class ShardedRMSNorm(base):
        """``weight`` ``Shard(0)``; the mean of squares summed over the group (see the module docstring)."""

        def shard_param(self, module, param, mesh, **_context) -> None:
            place(module, param, mesh, Shard(0))

        def install_forward(self, module, mesh, **_context):
            group, width = mesh.get_group(), int(module.weight.shape[0])  # the full width: the DTensor's shape
            reduce = compat.attribute(compat.TP_DIST).all_reduce

            def forward(hidden_states):
                import torch

                dtype = hidden_states.dtype
                x = hidden_states.to(torch.float32)
                squares = x.pow(2).sum(-1, keepdim=True)
                reduce(squares, group=group)  # read per call: MPI on CPU
                x = x * torch.rsqrt(squares / width + module.variance_epsilon)
                with local_params(module):
                    return module.weight * x.to(dtype)

            module.forward = forward
            return module

    class PackedWithBias(packed):
        """transformers' packed split, the bias strided like the weight."""

        def shard_param(self, module, param, mesh, **context) -> None:
            meta = getattr(module, param, None)
            if meta is not None and meta.ndim == 1:
                place(module, param, mesh, strided(dim=0, split_factor=self.split_factor))
                return
            super().shard_param(module, param, mesh, **context)

    return {ROWS: Rows(), DIM1: Rows(1), DIM2: Rows(2), PACKED_DIM1_2: Rows(1, 2), LOCAL: Local(),
            EXPERT_ROWS: ExpertRows(), LOCAL_SUM: LocalSum(), SEQUENTIAL_MLP: SequentialMLP(),
            RMS_NORM: ShardedRMSNorm(),
            PACKED_2: PackedWithBias(split_factor=2), PACKED_3: PackedWithBias(split_factor=3)}
