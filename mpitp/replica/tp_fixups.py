"""After a tensor-parallel load with one of mpitp's own plans (:mod:`mpitp.replica.tp_plans`): what a family needs
beyond the plan, declared there as data (``heads``, ``head_lists``, ``alibi``, ``mqa_rows``, ``fused_heads``,
``own_rows``, ``sum_after``, ``split_state``), applied to the loaded model by :func:`fix_up`: head counts divided,
per-head lists and rows cut to the rank's own, ALiBi biases sliced per rank, sums over the group added after a
method, a recurrent state allocated at the rank's width, and the forwards transformers' kernelization dropped put
back. Declarations and application live apart so that the table of plans reads as data."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.replica import channel_tp, vocab_embedding
from mpitp.replica.tp_plans import _ATTN, _STYLES, _rule, for_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def _tp_mesh(model, tp: int):
    """The TP group's device mesh, read from any parameter transformers sharded."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            if p.device_mesh.size() != tp:
                raise RuntimeError(f"sharded over {p.device_mesh.size()} ranks, expected --tp {tp}")
            return p.device_mesh
    raise RuntimeError("no parameter was sharded: the tensor-parallel plan matched nothing")


def fix_up(model: PreTrainedModel, tp: int) -> None:
    """After a TP load: the vocabulary-split input embeddings summed over MPI (:mod:`mpitp.replica.vocab_embedding`,
    any plan); with mpitp's plan, every fix-up the plan declares (the module docstring) and the forwards transformers'
    kernelization dropped put back, in one walk over the base model's modules."""
    if tp > 1:
        vocab_embedding.install(model, tp)
    own = for_config(model.config) if tp > 1 else None
    if own is None:
        return
    mesh = _tp_mesh(model, tp)
    rank, styles = mesh.get_local_rank(), compat.attribute(_STYLES)
    text = model.config.get_text_config()
    prefix = type(model).base_model_prefix + "."
    for name, module in list(model.named_modules()):
        if not name.startswith(prefix):
            continue
        rule = _rule(name[len(prefix):])
        if _forward_dropped(own.plan.get(rule), module):  # before sum_after wraps a forward
            styles[own.plan[rule]].install_forward(module, mesh)
        for linear, parts in own.fused_heads.get(rule, {}).items():
            _keep_fused_heads(getattr(module, linear), [int(getattr(module, p)) for p in parts], tp, rank)
        for attr in head_attrs(module, own.heads.get(rule, ())):
            setattr(module, attr, _divided(module, attr, tp, model.config.model_type))
        if rule in own.head_lists:
            setattr(module, own.head_lists[rule], _own_entries(getattr(module, own.head_lists[rule]), tp, rank))
        if rule in own.alibi:
            heads = int(getattr(text, _ATTN[0]))
            module.register_forward_pre_hook(_AlibiSlice(own.alibi[rule], heads, tp, rank), with_kwargs=True)
        if rule in own.mqa_rows:
            _keep_mqa_rows(module, int(getattr(text, own.mqa_rows[rule])), tp, rank)
        for attr in own.own_rows.get(rule, ()):
            _keep_own_rows(module, attr, tp, rank)
        if rule in own.sum_after:
            _sum_after(module, *own.sum_after[rule], mesh.get_group())
    if own.split_state:
        model.get_submodule(prefix[:-1]).register_forward_pre_hook(_SplitState(text, tp, own.split_state),
                                                                    with_kwargs=True)


def head_attrs(module, declared: tuple[str, ...]) -> list[str]:
    """The attributes of ``module`` that a ``heads`` entry divides: every name as declared, and a name ending in
    ``?`` only where the module has it (the ``?`` dropped)."""
    return [a.rstrip("?") for a in declared if not a.endswith("?") or hasattr(module, a[:-1])]


def _divided(module, attr: str, tp: int, model_type: str) -> int:
    n = getattr(module, attr)
    if n % tp:
        raise UsageError(f"{model_type}: {n} ({type(module).__name__}.{attr}) is not divisible by --tp {tp}")
    return n // tp


def _own_entries(modules, tp: int, rank: int):
    import torch

    per = len(modules) // tp
    return torch.nn.ModuleList(list(modules)[rank * per:(rank + 1) * per])


class _AlibiSlice:
    """A forward pre-hook: the ALiBi biases in keywords ``keys`` cut to this rank's heads. The slopes are the full
    model's (each head keeps its own), only fewer of them. Layouts: 3-D head-major (``[batch * heads, 1, k]``, BLOOM;
    ``[heads, 1, k]``, MPT) and 4-D ``[batch, heads, q, k]`` (Falcon); a 4-D mask with one head broadcasts, as is."""

    def __init__(self, keys: tuple[str, ...], heads: int, tp: int, rank: int):
        self.keys, self.heads = keys, heads
        per = heads // tp
        self.lo, self.hi = rank * per, (rank + 1) * per

    def own(self, bias: torch.Tensor) -> torch.Tensor:
        if bias.dim() == 4:
            return bias[:, self.lo:self.hi] if bias.shape[1] == self.heads else bias
        rest = tuple(bias.shape[1:])
        return bias.reshape(-1, self.heads, *rest)[:, self.lo:self.hi].reshape(-1, *rest)

    def __call__(self, module, args, kwargs):
        cut = {k: self.own(kwargs[k]) for k in self.keys if kwargs.get(k) is not None}
        return (args, {**kwargs, **cut}) if cut else None


