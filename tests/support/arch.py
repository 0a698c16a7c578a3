"""The architecture matrix: every causal-LM architecture of the installed transformers, built tiny and at random.

Used by ``tests/test_architectures.py`` (CI) and ``bench/arch_matrix.py`` (the same matrix, and the support table).
Nothing is hand-picked: the architectures come from transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; the ones
that cannot take part say why (:func:`exclusion`), computed, never skipped silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from . import REPO, SHARED

TOKENIZER = SHARED / "tokenizers" / "gpt2"
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128, n_positions=128, n_embd=64, n_layer=2, n_head=4,
             ffn_dim=128, word_embed_proj_dim=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, sliding_window=64, rotary_dim=8, n_inner=128, d_model=64,
             layers_block_type=None, n_heads=4, n_layers=2)
# Options that change the numbers between the head and the logits, or scale a path: set to a non-default value.
_SCALING = re.compile(r"(logit_scale|logits_scaling|lm_head_multiplier|softcap|_multiplier$|multiplier_|"
                      r"embedding_scale|residual_scale|scale_emb|scale_depth|dim_model_base)")
_SOFTCAP_DEFAULT = 30.0
MAX_PARAMS = 30_000_000  # the GPT-2 vocabulary's embedding and head are 2 x 3.2M at hidden 64


@dataclass
class Arch:
    model_type: str
    class_name: str
    tp_plan: bool  # transformers' own
    pp_plan: bool
    own_plan: bool = False  # mpitp's (mpitp.replica.tp_plans), where transformers has none


def architectures() -> list[Arch]:
    """Every causal-LM architecture transformers maps, with whether its config class has TP / PP plans."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from mpitp.replica.tp_plans import PLANS

    out = []
    for mt, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cfg_name = CONFIG_MAPPING_NAMES.get(mt)
        cfg_cls = getattr(transformers, cfg_name, None) if cfg_name else None
        tp_plan = bool(getattr(cfg_cls, "base_model_tp_plan", None))
        own = getattr(cfg_cls, "model_type", mt) in PLANS  # gpt-sw3's config is GPT-2's
        out.append(Arch(mt, cls_name, tp_plan, bool(getattr(cfg_cls, "base_model_pp_plan", None)), not tp_plan and own))
    return out


