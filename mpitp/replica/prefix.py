"""Prefix sharing: rows of a batch that share their context are scored as one tree, the context computed once.

lm-eval scores a multiple-choice document as one row per choice, each the whole context plus that choice: hellaswag's
four endings make the model read the same context four times. Here the rows of a batch whose tokens before their
targets are identical become one packed sequence -- the context once, then each row's continuation but its last
token -- with position ids that restart at the context's end for every continuation. In every layer the context
attends causally to itself and each continuation to the context and causally to itself, never to another
continuation: exactly the attention each row has alone, so the log-probs are the same up to rounding. The context's
last position predicts every row's first target (its head row made once: :meth:`mpitp.replica.shard.ReplicaShard.score`
hands the head each target's row); the rest are predicted inside each continuation.

The attention runs in :func:`tree_attention`, under an attention function of its own (:func:`sdpa_or_tree`, registered
with transformers as ``mpitp_tree`` and set on mpitp's model only: ``"sdpa"`` itself is never replaced) that runs
``sdpa`` unchanged unless a forward carries a :class:`TreeSpec` (keyword ``mpitp_tree``, handed down to every
attention call as transformers hands down its attention keyword arguments). Whether a model's forward really
honours it -- position ids used, the keyword reaching every layer, nothing carried along the sequence outside
attention (state-space layers), no sliding window or soft-cap -- is decided from numbers, not from a list of model
types: :func:`mpitp.replica.prefix_probe.check_sharing` scores a probe both ways once after loading, and a model that
differs, raises, or calls the attention fewer times than it has layers scores plain rows. With pipeline stages
every stage probes its own layers and the replica agrees on one verdict; a tree then travels through the stages in
micro-batches of whole trees, each stage building its part of the spec from the same packed batch.

Whether rows that may share are packed as trees is decided per set of rows by :func:`plan`, from what each plan sends
and computes (:class:`Cost`): a tree pads its batch to its whole length and masks its continuations' attention, which
a short shared context does not pay back (rolling windows share only the token before each window: issue 31).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mpitp import compat

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Callable

    from transformers import PreTrainedConfig, PreTrainedModel

log = logging.getLogger("mpitp")

SPEC_KW = "mpitp_tree"


class TreeUnsupported(RuntimeError):
    """A layer's attention call asks for something :func:`tree_attention` does not do (sliding window, soft-cap,
    attention sinks, a position bias, non-causal attention, dropout)."""


# ---------------------------------------------------------------------------------------------------------- leader
@dataclass
class Group:
    """Rows (indices into the batch's row list) sharing ``ctx``; each row's continuation is ``conts[k]``."""

    ctx: list[int]
    rows: list[int] = field(default_factory=list)
    conts: list[list[int]] = field(default_factory=list)

    @property
    def packed_len(self) -> int:
        return len(self.ctx) + sum(len(c) - 1 for c in self.conts)

    def split(self, size: int) -> tuple[Group, Group]:
        return (Group(self.ctx, self.rows[:size], self.conts[:size]),
                Group(self.ctx, self.rows[size:], self.conts[size:]))

    def alone(self) -> list[Group]:
        """Each row as a group of its own."""
        return [Group(self.ctx, [r], [c]) for r, c in zip(self.rows, self.conts)]


def group_rows(rows: list[tuple[list[int], int]], share: bool,
               keep: Callable[[Group], bool] | None = None) -> list[Group]:
    """Rows ``(input plus last target, n_targets)`` grouped by their context ``tokens[:-n]`` (each alone when
    ``share`` is off), longest packed sequence first (as plain rows are sorted longest first). ``keep(group)``:
    whether a group of several rows stays a tree; the rows of one it rejects are scored alone."""
    groups: dict = {}
    out = []
    for i, (toks, n) in enumerate(rows):
        ctx, cont = toks[:-n], toks[len(toks) - n:]
        key = tuple(ctx) if share else i
        g = groups.get(key)
        if g is None:
            g = groups[key] = Group(list(ctx))
            out.append(g)
        g.rows.append(i)
        g.conts.append(list(cont))
    if keep is not None:
        out = [part for g in out for part in ([g] if len(g.rows) == 1 or keep(g) else g.alone())]
    out.sort(key=lambda g: -g.packed_len)
    return out


def next_batch(queue: deque[Group], batch_size: int) -> tuple[list[Group], int]:
    """Take the next batch off ``queue`` (a deque of groups): whole groups while their rows fit in ``batch_size``,
    else the first ``batch_size`` rows of a group larger than a batch (its rest goes back first). Returns the batch
    and its number of rows."""
    batch, n_rows = [], 0
    while queue and n_rows + len(queue[0].rows) <= batch_size:
        batch.append(queue.popleft())
        n_rows += len(batch[-1].rows)
    if not batch:  # one context with more rows than a batch: a batch of them now, the rest next
        head, rest = queue.popleft().split(batch_size)
        queue.appendleft(rest)
        batch, n_rows = [head], batch_size
    return batch, n_rows


# ------------------------------------------------------------------------------------------- what a plan costs
PART_ROWS = 4  # continuations attended per call (TreeSpec's parts)


@dataclass(frozen=True)
class Cost:
    """What scoring some rows costs: ``ints`` int64 values the leader broadcasts to its TP workers (the packed
    batches), ``positions`` sequence positions the forwards compute (padding included: every layer's matmuls, and
    transformers' TP all-reduces of the hidden states, scale with them), ``entries`` query-key pairs the attention
    computes (a causal call counts its lower triangle, a masked one every pair), ``forwards`` batches."""

    ints: int = 0
    positions: int = 0
    entries: int = 0
    forwards: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.ints + other.ints, self.positions + other.positions, self.entries + other.entries,
                    self.forwards + other.forwards)

    def flops(self, weights: tuple[float, float]) -> float:
        """Multiply-adds per layer, roughly: ``weights`` = (per position, per attention entry)."""
        return self.positions * weights[0] + self.entries * weights[1]


def flop_weights(config: PreTrainedConfig) -> tuple[float, float]:
    """Per layer, the multiply-adds of one position (attention projections + MLP) and of one attention entry
    (scores and weighted values over all heads), from a text config: enough to rank two plans of the same rows."""
    h = int(getattr(config, "hidden_size", 0) or 1)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * h)
    return float(4 * h * h + 3 * h * inter), float(2 * h)


def _causal(t: int) -> int:
    return t * (t + 1) // 2


def batch_cost(groups: list[Group]) -> Cost:
    """The cost of one batch as :func:`pack` lays it out and :func:`tree_attention` (or, without a tree, the
    model's causal attention) computes it."""
    t = max(g.packed_len for g in groups)
    b = len(groups)
    n = sum(len(c) for g in groups for c in g.conts)
    ctx = [len(g.ctx) if len(g.conts) > 1 else g.packed_len for g in groups]
    branches = sorted(((len(c) - 1, cl) for g, cl in zip(groups, ctx) if len(g.conts) > 1 for c in g.conts
                       if len(c) > 1), key=lambda x: -x[0])
    if not branches:
        entries = b * _causal(t)
    else:
        entries = b * _causal(max(ctx))
        for i in range(0, len(branches), PART_ROWS):
            part = branches[i : i + PART_ROWS]
            emax = part[0][0]
            entries += len(part) * emax * (max(cl for _, cl in part) + emax)
    return Cost(packed_size(b, t, n, len(branches)), b * t, entries, 1)


def plan_cost(groups: list[Group], batch_size: int) -> Cost:
    """The cost of scoring ``groups`` in the batches :func:`next_batch` cuts."""
    queue, total = deque(groups), Cost()
    while queue:
        total = total + batch_cost(next_batch(queue, batch_size)[0])
    return total


def _no_more(a: Cost, b: Cost, weights) -> bool:
    return a.ints <= b.ints and a.flops(weights) <= b.flops(weights)


def plan(rows: list[tuple[list[int], int]], batch_size: int, share: bool,
         weights: tuple[float, float] = (1.0, 0.0)) -> list[Group]:
    """The groups to score ``rows`` as: trees only where they cost less.

    Sharing a context saves reading it once per extra row, but a tree is one long sequence (its context and every
    continuation) that the batch's other sequences are padded to, its continuations attend with an explicit mask
    (no causal fast path), and its tables travel with the ids. Rolling windows, whose "context" is the single token
    before each window, gain one position per window and would lose all that. So a context is shared only when its
    tree costs no more than its rows alone (ints sent, multiply-adds), and the trees are used only when the whole
    plan costs no more than the plain one: scoring never sends or computes more than plain rows of the same
    requests (``weights``: :func:`flop_weights`)."""
    plain = group_rows(rows, share=False)
    if not share:
        return plain

    def keep(g: Group) -> bool:
        return _no_more(batch_cost([g]), sum((batch_cost([a]) for a in g.alone()), Cost()), weights)

    trees = group_rows(rows, share=True, keep=keep)
    if len(trees) == len(plain):
        return plain
    return trees if _no_more(plan_cost(trees, batch_size), plan_cost(plain, batch_size), weights) else plain


def pack(groups: list[Group]) -> tuple[torch.Tensor, dict, list[int]]:
    """A batch of groups as one flat int64 tensor, its sizes (``b`` sequences of ``t`` ids, ``n`` scored positions,
    ``r`` continuations with input tokens of their own), and each scored position's row (rows in the groups' order).

    Layout: ``[ids (b*t) | sel (n) | tgt (n)]`` and, when ``r > 0``, ``[ctx_len (b) | br_group | br_start | br_len
    (r each)]``. ``sel`` are flat indices into ``ids`` of the positions whose next token is scored, ``tgt`` those
    tokens. A group of one row is that row as is; a group whose continuations are single tokens is its context alone
    (every row scored at its last position): both need no tree, ``r`` counts only what does.
    """
    t = max(g.packed_len for g in groups)
    ids = torch.zeros((len(groups), t), dtype=torch.long)
    sel, tgt, owner, ctx_len, br_group, br_start, br_len = [], [], [], [], [], [], []
    row = 0
    for gi, g in enumerate(groups):
        c = len(g.ctx)
        seq = list(g.ctx)
        ctx_len.append(c if len(g.conts) > 1 else g.packed_len)  # a row alone is all "context": causal throughout
        for cont in g.conts:
            start = len(seq)
            seq.extend(cont[:-1])
            sel.append(gi * t + c - 1)
            sel.extend(range(gi * t + start, gi * t + len(seq)))
            tgt.extend(cont)
            owner.extend([row] * len(cont))
            if len(cont) > 1 and len(g.conts) > 1:
                br_group.append(gi)
                br_start.append(start)
                br_len.append(len(cont) - 1)
            row += 1
        ids[gi, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    tables = (sel, tgt) + ((ctx_len, br_group, br_start, br_len) if br_group else ())
    flat = torch.cat([ids.flatten()] + [torch.tensor(x, dtype=torch.long) for x in tables])
    return flat, dict(b=len(groups), t=t, n=len(sel), r=len(br_group)), owner


def packed_size(b: int, t: int, n: int, r: int = 0) -> int:
    return b * t + 2 * n + (b + 3 * r if r else 0)


# ---------------------------------------------------------------------------------------------------- every rank
class _Part:
    """Some continuations of a batch (of similar lengths), attended in one call: their tokens' flat indices
    ``index`` [r, emax] (past a continuation's end: its first token again, computed and never read back), where
    their outputs go (``dst``, from ``src`` of the call's flattened output), and the mask over
    ``[their contexts, padded to cmax | themselves]``."""

    def __init__(self, ctx_len: torch.Tensor, group: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                 t: int):
        dev = ctx_len.device
        self.group = group
        self.r = group.numel()
        emax = int(length.max())
        ctx = ctx_len[group]
        self.cmax = int(ctx.max())
        ar = torch.arange(emax, device=dev)
        valid = ar[None, :] < length[:, None]
        self.index = group[:, None] * t + start[:, None] + torch.where(valid, ar[None, :], 0)
        self.dst = self.index[valid]
        self.src = torch.arange(self.r * emax, device=dev).view(self.r, emax)[valid]
        self.positions = (ctx[:, None] + ar[None, :])[valid]
        ctx_keys = torch.arange(self.cmax, device=dev)[None, None, :] < ctx[:, None, None]
        own_keys = (ar[None, :] <= ar[:, None]).expand(self.r, emax, emax)
        self.mask = torch.cat([ctx_keys.expand(self.r, emax, self.cmax), own_keys], dim=2).unsqueeze(1)


class TreeSpec:
    """Everything :func:`tree_attention` needs for one packed batch, built once per forward on every rank from the
    batch's small tables (``ctx_len`` per sequence; ``br_group``, ``br_start``, ``br_len`` per continuation with at
    least one input token), and shared by all layers.

    The continuations are attended in parts of ``part_rows``, longest first: one call over all of them would pad
    every continuation to the longest one of the batch (a document's endings differ in length), and the kernel
    computes padded entries like any other.
    """

    def __init__(self, ctx_len: torch.Tensor, br_group: torch.Tensor, br_start: torch.Tensor, br_len: torch.Tensor,
                 t: int, part_rows: int = PART_ROWS):
        dev = ctx_len.device
        self.tables = (ctx_len, br_group, br_start, br_len)
        self.b = ctx_len.numel()
        self.t = t
        self.cmax = int(ctx_len.max())
        self.calls = 0
        ar_t = torch.arange(t, device=dev)
        pos = torch.where(ar_t[None, :] < ctx_len[:, None], ar_t[None, :], 0)
        order = torch.argsort(br_len, descending=True, stable=True)
        self.parts = [_Part(ctx_len, br_group[ix], br_start[ix], br_len[ix], t)
                      for ix in torch.split(order, part_rows)]
        for part in self.parts:
            pos.view(-1)[part.dst] = part.positions
        self.position_ids = pos

    def forward_kwargs(self) -> dict:
        """The base model's keyword arguments for this tree: its position ids, the spec itself and an all-ones 2-D
        attention mask. Why the mask: given position ids that restart and no mask, transformers takes the batch for
        packed sequences and builds a ``[b, 1, t, t]`` mask with its Python mask functions, which
        :func:`tree_attention` never reads (8.8 ms of a 120-160 ms forward of stories260K at b=4, t=736: bench/README,
        "Session 23"); a mask that says "no padding", with as many queries as keys, lets its ``sdpa`` mask builder
        return none."""
        ones = torch.ones((self.b, self.t), dtype=torch.long, device=self.position_ids.device)
        return {"position_ids": self.position_ids, "attention_mask": ones, SPEC_KW: self}

    def rows(self, r0: int, r1: int) -> TreeSpec | None:
        """The spec of sequences ``r0..r1-1`` alone (a pipeline's micro-batch of this batch), at the same width;
        None where none of them has a continuation of its own (each is then causal throughout, a plain row)."""
        ctx_len, br_group, br_start, br_len = self.tables
        keep = (br_group >= r0) & (br_group < r1)
        if not bool(keep.any()):
            return None
        return TreeSpec(ctx_len[r0:r1], br_group[keep] - r0, br_start[keep], br_len[keep], self.t)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, b: int, t: int, n: int, r: int) -> TreeSpec:
        o = b * t + 2 * n
        ctx_len = packed[o : o + b]
        o += b
        br = packed[o : o + 3 * r].view(3, r)
        return cls(ctx_len, br[0], br[1], br[2], t)


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spec: TreeSpec,
                   dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention of each row of a packed tree with ``scaled_dot_product_attention``: the contexts (causal,
    by themselves) in one call, then each part of the continuations against their contexts and causally
    themselves. Returns ``[b, t, heads, head_dim]`` as transformers' attention functions do."""
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise TreeUnsupported(f"attention with {name}")
    if dropout or not getattr(module, "is_causal", True):
        raise TreeUnsupported("attention with dropout or without a causal mask")
    spec.calls += 1
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, hq, t, _ = query.shape
    hkv = key.shape[1]
    gqa = dict(enable_gqa=True) if hq != hkv else {}
    c = spec.cmax
    out = torch.zeros((b, t, hq, value.shape[-1]), dtype=query.dtype, device=query.device)
    out[:, :c] = sdpa(query[:, :, :c], key[:, :, :c], value[:, :, :c], is_causal=True, scale=scaling,
                      **gqa).transpose(1, 2)
    flat_q, flat_k, flat_v = (x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[3]) for x in (query, key, value))
    flat_out = out.view(b * t, hq, -1)
    for part in spec.parts:
        def rows(flat, part=part):  # the part's continuation tokens [r, heads, emax, d]
            return flat[part.index].transpose(1, 2)

        k = torch.cat([key[part.group, :, : part.cmax], rows(flat_k)], dim=2)
        v = torch.cat([value[part.group, :, : part.cmax], rows(flat_v)], dim=2)
        if gqa:  # the masked kernel's grouped-query path is the slow one: repeat the key/value heads instead
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        o = sdpa(rows(flat_q), k, v, attn_mask=part.mask, scale=scaling)
        flat_out[part.dst] = o.transpose(1, 2).reshape(-1, hq, o.shape[-1])[part.src]
    return out, None


def sdpa_or_tree(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function :data:`mpitp.compat.TREE_ATTENTION`: with a :class:`TreeSpec` in its keyword arguments
    :func:`tree_attention`, else exactly transformers' ``sdpa`` function."""
    spec = kwargs.pop(SPEC_KW, None)
    if spec is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    return tree_attention(module, query, key, value, spec, **kwargs)


def install(model: PreTrainedModel) -> bool:
    """Run ``model`` (an ``sdpa`` model) under :func:`sdpa_or_tree`, registered as transformers' attention function
    :data:`mpitp.compat.TREE_ATTENTION`: this model only; transformers' ``"sdpa"`` and other models are untouched.
    False where transformers has no attention interface to register it with."""
    try:
        compat.register_tree_attention(sdpa_or_tree)
    except ImportError:  # pragma: no cover
        return False
    model.set_attn_implementation(compat.TREE_ATTENTION)
    return True


def uninstall(model: PreTrainedModel) -> None:
    """Back to plain ``sdpa`` (the probe found that this model's forward does not honour trees)."""
    if compat.attention_implementation(model.config) == compat.TREE_ATTENTION:
        model.set_attn_implementation("sdpa")
