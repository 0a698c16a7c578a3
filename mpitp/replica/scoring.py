"""Vocab-parallel scoring: log-probs and greedy checks without ever gathering full logits.

Each TP rank holds a slice of the LM head's rows (a slice of the vocabulary). For the scored positions only, every
rank computes its local logits and the group combines three O(tokens) reductions:

1. all-reduce MAX of the local row maxima  -> global max ``m``                      (4 bytes/token)
2. all-reduce SUM of [sum exp(l - m), target logit (owner only)]                    (8 bytes/token)
3. all-reduce MIN of the first global index reaching ``m`` (torch.argmax's rule)    (4 bytes/token)

so log p(target) = target - m - log(sum exp) and is_greedy = (argmax == target): 16 bytes per token whatever the
vocabulary size. Rows are processed in blocks so the peak is bounded by ``block_elems`` floats, not by
``tokens x vocab``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mpitp.replica.logits import HeadTransform, head_transform

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedModel

    from mpitp.parallel.cpu_reduce import MPIReductions

_INT_BIG = 2**31 - 1


@dataclass
class CommCounter:
    """Bytes this rank sent into TP collectives, and how many calls, for the run's stats."""

    bytes: int = 0
    calls: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()
        self.calls += 1


class TPOps:
    """The reductions scoring needs, over a TP group, or no-ops for tp=1 (a fake for maths tests fits too).

    The leader's messages to its replica go another way (:class:`mpitp.replica.protocol.ControlChannel`).

    ``counter`` counts everything this rank sends into the TP group; ``reduce_counter`` only the scoring reductions
    (the O(tokens) traffic that must not grow with the vocabulary).
    """

    def __init__(self, size: int = 1, group: ProcessGroup | None = None, counter: CommCounter | None = None,
                 reduce_counter: CommCounter | None = None, mpi: MPIReductions | None = None):
        """``mpi``: the group's reductions over MPI (:mod:`mpitp.parallel.cpu_reduce`), used for the tensors it
        takes (CPU, MPI's dtypes); torch's collectives otherwise."""
        self.size = size
        self.group = group
        self.mpi = mpi
        self.counter = counter if counter is not None else CommCounter()
        self.reduce_counter = reduce_counter if reduce_counter is not None else CommCounter()

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            self.counter.add(t)
            self.reduce_counter.add(t)
            if self.mpi is not None and self.mpi.takes(t, self.group):
                self.mpi.all_reduce(t, op)
            else:
                dist.all_reduce(t, op=op, group=self.group)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._reduce(t, dist.ReduceOp.MAX)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._reduce(t, dist.ReduceOp.SUM)

    def min(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._reduce(t, dist.ReduceOp.MIN)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` stacked along a new first dimension, in rank order (``[size, *t.shape]``)."""
        if self.size == 1:
            return t.unsqueeze(0)
        import torch.distributed as dist

        self.counter.add(t)
        self.reduce_counter.add(t)
        if self.mpi is not None and self.mpi.takes(t, self.group):
            return self.mpi.all_gather(t)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)


@dataclass
class VocabParallelHead:
    """This rank's rows ``[offset, offset + weight.shape[0])`` of the LM head, plus the ops to combine shards."""

    weight: torch.Tensor
    offset: int
    vocab_size: int
    ops: TPOps
    bias: torch.Tensor | None = None
    transform: HeadTransform = field(default_factory=HeadTransform)  # the model's own steps around its head
    block_elems: int = 1 << 24  # floats of local logits alive at once (64 MiB in fp32)
    _wt: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_model(cls, model: PreTrainedModel, ops: TPOps) -> VocabParallelHead:
        """Take the local vocabulary shard of ``model``'s output embedding (sharded DTensor or a full weight), with
        the steps its forward takes around the head (:func:`mpitp.replica.logits.head_transform`)."""
        head = model.get_output_embeddings()
        weight, offset = _local_rows(head.weight, ops)
        bias = getattr(head, "bias", None)
        if bias is not None:
            bias, _ = _local_rows(bias, ops)
        vocab = int(head.weight.shape[0])
        transform = head_transform(model)
        if transform.vocab_limit is not None and transform.vocab_limit < vocab:  # a padded head: rows cut off
            vocab = transform.vocab_limit
            keep = max(0, min(weight.shape[0], vocab - offset))
            weight = weight[:keep]
            bias = bias[:keep] if bias is not None else None
        return cls(weight=weight, offset=offset, vocab_size=vocab, ops=ops, bias=bias, transform=transform)

    def local_logits(self, h: torch.Tensor, head_input: bool = False) -> torch.Tensor:
        """float32 logits of this shard for hidden states ``h`` [N, H], as the model's forward would return them.

        ``h`` is the decoder's output, or with ``head_input`` what the model's forward hands its head (its
        hidden-state steps already taken: the greedy stand-in head is called there)."""
        w = self.weight
        if not head_input:
            h = self.transform.apply_hidden(h)
        logits = torch.nn.functional.linear(h.to(w.dtype), w, self.bias).float()
        return self.transform.apply_logits(logits)

    def _blocks(self, n: int):
        # Sized from the *global* vocabulary: every rank must cut the same blocks, or their collectives would
        # not pair up (uneven shards differ by a row).
        step = max(1, self.block_elems // max(1, -(-self.vocab_size // self.ops.size)))
        for start in range(0, n, step):
            yield slice(start, min(n, start + step))

    def _global_max_and_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' global maximum and the lowest global index holding it (torch.argmax's rule), in one pass over
        the local logits: a rank's first index of the global maximum is its first index of its own maximum, where
        the two are equal (``torch.max`` returns the first maximal index); elsewhere the rank has none. A NaN
        maximum equals nothing, so such a row has no index (greedy false), as its log-probability is NaN."""
        local_max, first = logits.max(dim=-1)
        gmax = self.ops.max(local_max.clone())
        none = torch.full_like(first, _INT_BIG, dtype=torch.int32)
        cand = torch.where(local_max == gmax, first.to(torch.int32) + self.offset, none)
        return gmax, self.ops.min(cand)

    @torch.no_grad()
    def score(self, h: torch.Tensor, targets: torch.Tensor,
              head_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) (float32) and whether target is the argmax, for hidden states ``h`` [N, H] (``head_input``:
        as :meth:`local_logits`)."""
        n = h.shape[0]
        out_lp = torch.empty(n, dtype=torch.float32, device=h.device)
        out_greedy = torch.empty(n, dtype=torch.bool, device=h.device)
        vloc = self.weight.shape[0]
        for sl in self._blocks(n):
            logits = self.local_logits(h[sl], head_input)
            gmax, argmax = self._global_max_and_argmax(logits)
            tgt = targets[sl] - self.offset
            mine = (tgt >= 0) & (tgt < vloc)
            tlogit = logits.gather(1, tgt.clamp(0, vloc - 1).unsqueeze(1)).squeeze(1)
            sumexp = logits.sub_(gmax.unsqueeze(-1)).exp_().sum(dim=-1)  # in place: the block's logits end here
            pair = torch.stack([sumexp, torch.where(mine, tlogit, 0.0)], 1)
            pair = self.ops.sum(pair)
            out_lp[sl] = pair[:, 1] - gmax - torch.log(pair[:, 0])
            out_greedy[sl] = argmax.to(targets.dtype) == targets[sl]
        return out_lp, out_greedy

    @torch.no_grad()
    def argmax(self, h: torch.Tensor, head_input: bool = False) -> torch.Tensor:
        """Global greedy token ids for hidden states ``h`` [N, H] (lowest index among ties; an id past the vocabulary
        where a row's maximum is NaN).

        One collective per block, not two: each rank's (maximum, first index of it) are gathered and every rank picks
        the largest maximum, the lowest index among equal ones. That is :meth:`_global_max_and_argmax`'s answer
        (a rank's first hit of the global maximum is its own first maximum), for a decode step's one all-gather of 16
        bytes per row instead of a max and a min all-reduce one after the other."""
        out = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        for sl in self._blocks(h.shape[0]):
            logits = self.local_logits(h[sl], head_input)
            if logits.shape[-1]:
                local_max, first = logits.max(dim=-1)  # torch.max: the first maximal index
                first = (first + self.offset).double()
            else:  # a shard wholly past a padded vocabulary: never the answer
                local_max = torch.full(logits.shape[:-1], float("-inf"), device=h.device)
                first = torch.full(logits.shape[:-1], float(_INT_BIG), dtype=torch.float64, device=h.device)
            parts = self.ops.gather(torch.stack([local_max.double(), first], dim=-1))  # [size, n, 2]
            vals, idx = parts[..., 0], parts[..., 1]
            gmax = vals.max(dim=0).values  # NaN wins: the row is reported
            pick = torch.where(vals == gmax.unsqueeze(0), idx, float(_INT_BIG)).min(dim=0).values
            out[sl] = torch.where(torch.isnan(gmax), float(_INT_BIG), pick).long()
        return out

    @torch.no_grad()
    def local_log_softmax(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's columns ``[offset, offset + width)`` of the log-softmax rows for hidden states ``h`` [N, H]:
        the normaliser from two reductions (max, sum of exp: 8 B per row), nothing gathered (the head check's
        comparison; :meth:`full_logits` would all-gather 4 B per row and vocabulary entry)."""
        logits = self.local_logits(h)
        gmax = self.ops.max(logits.max(dim=-1).values.clone())
        sumexp = self.ops.sum(torch.exp(logits - gmax.unsqueeze(-1)).sum(dim=-1))
        return logits - (gmax + torch.log(sumexp)).unsqueeze(-1)

    def full_logits(self, h: torch.Tensor, head_input: bool = False) -> torch.Tensor:
        """All-gathered logits [N, V]; only for sampling, where the full distribution is genuinely needed. The
        shards go in vocabulary order, which is not rank order when the head is spread over pipeline stages."""
        local = self.local_logits(h, head_input)
        if self.ops.size == 1:
            return local
        import torch.distributed as dist

        sizes = [torch.zeros(2, dtype=torch.long, device=h.device) for _ in range(self.ops.size)]
        dist.all_gather(sizes, torch.tensor([local.shape[1], self.offset], device=h.device), group=self.ops.group)
        width = int(max(int(s[0]) for s in sizes))
        padded = torch.full((local.shape[0], width), float("-inf"), device=h.device)
        padded[:, : local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in range(self.ops.size)]
        self.ops.counter.add(padded)
        dist.all_gather(parts, padded, group=self.ops.group)
        order = sorted(range(self.ops.size), key=lambda r: int(sizes[r][1]))
        return torch.cat([parts[r][:, : int(sizes[r][0])] for r in order], dim=1)


def _local_rows(param: torch.Tensor, ops: TPOps) -> tuple[torch.Tensor, int]:
    """The rows of a vocabulary-major parameter that this rank owns, and the global index of the first one.

    transformers shards the head (and, with tied embeddings, the embedding) along the vocabulary as a DTensor;
    a plain tensor (tp=1, or a model class whose plan replicates the head) is sliced here evenly, the way
    ``torch.chunk`` (and DTensor's ``Shard(0)``) split an uneven vocabulary: ``ceil(V / tp)`` rows per rank.
    """
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover
        DTensor = ()  # type: ignore
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    vocab = int(param.shape[0])
    if isinstance(data, DTensor):
        placements = data.placements
        local = data.to_local()
        if any(isinstance(p, Shard) and p.dim == 0 for p in placements):
            from mpitp import compat

            _, offsets = compat.attribute(compat.LOCAL_SHARD)(data.shape, data.device_mesh, placements)
            return local, int(offsets[0])
        data = local  # replicated: slice below
    rank = _rank(ops)
    per = -(-vocab // ops.size)
    start = min(vocab, rank * per)
    return data[start : min(vocab, start + per)], start


def _rank(ops: TPOps) -> int:
    if ops.size == 1:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group=ops.group)
