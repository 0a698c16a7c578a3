"""LoRA adapters (``--model_args peft=``): the merge against peft's own ``merge_and_unload``, the refusals, parity of
tp=2 / pp=2 with single-process ``lm_eval --model hf --model_args pretrained=BASE,peft=ADAPTER``, and adapter sweeps
(``--peft 'adapters/step-*'``: one base load, the base shards restored bit for bit between adapters)."""

from __future__ import annotations

import functools
import json
import os

import pytest

from support import STORIES
from support.mpi import explain, run_mpi
from support.parity import compare_requests, mpitp_requests, reference_requests

peft = pytest.importorskip("peft")


def _tiny_llama(tied: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).float().eval()


def _perturb(model, names) -> None:
    """Give saved copies (modules_to_save, biases) new values, so applying them is visible."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names) and p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)


def _save_adapter(base, path, perturb=(), seed=1, **lora):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    _perturb(model, perturb)
    model.save_pretrained(str(path))
    return str(path)


def _merged_by_peft(base_factory, path):
    from peft import PeftModel

    return PeftModel.from_pretrained(base_factory(), path).merge_and_unload().state_dict()


def _merged_by_mpitp(base_factory, path):
    from mpitp.replica import adapters

    m = base_factory()
    assert adapters.apply(m, adapters.read(path)).changed > 0
    return m.state_dict()


def _assert_same(ours: dict, theirs: dict, base: dict) -> None:
    import torch

    assert set(ours) == set(theirs)
    moved = [k for k in ours if not torch.equal(ours[k], base[k])]
    assert moved, "the adapter changed nothing"
    for k in ours:
        assert torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-6), f"{k}: max |d| " \
            f"{(ours[k] - theirs[k]).abs().max().item():.3g}"


@pytest.mark.parametrize("lora", [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"]),
    dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
         rank_pattern={"down_proj": 2}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3}),
    dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], bias="lora_only"),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
], ids=["attn_mlp", "rslora_patterns", "modules_to_save_bias", "lm_head"])
def test_merge_matches_peft_merge_and_unload(tmp_path, lora):
    """Our merge of each LoRA option gives the weights peft's own merge gives (float32, to 1e-6). ``lm_head``: peft
    saves the head's base weight beside its pair (copied after the merge, it undid the head's delta)."""
    path = _save_adapter(_tiny_llama(), tmp_path / "a", perturb=("lm_head", "bias"), **lora)
    _assert_same(_merged_by_mpitp(_tiny_llama, path), _merged_by_peft(_tiny_llama, path),
                 _tiny_llama().state_dict())


def test_pipeline_stage_skips_the_head_another_stage_holds(tmp_path):
    """A stage without the head (transformers' PP plan leaves a PipelineIdentityLayer there) merges the rest and
    leaves the head's pair to the last stage; it was refused ("lm_head has no weight to merge into")."""
    import torch
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    from mpitp.replica import adapters

    path = _save_adapter(_tiny_llama(), tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    stage, base = _tiny_llama(), _tiny_llama().state_dict()
    stage.lm_head = PipelineIdentityLayer()
    assert adapters.apply(stage, adapters.read(path), stubbed=True).changed == 2  # the two layers' q_proj
    theirs = _merged_by_peft(_tiny_llama, path)
    for k, v in stage.state_dict().items():
        assert torch.allclose(v, theirs[k], rtol=0, atol=1e-6), k
        assert torch.equal(v, base[k]) == ("q_proj.weight" not in k), k


@pytest.mark.parametrize("rank", [0, 1])
def test_rows_a_fix_up_kept_take_their_rows_of_the_adapter(tmp_path, rank):
    """Falcon-7B's fused ``query_key_value`` (one shared key/value head) is loaded whole at tp=2 and each rank keeps
    its query heads' rows and the shared ones (``tp_fixups._keep_mqa_rows``, as StarCoder's ``c_attn`` and DBRX's
    ``Wqkv``): the adapter's ``B @ A`` was compared with that cut weight and a valid adapter refused (hidden 64:
    "B @ A is (96, 64) but the weight is (64, 64)"). Each rank must hold peft's merged weight's rows for it."""
    import torch
    from transformers import FalconConfig, FalconForCausalLM

    from mpitp.replica import adapters, tp_fixups

    def base():
        torch.manual_seed(0)
        return FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, multi_query=True, bias=True)).float().eval()

    path = _save_adapter(base(), tmp_path / "a", r=4, lora_alpha=8, target_modules=["query_key_value", "dense"])
    theirs = _merged_by_peft(base, path)
    m = base()
    qkv = [mod for name, mod in m.named_modules() if name.endswith("query_key_value")]
    for linear in qkv:  # rank `rank` of tp=2: queries 2 x 8 of 32 rows, then the shared key and value rows
        tp_fixups._keep_mqa_rows(linear, 32, 2, rank)
    assert adapters.apply(m, adapters.read(path)).changed > 0
    rows = torch.cat([torch.arange(16 * rank, 16 * rank + 16), torch.arange(32, 48)])
    for name, p in m.state_dict().items():
        want = theirs[name][rows] if "query_key_value" in name else theirs[name]
        assert torch.allclose(p, want, rtol=0, atol=1e-6), name


