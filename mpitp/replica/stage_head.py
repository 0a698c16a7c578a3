"""The LM head spread over the pipeline stages: every rank of the replica holds a slice of the vocabulary.

transformers' pipeline split gives the head to the last stage, which then does its layers *and* the head while the
other stages do their layers alone. With a large vocabulary against few layers that is most of the work: the bench
model's head (GPT-2's 50,257 x 512) is as large as its eight layers together, so at pp=2 the last stage did 75% of a
rolling window's multiply-adds and the replica ran at 1.6x the forwards' own time (bench/README,
``bench_forward_limit.py``). Giving the last stage fewer layers instead fits no workload: the head runs on the
*scored* positions only, all of a rolling window's but a few of a multiple-choice row's and one of a decode step's.

So after loading, the last stage's TP rank ``t`` keeps one ``pp``-th of its head rows and sends the others to TP rank
``t`` of every other stage (once per evaluation, ``V x hidden / tp`` values in all). At a forward's end the last
stage sends the scored positions' hidden states (after the head's own hidden-state steps, such as a logit scale
applied to the input) to the other stages, and the whole replica scores vocab-parallel over all its ``pp x tp``
ranks: the same O(tokens) reductions as a TP group's (:class:`mpitp.replica.scoring.VocabParallelHead`), the leader
holding the answer at the end instead of receiving it from the last stage. Every stage now does its layers and the
same share of the head, whatever the workload.

Kept on the last stage (the run's summary says why) where a step after the head is a module of the model (a soft-cap
layer: it exists on the last stage only) or a rank's rows would not cut into ``pp`` non-empty parts.
"""

from __future__ import annotations

import torch

from mpitp.parallel import comm as mpicomm
from mpitp.parallel.layout import split_layers
from mpitp.replica.logits import HeadTransform
from mpitp.replica.scoring import TPOps, VocabParallelHead

_PORTABLE_STEPS = frozenset({"mul", "div", "tanh"})  # logit steps a stage without the model's head can repeat


def _why_not(head: VocabParallelHead, pp: int) -> str | None:
    """On a last-stage rank: why its head cannot be spread (None: it can)."""
    kept = [op for op, _ in head.transform.logits if op not in _PORTABLE_STEPS]
    if kept:
        return f"kept on the last stage: a logit step of the model's own ({', '.join(kept)})"
    if head.weight.shape[0] < pp:
        return f"kept on the last stage: {head.weight.shape[0]} head rows on a rank cannot go to {pp} stages"
    return None


def _portable(c: object) -> object:
    """A logit step's constant as it can travel to another rank: a one-element tensor as a number, another tensor
    on the CPU (the receiver puts it on its own device: a CUDA tensor would unpickle on the sender's device index)."""
    if torch.is_tensor(c):
        return c.item() if c.numel() == 1 else c.detach().cpu()
    return c


def spread_head(shard, timeout: float | None) -> str | None:
    """Spread the last stage's head over every stage (``shard.head`` set on every rank, ``shard.spread`` True);
    returns None, or why the head stays on the last stage. Collective over the replica (``pp > 1`` only). ``shard``:
    this rank's :class:`~mpitp.replica.shard.ReplicaShard` (not imported: the shard imports this module)."""
    lay, link = shard.layout, shard.link
    why = _why_not(shard.head, lay.pp) if lay.last_stage else None
    why = mpicomm.first_objection(why, lay.replica_comm, timeout, phase="head spread")
    if why is not None:
        return why
    mine, steps = None, HeadTransform()
    if lay.last_stage:
        head, steps = shard.head, shard.head.transform
        cuts = split_layers(head.weight.shape[0], lay.pp)
        mine = (head.offset, head.vocab_size, [(op, _portable(c)) for op, c in head.transform.logits],
                head.bias is not None, cuts)
    said = mpicomm.gather_obj(mine, lay.replica_comm, root=0, timeout=timeout, phase="head spread")
    said = mpicomm.bcast_obj(said, lay.replica_comm, root=0, timeout=timeout, phase="head spread")
    source = (lay.pp - 1) * lay.tp + lay.tp_rank  # the last stage's rank with this rank's TP position
    offset, vocab, logit_steps, has_bias, cuts = said[source]
    logit_steps = [(op, c.to(shard.device) if torch.is_tensor(c) else c) for op, c in logit_steps]
    a, b = cuts[lay.pp_rank]
    if lay.last_stage:
        for stage, (s0, s1) in enumerate(cuts[:-1]):
            dst = stage * lay.tp + lay.tp_rank
            link.send_activation(head.weight[s0:s1].contiguous(), dst)
            if has_bias:
                link.send_activation(head.bias[s0:s1].contiguous(), dst)
        link.flush()
        weight = head.weight[a:b]
        bias = head.bias[a:b] if has_bias else None
    else:
        weight = link.recv_activation(shard.device, src=source)
        bias = link.recv_activation(shard.device, src=source) if has_bias else None
    ops = TPOps(size=lay.replica_size, group=None, counter=shard.stats.tp, reduce_counter=shard.stats.tp_score,
                mpi=shard.replica_reductions())
    # The hidden-state steps are taken on the last stage before its hidden states travel (``head_input``).
    shard.head = VocabParallelHead(weight=weight, offset=offset + a, vocab_size=vocab, ops=ops, bias=bias,
                                   transform=HeadTransform(logits=logit_steps))
    shard.head_steps = steps
    shard.spread = True
    return None


def head_input(shard, h: torch.Tensor | None) -> torch.Tensor:
    """The spread head's input on every rank: the last stage's hidden states ``h`` [N, H] (the decoder's output)
    after the head's hidden-state steps, sent to the same TP rank of every other stage (``h`` is None there)."""
    lay, link = shard.layout, shard.link
    if lay.last_stage:
        h = shard.head_steps.apply_hidden(h).contiguous()
        for stage in range(lay.pp - 1):
            link.send_activation(h, stage * lay.tp + lay.tp_rank)
        return h
    return link.recv_activation(shard.device, src=(lay.pp - 1) * lay.tp + lay.tp_rank)
