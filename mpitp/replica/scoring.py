"""Vocab-parallel scoring: log-probs and greedy checks without ever gathering full logits.

Each TP rank holds a slice of the LM head's rows (a slice of the vocabulary). For the scored positions only, every
rank computes its local logits and sums them up per row: its maximum ``m_r``, ``s_r = sum exp(l - m_r)``, the target's
logit (on the rank that holds it, 0 elsewhere) and the first index of ``m_r`` (torch.argmax's rule). One all-gather
of those four float32 per row (16 bytes per token whatever the vocabulary size), and every rank has
``m = max m_r``, ``sum exp = sum_r s_r exp(m_r - m)``, log p(target) = target - m - log(sum exp) and is_greedy =
(the lowest index reaching ``m`` == target). On a CPU the local logits are made and summed up in pieces of
:data:`CPU_HEAD_COLUMNS` vocabulary rows (MKL's speed on a narrow product, and each piece reduced while in cache).
Rows are processed in blocks so the peak is bounded by ``block_elems`` floats, not by
``tokens x vocab``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mpitp.parallel.deadline import torch_deadline
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
                with torch_deadline("TP all-reduce", None):
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
        with torch_deadline("TP all-gather", None):
            dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)


#: Vocabulary rows per matrix product on a CPU (:func:`head_product`).
CPU_HEAD_COLUMNS = 512


def cpu_pieces(w: torch.Tensor) -> list[slice] | None:
    """The blocks of :data:`CPU_HEAD_COLUMNS` vocabulary rows of an LM head's rows ``w`` [V, H] taken one product
    each (:func:`head_product`); None where one product serves: a GPU, or a shard of at most two blocks."""
    n = w.shape[0]
    if w.device.type != "cpu" or n <= 2 * CPU_HEAD_COLUMNS:
        return None
    return [slice(start, min(n, start + CPU_HEAD_COLUMNS)) for start in range(0, n, CPU_HEAD_COLUMNS)]


def head_product(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(h, w, bias)`` for an LM head's rows ``w`` [V, H]; on a CPU in blocks of :data:`CPU_HEAD_COLUMNS`
    vocabulary rows written into one output.

    Why: MKL's single product over a whole vocabulary shard (25k-50k columns) runs at 50-60 GFLOP/s on a core where the
    same product in blocks of 512 columns runs at 90 (1.5x at hidden 512, 1.05x at 4096; never slower in
    ``bench/README.md``'s table). Each logit is one dot product over the same hidden dimension either way; whether
    the rounding matches the single product bit for bit depends on the kernels MKL picks for the shapes: it did on
    the AMD VMs of sessions 1-22, while on an Intel AVX-512 VM (session 23) two threads split a one-row product's
    reduction differently and bf16 products of 100+ rows at hidden 512 round differently, by a unit or so in the last
    place (``tests/test_scoring_math.py`` holds them to that). lm-eval's own logits move as much with its batch's
    shape, and parity's rule is 1e-5 relative. A GPU keeps one product."""
    pieces = cpu_pieces(w)
    if pieces is None or h.dim() != 2:
        return torch.nn.functional.linear(h, w, bias)
    out = torch.empty(h.shape[0], w.shape[0], dtype=torch.result_type(h, w), device=h.device)
    for rows in pieces:
        if bias is None:
            torch.mm(h, w[rows].t(), out=out[:, rows])
        else:
            torch.addmm(bias[rows], h, w[rows].t(), out=out[:, rows])
    return out


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
        logits = head_product(h.to(w.dtype), w, self.bias).float()
        return self.transform.apply_logits(logits)

    def _blocks(self, n: int):
        # Sized from the *global* vocabulary: every rank must cut the same blocks, or their collectives would
        # not pair up (uneven shards differ by a row).
        step = max(1, self.block_elems // max(1, -(-self.vocab_size // self.ops.size)))
        for start in range(0, n, step):
            yield slice(start, min(n, start + step))

    def _logit_chunks(self, h: torch.Tensor, head_input: bool):
        """This shard's logits for ``h`` as (first local row, logits [N, width]) pieces: where the model's
        steps after its head are scalars' (:attr:`HeadTransform.scalar_logit_steps`), one piece per block of
        :func:`cpu_pieces` (each product at MKL's full speed, and its logits reduced while still in cache); otherwise
        the whole shard at once (:meth:`local_logits`)."""
        w = self.weight
        pieces = cpu_pieces(w) if self.transform.scalar_logit_steps else None
        if pieces is None:
            yield 0, self.local_logits(h, head_input)
            return
        if not head_input:
            h = self.transform.apply_hidden(h)
        h = h.to(w.dtype)
        for rows in pieces:
            bias = None if self.bias is None else self.bias[rows]
            yield rows.start, self.transform.apply_logits(torch.nn.functional.linear(h, w[rows], bias).float())

    def _shard_summary(self, h: torch.Tensor, targets: torch.Tensor, head_input: bool,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """Per target, this shard's [maximum logit, sum of exp(logit - that maximum), the target's logit (0 where
        another shard holds the target), global index of the first maximum] of its row of ``h`` (``rows[i]``; the
        i-th row without): ``[N, 4]``, each row's logits made once however many targets it has."""
        maxes, sums, firsts = [], [], []
        target = torch.zeros(targets.shape[0], dtype=torch.float32, device=h.device)
        local = targets - self.offset
        for start, logits in self._logit_chunks(h, head_input):
            width = logits.shape[-1]
            if width == 0:  # a shard wholly past a padded vocabulary
                continue
            top, first = logits.max(dim=-1)  # torch.max: the first maximal index
            inside = (local >= start) & (local < start + width)
            column = (local - start).clamp(0, width - 1)
            picked = logits[rows, column] if rows is not None else logits.gather(1, column.unsqueeze(1)).squeeze(1)
            target = torch.where(inside, picked, target)
            sums.append(logits.sub_(top.unsqueeze(-1)).exp_().sum(dim=-1))  # in place: the piece ends here
            maxes.append(top)
            firsts.append(first + (start + self.offset))
        if not maxes:
            none = torch.full((targets.shape[0],), float("-inf"), device=h.device)
            return torch.stack([none, torch.zeros_like(none), target, none.neg()], dim=-1)  # adds nothing
        top_k = torch.stack(maxes)
        top, k = top_k.max(dim=0)  # the first piece holding the maximum (a NaN maximum: NaN)
        sumexp = _rescaled_sum(top_k, torch.stack(sums), top)
        first = torch.stack(firsts).gather(0, k.unsqueeze(0)).squeeze(0)
        if rows is not None:
            top, sumexp, first = top[rows], sumexp[rows], first[rows]
        exact = torch.float32 if self.vocab_size < 1 << 24 else torch.float64  # every index exact in the float
        return torch.stack([x.to(exact) for x in (top, sumexp, target, first)], dim=-1)

    @torch.no_grad()
    def score(self, h: torch.Tensor, targets: torch.Tensor, head_input: bool = False,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) (float32) and whether target is the argmax, for hidden states ``h`` [N, H] (``head_input``:
        as :meth:`local_logits`): each rank's :meth:`_shard_summary` gathered, one collective per block of rows.
        ``rows``: the row of ``h`` each target is scored at (several targets may share one: a prefix tree's context
        predicts every continuation's first token), ascending-sorted or not; without, target i at row i."""
        n = targets.shape[0]
        out_lp = torch.empty(n, dtype=torch.float32, device=h.device)
        out_greedy = torch.empty(n, dtype=torch.bool, device=h.device)
        for sl in self._blocks(h.shape[0]):
            if rows is None:
                which, at = sl, None
            else:
                which = ((rows >= sl.start) & (rows < sl.stop)).nonzero().squeeze(1)
                at = rows[which] - sl.start
            parts = self.ops.gather(self._shard_summary(h[sl], targets[which], head_input, at))  # [size, n, 4]
            top_r, sums_r, target_r, first_r = parts.unbind(-1)
            gmax, pick = _first_of_max(top_r, first_r)  # a NaN maximum: log-probability NaN, never greedy
            sumexp = _rescaled_sum(top_r, sums_r, gmax)
            out_lp[which] = target_r.sum(dim=0) - gmax - torch.log(sumexp)
            out_greedy[which] = pick == targets[which].to(pick.dtype)
        return out_lp, out_greedy

    @torch.no_grad()
    def argmax(self, h: torch.Tensor, head_input: bool = False) -> torch.Tensor:
        """Global greedy token ids for hidden states ``h`` [N, H] (lowest index among ties; an id past the vocabulary
        where a row's maximum is NaN).

        One collective per block: each rank's (maximum, first index of it) are gathered and every rank picks the
        largest maximum, the lowest index among equal ones (a rank's first hit of the global maximum is its own first
        maximum), as :meth:`score` does: a decode step's one all-gather of 16 bytes per row."""
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
            gmax, pick = _first_of_max(parts[..., 0], parts[..., 1])
            out[sl] = torch.where(torch.isnan(gmax), float(_INT_BIG), pick).long()  # NaN: the row is reported
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
        with torch_deadline("TP all-gather", None):
            dist.all_gather(sizes, torch.tensor([local.shape[1], self.offset], device=h.device), group=self.ops.group)
        width = int(max(int(s[0]) for s in sizes))
        padded = torch.full((local.shape[0], width), float("-inf"), device=h.device)
        padded[:, : local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in range(self.ops.size)]
        self.ops.counter.add(padded)
        with torch_deadline("TP all-gather", None):
            dist.all_gather(parts, padded, group=self.ops.group)
        order = sorted(range(self.ops.size), key=lambda r: int(sizes[r][1]))
        return torch.cat([parts[r][:, : int(sizes[r][0])] for r in order], dim=1)


def _first_of_max(tops: torch.Tensor, firsts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From every rank's row maxima ``tops`` [R, N] and the global index of each one's first hit ``firsts``: the
    global maximum and the lowest index holding it, torch.argmax's rule (a rank's first hit of the global maximum is
    its own first maximum). A NaN maximum wins and equals nothing: that row's index is +inf."""
    gmax = tops.max(dim=0).values
    return gmax, torch.where(tops == gmax.unsqueeze(0), firsts, float("inf")).min(dim=0).values


def _rescaled_sum(tops: torch.Tensor, sums: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``sum_k sums[k] * exp(tops[k] - top)``: sums of exp taken relative to their own maxima ``tops`` [K, N], brought
    to the common maximum ``top`` [N] (a part whose maximum is -inf adds nothing)."""
    scale = torch.exp(tops - top.unsqueeze(0))
    return torch.where(scale == 0, 0.0, sums * scale).sum(dim=0)


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
        if any(isinstance(p, Shard) and p.dim == 0 for p in data.placements):
            return data.to_local(), first_row(data)
        data = data.to_local()  # replicated: slice below
    rank = _rank(ops)
    per = -(-vocab // ops.size)
    start = min(vocab, rank * per)
    return data[start : min(vocab, start + per)], start


def first_row(dtensor) -> int:
    """The global index of the first row this rank holds of a DTensor split along its first dimension, as torch's
    DTensor computes it (:data:`mpitp.compat.LOCAL_SHARD`)."""
    from mpitp import compat

    _, offsets = compat.attribute(compat.LOCAL_SHARD)(dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return int(offsets[0])


def _rank(ops: TPOps) -> int:
    if ops.size == 1:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group=ops.group)