@pytest.mark.mpi
def test_a_packed_projections_shard_takes_its_rows_of_the_adapter(tmp_path):
    """GPT-2's ``c_attn`` (LoRA's default target for it), MPT's ``Wqkv``, Mamba's ``in_proj`` are split part by part
    at tp > 1 (``_StridedShard``); an adapter on them was refused ("sharded as _StridedShard(...) under TP: ...
    use --tp 1"). The merge's index of ``B @ A`` on each of two ranks must be the rows that rank holds."""
    from pathlib import Path

    from support.mpi import run_mpi_script

    proc = run_mpi_script(2, Path(__file__).parent / "mpi" / "strided_shards.py", [str(tmp_path), "adapter"],
                          timeout=120)
    assert proc.returncode == 0 and "strided adapter ok: 3 checks" in proc.stdout, explain(proc)


def test_fan_in_fan_out_matches_peft(tmp_path):
    """GPT-2's Conv1D keeps weights as (in, out): ``fan_in_fan_out`` transposes ``B @ A``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()

    path = _save_adapter(gpt2(), tmp_path / "g", r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                         fan_in_fan_out=True)
    _assert_same(_merged_by_mpitp(gpt2, path), _merged_by_peft(gpt2, path), gpt2().state_dict())


@pytest.mark.mpi
def test_adapter_refused_after_the_load_is_printed_once(tmp_path, shared_dir):
    """A refusal only the loaded model shows (an adapter saved from a GPT-2 of three layers on a base of two: GPT-2's
    packed c_attn under TP was one, until its rows were merged) is met by every rank of the replica; the first in rank
    order is printed once (it was once per rank), every rank exits 2."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from mpitp.tasks.demo import demo_tasks_dir

    torch.manual_seed(0)
    base = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=4)).save_pretrained(str(base))
    for f in (shared_dir / "tokenizers" / "gpt2").iterdir():
        if f.name != "config.json":  # the tokenizer's files, not GPT-2's own config
            shutil.copyfile(f, base / f.name)
    other = GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=3, n_head=4))
    adapter = _save_adapter(other, tmp_path / "lora", r=2, lora_alpha=4, target_modules=["c_attn"],
                            fan_in_fan_out=True)
    proc = run_mpi(2, ["eval", "--model", str(base), "--peft", adapter, "--tasks", "mpitp_demo_mc", "--include-path",
                       demo_tasks_dir(), "--limit", "2", "--tp", "2", "--output", str(tmp_path / "out.h5")],
                   timeout=300)
    message = "LoRA target transformer.h.2.attn.c_attn.weight is not in the base model (adapter for another model?)"
    assert proc.returncode == 2, explain(proc)
    assert (proc.stdout + proc.stderr).count(message) == 1 and "Traceback" not in proc.stderr, explain(proc)


def _edit_config(path, **changes) -> None:
    cfg_path = f"{path}/adapter_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("changes,named", [
    (dict(use_dora=True), "DoRA (use_dora)"),
    (dict(peft_type="IA3"), "peft_type IA3"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
])
def test_unsupported_adapter_refused_by_name(tmp_path, changes, named):
    from mpitp.errors import UsageError
    from mpitp.replica import adapters

    path = _save_adapter(_tiny_llama(), tmp_path / "a", r=2, lora_alpha=4, target_modules=["q_proj"])
    _edit_config(path, **changes)
    with pytest.raises(UsageError) as err:
        adapters.read(path)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_saved_copy_of_tied_parameter_refused(tmp_path):
    from mpitp.errors import UsageError
    from mpitp.replica import adapters

    path = _save_adapter(_tiny_llama(tied=True), tmp_path / "t", r=2, lora_alpha=4, target_modules=["q_proj"],
                         modules_to_save=["lm_head"])
    with pytest.raises(UsageError, match="tied to"):
        adapters.apply(_tiny_llama(tied=True), adapters.read(path))


