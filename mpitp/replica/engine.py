"""Coordinator-forward inside one model replica: the leader drives, every other rank mirrors each forward.

Only the replica's leader runs batching and HF ``generate``. Before each forward it sends a small control message
over MPI (the others wait for it with a polled, sleeping receive rather than a spinning collective) and then the
forward's tensors over the replica's torch world; every rank then runs its part of the same forward, so
transformers' TP collectives line up. Workers keep their own KV-cache shards in step during generation, so each
decode step ships only the new token ids.

With pipeline stages (pp > 1) "its part" is its stage: stage 0 embeds and runs its layers, hands the activations
to the next stage (micro-batched when scoring, so stages overlap), and the last stage scores vocab-parallel over its
TP group; only O(tokens) scores (or, when generating, the chosen token ids) travel back to the leader.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, field

import torch

from mpitp.parallel import comm as mpicomm
from mpitp.replica.pipeline import HEAD_ONLY_KWARGS, StageLink, micro_batches
from mpitp.replica.scoring import CommCounter, TPOps, VocabParallelHead

log = logging.getLogger("mpitp")
_OOM = (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (RuntimeError,)

OP_SCORE = "score"
OP_GEN_BEGIN = "gen_begin"
OP_GEN_FORWARD = "gen_forward"
OP_GEN_END = "gen_end"
OP_STOP = "stop"
OP_IDLE = "idle"


@dataclass
class Stats:
    """Per-rank counters; the DP leader's are the group's and end up in the results file."""

    busy_s: float = 0.0
    requests: float = 0.0  # rolling requests count 1/n per window computed, so they can span DP groups
    tokens_scored: int = 0
    tokens_generated: int = 0
    forwards: int = 0
    tp: CommCounter = field(default_factory=CommCounter)
    tp_score: CommCounter = field(default_factory=CommCounter)
    pp: CommCounter = field(default_factory=CommCounter)
    mpi_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(busy_s=self.busy_s, requests=self.requests, tokens_scored=self.tokens_scored,
                    tokens_generated=self.tokens_generated, forwards=self.forwards, tp_bytes=self.tp.bytes,
                    tp_calls=self.tp.calls, tp_score_bytes=self.tp_score.bytes, mpi_bytes=self.mpi_bytes,
                    pp_bytes=self.pp.bytes)


def _base(model):
    """The decoder stack without the LM head (``LlamaModel`` inside ``LlamaForCausalLM``, and so on)."""
    return model.base_model


class TPEngine:
    """One per rank. Leaders call :meth:`score`, :meth:`generating` and :meth:`stop`; workers call :meth:`serve`."""

    def __init__(self, model, layout, device: str, timeout: float, tp_size: int, stats: Stats | None = None,
                 group=None):
        self.model = model
        self.layout = layout
        self.device = torch.device(device)
        self.timeout = timeout
        self.stats = stats or Stats()
        self.ops = TPOps(size=tp_size, group=group, counter=self.stats.tp, reduce_counter=self.stats.tp_score)
        self.pipeline = layout.pp > 1
        # Control tensors go to the whole replica: with stages, that is the default world, not the TP group.
        self.replica_ops = (TPOps(size=layout.replica_size, group=None, counter=self.stats.tp) if self.pipeline
                            else self.ops)
        self.link = StageLink(layout, self.stats.pp) if self.pipeline else None
        self.head = VocabParallelHead.from_model(model, self.ops) if layout.last_stage else None
        self._greedy = False
        self._wait_phase = ("TP worker waiting for its leader" if not self.pipeline or layout.first_stage
                            else f"pipeline stage {layout.pp_rank} waiting for its leader")
        self._cache = None
        self._buf: torch.Tensor | None = None
        self._sent: dict[str, torch.Tensor] = {}
        self._restore_head = None
        self.nonfinite_steps = 0  # greedy steps whose logits held NaN (no token reached the maximum)
        _install_forward_fault(model, layout, self.stats)

    # ------------------------------------------------------------------ control plane (MPI)
    @property
    def has_workers(self) -> bool:
        return self.replica_ops.size > 1

    def _control(self, msg: dict | None = None, phase: str = "TP control", idle: bool = False) -> dict:
        # Workers wait a little longer than their leader: when a stall upstream trips the deadline, the leader's
        # message (which names the upstream phase) is the one the user sees. An idle worker (its leader between
        # dispatch runs, see :meth:`idle`) waits without one.
        timeout = None if idle else self.timeout if self.layout.is_leader else self.timeout + 5.0
        return mpicomm.bcast_obj(msg, self.layout.replica_comm, root=0, timeout=timeout, phase=phase)

    def _send_tensors(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.replica_ops.broadcast(t, src=0)

    def _recv_tensors(self, specs: list[tuple[tuple, str]]) -> list[torch.Tensor]:
        out = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.replica_ops.broadcast(t, src=0)
            out.append(t)
        return out

    # ------------------------------------------------------------------ scoring
    def _buffer(self, n: int) -> torch.Tensor:
        """A view of ``n`` elements of one persistent int64 buffer grown in powers of two.

        Every batch has another size; allocating a fresh tensor per message fragments a GPU caching allocator (one
        of Fast-LLM's reported problems). Leader and workers size their buffers the same way.
        """
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(1 << max(10, (n - 1).bit_length()), dtype=torch.long, device=self.device)
        return self._buf[:n]

    def score_rows(self, rows: list[tuple[list[int], int]], batch_size: int, tick=None) -> list[tuple[float, bool, int]]:
        """Score token rows ``(input_tokens_plus_last_target, n_targets)`` -> ``(sum log p, all greedy, n)``.

        A row is lm-eval's ``(context + continuation)[-(max_length + 1):]``: the model reads all but the last token
        and the last ``n_targets`` tokens are scored, exactly as lm-eval's ``_loglikelihood_tokens`` slices them.
        """
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list = [None] * len(rows)
        start = 0
        while start < len(order):
            idx = order[start : start + batch_size]
            try:
                results = self._score_batch([rows[i] for i in idx])
            except _OOM as exc:
                if self.has_workers:
                    # The workers may sit inside a collective of the very forward that failed: a retry cannot be
                    # agreed with them, so the job fails fast (rows computed so far stay in the file).
                    raise _OOM[0](f"out of memory on a batch of {len(idx)} rows in a replica of "
                                  f"{self.replica_ops.size} ranks ({str(exc).splitlines()[0][:160]}); rerun with a "
                                  f"smaller --batch-size and --resume") from exc
                if len(idx) == 1:
                    raise
                batch_size = max(1, len(idx) // 2)
                log.warning("out of memory on a batch of %d rows (%s); retrying with batch size %d",
                            len(idx), str(exc).splitlines()[0][:120], batch_size)
                _free_cache(self.device)
                continue
            for i, r in zip(idx, results):
                out[i] = r
            start += len(idx)
            if tick is not None:
                tick()
        return out

    def _score_batch(self, rows) -> list[tuple[float, bool, int]]:
        _test_oom(len(rows))
        inps = [r[0][:-1] for r in rows]
        width = max(len(x) for x in inps)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        sel, tgt, owner = [], [], []
        for b, ((toks, n), inp) in enumerate(zip(rows, inps)):
            ids[b, : len(inp)] = torch.tensor(inp, dtype=torch.long)
            inplen = len(inp)
            sel.extend(b * width + p for p in range(inplen - n, inplen))
            tgt.extend(toks[-n:])
            owner.extend([b] * n)
        flat = torch.cat([ids.flatten(), torch.tensor(sel, dtype=torch.long), torch.tensor(tgt, dtype=torch.long)])
        packed = self._buffer(flat.numel())
        packed.copy_(flat)
        if self.has_workers:
            self._control({"op": OP_SCORE, "b": len(rows), "t": width, "n": len(sel)})
            self.replica_ops.broadcast(packed, src=0)
        lp, greedy = self._score_local(packed, len(rows), width, len(sel))
        lp, greedy = lp.double().cpu(), greedy.cpu()
        owner_t = torch.tensor(owner, dtype=torch.long)
        sums = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, owner_t, lp)
        misses = torch.zeros(len(rows), dtype=torch.long).index_add_(0, owner_t, (~greedy).long())
        self.stats.tokens_scored += len(sel)
        return [(float(sums[b]), bool(misses[b] == 0), rows[b][1]) for b in range(len(rows))]

    @torch.no_grad()
    def _score_local(self, packed: torch.Tensor, b: int, t: int, n: int):
        """(log p, is_greedy) of the ``n`` scored positions: on every rank without stages, on the leader with."""
        ids = packed[: b * t].view(b, t)
        sel = packed[b * t : b * t + n]
        tgt = packed[b * t + n :]
        self.stats.forwards += 1
        if self.pipeline:
            return self._score_pipeline(ids, sel, tgt)
        hidden = _base(self.model)(input_ids=ids, use_cache=False).last_hidden_state
        hs = hidden.reshape(b * t, -1).index_select(0, sel)
        return self.head.score(hs, tgt)

    def _score_pipeline(self, ids: torch.Tensor, sel: torch.Tensor, tgt: torch.Tensor):
        """One batch through the stages in micro-batches (GPipe's forward half); scores come back to the leader."""
        lay, link, base = self.layout, self.link, _base(self.model)
        b, t = ids.shape
        outs = []
        for r0, r1 in micro_batches(b, lay.pp):
            if lay.first_stage:
                h = base(input_ids=ids[r0:r1], use_cache=False).last_hidden_state
            else:
                x = link.recv_activation(self.device)
                h = base(inputs_embeds=x, use_cache=False).last_hidden_state
            if lay.last_stage:
                outs.append(h)
            else:
                link.send_activation(h)  # asynchronous: this stage goes on with the next micro-batch
        link.flush()
        if lay.last_stage:
            hs = torch.cat(outs).reshape(b * t, -1).index_select(0, sel)
            lp, greedy = self.head.score(hs, tgt)
            if lay.tp_rank == 0:
                link.send(lp.float(), dst=0)
                link.send(greedy.to(torch.uint8), dst=0)
                link.flush()
            return lp, greedy
        if lay.is_leader:
            n = sel.numel()
            lp = link.recv((n,), torch.float32, self.device, src=lay.last_stage_leader)
            greedy = link.recv((n,), torch.uint8, self.device, src=lay.last_stage_leader).bool()
            return lp, greedy
        return None, None

    # ------------------------------------------------------------------ generation
    @contextlib.contextmanager
    def generating(self, greedy: bool = False):
        """While active, every forward the leader's model runs (HF ``generate``'s) is mirrored by the workers.

        With ``greedy`` the LM head is swapped, on every TP rank, for a vocab-parallel argmax of the last position
        (two all-reduces of O(batch)), so no rank gathers full logits; HF's greedy search then picks that token.
        Sampling keeps transformers' gathered logits, and only the leader samples: workers are sent its tokens, so
        one seeded generator decides for the whole group.
        """
        model = self.model
        if self.has_workers:
            self._control({"op": OP_GEN_BEGIN, "greedy": greedy})
        self._greedy = greedy
        restore_head = self._swap_head() if greedy and not self.pipeline else None
        scoring_counter, self.ops.reduce_counter = self.ops.reduce_counter, CommCounter()  # argmax != scoring
        patched = "forward" in vars(model)
        original = model.forward
        sent: dict[str, torch.Tensor] = {}

        @functools.wraps(original)  # generate validates its kwargs against the forward's signature (Falcon-H1)
        def mirrored_forward(*args, **kwargs):
            if args:
                raise TypeError("mpitp mirrors keyword-argument forwards only")
            plain, specs, tensors = {}, [], []
            for k, v in kwargs.items():
                if torch.is_tensor(v):
                    prev = sent.get(k)
                    if prev is not None and _extends_with_ones(prev, v):
                        plain[k] = "__extend_ones__"  # the grown attention mask: workers append the column
                    else:
                        specs.append((k, tuple(v.shape), str(v.dtype).removeprefix("torch.")))
                        tensors.append(v.contiguous())
                    sent[k] = v
                elif _is_cache(v):
                    plain[k] = "__cache__"
                elif v is None or isinstance(v, (bool, int, float, str)):
                    plain[k] = v
                else:
                    raise TypeError(f"cannot mirror forward argument {k}={type(v).__name__} to TP workers")
            self._control({"op": OP_GEN_FORWARD, "plain": plain, "specs": specs})
            self._send_tensors(tensors)
            self.stats.forwards += 1
            if self.pipeline:
                with torch.no_grad():
                    return self._pipeline_forward(kwargs)
            return original(**kwargs)

        if self.has_workers:
            model.forward = mirrored_forward
        ok = False
        try:
            yield
            ok = True
        finally:
            if self.has_workers:
                if patched:
                    model.forward = original
                else:
                    del model.forward  # back to the class's forward
                if ok:  # after a failure the workers may sit in a collective of the failed forward: no message
                    self._control({"op": OP_GEN_END})
            if restore_head is not None:
                restore_head()
            self.ops.reduce_counter = scoring_counter

    def _note_nonfinite(self) -> None:
        self.nonfinite_steps += 1

    def _swap_head(self):
        """Replace the model's output embedding by :class:`_GreedyHead`; returns the undo."""
        model = self.model
        head = model.get_output_embeddings()
        for name, child in model.named_children():
            if child is head:
                setattr(model, name, _GreedyHead(self.head, self._note_nonfinite))
                return lambda: setattr(model, name, head)
        raise RuntimeError("could not locate the LM head among the model's children")

    def _worker_gen_forward(self, msg: dict) -> None:
        specs = msg["specs"]
        tensors = self._recv_tensors([(s[1], s[2]) for s in specs])
        kwargs = {s[0]: t for s, t in zip(specs, tensors)}
        for k, v in msg["plain"].items():
            if v == "__cache__":
                if self._cache is None:
                    from transformers import DynamicCache

                    self._cache = DynamicCache(config=self.model.config)
                v = self._cache
            elif v == "__extend_ones__":
                prev = self._sent[k]
                v = torch.cat([prev, torch.ones_like(prev[..., :1])], dim=-1)
            kwargs[k] = v
        self._sent.update({k: v for k, v in kwargs.items() if torch.is_tensor(v)})
        with torch.no_grad():
            if self.pipeline:
                self._pipeline_forward(kwargs)
            else:
                self.model(**kwargs)
        self.stats.forwards += 1

    def _pipeline_forward(self, kwargs: dict):
        """One ``generate`` step through the stages, each with its own KV cache; returns the leader's output.

        The last stage picks the next token vocab-parallel (greedy) and sends only the ids to the leader, which
        hands HF a logits tensor that is 0 at that id and -inf elsewhere; for sampling it sends the last
        position's gathered logits, and the leader's seeded generator samples.
        """
        lay, link, base = self.layout, self.link, _base(self.model)
        kw = {k: v for k, v in kwargs.items() if k not in HEAD_ONLY_KWARGS}
        ids = kw["input_ids"]
        b = ids.shape[0]
        if not lay.first_stage:
            kw.pop("input_ids")
            kw["inputs_embeds"] = link.recv_activation(self.device)
        h = base(**kw).last_hidden_state
        if not lay.last_stage:
            link.send_activation(h)
            link.flush()
        if lay.last_stage:
            if self._greedy:
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
        if self._greedy:
            tok = link.recv((b,), torch.long, self.device, src=lay.last_stage_leader)
            logits = _chosen_token_logits(tok, vocab, self._note_nonfinite)
        else:
            logits = link.recv((b, 1, vocab), torch.float32, self.device, src=lay.last_stage_leader)
        return CausalLMOutputWithPast(logits=logits, cache=kw.get("cache"))

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Release the workers from :meth:`serve` (leader only)."""
        if self.has_workers:
            self._control({"op": OP_STOP}, phase="TP stop")

    def idle(self) -> None:
        """Tell the workers that no forward comes until the next dispatch run (leader only): they wait without a
        deadline while rank 0 does work of its own (lm-eval's metrics, the results file), however long it takes."""
        if self.has_workers:
            self._control({"op": OP_IDLE}, phase="TP idle")

    def serve(self) -> None:
        """Worker loop: mirror the leader's forwards until it says stop.

        Idle until the first forward (rank 0 is building lm-eval's tasks) and after each :data:`OP_IDLE`: then the
        wait has no deadline (see :func:`mpitp.evaluation.dispatch.serve_remote` for why that still ends a broken job).
        """
        idle = True
        while True:
            msg = self._control(phase=self._wait_phase, idle=idle)
            op = msg["op"]
            idle = op == OP_IDLE
            _test_raise(self.layout, self.stats.forwards)
            if op == OP_SCORE:
                packed = self._buffer(msg["b"] * msg["t"] + 2 * msg["n"])
                self.replica_ops.broadcast(packed, src=0)
                self._score_local(packed, msg["b"], msg["t"], msg["n"])
            elif op == OP_GEN_BEGIN:
                self._cache, self._sent = None, {}
                scoring_counter, self.ops.reduce_counter = self.ops.reduce_counter, CommCounter()
                self._greedy = bool(msg.get("greedy"))
                self._restore_head = self._swap_head() if self._greedy and not self.pipeline else None
            elif op == OP_GEN_FORWARD:
                self._worker_gen_forward(msg)
            elif op == OP_GEN_END:
                self._cache, self._sent = None, {}
                if self._restore_head is not None:
                    self._restore_head()
                    self._restore_head = None
                self.ops.reduce_counter = scoring_counter
            elif op == OP_STOP:
                return
            elif op == OP_IDLE:
                pass
            else:  # pragma: no cover - protocol bug
                raise RuntimeError(f"unknown TP control op {op!r}")


def _is_cache(v) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        return False
    return isinstance(v, Cache)


def _extends_with_ones(prev: torch.Tensor, new: torch.Tensor) -> bool:
    """``new`` is ``prev`` with one column of ones appended (how generate grows the attention mask)."""
    return (new.dim() == prev.dim() >= 1 and new.shape[:-1] == prev.shape[:-1] and new.shape[-1] == prev.shape[-1] + 1
            and bool((new[..., -1] == 1).all()) and torch.equal(new[..., :-1], prev))


class _GreedyHead(torch.nn.Module):
    """Stands in for the LM head during greedy generation: vocab-parallel argmax of the last position.

    Returns logits that are 0 at the chosen token and -inf elsewhere, so HF's greedy search (argmax) picks exactly
    the token the sharded argmax chose (torch.argmax's lowest-index rule), without gathering the vocabulary.
    """

    def __init__(self, head: VocabParallelHead, on_nonfinite=None):
        super().__init__()
        self.head = head
        self.on_nonfinite = on_nonfinite

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.head.argmax(hidden[:, -1, :], head_input=True)
        return _chosen_token_logits(ids, self.head.vocab_size, self.on_nonfinite)


def _chosen_token_logits(ids: torch.Tensor, vocab: int, on_nonfinite=None) -> torch.Tensor:
    """[batch, 1, vocab] logits that are 0 at ``ids`` and -inf elsewhere: HF's greedy search picks exactly ``ids``.

    An id past the vocabulary means no logit reached the row's maximum (NaN logits): token 0 stands in so the
    group's forwards stay in step, and ``on_nonfinite`` is told (the leader refuses the request afterwards)."""
    bad = ids >= vocab
    if bool(bad.any()):
        if on_nonfinite is not None:
            on_nonfinite()
        ids = torch.where(bad, torch.zeros_like(ids), ids)
    logits = torch.full((ids.shape[0], 1, vocab), float("-inf"), device=ids.device)
    logits[torch.arange(ids.shape[0], device=ids.device), 0, ids] = 0.0
    return logits


def _free_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _test_oom(rows: int) -> None:
    """Test-only: ``MPITP_TEST_OOM_ABOVE=N`` makes any batch of more than N rows fail as out of memory."""
    limit = os.environ.get("MPITP_TEST_OOM_ABOVE")
    if limit and rows > int(limit):
        raise _OOM[0](f"test hook: simulated out of memory for {rows} rows")


def _test_raise(layout, forwards: int) -> None:
    """Test-only: ``MPITP_TEST_RAISE=<global rank>:<forwards>`` raises on that TP worker after that many forwards."""
    spec = os.environ.get("MPITP_TEST_RAISE")
    if spec:
        rank, after = (int(x) for x in spec.split(":"))
        if layout.rank == rank and forwards >= after:
            raise RuntimeError(f"test hook: injected failure on rank {rank} after {forwards} forwards")


def _install_forward_fault(model, layout, stats: Stats) -> None:
    """Test-only: ``MPITP_TEST_RAISE_IN_FORWARD=<global rank>:<forwards>[:oom]`` raises inside the forward of that
    rank's last decoder layer once it has run that many forwards: its TP peers are then inside a torch collective
    of the same forward (or, with stages, waiting for its activations), not at a message boundary."""
    spec = os.environ.get("MPITP_TEST_RAISE_IN_FORWARD")
    if not spec:
        return
    parts = spec.split(":")
    rank, after, oom = int(parts[0]), int(parts[1]), parts[2:] == ["oom"]
    layers = getattr(_base(model), "layers", None)
    if layout.rank != rank or not layers:
        return

    def hook(module, args):
        if stats.forwards > after:
            where = f"inside a forward on rank {rank} after {stats.forwards - 1} forwards"
            if oom:
                raise _OOM[0](f"test hook: simulated out of memory {where}")
            raise RuntimeError(f"test hook: injected failure {where}")

    layers[-1].register_forward_pre_hook(hook)
