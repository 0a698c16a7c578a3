"""Pipeline stages: each stage loads only its layers (TP-sharded inside the stage) and passes activations on.

Loading is transformers' own (``DistributedConfig(tp_size=tp, pp_size=pp)`` over the replica's torch world): before
any weight is read it replaces the layers other stages own by identity stubs on the meta model (and the embedding,
final norm and head where a stage does not need them), so no rank reads or allocates another stage's layers. We add
two things transformers 5.24 lacks:

1. it resolves the TP plan *before* the PP split, so with tp > 1 the plan still names the stubbed modules and
   ``apply_tensor_parallelism`` fails (``KeyError: 'model.layers.3.self_attn.q_proj.weight'``, or "PipelineIdentityLayer
   has no out_features"); :func:`_tp_plan_without_stubs` drops those entries while the model loads;
2. :func:`compact` keeps only the stage's layers, renumbered from 0, with a config of the stage's depth, so a plain
   ``DynamicCache`` (and the mask code, which sizes the mask from the cache's first layer) works per stage and the
   stage is an ordinary model to run.

The forward is ours (:class:`StageLink` and :mod:`mpitp.replica.shard`), not transformers' naive PP forward, which
broadcasts the full logits from the last stage on every call and runs a batch as one piece, so stages never overlap.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING

import torch

from mpitp import compat
from mpitp.errors import UsageError
from mpitp.parallel.deadline import torch_deadline
from mpitp.parallel.layout import split_layers

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedConfig, PreTrainedModel

    from mpitp.parallel.layout import Layout
    from mpitp.replica.scoring import CommCounter

# Keyword arguments of a CausalLM forward that a decoder stack (the base model) does not take.
HEAD_ONLY_KWARGS = frozenset({"labels", "logits_to_keep", "return_dict"})


def num_layers(config: PreTrainedConfig) -> int:
    return int(config.get_text_config().num_hidden_layers)


def check_pp(config: PreTrainedConfig, pp: int) -> None:
    """Refuse pipeline layouts the model cannot take, with the arithmetic spelled out."""
    if pp == 1:
        return
    text = config.get_text_config()
    if not (getattr(text, "base_model_pp_plan", None) or getattr(config, "base_model_pp_plan", None)):
        raise UsageError(f"model type '{config.model_type}' has no pipeline-parallel plan in transformers; "
                         f"run it with --pp 1")
    n = num_layers(config)
    if pp > n:
        raise UsageError(f"pp={pp} exceeds the model's {n} decoder layers (each stage needs at least one)")


def base_model(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack without the LM head (``LlamaModel`` inside ``LlamaForCausalLM``, and so on). transformers'
    ``base_model`` is the attribute ``base_model_prefix`` names, and a class may name one it does not have
    (``Llama4ForCausalLM``: ``language_model``, while its decoder is ``model``): ``base_model`` is then the whole model,
    whose output has no ``last_hidden_state`` (and ``get_decoder()`` returns it too); the stack is then the submodule
    under the name transformers' causal LMs give it (``model``, GPT-2's ``transformer``)."""
    base = model.base_model
    if base is not model:
        return base
    for name in ("model", "transformer"):
        found = getattr(model, name, None)
        if isinstance(found, torch.nn.Module) and found is not model:
            return found
    return base