def test_fingerprint_follows_weights(tmp_path):
    from mpitp.replica.adapters import fingerprint

    a = _save_adapter(_tiny_llama(), tmp_path / "a", r=2, lora_alpha=4, target_modules=["q_proj"])
    before = fingerprint(a)
    _edit_config(a, lora_alpha=5)
    assert fingerprint(a) != before


# --- parity under MPI -----------------------------------------------------------------------------------------------

TASKS = ["arc_easy_local", "lambada_openai_local"]
LIMIT = 3


@pytest.fixture(scope="module")
def stories_adapter(tmp_path_factory):
    """LoRA on every attention and MLP projection of stories260K (random non-zero B), plus a perturbed saved copy
    of the final norm (``modules_to_save``)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32)
    return _save_adapter(base, tmp_path_factory.mktemp("adapter") / "lora", perturb=("model.norm",), r=4,
                         lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"], modules_to_save=["model.norm"])


@functools.lru_cache(maxsize=2)
def _task_manager(include_path: str):
    """lm-eval's task index, built once per include path (indexing lm-eval's tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _lm_eval(test_tasks, model_args, tasks=TASKS):
    import lm_eval
    import torch

    torch.set_num_threads(2)
    res = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, limit=LIMIT, batch_size=4,
                                  device="cpu", log_samples=True, bootstrap_iters=0,
                                  task_manager=_task_manager(test_tasks))
    return reference_requests(res["samples"])


@pytest.fixture(scope="module")
def adapter_reference(stories_adapter, test_tasks):
    """lm-eval's requests with the adapter, and how far the adapter moves them from the base model's."""
    ref = _lm_eval(test_tasks, f"pretrained={STORIES},dtype=float32,peft={stories_adapter}")
    base = _lm_eval(test_tasks, f"pretrained={STORIES},dtype=float32")
    moved, _ = compare_requests(base, ref)
    return ref, moved


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n,tp,pp", [(2, 2, 1), (2, 1, 2)], ids=["tp2", "pp2"])
def test_adapter_parity_with_lm_eval(n, tp, pp, stories_adapter, adapter_reference, test_tasks, tmp_path):
    """mpitp with the adapter matches lm-eval with the same adapter, and not the base model: an adapter ignored
    (or applied to the wrong shard) fails here, since the adapter moves lm-eval's scores far beyond the tolerance."""
    ref, moved = adapter_reference
    assert moved > 1e-3, f"the adapter hardly changes lm-eval's scores (max relative |d ll| {moved:.2e})"
    out = tmp_path / "out.h5"
    proc = run_mpi(n, ["eval", "--model", str(STORIES), "--model_args", f"peft={stories_adapter}",
                       "--tasks", ",".join(TASKS), "--include-path", test_tasks, "--limit", str(LIMIT),
                       "--batch-size", "4", "--bootstrap-iters", "0", "--dtype", "float32", "--tp", str(tp),
                       "--pp", str(pp), "--output", str(out)])
    assert proc.returncode == 0, explain(proc)
    worst, problems = compare_requests(ref, mpitp_requests(str(out), TASKS))
    assert not problems, "\n".join(problems[:20])
    print(f"adapter tp={tp} pp={pp}: max relative |d ll| vs lm-eval+peft {worst:.2e}; adapter moves lm-eval's "
          f"scores by up to {moved:.2e}")


def test_resume_with_another_adapter_is_refused(tmp_path):
    """The same adapter path rewritten (another training step saved over it): the fingerprint names the change."""
    from mpitp.evaluation.fingerprint import record, resume_differences
    from mpitp.evaluation.settings import EvalConfig

    a = _save_adapter(_tiny_llama(), tmp_path / "a", r=2, lora_alpha=4, target_modules=["q_proj"])
    cfg = EvalConfig(model=str(STORIES), tasks=["t"], peft=a)
    on_disk = record(cfg.model, None, None, a)
    settings = {"model": cfg.model, "peft": a}
    assert resume_differences(on_disk, settings, settings, cfg) == []
    _save_adapter(_tiny_llama(), tmp_path / "a", r=2, lora_alpha=4, target_modules=["v_proj"])
    diffs = resume_differences(on_disk, settings, settings, cfg)
    assert any(d.startswith("adapter ") for d in diffs), diffs