class _SplitState:
    """A forward pre-hook on the base model: where it would allocate its recurrent ``state`` (RWKV: five
    ``[batch, hidden_size, layers]`` tensors, when caching and none is passed), pass one in, the entries ``parts``
    at ``1/tp`` of the width (this rank's channels), as the model fills them: the first two in the embeddings'
    dtype, the rest in float32, the last at -1e30."""

    def __init__(self, config, tp: int, parts: tuple[int, ...]):
        self.config, self.tp, self.parts = config, tp, parts

    def __call__(self, module, args, kwargs):
        import torch

        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = self.config.use_cache and not module.training
        if not use_cache or kwargs.get("state") is not None:
            return None
        ids = args[0] if args else kwargs.get("input_ids")
        embeds = kwargs.get("inputs_embeds")
        batch = (ids if ids is not None else embeds).shape[0]
        weight = module.get_input_embeddings().weight
        dtype = embeds.dtype if embeds is not None else weight.dtype
        width, layers = self.config.hidden_size, self.config.num_hidden_layers
        state = [torch.zeros(batch, width // self.tp if i in self.parts else width, layers,
                             dtype=dtype if i <= 1 else torch.float32, device=weight.device) for i in range(5)]
        state[4] -= 1e30
        return args, {**kwargs, "state": state}


def _forward_dropped(style: str | None, module) -> bool:
    """transformers 5.25 kernelizes every load by default (its ``kernels`` integration, whose torch fallback is the
    class's own forward): for a class decorated with ``use_kernel_forward_from_hub`` (the RMS norms ...) that pops
    the module's instance ``forward``, which is where a style of :mod:`mpitp.replica.channel_tp` installed its own
    (BitNet's sharded norm then ran the whole-width forward on its shard: a traceback at tp=2). True where such a
    style's forward is gone."""
    return style in channel_tp.FORWARDS and "forward" not in vars(module)


def _sum_after(module, method: str, bias: str, group) -> None:
    """``module.<method>`` run with ``module.<bias>`` at zero, its output summed over ``group``, the bias added after
    (see ``sum_after`` in the module docstring)."""
    import torch

    original = getattr(module, method)

    def summed(*args, **kwargs):
        kept = getattr(module, bias)
        with torch.no_grad():
            setattr(module, bias, torch.nn.Parameter(torch.zeros_like(kept), requires_grad=False))
            try:
                out = original(*args, **kwargs)
            finally:
                setattr(module, bias, kept)
        compat.attribute(compat.TP_DIST).all_reduce(out, group=group)  # read per call: MPI on CPU
        return out + kept

    setattr(module, method, summed)


def _keep_fused_heads(linear, heads: list[int], tp: int, rank: int) -> None:
    """``[part 0 | part 1 | ...]`` loaded whole, the parts ``heads`` heads each: keep this rank's ``1/tp`` of each
    part's heads (rows), in the same order."""
    import torch

    dim, dev, rows, start = linear.weight.shape[0] // sum(heads), linear.weight.device, [], 0
    for n in heads:
        per = n // tp * dim
        rows.append(torch.arange(start + rank * per, start + (rank + 1) * per, device=dev))
        start += n * dim
    _keep_rows(linear, torch.cat(rows))


WHOLE_ROWS = "_mpitp_whole_rows"
"""Attribute of a parameter cut by hand to this rank's rows: ``(the whole tensor's shape, the rows it holds)``, so
that what is merged into it later (a LoRA adapter's ``B @ A``, :mod:`mpitp.replica.adapters`) takes the same rows."""


def kept_rows(param) -> tuple[tuple[int, ...], torch.Tensor] | None:
    """``(whole shape, rows)`` of a parameter a fix-up cut to this rank's rows (:data:`WHOLE_ROWS`), else None."""
    return getattr(param, WHOLE_ROWS, None)


def _rows_of(whole: torch.Tensor, rows: torch.Tensor) -> torch.nn.Parameter:
    import torch

    with torch.no_grad():
        kept = torch.nn.Parameter(whole.index_select(0, rows).contiguous(), requires_grad=False)
    setattr(kept, WHOLE_ROWS, (tuple(whole.shape), rows.cpu()))
    return kept


def _keep_rows(linear, rows) -> None:
    """Keep ``rows`` of ``linear``'s weight (and bias): its output features become those."""
    linear.weight = _rows_of(linear.weight, rows)
    if linear.bias is not None:
        linear.bias = _rows_of(linear.bias, rows)
    linear.out_features = int(rows.numel())


def _keep_own_rows(module, attr: str, tp: int, rank: int) -> None:
    """Parameter ``attr`` of ``module``, loaded whole: keep this rank's ``1/tp`` of its rows."""
    import torch

    whole = getattr(module, attr)
    per = whole.shape[0] // tp
    setattr(module, attr, _rows_of(whole, torch.arange(rank * per, (rank + 1) * per, device=whole.device)))


def _keep_mqa_rows(linear, q_width: int, tp: int, rank: int) -> None:
    """``[q | k | v]`` loaded whole: keep this rank's ``q_width / tp`` query rows and every shared k/v row."""
    import torch

    per, dev = q_width // tp, linear.weight.device
    _keep_rows(linear, torch.cat([torch.arange(rank * per, (rank + 1) * per, device=dev),
                                  torch.arange(q_width, linear.weight.shape[0], device=dev)]))
