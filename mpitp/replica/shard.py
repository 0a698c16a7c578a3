"""This rank's part of every forward of its replica: its stage's layers (TP-sharded), its slice of the LM head.

Leader and workers run the same code here, so transformers' TP collectives and the stage-to-stage sends line up.
Without pipeline stages every rank runs the whole (sharded) model and scores vocab-parallel over its TP group. With
stages (pp > 1) stage 0 embeds and runs its layers, hands the activations to the next stage (micro-batched when
scoring, so stages overlap), and the last stage's hidden states at the scored positions go to every other stage,
each holding a slice of the head's vocabulary (:mod:`mpitp.replica.stage_head`): the whole replica scores
vocab-parallel and the leader holds the answer. Where the head cannot be spread, the last stage scores over its TP
group and only O(tokens) scores (or, when generating, the chosen token ids) travel back to the leader.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from mpitp import compat, testing
from mpitp.parallel.cpu_reduce import MPIReductions, TorchDistributedOverMPI
from mpitp.replica.generation import chosen_token_logits
from mpitp.replica.pipeline import HEAD_ONLY_KWARGS, StageLink, base_model
from mpitp.replica.prefix import TreeSpec, flop_weights
from mpitp.replica.scoring import TPOps, VocabParallelHead
from mpitp.replica.stage_chunks import MIN_CHUNK, pieces, prefill_chunks
from mpitp.replica.stage_head import head_input
from mpitp.replica.stats import Stats

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from contextlib import AbstractContextManager

    from torch.distributed import ProcessGroup
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from mpitp.parallel.layout import Layout


class ReplicaShard:
    """One per rank: the model shard it holds and the forwards it runs, whether it leads the replica or not.

    ``tp_group`` is the torch group of this rank's stage's TP ranks (None = the default world).
    """

    def __init__(self, model: PreTrainedModel, layout: Layout, device: str, stats: Stats | None = None,
                 tp_group: ProcessGroup | None = None, timeout: float | None = None):
        """``timeout``: the deadline of a wait inside a TP collective that goes over MPI (:meth:`tp_reductions`)."""
        self.model = model
        self.layout = layout
        self.device = torch.device(device)
        self.stats = stats or Stats()
        self.timeout = timeout
        # On CPU a TP group reduces over MPI (mpitp.parallel.cpu_reduce): gloo's loopback was the decode step's cost
        self.mpi = (MPIReductions(tp_group, layout.tp_comm, timeout)
                    if layout.tp > 1 and self.device.type == "cpu" else None)
        self.ops = TPOps(size=layout.tp, group=tp_group, counter=self.stats.tp, reduce_counter=self.stats.tp_score,
                         mpi=self.mpi)
        self.pipeline = layout.pp > 1
        self.link = StageLink(layout, self.stats.pp) if self.pipeline else None
        self.head = VocabParallelHead.from_model(model, self.ops) if layout.last_stage else None
        self.spread = False  # the head over every stage (mpitp.replica.stage_head.spread_head sets it)
        self.head_steps = None  # then: the last stage's hidden-state steps before its head, taken there
        self.base = base_model(model)
        self.share = False  # rows sharing a context scored as trees (mpitp.replica.prefix_probe.check_sharing sets it)
        self.attention_layers = 0  # set with it: the attention calls one forward makes
        self.flop_weights = flop_weights(model.config.get_text_config())  # to weigh a tree against plain rows
        self.chunked = False  # few-row batches cut along their positions (mpitp.replica.stage_chunks sets it)
        self.min_chunk = MIN_CHUNK
        testing.install_forward_fault(getattr(self.base, "layers", None), layout.rank, lambda: self.stats.forwards)
        testing.install_generate_log(model, layout)

    def tp_reductions(self) -> AbstractContextManager[object]:
        """While active, the all-reduces transformers' TP layers make (``tensor_parallel.dist.all_reduce``) of CPU
        tensors go over this TP group's MPI communicator (:class:`mpitp.parallel.cpu_reduce.TorchDistributedOverMPI`,
        put back on leaving: :func:`mpitp.compat.replaced`); on GPU, or at tp=1, nothing changes."""
        if self.mpi is None:
            return contextlib.nullcontext()
        return compat.replaced(compat.TP_DIST, TorchDistributedOverMPI(self.mpi))

    def replica_reductions(self) -> MPIReductions | None:
        """Reductions over the whole replica (the default torch world) over MPI, on CPU; None on GPU."""
        return MPIReductions(None, self.layout.replica_comm, self.timeout) if self.device.type == "cpu" else None

    @torch.no_grad()
    def score(self, packed: torch.Tensor, b: int, t: int, n: int, r: int = 0, spec: TreeSpec | None = None,
              probe: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(log p, is_greedy) of the ``n`` scored positions of a packed batch (:func:`mpitp.replica.prefix.pack`:
        ``b`` sequences of ``t`` input ids, the flat indices of the scored positions, their targets, and with ``r``
        continuations a tree's tables): on every rank without stages, on the leader with. ``probe``: a start-up
        check's forward, none of the run's (left out of the forward log of :func:`mpitp.testing.log_forward`)."""
        ids, sel, tgt, spec = self._unpack(packed, b, t, n, r, spec, probe)
        if self.pipeline:
            return list(self._pipeline([(ids, sel, tgt, spec)]))[0]
        if r:
            hidden = self.base(input_ids=ids, use_cache=False, **spec.forward_kwargs()).last_hidden_state
            if self.share and spec.calls != self.attention_layers:  # the probe saw every layer take the tree
                raise RuntimeError(f"prefix sharing: the tree reached {spec.calls} of {self.attention_layers} "
                                   f"layers' attention")
        else:
            hidden = self.base(input_ids=ids, use_cache=False).last_hidden_state
        at, rows = _distinct(sel)
        return self.head.score(hidden.reshape(b * t, -1).index_select(0, at), tgt, rows=rows)

    @torch.no_grad()
    def score_batches(self, batches: list[tuple[torch.Tensor, dict]]
                      ) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """With pipeline stages: several packed batches (each ``(packed, sizes)`` as :meth:`score` takes one) through
        the stages one after the other, yielding each batch's (log p, is_greedy) in order (on the leader, and with the
        head spread on every rank; None elsewhere). Unlike one :meth:`score` per batch the stages go on from one
        batch to the next without waiting for the head (:meth:`_pipeline`)."""
        return self._pipeline(self._unpack(packed, **size) for packed, size in batches)

    def _unpack(self, packed: torch.Tensor, b: int, t: int, n: int, r: int = 0, spec: TreeSpec | None = None,
                probe: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeSpec | None]:
        """A packed batch's ids, scored positions, targets and tree spec; counts the forward (and logs it)."""
        ids = packed[: b * t].view(b, t)
        sel = packed[b * t : b * t + n]
        tgt = packed[b * t + n : b * t + 2 * n]
        self.stats.forwards += 1
        if not probe:  # b sequences of t positions fed, whether rows or trees (r > 0: continuations of their own)
            testing.log_forward(self.layout, "score", batch=b, seq=t, tokens=b * t, scored=n, branches=r)
        if r:
            spec = spec or TreeSpec.from_packed(packed, b, t, n, r)
        return ids, sel, tgt, spec

    def _pipeline(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor, TreeSpec | None]]
                  ) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Batches through the stages in pieces (GPipe's forward half): micro-batches of rows (trees: each piece with
        its sequences' part of the spec), or with too few rows chunks of positions, each stage keeping the chunks
        before in a KV cache (:mod:`mpitp.replica.stage_chunks`). Yields each batch's scores (:meth:`_stage_head`).

        A batch's head needs the last stage's output, so a stage that finished its own pieces would wait there while
        the stages after it work: stage ``s`` runs batch i's head only after its first ``pp - 1 - s`` pieces of batch
        i + 1, about when the last stage gets there, and every stage stays busy from one batch to the next."""
        lay, link, base = self.layout, self.link, self.base
        ahead = lay.pp - 1 - lay.pp_rank  # pieces of the next batch before a batch's head
        pending = None
        for ids, sel, tgt, spec in batches:
            b, t = ids.shape
            parts, chunked = pieces(b, t, lay.pp, self.chunked and spec is None, self.min_chunk)
            outs, cache = [], None
            for k, p in enumerate(parts):
                if k == ahead and pending is not None:
                    yield self._stage_head(*pending)
                    pending = None
                kw = dict(use_cache=True, cache=cache) if chunked else dict(use_cache=False)
                sub = spec.rows(p.rows.start, p.rows.stop) if spec is not None else None
                if sub is not None:
                    kw.update(sub.forward_kwargs())
                if lay.first_stage:
                    out = base(input_ids=ids[p.rows, p.cols], **kw)
                else:
                    out = base(inputs_embeds=link.recv_activation(self.device), **kw)
                if sub is not None and self.share and sub.calls != self.attention_layers:
                    raise RuntimeError(f"prefix sharing: the tree reached {sub.calls} of {self.attention_layers} "
                                       f"layers' attention on pipeline stage {lay.pp_rank}")
                cache = out.cache if chunked else None
                h = out.last_hidden_state
                if lay.last_stage:
                    outs.append(h)
                else:
                    link.send_activation(h)  # asynchronous: this stage goes on with the next piece
            if pending is not None:  # fewer pieces than ``ahead``: the head before this stage waits on its sends
                yield self._stage_head(*pending)
            link.flush()
            at, rows = _distinct(sel)
            hs = torch.cat(outs, dim=1 if chunked else 0).reshape(b * t, -1).index_select(0, at) \
                if lay.last_stage else None
            pending = (hs, tgt, rows)
        if pending is not None:
            yield self._stage_head(*pending)

    def _stage_head(self, hs: torch.Tensor | None, tgt: torch.Tensor, rows: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batch's scores from the last stage's hidden states ``hs`` (None on other stages; ``rows``: the row
        of ``hs`` each target is scored at): spread, every stage scores its slice of the vocabulary and the leader
        holds the answer; else the last stage scores over its TP group and sends the O(tokens) scores to the
        leader."""
        lay, link = self.layout, self.link
        if self.spread:
            lp, greedy = self.head.score(head_input(self, hs), tgt, head_input=True, rows=rows)
            if lay.last_stage:
                link.flush()
            return lp, greedy
        if lay.last_stage:
            lp, greedy = self.head.score(hs, tgt, rows=rows)
            if lay.tp_rank == 0:
                link.send(lp.float(), dst=0)
                link.send(greedy.to(torch.uint8), dst=0)
                link.flush()
            return lp, greedy
        if lay.is_leader:
            n = tgt.numel()
            lp = link.recv((n,), torch.float32, self.device, src=lay.last_stage_leader)
            greedy = link.recv((n,), torch.uint8, self.device, src=lay.last_stage_leader).bool()
            return lp, greedy
        return None, None

    @torch.no_grad()
    def generate_step(self, kwargs: dict, greedy: bool, on_nonfinite: Callable[[], None] | None = None,
                      keep_cache: Callable[[object], None] | None = None) -> CausalLMOutputWithPast | None:
        """One ``generate`` forward through the stages, each with its own KV cache; returns the leader's output.

        Each stage keeps the cache its forward returned (``keep_cache``), and the leader hands it to HF: a model that
        builds its own cache class on the first forward (MiniMax) gets that class on every stage.

        The next token is picked vocab-parallel (greedy) by every stage over its head slice (or by the last stage,
        which sends only the ids to the leader, where the head is not spread); the leader hands HF a logits tensor
        that is 0 at that id and -inf elsewhere. For sampling the leader gets the last position's gathered logits,
        and its seeded generator samples.
        """
        lay, link = self.layout, self.link
        kw = {k: v for k, v in kwargs.items() if k not in HEAD_ONLY_KWARGS}
        b = kw["input_ids"].shape[0]
        cache = kw.get("cache")
        # A prompt goes through in chunks of positions where the model takes them (mpitp.replica.stage_chunks)
        for part in prefill_chunks(kw, lay.pp, self.min_chunk) if self.chunked else [kw]:
            if cache is not None:
                part["cache"] = cache  # the chunks before, whichever cache the first chunk's forward returned
            if not lay.first_stage:
                part.pop("input_ids")
                part["inputs_embeds"] = link.recv_activation(self.device)
            base_out = self.base(**part)
            h, cache = base_out.last_hidden_state, getattr(base_out, "cache", None)
            if not lay.last_stage:
                link.send_activation(h)  # asynchronous: this stage goes on with the next chunk
        if keep_cache is not None:
            keep_cache(cache)
        if not lay.last_stage:
            link.flush()
        if self.spread:  # every stage computes its slice of the vocabulary; the leader holds the answer
            x = head_input(self, h[:, -1, :] if lay.last_stage else None)
            out = self.head.argmax(x, head_input=True) if greedy else \
                self.head.full_logits(x, head_input=True).unsqueeze(1)
            link.flush()
            if not lay.is_leader:
                return None
        elif lay.last_stage:
            if greedy:
                out = self.head.argmax(h[:, -1, :])
            else:
                out = self.head.full_logits(h[:, -1, :]).unsqueeze(1)  # the model's logits: its head steps applied
            if lay.tp_rank == 0:
                link.send(out, dst=0)
                link.flush()
            return None
        if not lay.is_leader:
            return None
        from transformers.modeling_outputs import CausalLMOutputWithPast

        vocab = int(self.model.config.get_text_config().vocab_size)
        if greedy:
            tok = out if self.spread else link.recv((b,), torch.long, self.device, src=lay.last_stage_leader)
            logits = chosen_token_logits(tok, vocab, on_nonfinite)
        else:
            logits = out if self.spread else \
                link.recv((b, 1, vocab), torch.float32, self.device, src=lay.last_stage_leader)
        return CausalLMOutputWithPast(logits=logits, cache=cache if cache is not None else kw.get("cache"))


def _distinct(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct positions of ``sel`` (ascending) and, per entry, which of them it is: a prefix tree scores every
    continuation's first token at its context's last position, whose head row is then made once (hellaswag's four
    endings: a row in 14 of the head's; a multiple-choice task with one-token answers: three in four)."""
    return torch.unique(sel, return_inverse=True)