def test_peft_option_and_model_args_agree_or_are_refused():
    from mpitp.errors import UsageError
    from mpitp.evaluation.lmeval_args import parse_eval_args

    cfg = parse_eval_args(["--model", "hf", "--model_args", "pretrained=x", "--tasks", "t", "--peft", "ad"]).cfg
    assert cfg.peft == "ad" and cfg.model_args["peft"] == "ad"
    with pytest.raises(UsageError, match="--peft ad and --model_args peft=other disagree"):
        parse_eval_args(["--model", "hf", "--model_args", "pretrained=x,peft=other", "--tasks", "t", "--peft", "ad"])


# --- adapter sweeps -------------------------------------------------------------------------------------------------


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_apply_restore_cycles_give_the_base_back_bit_for_bit(tmp_path):
    """Ten apply/restore cycles over three adapters (every projection, rsLoRA with patterns, a saved lm_head and
    biases), the last five keeping the base values from one merge to the next as a sweep does: after each restore
    every parameter equals the base bit for bit, while each apply did change it."""
    import torch

    from mpitp.replica import adapters

    kinds = [dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
             dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "down_proj"],
                  rank_pattern={"down_proj": 2}),
             dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                  bias="lora_only")]
    read = [adapters.read(_save_adapter(_tiny_llama(), tmp_path / f"a{i}", perturb=("lm_head", "bias"), seed=i + 1,
                                        **k)) for i, k in enumerate(kinds)]
    model = _tiny_llama()
    base = _state(model)
    originals: dict = {}  # a sweep's: each parameter's base values copied on its first touch, kept for the next
    for cycle in range(10):
        shared = cycle >= 5
        before = {k: v[1] for k, v in originals.items()}
        done = adapters.apply(model, read[cycle % 3], keep=True, originals=originals if shared else None)
        moved = [k for k, v in model.state_dict().items() if not torch.equal(v, base[k])]
        assert moved and done.changed >= len(moved), f"cycle {cycle}: the adapter changed nothing"
        touched = {f"{p.module}.weight" for p in read[cycle % 3].pairs} | set(read[cycle % 3].saved)
        assert done.touched == touched
        assert done.restore() == len(touched)  # a copy of exactly the parameters it touched
        diff = [k for k, v in model.state_dict().items() if not torch.equal(v, base[k])]
        assert not diff, f"cycle {cycle}: not restored bit for bit: {diff[:5]}"
        if shared:  # copied once: the copies of earlier cycles reused, the new ones kept
            assert all(originals[k][1] is v for k, v in before.items()) and touched <= set(originals)
    assert set(originals) == set().union(*({f"{p.module}.weight" for p in a.pairs} | set(a.saved) for a in read))


def test_failed_apply_leaves_the_base_untouched(tmp_path):
    """An adapter that fails half-way (its last pair does not fit) is undone before the error: a sweep goes on
    with the base intact."""
    import torch

    from mpitp.errors import UsageError
    from mpitp.replica import adapters

    a = adapters.read(_save_adapter(_tiny_llama(), tmp_path / "a", r=2, lora_alpha=4,
                                    target_modules=["q_proj", "v_proj"]))
    bad = a.pairs[-1]
    a.pairs.append(adapters.LoraPair(bad.module, bad.a, bad.b[:-1], bad.scale, False))  # one row short
    model = _tiny_llama()
    base = _state(model)
    with pytest.raises(UsageError, match="B @ A is"):
        adapters.apply(model, a, keep=True)
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items())


def test_job_file_peft_list_and_both_sweeps_refused(tmp_path):
    from mpitp.errors import UsageError
    from mpitp.jobs.adapter_sweep import check_one_kind
    from mpitp.jobs.jobfile import JobFileError, load_job

    job = tmp_path / "job.yaml"
    job.write_text("runs:\n  - name: ad\n    model: /m\n    tasks: [t]\n    peft: [ads/step-*, ./final]\n")
    run = load_job(job).runs[0]
    assert run.peft == f"{tmp_path}/ads/step-*,{tmp_path}/final" and run.output.endswith("results/ad/{name}.h5")
    for run, refused in [("models: [a, b]\n    peft: [x, y]", "checkpoints .'models'. and of adapters"),
                         ("model: /m\n    peft: [x, y]\n    output: one.h5", "one file per adapter")]:
        job.write_text(f"runs:\n  - name: s\n    tasks: [t]\n    {run}\n")
        with pytest.raises(JobFileError, match=refused):
            load_job(job)
    with pytest.raises(UsageError) as err:
        check_one_kind("ck/step-*", "a,b", collective=True)
    assert err.value.collective and "\n" not in str(err.value) and "not both" in str(err.value)
    check_one_kind("ck/step-*", "a")  # one adapter over a checkpoint sweep is an ordinary sweep