def not_plain_decoder(arch: Arch) -> str | None:
    """Why ``arch`` is not a plain text decoder-only causal LM (multimodal, encoder-decoder ...), else None."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    cfg_cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(arch.model_type, ""), None)
    if cfg_cls is None or getattr(transformers, arch.class_name, None) is None:
        return "config or model class not importable from transformers"
    subs = getattr(cfg_cls, "sub_configs", {}) or {}
    modal = ("vision", "audio", "speech", "encoder", "image", "video", "vq", "depth_decoder", "text_config")
    if any(word in k for k in subs for word in modal):  # an attention sub-config (MPT's) is still a plain decoder
        return f"multimodal or composite (sub-configs: {', '.join(sorted(subs))})"
    if getattr(cfg_cls, "is_encoder_decoder", False):
        return "encoder-decoder"
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if arch.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "encoder (masked LM) model with a decoder mode, not a decoder-only LM"
    return None


#: An encoder family registered as a causal LM that attends both ways unless told it is a decoder (transformers warns
#: "add `is_decoder=True`"): built as the decoder it is registered as. Without it its log-likelihoods depend on the
#: padding beside a row (the matrix: one request off by 1.6e-5 relative at dp=2).
DECODER_MODE = {"bert-generation": {"is_decoder": True}}

#: Values a type's default config lacks but its model reads (transformers 5.25: DBRX's attention reads
#: ``attn_config.rope_theta``, which ``DbrxAttentionConfig`` does not declare; every released DBRX config.json sets it),
#: and the sub-config sizes the shared ones (SIZES) do not reach.
SUB_CONFIGS = {"dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
                        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}}


def tiny_config(arch: Arch, vocab: int, eos: int):
    """A small config of ``arch`` with every scaling / capping / bias option set to a non-default value."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(arch.model_type)
    defaults = base.to_dict()
    kw = {k: v for k, v in SIZES.items() if k in defaults and v is not None}
    changed = {}
    for k, v in defaults.items():
        if _SCALING.search(k) and not isinstance(v, bool):
            if v is None and "softcap" in k:
                changed[k] = _SOFTCAP_DEFAULT
            elif isinstance(v, int) and v not in (0,):
                changed[k] = 8 if v == 1 else max(2, v // 2)
            elif isinstance(v, float) and v != 0.0:
                changed[k] = 8.0 if v == 1.0 else v * 0.5
        elif re.search(r"(^|_)bias$", k) and v is False:
            changed[k] = True
    kw.update(changed)
    kw.update(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    kw.update(DECODER_MODE.get(arch.model_type, {}))
    kw.update(SUB_CONFIGS.get(arch.model_type, {}))
    cfg = AutoConfig.for_model(arch.model_type, **kw)
    full, tiny = _layer_kinds(base), _layer_kinds(cfg)
    if full and tiny is not None and set(tiny) < set(full):
        # a hybrid whose two tiny layers are all of one kind (Qwen3-Next's pattern is three linear-attention layers,
        # then one full): every kind, twice, so each of two pipeline stages holds one of each
        kinds = list(dict.fromkeys(full))
        try:
            cfg = AutoConfig.for_model(arch.model_type, **{**kw, "num_hidden_layers": 2 * len(kinds),
                                                           "layer_types": kinds * 2})
            changed["layer_types"] = kinds * 2
        except (AttributeError, TypeError, ValueError):  # layer_types derived, not settable (Jamba): as it was
            pass
    return cfg, changed


def tiny_shard(model_type: str, stage: int | None = None):
    """A one-rank :class:`~mpitp.replica.shard.ReplicaShard` of a tiny random model of ``model_type`` (vocabulary 512,
    2 layers, its head scaled so that log-probs are far from uniform, as the matrix builds them); ``stage``: the shard
    posing as that stage (0 or 1) of a two-stage pipeline whose replica is this one rank (MPI's self communicator for
    the stages' agreements), every layer its own."""
    import types

    import torch
    from transformers import AutoModelForCausalLM

    from mpitp.replica.shard import ReplicaShard

    arch = next(a for a in architectures() if a.model_type == model_type)
    cfg, _ = tiny_config(arch, 512, 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    shard = ReplicaShard(model, types.SimpleNamespace(tp=1, pp=1, last_stage=True, first_stage=True, rank=0), "cpu")
    if stage is not None:
        from mpi4py import MPI

        shard.pipeline = True
        shard.layout = types.SimpleNamespace(tp=1, pp=2, pp_rank=stage, first_stage=stage == 0,
                                             last_stage=stage == 1, rank=0, replica_comm=MPI.COMM_SELF)
    return shard


def _layer_kinds(cfg) -> list[str] | None:
    try:
        kinds = getattr(cfg, "layer_types", None)
    except Exception:  # noqa: BLE001 - a property that cannot answer at these sizes
        return None
    return list(kinds) if isinstance(kinds, list) else None


def build(arch: Arch, out_dir: Path, seed: int = 0) -> dict:
    """Build a tiny random ``arch`` into ``out_dir`` with the GPT-2 tokenizer; returns what was changed, or raises."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    cfg, changed = tiny_config(arch, len(tok), tok.eos_token_id)
    with torch.device("meta"):  # a config that ignores the size overrides would allocate gigabytes: count first
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > MAX_PARAMS:
        raise RuntimeError(f"{n / 1e6:.0f}M parameters at the tiny sizes (the config ignores them)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # sharper than the 0.02-std init: log-probs far from uniform, head steps visible
        head = model.get_output_embeddings()
        head.weight.mul_(20.0)
        _vary_constants(model)
    if type(model).__name__ != arch.class_name:
        raise RuntimeError(f"AutoModelForCausalLM built {type(model).__name__}, not {arch.class_name}")
    model.generation_config.pad_token_id = tok.eos_token_id
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    (out_dir / "mpitp_arch.json").write_text(json.dumps({"model_type": arch.model_type, "changed": changed}))
    return changed


def _vary_constants(model) -> None:
    """Give every parameter that its init left constant (biases at zero, norm weights at one, a state-space ``D``)
    a small spread: a split that hands a rank another rank's slice of it then changes the numbers. Found by Mamba's
    packed ``in_proj``: transformers splits a packed projection's 1-D bias contiguously, not part by part, which a
    zero bias hides (0.03 relative at tp=2 with a random one)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        if flat.numel() > 1 and bool((flat == flat[0]).all()):
            scale = 0.05 * max(1.0, abs(float(flat[0])))
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


# ------------------------------------------------------------------------------------------------ the comparison
# One task per request kind that goes through the head: multiple choice, log-likelihood with greedy flags, greedy
# generation, zero-shot (prompts of different lengths, shorter than the models' 128 positions: a left-padded batch,
# which mpitp prefills row by row where the model's probe agrees; 5-shot prompts would all be cut to one length).
# (Rolling windows score through the same head as any log-likelihood; tests/test_parity.py covers them.)
TASKS = ["arc_easy_local", "lambada_openai_local", "gsm8k_zeroshot_local"]
LIMIT = 2
GEN_KWARGS = "max_gen_toks=6"
BATCH = 2


#: Types the registry-wide matrix found failing (fixed, or now refused before loading): kept in the quick subset.
#: GPT-NeoX and Phi (final norm of another name: wrong at pp=2), MiniMax (its own cache class on TP workers),
#: BERT-generation (a nested head), CodeGen, DeepSeek-V4, OLMo-hybrid, Doge, HRM (refusals), Qwen3-Next (a hybrid).
FOUND_BY_MATRIX = {"gpt_neox", "phi", "minimax", "bert-generation", "codegen", "deepseek_v4", "olmo_hybrid", "doge",
                   "hrm_text", "qwen3_next"}


#: The generated support table (bench/arch_matrix.py --table): the types the last whole-registry run covered.
SUPPORT_TABLE = REPO / "docs" / "model-support.md"


def tabled_types(table: Path = SUPPORT_TABLE) -> set[str]:
    """The types the support table has a row for (its first column)."""
    rows = re.findall(r"^\| ([A-Za-z0-9_.-]+) \| ", table.read_text(), flags=re.M)
    return {r for r in rows if r not in ("type", "layout")}


def suite_subset(archs: list[Arch], also: set[str] = frozenset()) -> list[Arch]:
    """What the test suite's matrix runs unless ``MPITP_MATRIX_FULL`` is set: :func:`quick_subset`, the types in
    ``also`` (the test's expected refusals), and every type the support table does not list yet, so a transformers
    release's new architectures are run by the next CI (fresh installs take the latest) without the whole
    registry's 13 minutes there; ``bench/arch_matrix.py`` runs every type and writes the table."""
    known = tabled_types()
    chosen = {a.model_type for a in quick_subset(archs)} | set(also)
    return [a for a in archs if a.model_type in chosen or a.model_type not in known]


def head_statements(arch: Arch) -> tuple[str, ...]:
    """The statements of the class's forward between the decoder output and the loss (:mod:`mpitp.replica.logits`) that
    differ between classes: the key that groups architectures by what they do around their head."""
    import transformers

    from mpitp.replica.logits import statements
    try:
        stmts = statements(getattr(transformers, arch.class_name).forward)
    except (OSError, TypeError, AttributeError):
        return ("<no source>",)
    key = []
    for s in stmts:  # what is the same for every model (slicing, the bare head call) is left out of the key
        if s.kind == ("neutral",):
            continue
        key.append("HEAD" if s.kind and s.kind[0] == "head" and not s.kind[2] and not s.kind[3] else s.text)
    return tuple(key)


def quick_subset(archs: list[Arch]) -> list[Arch]:
    """The architectures the CI test covers, chosen by rule from the full list:

    - one per distinct head code among those with a TP plan (the statements between decoder and loss: Cohere's
      scale, Granite's division, Gemma's soft-cap, Falcon-H1's multiplier, MiniCPM3's hidden division ...), the first
      in transformers' order, with Llama standing for the plain ``logits = lm_head(h)`` group;
    - Cohere and Granite, named in issue #13, whatever group they fall in;
    - GPT-2 and OPT: no TP plan in transformers (both split by mpitp's own plan, GPT-2's ``Conv1D`` by its own
      styles);
    - one per fix-up mechanism of mpitp's own plans (:mod:`mpitp.replica.tp_plans`): StableLM (separate q/k/v,
      grouped key/value head counts), BLOOM (per-head fused qkv, ALiBi cut to each rank's heads), StarCoder 1
      (``gpt_bigcode``: one shared key/value head, the query rows of a fused projection kept by hand), BioGPT (an LM
      head of another name), Mamba (a state-space mixer split by inner channel), RWKV (its recurrent
      state allocated per rank and mirrored as each rank's own in generation), DBRX (fused experts, unequal
      ``Wqkv`` parts), JetMoE (sums after a method), CTRL (a ``Sequential`` MLP), BitNet (norms over a split width);
    - ModernBERT-decoder: a prediction head before the vocabulary projection (a hidden-state module step).
    """
    plain = [a for a in archs if not_plain_decoder(a) is None]
    by_key: dict[tuple, Arch] = {}
    for a in plain:
        if a.tp_plan:
            by_key.setdefault(head_statements(a), a)
    chosen = {a.model_type for a in by_key.values()}
    llama = next(a for a in plain if a.model_type == "llama")
    plain_key = head_statements(llama)
    chosen.discard(by_key[plain_key].model_type)
    chosen |= {"llama", "cohere", "granite", "gpt2", "opt", "stablelm", "bloom", "gpt_bigcode", "biogpt",
               "modernbert-decoder", "mamba", "rwkv", "dbrx", "jetmoe", "ctrl", "bitnet"} | FOUND_BY_MATRIX
    return [a for a in plain if a.model_type in chosen]


def reference(model_dir: Path, include: str, task_manager=None) -> dict:
    """Single-process ``lm_eval --model hf`` on the matrix's tasks: ``{(task, doc, idx): (ll, greedy, text)}``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .parity import reference_requests

    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32", tasks=TASKS,
                                  limit=LIMIT, batch_size=BATCH, device="cpu", gen_kwargs=GEN_KWARGS,
                                  log_samples=True, bootstrap_iters=0,
                                  task_manager=task_manager or TaskManager(include_path=include))
    return reference_requests(res["samples"])


class References:
    """:func:`reference` for many models: the matrix's tasks built once, and each model scored by lm-eval's own
    ``evaluate`` with its ``HFLM``, after the per-run settings ``simple_evaluate`` applies (its ``gen_kwargs``, the
    default few-shot count, the few-shot seed reset, so every model sees the same prompts). What is skipped is only
    ``simple_evaluate``'s environment report (a ``pip list`` subprocess: 1.8 s a model) and the task builds (1.3 s:
    the few-shot splits decoded row by row): 4.9 -> 1.8 s a model, for the registry's ~110 models. Requests and
    results equal :func:`reference`'s (``tests/test_architectures.py`` holds it on one model)."""

    def __init__(self, include: str, task_manager=None):
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import simple_parse_args_string

        self.tm = task_manager or TaskManager(include_path=include)
        self.loaded = self.tm.load(TASKS)
        self.gen_kwargs = simple_parse_args_string(GEN_KWARGS)

    def __call__(self, model_dir: Path) -> dict:
        from lm_eval.evaluator import evaluate
        from lm_eval.models.huggingface import HFLM

        from .parity import reference_requests

        for task in self.loaded["tasks"].values():
            if task.get_config("output_type") == "generate_until":
                task.set_config(key="generation_kwargs", value=dict(self.gen_kwargs), update=True)
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=1234)  # simple_evaluate's default fewshot_random_seed
        lm = HFLM(pretrained=str(model_dir), dtype="float32", batch_size=BATCH, device="cpu")
        res = evaluate(lm=lm, task_dict=self.loaded, limit=LIMIT, log_samples=True, bootstrap_iters=0)
        return reference_requests(res["samples"])


#: Mixture-of-experts shapes whose experts ``--ep`` spreads over ranks (issue 40): Mixtral's, Qwen3-MoE's, OLMoE's
#: and GPT-OSS's, each with transformers' expert-parallel plan (``base_model_ep_plan``).
MOE_SHAPES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")


def job_file(path: Path, models: dict[str, Path], include: str, out_dir: Path, tp: int, pp: int,
             ep: int = 1) -> Path:
    """One job file running every model in ``models`` at this layout: one MPI launch for all of them."""
    import yaml

    runs = [dict(name=f"{name}-tp{tp}-pp{pp}" + (f"-ep{ep}" if ep > 1 else ""), model=str(d), tp=tp, pp=pp,
                 **({"ep": ep} if ep > 1 else {}), output=str(out_dir / f"{name}.h5")) for name, d in models.items()]
    doc = dict(defaults=dict(tasks=TASKS, include_path=include, limit=LIMIT, batch_size=BATCH, dtype="float32",
                             gen_kwargs=GEN_KWARGS, bootstrap_iters=0), runs=runs)  # stderr bootstraps: 0.3 s a run
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def compare(ref: dict, h5: Path) -> tuple[float, list[str]]:
    from .parity import compare_requests, mpitp_requests

    return compare_requests(ref, mpitp_requests(str(h5), TASKS))


# ------------------------------------------------------------------------------------------ the registry-wide matrix
@dataclass(frozen=True)
class Layout:
    """One column of the matrix: two ranks, as ``tp`` x ``pp`` (tp=1 pp=1 is two DP groups)."""

    key: str
    tp: int
    pp: int
    ranks: int = 2

    def run_name(self, model_type: str) -> str:
        return f"{model_type}-tp{self.tp}-pp{self.pp}"

    def env(self) -> dict[str, str]:
        """The launch's environment beyond the suite's: with stages, the short test rows are cut into chunks of
        positions as long rows are (:mod:`mpitp.replica.stage_chunks`, test hook ``MPITP_TEST_STAGE_CHUNK``), so that
        every type that takes chunks is held to parity through them."""
        return {"MPITP_TESTING": "1", "MPITP_TEST_STAGE_CHUNK": "4"} if self.pp > 1 else {}


LAYOUTS = (Layout("dp2", 1, 1), Layout("tp2", 2, 1), Layout("pp2", 1, 2))


@dataclass(frozen=True)
class Outcome:
    """A type at a layout: ``parity`` (detail: max relative |d ll|), ``refused`` (detail: mpitp's one line), or a
    failure: ``mismatch``, ``no output`` (neither a file nor a refusal), ``partial``."""

    kind: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.kind in ("parity", "refused")

    def cell(self) -> str:
        if self.kind == "parity":
            return f"parity ({self.detail})"
        return f"{self.kind}: {self.detail}"


TRACEBACK = "Traceback (most recent call last)"

SUPPORT_HEADER = """# Model support: every causal-LM type of transformers, at three layouts

Generated by `python bench/arch_matrix.py --table docs/model-support.md` (CI runs a subset of it, new types included:
`tests/test_architectures.py`). Each type is built tiny at random (hidden 64, 2 layers, the GPT-2 vocabulary, every
scaling or capping option set to a non-default value, the LM head scaled 20x so log-probs are far from uniform,
every parameter its init leaves constant, biases and norm weights, given a small random spread),
run by mpitp on two ranks at tp=1 dp=2, tp=2 and pp=2 (its rows cut into chunks of positions through the stages, as
long rows are, where the model takes them), and compared request by request with single-process lm-eval
(`--model hf`) on three tasks (multiple choice, log-likelihood with greedy flags, greedy generation): *parity* gives
the largest relative |d log-likelihood| (the rule: 1e-5); *refused* is mpitp's one line, given before scoring
(before the load where the type decides it). *TP plan*: transformers' own, mpitp's (`mpitp/replica/tp_plans.py`) or
none (refused at tp > 1).

"""


def refusal_line(output: str, run: str) -> str | None:
    """mpitp's one line for a refused run of a job file (``run NAME failed: ...``), or None."""
    marker = f"run {run} failed: "
    for line in output.splitlines():
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return None


def outcomes(models: dict[str, Path], refs: dict, layout: Layout, output: str, out_dir: Path) -> dict[str, Outcome]:
    """Each model's outcome in one launch of :func:`job_file` at ``layout`` (its combined stdout and stderr)."""
    result = {}
    for name in models:
        h5 = out_dir / f"{name}.h5"
        refused = refusal_line(output, layout.run_name(name))
        if refused is not None:
            result[name] = Outcome("refused" if not h5.exists() else "no output",
                                   refused if not h5.exists() else f"refused but wrote {h5.name}: {refused}")
            continue
        if not h5.exists():
            result[name] = Outcome("no output", "neither a results file nor a refusal")
            continue
        try:
            worst, problems = compare(refs[name], h5)
        except KeyError as exc:  # a run that died part-way
            result[name] = Outcome("partial", f"{exc}")
            continue
        result[name] = Outcome("parity", f"{worst:.1e}") if not problems else \
            Outcome("mismatch", f"{len(problems)} requests, first: {problems[0]}")
    return result


def plan_sources(arch: Arch) -> dict[str, str]:
    """Where each layout's plan comes from: ``transformers``, ``mpitp`` (own TP plan) or ``none``."""
    return {"dp2": "-", "tp2": "transformers" if arch.tp_plan else "mpitp" if arch.own_plan else "none",
            "pp2": "transformers" if arch.pp_plan else "none"}


def support_table(archs: list[Arch], excluded: dict[str, str], unbuilt: dict[str, str],
                  cells: dict[str, dict[str, Outcome]]) -> str:
    """The generated support table (docs/model-support.md): counts per outcome, then one row per registered type."""
    import transformers

    plain = [a for a in archs if a.model_type not in excluded]
    lines = [f"transformers {transformers.__version__}: {len(archs)} causal-LM types registered; "
             f"{len(excluded)} not plain text decoders; {len(unbuilt)} cannot be built small at random; "
             f"{len(plain) - len(unbuilt)} built and run at every layout.", "",
             "| layout | parity with lm-eval | refused before scoring | failed |", "|---|---|---|---|"]
    for lay in LAYOUTS:
        col = [c[lay.key] for c in cells.values() if lay.key in c]
        n = {k: sum(1 for o in col if o.kind == k) for k in ("parity", "refused")}
        lines.append(f"| {lay.key} (tp={lay.tp}, pp={lay.pp}, 2 ranks) | {n['parity']} | {n['refused']} | "
                     f"{len(col) - n['parity'] - n['refused']} |")
    lines += ["", "| type | TP plan | PP plan | " + " | ".join(lay.key for lay in LAYOUTS) + " |",
              "|---|---|---|" + "---|" * len(LAYOUTS)]
    for a in archs:
        src = plan_sources(a)
        if a.model_type in excluded or a.model_type in unbuilt:
            why = excluded.get(a.model_type) or f"cannot be built small: {unbuilt[a.model_type]}"
            lines.append(f"| {a.model_type} | {src['tp2']} | {src['pp2']} | " + f"not in the matrix: {why} |"
                         + " |" * (len(LAYOUTS) - 1))
            continue
        row = cells.get(a.model_type, {})
        lines.append(f"| {a.model_type} | {src['tp2']} | {src['pp2']} | "
                     + " | ".join(row[lay.key].cell().replace("|", "/") if lay.key in row else "-" for lay in LAYOUTS)
                     + " |")
    return "\n".join(lines) + "\n"


def dump(folder: str | None, name: str, data: dict) -> None:
    """Under ``MPITP_MATRIX_DUMP=DIR`` the CI test leaves what it found as JSON, for ``bench/arch_matrix.py
    --from-dump DIR`` to write the support table from the same run."""
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(data, indent=1))