def check_plans_apply(config: PreTrainedConfig, tp: int, pp: int, ep: int = 1) -> None:
    """A plan whose rules reach none of the class's layers leaves them whole on every rank (transformers only warns):
    at ``--tp`` that is every layer computed in full on each rank, the memory TP is for never saved. Refused before
    loading, from the class built on the meta device with one decoder layer (no memory, no weights read; models with
    remote code are not built here: their code runs only when loading).

    TP (without ``--ep``, whose plan spreads the experts): a rule of the class's ``tp_plan`` must name something in
    the layer stack (``model.layers.*...``, under a layer list the class has). transformers 5.24 wrote
    Llama4ForCausalLM's under its ``base_model_prefix`` ``language_model``, which the class does not have (5.25 also
    under ``model``, so it splits); 5.25 gives GPT-OSS, LFM2, LFM3, DiffLlama and HunYuan-dense a plan of
    ``embed_tokens`` alone. mpitp's own plans are written for the class's names. PP: transformers applies the plan
    under the ``base_model_prefix``, which a class without an attribute of that name does not have."""
    if tp == 1 and pp == 1 or getattr(config, "auto_map", None):
        return
    from transformers import AutoModelForCausalLM

    try:
        cfg = copy.deepcopy(config)
        text = cfg.get_text_config()
        text.num_hidden_layers = 1
        if isinstance(getattr(text, "layer_types", None), list):
            text.layer_types = text.layer_types[:1]  # a property on some configs (FalconH1): raises, left to the load
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:  # noqa: BLE001 - a config this shortcut cannot build is left to the load, as before
        return
    from mpitp.replica import tp_plans

    if tp > 1 and ep == 1 and tp_plans.for_config(config) is None and not _rules_reach_layers(model):
        rules = ", ".join(sorted(getattr(model, "tp_plan", None) or {})) or "none"
        raise UsageError(f"model type '{config.model_type}': transformers' tensor-parallel plan for "
                         f"{type(model).__name__} reaches none of its layers (its rules: {rules}), so --tp {tp} would "
                         f"hold every layer whole on each rank; run it with --tp 1 (data parallel: more ranks)"
                         + (", or spread its experts with --ep" if getattr(model, "ep_plan", None) else ""))
    if pp > 1 and model.base_model is model:
        layout = " ".join(f"--{k} {n}" for k, n in (("tp", tp), ("pp", pp)) if n > 1)
        raise UsageError(f"model type '{config.model_type}': transformers' parallel plans for {type(model).__name__} "
                         f"apply under '{type(model).base_model_prefix}', which it does not have, so {layout} would "
                         f"not split its layers; run it with --tp 1 --pp 1 (data parallel: more ranks)")
    if pp > 1:
        _check_stage_split(config, model.base_model, pp)


def _rules_reach_layers(model: torch.nn.Module) -> bool:
    """Whether a rule of the class's TP plan names something in a layer stack: its part before the layer wildcard
    (``model.layers`` of ``model.layers.*.self_attn.q_proj``) is a module list the class has. Read from the rules,
    not from the one-layer meta model's modules: a hybrid's first layer may lack what the plan splits in others."""
    for rule in getattr(model, "tp_plan", None) or {}:
        stack, star, _ = rule.partition(".*")
        if not star:
            continue
        try:
            if isinstance(model.get_submodule(stack), torch.nn.ModuleList):
                return True
        except AttributeError:
            continue
    return False


def _check_stage_split(config: PreTrainedConfig, base: torch.nn.Module, pp: int) -> None:
    """What transformers' pipeline split can place: it cuts the decoder's ``layers`` (a PP plan that names its layer
    list otherwise, CodeGen's and GPT-J's ``h``, dies in the load), and every module with weights must be one the PP
    plan puts before or after the layers (DeepSeek-V4's and HY-V4's ``hc_head`` is in none: a stage would run it on
    activations, or skip it)."""
    layers_ok = isinstance(getattr(base, "layers", None), torch.nn.ModuleList)
    stack = _layer_list(base)
    if not layers_ok and stack:
        raise UsageError(f"model type '{config.model_type}': transformers' pipeline split reads the decoder's "
                         f"'layers', which {type(base).__name__} calls '{stack}', so --pp {pp} cannot split it; run it "
                         f"with --pp 1 (--tp or data parallel instead)")
    kinds = getattr(config.get_text_config(), "layer_types", None)
    if isinstance(kinds, list) and any(_attends(k) for k in kinds):
        for stage, (a, b) in enumerate(split_layers(len(kinds), pp)):
            if not any(_attends(k) for k in kinds[a:b]):
                raise UsageError(f"model type '{config.model_type}': --pp {pp} gives stage {stage} layers {a}-{b - 1} "
                                 f"({', '.join(sorted(set(kinds[a:b])))}) and no attention layer, while generation's "
                                 f"cache counts a stage's tokens in its attention layers; use a --pp whose stages "
                                 f"each hold one, or --pp 1")
    before, after = plan_sides(base)
    unplaced = [n for n, mod in base.named_children()
                if n not in [*before, *after, "layers"] and any(True for _ in mod.parameters())]
    if unplaced or not layers_ok:
        what = f"modules with weights its pipeline plan does not place on a stage ({', '.join(unplaced)})" \
            if unplaced else "no decoder layer list 'layers'"
        raise UsageError(f"model type '{config.model_type}': {type(base).__name__} has {what}, so --pp {pp} cannot "
                         f"split it; run it with --pp 1 (--tp or data parallel instead)")