SWEEP_TASKS = ["arc_easy_local", "piqa_local"]  # mean metrics: no bootstrap pool (job files keep lm-eval's iters)


@pytest.fixture(scope="module")
def stories_adapters(tmp_path_factory):
    """Three adapters of stories260K that differ (seeds, targets, ranks), named so that natural order
    (step-1, step-2, step-10) differs from plain sorting."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sweep") / "adapters"
    kinds = {"step-1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"],
                            modules_to_save=["model.norm"]),
             "step-2": dict(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
             "step-10": dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["o_proj", "up_proj", "gate_proj"])}
    for i, (name, lora) in enumerate(kinds.items()):
        base = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32)
        _save_adapter(base, root / name, perturb=("model.norm",), seed=10 + i, **lora)
    return root


@pytest.mark.mpi
@pytest.mark.slow
def test_adapter_sweep_one_load_parity_and_resume(stories_adapters, test_tasks, tmp_path):
    """One launch, a job file of two runs: (1) adapter step-1 alone at dp=2 (tp=1), (2) the sweep
    ``peft: [adapters/step-*]`` at tp=2, whose step-1 file is complete already and must be skipped (resume). The
    base is loaded once for the sweep, and every adapter's requests match lm-eval's ``hf`` with ``peft=`` that
    adapter; step-10 follows step-2 over the same shards, so a base not restored exactly fails its parity."""
    import shutil

    shutil.copytree(stories_adapters, tmp_path / "adapters")
    job = tmp_path / "job.yaml"
    job.write_text(f"""\
defaults:
  model: {STORIES}
  tasks: [{", ".join(SWEEP_TASKS)}]
  include_path: {test_tasks}
  dtype: float32
  limit: {LIMIT}
  batch_size: 4
runs:
  - name: one-dp2
    tp: 1
    peft: adapters/step-1
    output: out/step-1.h5
  - name: sweep-tp2
    tp: 2
    peft: [adapters/step-*]
    output: out/{{name}}.h5
""")
    proc = run_mpi(2, ["run", str(job)], timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    log = proc.stdout + proc.stderr
    assert log.count("loaded and sharded (load") == 1, explain(proc)
    # the probe runs for step-1 alone and for the sweep's first adapter with work (step-2); step-10 changes no
    # parameter of the head (model.norm is not one), so the base's check stands and lm-eval's tokenizer is kept
    assert log.count("head check: passed in") == 2, explain(proc)
    assert log.count("head check: passed on this base model before its first adapter") == 1, explain(proc)
    with open(tmp_path / "out" / "sweep-summary.json") as f:
        summary = json.load(f)
    assert summary["base_loads"] == 1
    rows = [(os.path.basename(r["model"]), r["name"], r["status"]) for r in summary["checkpoints"]]
    assert rows == [("step-1", "step-1", "skipped (complete)"), ("step-2", "step-2", "complete"),
                    ("step-10", "step-10", "complete")], rows
    assert {(c["a"], c["b"]) for c in summary["comparisons"]} == {("step-1", "step-2"), ("step-2", "step-10")}

    base = _lm_eval(test_tasks, f"pretrained={STORIES},dtype=float32", SWEEP_TASKS)
    for name in ("step-1", "step-2", "step-10"):
        ref = _lm_eval(test_tasks, f"pretrained={STORIES},dtype=float32,peft={stories_adapters / name}",
                       SWEEP_TASKS)
        moved, _ = compare_requests(base, ref)
        assert moved > 1e-3, f"{name} hardly changes lm-eval's scores ({moved:.2e})"
        worst, problems = compare_requests(ref, mpitp_requests(str(tmp_path / "out" / f"{name}.h5"), SWEEP_TASKS))
        assert not problems, f"{name}: " + "\n".join(problems[:20])
        print(f"adapter sweep {name}: max relative |d ll| vs lm-eval+peft {worst:.2e} (adapter moves {moved:.2e})")
