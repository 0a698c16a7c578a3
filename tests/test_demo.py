"""The built-in offline demo: tiny deterministic Llama + three small lm-eval tasks.

Everything here runs offline on CPU in a single process.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mpitp.tasks import demo  # noqa: E402
from mpitp.tasks.demo import DEMO_TASKS, build_demo_model, demo_tasks_dir, prepare_demo  # noqa: E402
from mpitp.tasks.demo import model as demo_model  # noqa: E402
from support import torch_threads  # noqa: E402

MAX_LENGTH = 64
LIMIT = 5


def _tensors(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


# --------------------------------------------------------------------------- model


def test_build_is_deterministic_and_has_tp_friendly_shapes(tmp_path):
    import torch

    rng_before = torch.random.get_rng_state()
    a = build_demo_model(tmp_path / "a")
    b = build_demo_model(tmp_path / "b", seed=0)
    # Building must not consume the caller's global torch RNG.
    assert torch.equal(rng_before, torch.random.get_rng_state())
    assert a == str((tmp_path / "a").resolve())

    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and len(ta) == 2 + 2 * 9 + 1  # embed, lm_head, 2 layers x 9, final norm
    for name in ta:
        assert ta[name].dtype == torch.float32
        assert torch.equal(ta[name], tb[name]), name
    for fname in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert Path(a, fname).read_bytes() == Path(b, fname).read_bytes(), fname

    cfg = json.loads(Path(a, "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_attention_heads"] == 8 and cfg["num_key_value_heads"] == 4
    assert cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 128
    assert cfg["num_hidden_layers"] == 2 and cfg["max_position_embeddings"] == 512
    assert cfg["tie_word_embeddings"] is False
    for tp in (1, 2, 4):
        assert cfg["num_attention_heads"] % tp == 0 and cfg["num_key_value_heads"] % tp == 0

    # The vocabulary comes from the tokenizer and gives uneven vocab-parallel shards.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    vocab = cfg["vocab_size"]
    assert vocab == len(tok) == demo.DEMO_VOCAB_SIZE
    assert vocab % 2 and vocab % 3 and vocab % 4
    assert ta["model.embed_tokens.weight"].shape == (vocab, 64)
    assert ta["lm_head.weight"].shape == (vocab, 64)
    assert not torch.equal(ta["model.embed_tokens.weight"], ta["lm_head.weight"])
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tok, attr) is not None, attr
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4
    assert cfg["bos_token_id"] == tok.bos_token_id and cfg["eos_token_id"] == tok.eos_token_id
    # Byte-level BPE: any text round-trips, nothing maps to <unk>.
    text = "Question: Which vehicle runs on rails?\nAnswer: a train (ünïcode ✓)"
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text

    # A different seed gives different weights (and a different recipe hash).
    c = build_demo_model(tmp_path / "c", seed=1)
    assert not torch.equal(_tensors(c)["lm_head.weight"], ta["lm_head.weight"])
    assert demo_model.recipe_hash(0) != demo_model.recipe_hash(1)


def test_cache_is_reused_and_repaired(tmp_path, monkeypatch):
    out = tmp_path / "m"
    build_demo_model(out)
    marker = json.loads((out / demo_model.MARKER_FILE).read_text())
    assert marker["recipe_hash"] == demo_model.recipe_hash(0)
    assert demo_model.is_complete(out)
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    original = weights.read_bytes()

    # A complete cache is reused without building anything.
    def boom(*a, **k):
        raise AssertionError("cache not reused")

    monkeypatch.setattr(demo_model, "_build_model", boom)
    assert build_demo_model(out) == str(out.resolve())
    assert weights.stat().st_mtime_ns == stamp
    # ... but not for another seed.
    assert not demo_model.is_complete(out, seed=1)
    with pytest.raises(AssertionError, match="cache not reused"):
        build_demo_model(out, seed=1)
    monkeypatch.undo()
    assert demo_model.is_complete(out)  # the failed build left the cache alone
    assert not list(tmp_path.glob(".m.tmp-*"))  # and cleaned up its temp dir

    # A damaged cache is detected and rebuilt to the same bytes.
    weights.write_bytes(original[:-16] + b"\0" * 16)
    assert not demo_model.is_complete(out)
    build_demo_model(out)
    assert demo_model.is_complete(out)
    assert weights.read_bytes() == original

    # A missing file is detected too.
    (out / "tokenizer.json").unlink()
    assert not demo_model.is_complete(out)
    build_demo_model(out)
    assert demo_model.is_complete(out)


def test_prepare_demo(tmp_path):
    model_dir, include_path, tasks = prepare_demo(tmp_path)
    assert Path(model_dir).parent == tmp_path.resolve()
    assert demo_model.is_complete(model_dir)
    assert tasks == DEMO_TASKS == ["mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen"]
    assert include_path == demo_tasks_dir() and os.path.isabs(include_path)
    for t in tasks:
        assert os.path.isfile(os.path.join(include_path, f"{t}.yaml"))
        assert os.path.isfile(os.path.join(include_path, f"{t}.jsonl"))
    assert prepare_demo(tmp_path) == (model_dir, include_path, tasks)


# --------------------------------------------------------------------------- tasks


def test_demo_tasks_load_from_any_cwd(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)  # data paths must not depend on the working directory
    tm = TaskManager(include_path=demo_tasks_dir(), include_defaults=False)
    assert set(DEMO_TASKS) <= set(tm.all_subtasks)
    assert demo.DEMO_TAG in tm.all_tags

    loaded = tm.load([demo.DEMO_TAG])["tasks"]
    assert set(loaded) == set(DEMO_TASKS)
    types = {name: t.OUTPUT_TYPE for name, t in loaded.items()}
    assert types == {
        "mpitp_demo_mc": "multiple_choice",
        "mpitp_demo_ppl": "loglikelihood_rolling",
        "mpitp_demo_gen": "generate_until",
    }
    for name, task in loaded.items():
        docs = list(task.test_docs())
        assert 20 <= len(docs) <= 40, name
        rows = [json.loads(x) for x in Path(demo_tasks_dir(), f"{name}.jsonl").read_text().splitlines()]
        assert [dict(d) for d in docs] == rows

    mc = loaded["mpitp_demo_mc"]
    for doc in mc.test_docs():
        choices = mc.doc_to_choice(doc)
        assert 3 <= len(choices) <= 4 and len(set(choices)) == len(choices)
        assert 0 <= mc.doc_to_target(doc) < len(choices)

    gen = loaded["mpitp_demo_gen"]
    assert gen.config.generation_kwargs["until"] == ["\n"]
    assert gen.config.generation_kwargs["max_gen_toks"] == 16
    assert gen.config.generation_kwargs["do_sample"] is False

    # Several rolling windows: the first docs (those `limit` keeps) include long ones.
    ppl = loaded["mpitp_demo_ppl"]
    first = [ppl.doc_to_target(d) for d in list(ppl.test_docs())[:LIMIT]]
    assert sum(len(t.split()) > 100 for t in first) >= 2


# --------------------------------------------------------------------------- lm-eval end to end


@pytest.fixture(scope="module")
def demo_eval(tmp_path_factory):
    """One real single-process lm-eval run over the three demo tasks."""
    import lm_eval
    import lm_eval.utils
    from lm_eval.tasks import TaskManager

    model_dir, include_path, tasks = prepare_demo(tmp_path_factory.mktemp("cache"))
    windows: list[list[tuple[list[int], list[int]]]] = []
    tokens_in: list[int] = []
    orig = lm_eval.utils.get_rolling_token_windows

    def spy(*args, **kwargs):
        got = list(orig(*args, **kwargs))
        windows.append(got)
        tokens_in.append(len(kwargs["token_list"] if "token_list" in kwargs else args[0]))
        return iter(got)

    with torch_threads(1):  # tiny model: threading only adds overhead on busy CI machines
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lm_eval.utils, "get_rolling_token_windows", spy)
            mp.chdir(tmp_path_factory.mktemp("cwd"))
            res = lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH}",
                tasks=tasks,
                task_manager=TaskManager(include_path=include_path, include_defaults=False),
                limit=LIMIT,
                device="cpu",
                batch_size=1,
            )
    return res, windows, tokens_in, model_dir


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_eval_produces_all_metrics(demo_eval):
    res, _, _, _ = demo_eval
    results = res["results"]
    assert set(DEMO_TASKS) <= set(results)
    for t in DEMO_TASKS:
        assert res["n-samples"][t]["effective"] == LIMIT

    mc = results["mpitp_demo_mc"]
    for m in ("acc,none", "acc_norm,none"):
        assert _finite(mc[m]) and 0.0 <= mc[m] <= 1.0
        assert (mc[m] * LIMIT) == pytest.approx(round(mc[m] * LIMIT))

    ppl = results["mpitp_demo_ppl"]
    for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert _finite(ppl[m]) and ppl[m] > 0, m
    assert ppl["word_perplexity,none"] > ppl["byte_perplexity,none"] > 1.0
    # lm-eval: bits_per_byte = -sum(ll) / (sum(bytes) * ln 2) = log2(byte_perplexity)
    assert ppl["bits_per_byte,none"] == pytest.approx(math.log2(ppl["byte_perplexity,none"]), rel=1e-9)
    # A random model is far from perfect but bounded by a uniform guess over the vocabulary per token.
    assert ppl["bits_per_byte,none"] > 1.0

    gen = results["mpitp_demo_gen"]
    assert _finite(gen["exact_match,remove_whitespace"])
    assert 0.0 <= gen["exact_match,remove_whitespace"] <= 1.0


def test_eval_samples(demo_eval):
    res, _, _, _ = demo_eval
    samples = res["samples"]

    mc = samples["mpitp_demo_mc"]
    assert len(mc) == LIMIT
    for s in mc:
        lls = [r[0][0] for r in s["resps"]]
        assert len(lls) == len(s["doc"]["choices"])
        assert all(_finite(x) and x < 0 for x in lls)
        assert s["acc"] == float(max(range(len(lls)), key=lls.__getitem__) == s["doc"]["answer"])

    gen = samples["mpitp_demo_gen"]
    assert len(gen) == LIMIT
    for s in gen:
        raw = s["resps"][0][0]
        assert "\n" not in raw
        assert s["filtered_resps"][0] == raw.strip()
        assert s["target"] == s["doc"]["answer"]


def test_rolling_task_uses_several_windows(demo_eval):
    res, windows, tokens_in, _ = demo_eval
    assert len(windows) == LIMIT  # one rolling request per document
    for got, n_tokens in zip(windows, tokens_in, strict=True):
        assert sum(len(pred) for _, pred in got) == n_tokens  # every token predicted once
        assert all(len(inp) <= MAX_LENGTH and len(pred) <= MAX_LENGTH for inp, pred in got)
    counts = [len(w) for w in windows]
    assert sum(counts) > LIMIT and max(counts) >= 4, counts

    # The per-document loglikelihood is the sum over its windows: finite and negative.
    for s in res["samples"]["mpitp_demo_ppl"]:
        ll = s["resps"][0][0]
        assert _finite(ll) and ll < 0


def test_concurrent_builders_agree(tmp_path):
    """Several builders racing on one directory (e.g. MPI ranks) all end with the same complete model."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path / "shared"
    with ThreadPoolExecutor(max_workers=3) as ex:
        paths = list(ex.map(lambda _: build_demo_model(out), range(3)))
    assert paths == [str(out.resolve())] * 3
    assert demo_model.is_complete(out)
    ref = build_demo_model(tmp_path / "ref")
    assert (out / "model.safetensors").read_bytes() == Path(ref, "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "shared"]  # no temp dirs left
