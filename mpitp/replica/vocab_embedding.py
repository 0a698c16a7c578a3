"""The input embedding split by vocabulary (transformers' ``embedding_rowwise``), its partial lookups summed over the
TP group the way every other sum of a replica's CPU tensors goes: over MPI.

transformers runs a vocabulary-split embedding as a DTensor operation: the lookup yields a ``_MaskPartial`` DTensor,
and its ``redistribute`` to ``Replicate`` is an all-reduce through torch's functional collectives -- gloo over
loopback on a CPU, whatever :mod:`mpitp.parallel.cpu_reduce` does with transformers' other TP sums. Profiled in a
gsm8k decode step at tp=2 (torch profiler, one rank): that one redistribute took 2.6 ms of a 45 ms step (2.1 ms of it
waiting in gloo), where the 16 all-reduces of the row-split layers over MPI's shared memory take tens of
microseconds each. Here each rank looks its own rows up (an id outside them reads the rank's row 0, then zeroed) and
the group sums the lookups: every position's row lives on exactly one rank and the others add zeros, so the sum is
that row, bit for bit what transformers' path gives.

Only plain ``nn.Embedding`` modules (the class's own forward: no scaling inside it, no ``max_norm``) whose weight is
split along the vocabulary over the whole group are taken; anything else keeps transformers' path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError

if TYPE_CHECKING:
    import torch


def install(model: torch.nn.Module, tp: int) -> int:
    """Route every vocabulary-split plain embedding of ``model`` (a TP load over ``tp`` ranks) through
    :func:`_summed_lookup`; returns how many. Every rank decides alike: from the module types and the weights'
    placements, which the plan makes the same on every rank."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(module, torch.nn.Embedding) and type(module).forward is torch.nn.Embedding.forward
                and module.max_norm is None and isinstance(weight, DTensor)
                and tuple(weight.placements) == (Shard(0),) and weight.device_mesh.size() == tp):
            continue
        module.forward = _summed_lookup(module, weight.device_mesh)
        n += 1
    return n


def _summed_lookup(module: torch.nn.Embedding, mesh):
    from mpitp.replica.scoring import first_row

    vocab, start, group = int(module.weight.shape[0]), first_row(module.weight), mesh.get_group()

    def reduce(out: torch.Tensor) -> None:
        compat.attribute(compat.TP_DIST).all_reduce(out, group=group)  # read per call: MPI on CPU

    return lambda input_ids: lookup(input_ids, module.weight.to_local(), start, reduce, vocab)


def lookup(input_ids: torch.Tensor, local_weight: torch.Tensor, start: int, reduce, vocab: int) -> torch.Tensor:
    """The embedding of ``input_ids`` from the rows ``start .. start + len(local_weight)`` this rank holds, the
    others zero, summed over the group by ``reduce`` (in place). On a CPU an id outside the ``vocab`` rows is
    refused (one process's lookup raises) rather than summed to a row of zeros (what the DTensor lookup gives): every
    rank of the group sees the same ids, so every one refuses."""
    import torch

    if input_ids.device.type == "cpu":  # a GPU would wait for the answer: there, as transformers' DTensor lookup
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
        if bad.numel():
            raise UsageError(f"token id {int(bad[0])} is outside the model's input embedding of {vocab} rows: the "
                             "tokenizer has ids the model lacks (--tokenizer of another model?)")
    local = input_ids - start
    outside = (local < 0) | (local >= local_weight.shape[0])
    if local_weight.shape[0] == 0:  # a rank past the vocabulary's end (tp > rows): adds zeros
        out = local_weight.new_zeros((*input_ids.shape, local_weight.shape[1]))
    else:
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), local_weight)
    out.masked_fill_(outside.unsqueeze(-1), 0)
    reduce(out)
    return out
