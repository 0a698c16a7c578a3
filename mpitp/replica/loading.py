"""Checking and loading a causal LM, TP-sharded with transformers' own plans.

Checks run on rank 0 *before* any weights load (through :func:`mpitp.parallel.runtime.agree`), so bad input costs
seconds,
not a model load on every rank. Loading with tp > 1 uses ``DistributedConfig(tp_size=tp)``: transformers shards each
weight as it reads it, so no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from mpitp.errors import UsageError
from mpitp.replica import tp_fixups, tp_plans

if TYPE_CHECKING:
    from collections.abc import Iterator

    from safetensors import safe_open
    from transformers import PreTrainedConfig, PreTrainedModel

    from mpitp.parallel.world import World

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: it exists, or it starts like a path, or has more parts than ``org/name``."""
    return os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1


def load_config(model: str, revision: str | None = None, trust_remote_code: bool = False,
                hf_assets: str | None = None) -> PreTrainedConfig:
    """The model's config, or a one-line :class:`UsageError` saying why it cannot be had. A torch DCP checkpoint
    folder's comes from ``hf_assets`` (or beside it: :func:`mpitp.replica.dcp.assets_dir`); formats that are neither
    are refused naming the conversion to use."""
    from transformers import AutoConfig

    from mpitp.replica import dcp

    source = model
    if _looks_local(model):
        path = os.path.expanduser(model)
        if not os.path.exists(path):
            raise UsageError(f"model path {model} does not exist")
        if os.path.isdir(path):
            dcp.refuse_foreign(path)
        if dcp.is_dcp(path):
            source = dcp.assets_dir(path, hf_assets)
        elif not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(f"model path {model} is not a Hugging Face model directory (no config.json)")
    if hf_assets and source == model:
        raise UsageError(f"--hf-assets applies to torch DCP checkpoint folders only, and {model} is not one (no "
                         f"{dcp.METADATA} file, or Hugging Face weights beside it)")
    try:
        return AutoConfig.from_pretrained(source, revision=None if source != model else revision,
                                          trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - every failure here is the user's model argument
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot load model config for {model!r}: {first}") from None


def warm_for_load(world: World, model: str) -> None:
    """:func:`mpitp.parallel.runtime.warm_imports`, then, where this rank imported, :func:`warm_model_code`."""
    from mpitp.parallel.runtime import warm_imports

    if warm_imports(world):
        warm_model_code(model)


def warm_model_code(model: str) -> None:
    """On a rank that waits for rank 0's checks with a core to spare (:func:`mpitp.parallel.runtime.warm_imports`):
    the model's causal-LM class imported, so that this rank's load finds it done instead of importing it while
    rank 0, which imported it during its checks, waits at the barrier after loading (small launch: this rank's load
    0.47 -> 0.16-0.26 s for 0.12-0.21 s spent here, bench/README "Session 24"). Best effort, and silent: a local
    Hugging Face folder only (no download), no remote code; whatever fails here is for rank 0's checks to report."""
    import warnings

    path = os.path.expanduser(model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = load_config(path)
            if not getattr(config, "auto_map", None):
                tp_plans.causal_lm_class(config)  # a type with no causal-LM class: KeyError, left to the checks
        except Exception:  # noqa: BLE001 - rank 0's checks read the same config and say what is wrong
            return


def check_tp(config: PreTrainedConfig, tp: int) -> None:
    """Refuse layouts transformers' TP cannot shard, with the arithmetic spelled out. A type transformers has no plan
    for is checked against mpitp's own (:mod:`mpitp.replica.tp_plans`), and refused only where neither exists."""
    if tp == 1:
        return
    text = config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        own = tp_plans.for_config(config)
        if own is None:
            raise UsageError(f"model type '{config.model_type}' has no tensor-parallel plan in transformers; "
                             f"run it with --tp 1")
        tp_plans.check(config, own, tp)
        return
    tp_plans.check_upstream(config, tp, plan)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is not None and heads % tp:
        raise UsageError(f"tp={tp} does not divide the model's {heads} attention heads")
    if kv is not None and kv % tp:
        raise UsageError(f"tp={tp} does not divide the model's {kv} key/value heads")


def check_decoder_mode(config: PreTrainedConfig) -> None:
    """Refuse a checkpoint whose causal-LM class is a decoder only with ``is_decoder=True`` in its config (BERT,
    RoBERTa, BERT-generation ... built as causal LMs: the class's ``__init__`` tests ``config.is_decoder``) when the
    config does not say so. transformers then warns and builds it attending both ways: every position sees the tokens
    after it, so the log-likelihood of a continuation is read off a model that was shown it, and a row's numbers move
    with the padding beside it in a batch (found at dp=2 in the registry matrix). lm-eval scores it anyway; mpitp
    cannot hold such numbers to anything, so it refuses them before the load."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_decoder", False) or getattr(config, "auto_map", None):
        return
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None or not _needs_is_decoder(config.model_type, name):
        return
    raise UsageError(f"model type '{config.model_type}': {name} predicts the next token only when its config has "
                     f"\"is_decoder\": true, and this one does not (it would attend both ways, seeing the tokens it "
                     f"scores); set it in config.json if the checkpoint is a causal decoder, or evaluate a causal LM")


def _needs_is_decoder(model_type: str, class_name: str) -> bool:
    """Whether transformers' ``class_name.__init__`` tests ``config.is_decoder`` (``if not config.is_decoder:`` with a
    warning, or an ``assert``); classes that set it themselves (``config.is_decoder = True``: BART's decoder) do not
    need it from the checkpoint. Read from the modeling file's syntax (4-13 ms), not from the imported class
    (:func:`mpitp.compat.forward_tree` of :func:`~mpitp.replica.tp_plans.causal_lm_class`): importing the modeling
    module costs 1.1 s for Llama's, 2.2 s for BERT's, which ``mpitp check`` would pay for this one method."""
    import ast
    import importlib.util

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (AttributeError, ImportError, OSError, TypeError, SyntaxError, ValueError):
        return False
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) if cls else None

    def is_decoder_flag(e) -> bool:
        return isinstance(e, ast.Attribute) and e.attr == "is_decoder" and isinstance(e.value, ast.Name) and \
            e.value.id == "config"

    for node in ast.walk(init) if init else ():
        if isinstance(node, ast.If) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not) \
                and is_decoder_flag(node.test.operand):
            return True
        if isinstance(node, ast.Assert) and is_decoder_flag(node.test):
            return True
    return False


def check_ep(config: PreTrainedConfig, ep: int, pp: int = 1, peft: str | None = None) -> None:
    """Refuse expert parallelism where transformers has no expert-parallel plan for the model or the experts do not
    divide evenly; ``ep`` is 1 or tp (:func:`mpitp.parallel.runtime.make_launch` checked it)."""
    if ep == 1:
        return
    if pp > 1:
        raise UsageError(f"--ep {ep} with --pp {pp}: expert parallelism runs without pipeline stages; use --pp 1")
    if peft:
        raise UsageError(f"--ep {ep} with --peft: an adapter is merged into TP shards, not into experts spread over "
                         "ranks; run it without --ep")
    text = config.get_text_config()
    if not (getattr(text, "base_model_ep_plan", None) or getattr(config, "base_model_ep_plan", None)):
        raise UsageError(f"model type '{config.model_type}' has no expert-parallel plan in transformers; run it "
                         f"without --ep (its experts are then split by --tp)")
    experts = next((getattr(text, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(getattr(text, k, None), int)), None)
    if experts is not None and experts % ep:
        raise UsageError(f"--ep {ep} does not divide the model's {experts} experts per layer")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")


def _one_byte_range(index, shape) -> bool:
    """Whether ``tensor[index]`` of a row-major tensor of ``shape`` is one contiguous range of its bytes: the whole
    tensor, or a range of dim 0 with every later dim whole."""
    if index is Ellipsis:
        return True
    parts = index if isinstance(index, tuple) else (index,)
    if not parts or not isinstance(parts[0], slice) or parts[0].step not in (None, 1):
        return False
    return all(isinstance(p, slice) and p.step in (None, 1) and p.indices(n)[:2] == (0, n)
               for p, n in zip(parts[1:], shape[1:])) and len(parts) <= len(shape)


class _ShardReads:
    """A safetensors file opened twice: reads of one contiguous byte range (whole tensors, dim-0 shards) from the
    memory map transformers asked for, strided reads (dim >= 1 shards) through safetensors' ``pread`` backend.
    Everything else (``keys``, ``get_tensor``, ``metadata`` ...) is the mapped handle's."""

    def __init__(self, mapped: safe_open, pread: safe_open):
        self._mapped, self._pread = mapped, pread

    def get_slice(self, name: str) -> _ShardSlice:
        return _ShardSlice(self._mapped.get_slice(name), self._pread, name)

    def __getattr__(self, attr):
        return getattr(self._mapped, attr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._pread.__exit__(*exc)
        return self._mapped.__exit__(*exc)


class _ShardSlice:
    def __init__(self, mapped: object, pread: safe_open, name: str):  # mapped: safetensors' slice handle
        self._mapped, self._pread, self._name = mapped, pread, name

    def __getitem__(self, index):
        if _one_byte_range(index, self._mapped.get_shape()):
            return self._mapped[index]  # a view of the mapping: pages come in as they are used
        return self._pread.get_slice(self._name)[index]  # strided: exactly its bytes, into private memory

    def __getattr__(self, attr):
        return getattr(self._mapped, attr)


@contextlib.contextmanager
def strided_shards_with_pread() -> Iterator[None]:
    """While transformers loads a TP-sharded model, read strided shards with ``pread`` instead of from ``mmap``.

    transformers (5.x, ``modeling_utils``) opens every ``.safetensors`` file with ``safe_open(..., backend="mmap")``
    on Linux and each rank cuts its shards out of the mapping. A shard cut along dim 1 (rowwise: ``o_proj``,
    ``down_proj``) is strided across the whole tensor, so copying it out faults in every page of the *whole* tensor,
    and those file-backed pages stay in the rank's RSS. Read with ``pread``, a strided shard costs exactly its own
    bytes. Reads of one contiguous byte range (dim-0 shards, replicated tensors) stay zero-copy views of the mapping,
    as before: they fault in only their own pages, as they are used (of an embedding shard, just the rows looked up).

    Measured with ``bench/bench_memory.py`` (tp=2, peak RSS of the larger rank): 308.5M-param float32 model 1354 MiB
    with mmap (RssFile ~790 MiB per rank), 1250 MiB with every read through ``pread``, 1147 MiB this way; 1.02B
    model 3418, 2604 and 2498-2523 MiB (lm-eval in one process: 1574 and 4150 MiB). tp=1 loads are left alone:
    they read every byte anyway.

    Patches the module global ``transformers.modeling_utils.safe_open`` (the name the loader calls) for the duration
    of one ``from_pretrained`` and restores it in ``finally``. With a transformers that has no such global, or a
    safetensors without a ``backend`` argument, loading goes on unchanged (all from the mapping).
    """
    import transformers.modeling_utils as mu

    from mpitp import compat

    original = getattr(mu, "safe_open", None)
    if original is None:
        yield
        return

    def safe_open_shards(*args, **kwargs) -> safe_open | _ShardReads:
        mapped = original(*args, **kwargs)
        try:
            pread = original(*args, **{**kwargs, "backend": "pread"})
        except TypeError as exc:  # a safetensors without backends: what transformers asked for, unchanged
            if "backend" not in str(exc):
                raise
            return mapped
        return _ShardReads(mapped, pread)

    with compat.replaced("transformers.modeling_utils.safe_open", safe_open_shards):
        yield


#: ``from_pretrained`` arguments of every mpitp load, under the caller's. ``use_kernels=False``: transformers 5.25
#: "kernelizes" every load by default, fetching layer kernels from Hub repositories (``kernels-community/...``) at load
#: time: code from the network on every rank, and on a GPU node without network (or with ``HF_HUB_OFFLINE=1``) the
#: load fails ("Version 2 of 'kernels-community/rotary' is not available in the local cache", seen on an H200, the
#: lm-eval reference of bench/gpu_drill.py). mpitp runs the model classes' own forwards, as transformers 5.24 did.
LOAD_DEFAULTS = {"use_kernels": False}


def load_model(model: str, tp: int, device: str, dtype: str = "auto", revision: str | None = None,
               trust_remote_code: bool = False, peft: str | None = None, ep: int = 1,
               **load_kwargs) -> PreTrainedModel:
    """Load ``model`` for this rank: whole for tp=1, sharded by transformers' TP plan for tp > 1.

    ``load_kwargs`` go to ``from_pretrained`` (``attn_implementation``, ``subfolder`` from ``--model_args``);
    ``peft``: a LoRA adapter folder merged into this rank's shards (:mod:`mpitp.replica.adapters`). ``ep`` = tp
    spreads each layer's experts over the TP group (transformers' ``DistributedConfig(ep_size=tp)``: its expert-parallel
    plan, every rank running its own experts on the batch the group shares and the outputs summed). A torch DCP
    checkpoint folder (``hf_assets`` in ``load_kwargs``: its config and tokenizer) is read by
    :func:`mpitp.replica.dcp.from_pretrained` with the same TP plan, each rank reading its own slices.

    With tp > 1 each rank reads its strided (dim >= 1) shards with ``pread`` (:func:`strided_shards_with_pread`):
    only its shards' bytes, rather than faulting whole tensors of the memory-mapped checkpoint into its RSS.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from mpitp.replica import dcp

    _check_load_arguments(tp, device, dtype)
    load_kwargs = {**LOAD_DEFAULTS, **load_kwargs}
    hf_assets = load_kwargs.pop("hf_assets", None)
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    if dcp.is_dcp(model):
        distributed = None
        if tp > 1:
            distributed = _distributed(model, tp, revision, trust_remote_code, hf_assets, load_kwargs, ep)
        m = dcp.from_pretrained(model, hf_assets, distributed, torch_dtype, trust_remote_code, **load_kwargs)
        if tp == 1:
            m = m.to(device)
        tp_fixups.fix_up(m, tp)
        return _finish(m, peft)
    kwargs = dict(dtype=torch_dtype, revision=revision, trust_remote_code=trust_remote_code, **load_kwargs)
    if tp > 1:
        distributed = _distributed(model, tp, revision, trust_remote_code, hf_assets, load_kwargs, ep)
        with strided_shards_with_pread():
            m = AutoModelForCausalLM.from_pretrained(model, distributed_config=distributed, **kwargs)
        tp_fixups.fix_up(m, tp)
    else:
        m = AutoModelForCausalLM.from_pretrained(model, **kwargs).to(device)
    return _finish(m, peft)


def _check_load_arguments(tp, device, dtype) -> None:
    """The public :func:`mpitp.load_model`'s layout, device and dtype, refused in one line before any file is read
    (every rank of a replica holds the same values, so each refuses alike): ``dtype="fp32"`` was an AttributeError
    from ``getattr(torch, ...)``, ``device="gpu"`` torch's RuntimeError after the load, and ``tp=2`` in a torch world
    that is not one replica of 2 ranks (``mpitp.start()`` at tp=1, say) transformers' OSError ('We tried to initialize
    torch.distributed for you, but it failed'), each a traceback that ended the job."""
    import torch

    if dtype not in DTYPES:
        raise UsageError(f"mpitp.load_model: dtype={dtype!r}: expected one of {', '.join(DTYPES)}", collective=True)
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"mpitp.load_model: device={device!r}: {str(exc).splitlines()[0]}", collective=True) from None
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UsageError(f"mpitp.load_model: tp={tp!r}: expected a positive integer", collective=True)
    import torch.distributed as dist

    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if tp > 1 and size != tp:
        raise UsageError(f"mpitp.load_model: tp={tp}, but this rank's torch world has {size} rank(s): a replica of "
                         f"tp={tp} needs one torch world of its {tp} ranks (mpitp.start(tp={tp}) makes it; pass "
                         "rt.layout.tp)", collective=True)


def _distributed(model: str, tp: int, revision, trust_remote_code: bool, hf_assets, load_kwargs: dict, ep: int = 1):
    """``DistributedConfig(tp_size=tp)``, with mpitp's own plan (:mod:`mpitp.replica.tp_plans`) where transformers has
    none: the config is read first (a file read), since the plan depends on the type and, for some, its variant."""
    from transformers import AutoConfig

    from mpitp.replica import dcp

    source = dcp.assets_dir(model, hf_assets) if dcp.is_dcp(model) else model
    extra = {"subfolder": load_kwargs["subfolder"]} if load_kwargs.get("subfolder") and source == model else {}
    try:
        config = AutoConfig.from_pretrained(source, revision=None if source != model else revision,
                                            trust_remote_code=trust_remote_code, **extra)
    except Exception:  # noqa: BLE001 - the load itself then says what is wrong, as it did before
        config = None
    return tp_plans.distributed_config(config, tp, **({"ep_size": ep} if ep > 1 else {}))


def _finish(m, peft: str | None):
    if peft:
        from mpitp.replica import adapters

        adapters.apply(m, adapters.read(peft))
    m.eval()
    return m
