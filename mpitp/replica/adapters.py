"""LoRA adapters (``--model_args peft=ADAPTER``), merged into each rank's own shard of the base weights.

Why merged, and why here: transformers' TP plan shards the base model's ``nn.Linear`` weights as DTensors (colwise:
rows, ``Shard(0)``; rowwise: columns, ``Shard(-1)``) and knows nothing of LoRA-wrapped layers, so peft's wrappers
under TP are exactly where adapters get silently ignored or mis-sharded. Merging ``W += scale * B @ A`` in float32
into the slice of ``W`` this rank holds (the slice's offsets come from the DTensor's own placements) gives the weights
peft's ``merge_and_unload`` gives, sharded the way the model already is, with no change to mpitp's forward. With
pp > 1 each stage merges only the layers it loaded (:func:`apply` runs before the stage is renumbered).

``modules_to_save`` (and ``bias='all'|'lora_only'``) are saved as whole parameters: each rank copies in its slice.
Everything this module does not apply exactly is refused by :func:`read`, with one line naming it: non-LoRA peft
types, DoRA, ``lora_bias``, embedding or convolution LoRA, ``target_parameters``, trainable tokens, layer
replication, aLoRA, and saved copies of a tied parameter (the tie would carry the change to its twin).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from typing import TYPE_CHECKING

from mpitp.digest import update_file
from mpitp.errors import UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."

REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "lora_bias",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "megatron_config": "megatron_config",
    "arrow_config": "arrow_config",
}
"""Adapter config keys that change what LoRA computes beyond ``W + scale * B @ A``: refused when set."""


@dataclasses.dataclass
class LoraPair:
    """One targeted module's low-rank update: ``delta = scale * B @ A`` (transposed with ``fan_in_fan_out``)."""
    module: str
    a: object
    b: object
    scale: float
    transpose: bool

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of ``delta`` (and of the weight it is added to)."""
        rows, cols = self.b.shape[0], self.a.shape[1]
        return (cols, rows) if self.transpose else (rows, cols)

    def add_to(self, local: torch.Tensor, index: tuple[slice, slice] | None) -> None:
        """``local += delta[index]`` (``index`` None: the whole of it), in float32, without forming ``delta``: one
        ``addmm`` of the rows of B and the columns of A the block needs (a TP rank's half of the work); in place
        where the weight is float32."""
        import torch

        rows, cols = index or (slice(None), slice(None))
        if self.transpose:  # delta = (B @ A).T, so delta[rows, cols] = A[:, rows].T @ B[cols].T
            left, right = self.a[:, rows].T, self.b[cols].T
        else:
            left, right = self.b[rows], self.a[:, cols]
        left, right = (m.to(local.device, torch.float32) for m in (left, right))
        if local.dtype == torch.float32:
            local.addmm_(left, right, alpha=self.scale)
        else:
            local.copy_(torch.addmm(local.to(torch.float32), left, right, alpha=self.scale).to(local.dtype))


@dataclasses.dataclass
class Adapter:
    """A LoRA adapter read from its folder: the low-rank pairs and the whole parameters it saves."""
    path: str
    config: dict
    pairs: list[LoraPair]
    saved: dict  # parameter name in the base model -> full tensor (modules_to_save, biases)


def _one_line(path: str, what: str) -> UsageError:
    return UsageError(f"--model_args peft={path}: {what}")


def _load_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise _one_line(path, "no such adapter directory")
    cfg_path, weights = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not os.path.isfile(cfg_path) or not os.path.isfile(weights):
        raise _one_line(path, f"not a PEFT adapter folder (needs {CONFIG} and {WEIGHTS})")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise _one_line(path, f"{CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _one_line(path, f"{CONFIG} is not a JSON object")
    return config


def check_config(path: str) -> dict:
    """The adapter's config if mpitp applies it exactly, else a one-line :class:`UsageError` naming what is not."""
    config = _load_config(path)
    kind = config.get("peft_type")
    if kind != "LORA":
        raise _one_line(path, f"peft_type {kind} is not supported (LoRA adapters only)")
    for key, name in REFUSED_OPTIONS.items():
        if config.get(key) not in (None, False, {}, [], 0, ""):
            raise _one_line(path, f"{name} is not supported: only plain LoRA (W + scale * B @ A) is applied")
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        raise _one_line(path, f"bias={config.get('bias')!r} is not a LoRA bias setting")
    return config


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule (``get_pattern_key``): the first pattern that matches the end of the module name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def read(path: str) -> Adapter:
    """Read and check the adapter at ``path``: every tensor is either a LoRA ``A``/``B`` or a saved parameter."""
    from safetensors.torch import load_file

    config = check_config(path)
    tensors = load_file(os.path.join(path, WEIGHTS))
    groups: dict[str, dict] = {}
    saved = {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if m:
            groups.setdefault(m.group(1), {})[m.group(2)] = t
        elif re.search(r"\.lora_[a-zA-Z_]+", name):
            raise _one_line(path, f"tensor {key} is not a LoRA A/B weight of a linear layer (embedding or other "
                                  "LoRA variants are not supported)")
        else:  # peft names a LoRA-wrapped layer's own parameters (bias='lora_only'|'all') under base_layer
            saved[name.replace(".base_layer.", ".")] = t
    pairs = []
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    for module, ab in sorted(groups.items()):
        if set(ab) != {"A", "B"}:
            raise _one_line(path, f"{module} has lora_{'A' if 'A' in ab else 'B'} without its partner")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _one_line(path, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a "
                                  "linear layer's low-rank pair (convolution LoRA is not supported)")
        r = _pattern_value(config.get("rank_pattern"), module, r_default)
        alpha = _pattern_value(config.get("alpha_pattern"), module, alpha_default)
        if r != a.shape[0]:
            raise _one_line(path, f"{module}: rank {r} in {CONFIG} but lora_A has {a.shape[0]} rows")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        pairs.append(LoraPair(module, a, b, scale, bool(config.get("fan_in_fan_out"))))
    return Adapter(path, config, pairs, saved)


def fingerprint(path: str) -> str:
    """SHA-256 of the adapter's config and weights, hashed whole (adapters are small): part of the resume
    identity, so a rewritten adapter at the same path is not mixed with the old one's rows."""
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        update_file(h, os.path.join(path, name))
        h.update(b"\0")
    return h.hexdigest()[:16]


def _local_slice(param, full, name: str = "", path: str = ""):
    """The part of ``full`` (a global-shape tensor) that this rank's ``param`` holds, and ``param``'s local data."""
    local, index = _local_part(param, name, path)
    return local, full if index is None else full[index]


def _local_part(param, name: str = "", path: str = ""):
    """``param``'s local data and where it sits in the whole tensor (a tuple of slices; None: it is the whole).

    A DTensor says where its local shard sits (``compute_local_shape_and_global_offset`` of its placements: colwise
    ``Shard(0)`` rows, rowwise ``Shard(-1)`` columns, replicated whole); a parameter a fix-up cut by hand says which
    rows it kept (:func:`~mpitp.replica.tp_fixups.kept_rows`: Falcon-7B's and StarCoder's query heads with the shared
    key/value rows, DBRX's ``Wqkv``); any other plain tensor holds the whole of it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # type: ignore
    from mpitp.replica.tp_fixups import kept_rows

    data = param.data
    kept = kept_rows(param)
    if kept is not None:
        return data, (kept[1], *[slice(None)] * (data.dim() - 1))  # row numbers on the host, as B and A
    if isinstance(data, DTensor):
        from torch.distributed.tensor import Replicate, Shard

        from mpitp import compat
        from mpitp.replica.channel_tp import strided_index

        packed = strided_index(data)  # a packed projection split part by part: its rows of each part
        if packed is not None:
            return data.to_local(), packed
        odd = [pl for pl in data.placements if type(pl) not in (Shard, Replicate)]
        if odd:  # any other placement: a rank's part of the weight is not one slice of it
            raise _one_line(path, f"{name} is sharded as {odd[0]} under TP: adapters on packed/strided shards are "
                                  "not supported (use --tp 1)")

        shape, offset = compat.attribute(compat.LOCAL_SHARD)(data.shape, data.device_mesh, data.placements)
        return data.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return data, None


def _whole_shape(param) -> tuple[int, ...]:
    """The shape of the whole of ``param`` (a DTensor's global one, that of the tensor a fix-up cut it from)."""
    from mpitp.replica.tp_fixups import kept_rows

    kept = kept_rows(param)
    return kept[0] if kept is not None else tuple(param.shape)


def _param_owners(model) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return owners


@dataclasses.dataclass
class Restore:
    """What :func:`apply` changed, and (with ``keep``) a copy of each changed local shard's original values.

    Why a copy and not ``W -= scale * B @ A``: in float32 (let alone bf16) the subtraction does not give the old bits
    back, and a sweep over many adapters would carry the rounding from one adapter into the next. Only the
    parameters the adapter touches are copied, each rank only its own shard of them. ``shared``: ``saved`` is the
    sweep's copy of the base values (apply's ``originals``), made on a parameter's first touch by any adapter and
    kept after :meth:`restore` for the next (a restored parameter holds the base values again): copying 150 MB of
    weights took 60 ms of every adapter's 100 ms merge on bench_adapters.py's base."""
    changed: int = 0
    saved: dict = dataclasses.field(default_factory=dict)  # parameter name -> (local shard, its original values)
    touched: set = dataclasses.field(default_factory=set)  # the parameters this merge changed
    shared: bool = False

    def keep(self, name: str, local: torch.Tensor) -> None:
        self.touched.add(name)
        if name not in self.saved:  # the first touch holds the base values
            self.saved[name] = (local, local.detach().clone())

    def restore(self) -> int:
        """Copy the base values back (bit for bit); returns how many parameters were restored."""
        import torch

        with torch.no_grad():
            for name in self.touched:
                local, original = self.saved[name]
                local.copy_(original)
        n = len(self.touched)
        self.touched = set()
        if not self.shared:
            self.saved = {}
        return n


def apply(model: PreTrainedModel, adapter: Adapter, stubbed: bool = False, keep: bool = False,
          originals: dict | None = None) -> Restore:
    """Merge ``adapter`` into ``model``'s (local shards of its) weights in place; returns what it changed.

    ``stubbed``: a pipeline stage, whose other stages' layers are stubs here: their updates are skipped (the stage
    holding them applies them). Otherwise every targeted module must exist, or the adapter is for another model.
    ``keep``: copy the original values of every shard it changes first, so :meth:`Restore.restore` gives the base
    model back exactly (adapter sweeps, :mod:`mpitp.jobs.adapter_sweep`); should the merge fail half-way, what it
    changed is restored before the error is raised. ``originals``: where those copies are kept from one merge into
    this very model to the next, each restored before the next merge (:class:`Restore`, ``shared``)."""
    done = Restore() if originals is None else Restore(saved=originals, shared=True)
    try:
        _merge(model, adapter, stubbed, done, keep)
    except BaseException:
        done.restore()
        raise
    return done


def _pipeline_stub(module) -> bool:
    """Whether ``module`` stands in for one another pipeline stage holds (transformers' PP plan)."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    return isinstance(module, PipelineIdentityLayer)


def _merge(model, adapter: Adapter, stubbed: bool, done: Restore, keep: bool) -> None:
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    owners = _param_owners(model)

    def target(name: str, what: str) -> torch.nn.Parameter | None:
        p = params.get(name)
        if p is None:
            if stubbed:
                return None
            raise _one_line(adapter.path, f"{what} {name} is not in the base model (adapter for another model?)")
        twins = [n for n in owners[id(p)] if n != name]
        if twins:
            raise _one_line(adapter.path, f"{what} {name} is tied to {twins[0]}: changing it would change both; "
                                          "adapters of tied parameters are not supported")
        return p

    with torch.no_grad():
        # Saved parameters first: peft saves the base weight of a LoRA-wrapped head or embedding ("base_layer", its
        # save_embedding_layers) beside the pair, and loads it under the pair's delta; copied after the merge, it
        # put the base weight back over it (an lm_head adapter was silently ignored).
        for name, full in adapter.saved.items():
            p = target(name, "saved parameter")
            if p is None:
                continue
            if tuple(full.shape) != _whole_shape(p):
                raise _one_line(adapter.path, f"saved {name} is {tuple(full.shape)} but the model's is "
                                              f"{_whole_shape(p)}")
            local, part = _local_slice(p, full.to(p.device), name, adapter.path)
            if keep:
                done.keep(name, local)
            local.copy_(part.to(local.dtype))
            done.changed += 1
        for pair in adapter.pairs:
            mod = modules.get(pair.module)
            if stubbed and _pipeline_stub(mod):
                continue  # the stage that holds this module (the head, an embedding) merges it
            if mod is not None and not hasattr(mod, "weight"):
                raise _one_line(adapter.path, f"{pair.module} ({type(mod).__name__}) has no weight to merge into")
            p = target(f"{pair.module}.weight", "LoRA target")
            if p is None:
                continue
            fits = pair.b.shape[1] == pair.a.shape[0]
            if not fits or tuple(pair.shape) != _whole_shape(p):
                got = tuple(pair.shape) if fits else f"undefined (B {tuple(pair.b.shape)}, A {tuple(pair.a.shape)})"
                raise _one_line(adapter.path, f"{pair.module}: B @ A is {got} but the weight is {_whole_shape(p)}")
            local, index = _local_part(p, pair.module, adapter.path)
            if keep:
                done.keep(f"{pair.module}.weight", local)
            pair.add_to(local, index)
            done.changed += 1