def describe_split(n_layers: int, pp: int) -> str:
    """``stage 0: layers 0-2 (3), stage 1: layers 3-4 (2)``: what ``mpitp info`` and the run log print."""
    parts = []
    for s, (a, b) in enumerate(split_layers(n_layers, pp)):
        parts.append(f"stage {s}: layers {a}-{b - 1} ({b - a})")
    return ", ".join(parts)


@contextlib.contextmanager
def _tp_plan_without_stubs() -> Iterator[None]:
    """While loading, drop TP plan entries that name modules the PP split replaced (see the module docstring)."""
    import transformers.distributed.mixin as mixin
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    original = mixin.apply_tensor_parallelism

    def apply(model: torch.nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> torch.nn.Module:
        modules, params = dict(model.named_modules()), dict(model.named_parameters())
        kept = {k: v for k, v in plan.items()
                if k in params or (k in modules and not isinstance(modules[k], PipelineIdentityLayer))}
        return original(model, mesh, kept)

    with compat.replaced("transformers.distributed.mixin.apply_tensor_parallelism", apply):
        yield


def load_stage(model: str, tp: int, pp: int, pp_rank: int, dtype: str = "auto", revision: str | None = None,
               trust_remote_code: bool = False, peft: str | None = None, **load_kwargs) -> PreTrainedModel:
    """Load this rank's stage: its layers only, TP-sharded over its stage's ranks. Collective over the replica.

    ``load_kwargs`` go to ``from_pretrained`` (``attn_implementation``, ``subfolder`` from ``--model_args``);
    ``peft``: a LoRA adapter merged into the stage's own layers before they are renumbered (so the adapter's layer
    indices still name them)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from mpitp.replica import dcp
    from mpitp.replica.loading import LOAD_DEFAULTS, strided_shards_with_pread

    load_kwargs = {**LOAD_DEFAULTS, **load_kwargs}
    hf_assets = load_kwargs.pop("hf_assets", None)
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    distributed = DistributedConfig(tp_size=tp, pp_size=pp)
    if dcp.is_dcp(model):  # the same split and plan; each rank reads its stage's tensors (its slices) from DCP
        with _tp_plan_without_stubs():
            m = dcp.from_pretrained(model, hf_assets, distributed, torch_dtype, trust_remote_code, **load_kwargs)
    else:
        reads = strided_shards_with_pread() if tp > 1 else contextlib.nullcontext()
        with _tp_plan_without_stubs(), reads:
            m = AutoModelForCausalLM.from_pretrained(model, distributed_config=distributed, dtype=torch_dtype,
                                                     revision=revision, trust_remote_code=trust_remote_code,
                                                     **load_kwargs)
    if peft:
        from mpitp.replica import adapters

        adapters.apply(m, adapters.read(peft), stubbed=True)
    start, end = split_layers(num_layers(m.config), pp)[pp_rank]
    compact(m, start, end)
    m.eval()
    return m


def compact(model: PreTrainedModel, start: int, end: int) -> None:
    """Keep layers ``[start, end)`` only, renumbered from 0, under a config of that depth; undo the PP forward wrap."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    base = base_model(model)
    total = len(base.layers)
    layers = list(base.layers)[start:end]
    if any(isinstance(layer, PipelineIdentityLayer) for layer in layers) or not layers:
        raise RuntimeError(f"stage layers {start}..{end - 1} were not loaded by transformers' pipeline split")
    base.layers = torch.nn.ModuleList(layers)
    for i, layer in enumerate(layers):
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = i
    was, was_text = model.config, model.config.get_text_config()
    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    text.num_hidden_layers = end - start
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[start:end]
    # Every module that held the old config holds the stage's: a layer's attention reads the implementation from its
    # own ``config`` at every call, so an attention function set on the stage model (prefix sharing's tree) reached
    # no layer while the layers kept the config they were built with.
    for mod in model.modules():
        held = getattr(mod, "config", None)
        if held is was:
            mod.config = config
        elif held is was_text:
            mod.config = text
    if start > 0:
        _embedding_steps_off(base)
    if end < total:
        _after_layers_off(base)
    # transformers wraps the instance's forward with its naive PP forward; mpitp.replica.shard drives stages itself.
    compat.undo_pp_forward_wrap(model)


def _attends(layer_type: str) -> bool:
    """A layer type whose cache holds keys and values (``full_attention``, ``sliding_attention``), not a linear
    attention, state-space, convolution or MLP-only layer."""
    return "attention" in layer_type and "linear" not in layer_type


def plan_sides(base: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The base model's PP plan split around its layer list: (modules before it, modules after it), by the names the
    plan gives (GPT-NeoX's ``final_layer_norm``, Phi's ``final_layernorm``, Llama's ``norm``)."""
    plan = list(getattr(base.config, "base_model_pp_plan", None) or {})
    stack = _layer_list(base)
    return (plan, []) if stack is None else (plan[:plan.index(stack)], plan[plan.index(stack) + 1:])


def _layer_list(base: torch.nn.Module) -> str | None:
    """The name the base model's PP plan gives its decoder layer list (the entry that is a ``ModuleList``)."""
    return next((k for k in getattr(base.config, "base_model_pp_plan", None) or {}
                 if isinstance(getattr(base, k, None), torch.nn.ModuleList)), None)


def _after_layers_off(base) -> None:
    """On a stage before the last, what the PP plan puts after the layers (the final norm) must not run: transformers'
    split replaces only a module called ``norm`` (and ``embed_tokens``), so a final norm of another name (GPT-NeoX's
    ``final_layer_norm``, Phi's ``final_layernorm``) stayed on stage 0 and normalised its activations before stage 1's
    layers: every log-likelihood wrong at pp=2 (found by the registry-wide matrix). Each is replaced as transformers
    replaces ``norm``."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    for name in plan_sides(base)[1]:
        if isinstance(getattr(base, name, None), torch.nn.Module):
            setattr(base, name, PipelineIdentityLayer())


def _embedding_steps_off(base) -> None:
    """On a stage after the first, ``inputs_embeds`` are the previous stage's activations, not embeddings: undo the
    scaling the decoder's forward applies to them (Granite and HyperCLOVAX: ``inputs_embeds = inputs_embeds *
    self.embedding_multiplier``), read from the forward's source, or every later stage would scale them again. The
    stage model is mpitp's own and never handed back, so the attributes stay 1."""
    for attr in _embedding_scales(type(base).forward):
        value = getattr(base, attr, None)
        if isinstance(value, (int, float)):
            setattr(base, attr, type(value)(1))
        elif torch.is_tensor(value):
            setattr(base, attr, torch.ones_like(value))


def _embedding_scales(forward) -> list[str]:
    """The ``attr`` of every ``inputs_embeds = inputs_embeds * self.attr`` (or ``/``) in ``forward``, read with ast
    (:func:`mpitp.compat.forward_tree`: a declared fact per model type would miss the next family that scales)."""
    import ast

    try:
        tree = compat.forward_tree(forward)
    except (OSError, TypeError, SyntaxError):
        return []
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "inputs_embeds" and isinstance(node.value, ast.BinOp)):
            continue
        v = node.value
        if isinstance(v.op, (ast.Mult, ast.Div)) and isinstance(v.left, ast.Name) and v.left.id == "inputs_embeds" \
                and isinstance(v.right, ast.Attribute) and isinstance(v.right.value, ast.Name) \
                and v.right.value.id == "self":
            out.append(v.right.attr)
    return out


class StageLink:
    """Point-to-point activations between neighbouring stages over the replica's torch world.

    Stage ``s``'s TP rank ``t`` talks to the same TP rank of stages ``s - 1`` and ``s + 1`` (every TP rank of a
    stage holds the full hidden state after the stage's last all-reduce, so each forwards its own copy and no
    broadcast is needed on the receiving side). Sends are asynchronous so that a stage starts its next micro-batch
    while the previous one travels; :meth:`flush` waits for them.
    """

    def __init__(self, layout: Layout, counter: CommCounter | None = None):
        self.layout = layout
        self.counter = counter
        r = layout.replica_rank
        self.prev = r - layout.tp if not layout.first_stage else None
        self.next = r + layout.tp if not layout.last_stage else None
        self._pending: list = []

    def send(self, t: torch.Tensor, dst: int | None = None) -> None:
        import torch.distributed as dist

        dst = self.next if dst is None else dst
        t = t.contiguous()
        if self.counter is not None:
            self.counter.add(t)
        self._pending.append((dist.isend(t, dst=dst), t))  # keep t alive until sent

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
             src: int | None = None) -> torch.Tensor:
        import torch.distributed as dist

        t = torch.empty(shape, dtype=dtype, device=device)
        with torch_deadline("pipeline stage receiving activations", None):
            dist.recv(t, src=self.prev if src is None else src)
        return t

    def send_activation(self, t: torch.Tensor, dst: int | None = None) -> None:
        """``t`` preceded by its spec (dtype and shape), so the receiver need not guess them: a stage of another
        dtype (mixed precision, a quantized stage) or an unexpected shape would otherwise hang it or be misread."""
        self.send(_spec_tensor(t), dst)
        self.send(t, dst)

    def recv_activation(self, device: str | torch.device, src: int | None = None) -> torch.Tensor:
        """The next tensor :meth:`send_activation` sent to this rank, allocated from its spec."""
        spec = self.recv((_SPEC_LEN,), torch.long, device, src)
        dtype, shape = _from_spec(spec)
        return self.recv(shape, dtype, device, src)

    def flush(self) -> None:
        with torch_deadline("pipeline stage sending activations", None):
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()


_SPEC_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
                torch.int8, torch.bool)
_SPEC_LEN = 2 + 6  # dtype code, ndim, up to six dimensions


def _spec_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _SPEC_DTYPES or t.dim() > _SPEC_LEN - 2:
        raise TypeError(f"cannot send a {t.dtype} activation of {t.dim()} dimensions between stages")
    dims = list(t.shape) + [0] * (_SPEC_LEN - 2 - t.dim())
    return torch.tensor([_SPEC_DTYPES.index(t.dtype), t.dim(), *dims], dtype=torch.long, device=t.device)


def _from_spec(spec: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    code, ndim, *dims = (int(x) for x in spec.tolist())
    return _SPEC_DTYPES[code], tuple(dims[:ndim])


def micro_batches(b: int, pp: int, per_stage: int = 2) -> list[tuple[int, int]]:
    """Cut ``b`` rows into contiguous micro-batches: ``per_stage * pp`` of them where there are enough rows.

    At least ``pp`` pieces keep every stage busy once the pipeline is full; more pieces shorten the fill and drain.
    """
    return split_layers(b, max(1, min(b, per_stage * pp)))
