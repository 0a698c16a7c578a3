"""torch DCP (torchtitan) checkpoints evaluated in place: names, rotary order, refusals, fingerprints, layouts.

The run is written by ``tests/support/titan_ckpt.py`` from the real stories260K: ``checkpoint/step-1`` (model only),
``step-2`` (a full training state: optimizer, lr_scheduler, dataloader, train_state beside the model's names),
``step-10`` (the model under a ``model.`` prefix), torchtitan's names and q/k row order, and each step's Hugging Face
twin (``hf/step-N``). The MPI tests compare every request with single-process ``lm_eval --model hf`` on the twins.
``tied`` is stories260K itself (``tie_word_embeddings: true``) saved by ``dcp.save`` of its own ``state_dict()``,
compared with its HF folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path

import h5py
import pytest
import torch

from mpitp.errors import UsageError
from mpitp.replica import dcp
from support.titan_ckpt import write_run

TASKS = ["mpitp_demo_mc", "mpitp_demo_ppl"]
LIMIT = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_dir):
    return write_run(tmp_path_factory.mktemp("titan") / "run")


@pytest.fixture(scope="module")
def tied(tmp_path_factory, shared_dir):
    """stories260K, whose config ties the head to the embedding, saved by ``dcp.save`` of its own ``state_dict()``
    (which holds the embedding twice: as ``lm_head.weight`` too): ``step-1`` in HF names (an outside tester's
    checkpoint, refused before the fix), ``step-2`` in torchtitan's (``output.weight``), ``step-3`` in HF names under
    ``model.`` (accelerate's FSDP SHARDED_STATE_DICT)."""
    from transformers import AutoModelForCausalLM

    from support import STORIES
    from support.titan_ckpt import save

    model = AutoModelForCausalLM.from_pretrained(STORIES)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # one tensor
    root = tmp_path_factory.mktemp("tied") / "checkpoint"
    save(state, root / "step-1")
    save(dcp.hf_to_titan_names(state, model.config), root / "step-2")
    save({"model": state}, root / "step-3")
    return root


# ------------------------------------------------------------------------------------------------ fast


def test_rotary_permutation_is_hf_conversion_and_round_trips():
    """titan -> HF is exactly HF's convert_llama_weights_to_hf ``permute``, and the inverse undoes it; per-head, so
    cutting whole heads (TP's colwise shards) and permuting each part gives the same rows."""
    heads, hd, dim = 4, 8, 16
    w = torch.randn(heads * hd, dim)

    def hf_permute(x, n_heads, dim1, dim2):  # transformers' convert_llama_weights_to_hf.py
        return x.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    assert torch.equal(dcp.titan_to_hf_rows(w, heads), hf_permute(w, heads, heads * hd, dim))
    assert not torch.equal(dcp.titan_to_hf_rows(w, heads), w)  # a forgotten permutation would be seen
    assert torch.equal(dcp.titan_to_hf_rows(dcp.hf_to_titan_rows(w, heads), heads), w)
    halves = [dcp.titan_to_hf_rows(part, heads // 2) for part in w.chunk(2)]
    assert torch.equal(torch.cat(halves), dcp.titan_to_hf_rows(w, heads))


def test_names_of_each_step(run):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(run["assets"])
    plans = {s: dcp.check(str(run[s]), config) for s in ("step-1", "step-2", "step-10")}
    assert {s: (p.naming, p.prefix) for s, p in plans.items()} == {
        "step-1": ("torchtitan", ""), "step-2": ("torchtitan", ""), "step-10": ("torchtitan", "model.")}
    e = plans["step-2"].entries
    assert e["model.layers.3.self_attn.q_proj.weight"] == dcp.Entry("layers.3.attention.wq.weight", "q")
    assert e["model.layers.0.self_attn.k_proj.weight"] == dcp.Entry("layers.0.attention.wk.weight", "k")
    assert e["model.layers.0.mlp.down_proj.weight"] == dcp.Entry("layers.0.feed_forward.w2.weight", None)
    assert e["lm_head.weight"].key == "output.weight"
    assert not any(v.key.startswith(dcp.IGNORED_SECTIONS) for v in e.values())  # optimizer state left out


def test_tp1_load_equals_the_hf_twin(run):
    """Every parameter bit for bit (q/k back in HF's order), and the logits, for each kind of step."""
    from transformers import AutoModelForCausalLM

    from mpitp.replica.loading import load_model

    x = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
    for step in ("step-1", "step-2", "step-10"):
        m = load_model(str(run[step]), 1, "cpu", "auto", hf_assets=str(run["assets"]))
        ref = AutoModelForCausalLM.from_pretrained(run[f"hf/{step}"])
        a, b = m.state_dict(), ref.state_dict()
        assert a.keys() == b.keys()
        assert [k for k in a if not torch.equal(a[k], b[k])] == [], step
        with torch.no_grad():
            assert torch.equal(m(x).logits, ref(x).logits), step
        assert type(m) is type(ref) and m.dtype == torch.float32
        # no Hub kernels fetched at load (loading.LOAD_DEFAULTS), where transformers 5.25's own default kernelizes
        assert not m.use_kernels and not load_model(str(run[f"hf/{step}"]), 1, "cpu").use_kernels


def test_a_model_without_attention_heads_loads(tmp_path):
    """A Mamba checkpoint saved by ``dcp.save`` of its own ``state_dict()``: every parameter bit for bit. The load
    read the head width (``num_attention_heads``) for torchtitan's rotary rows even where no row needs it: an
    AttributeError traceback on every rank after the weights were read, at any layout."""
    from transformers import AutoModelForCausalLM, MambaConfig

    from mpitp.replica.loading import load_model
    from support.titan_ckpt import save

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=64, hidden_size=16, state_size=4,
                                                       num_hidden_layers=2, expand=2))
    ref.config.save_pretrained(tmp_path / "step")
    save(ref.state_dict(), tmp_path / "step")
    m = load_model(str(tmp_path / "step"), 1, "cpu", "float32")
    a, b = m.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_slice_reads_only_the_region_bytes(run):
    """Each rank's region of a tensor, read with pread, equals DCP's own full read, and costs only its own bytes:
    whole rows for a dim-0 (colwise) shard, row segments for a dim-1 (rowwise) one, across chunk boundaries of a
    checkpoint saved as FSDP over 2 ranks does (step-1) and in one chunk (step-2); read straight into the shard, or
    into a buffer and converted when the shard has another dtype."""
    import torch.distributed.checkpoint as tdcp

    for step in ("step-1", "step-2"):
        path = str(run[step])
        md = dcp.read_metadata(path)
        key = "layers.1.feed_forward.w2.weight"  # [64, 172]: step-1 holds rows 0-31 and 32-63 in two files
        full = torch.zeros(md.state_dict_metadata[key].size)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            tdcp.load({key: full}, storage_reader=tdcp.FileSystemReader(path), no_dist=True)
        assert full.abs().sum() > 0
        for lo, shape in [((0, 0), (64, 172)), ((16, 0), (32, 172)), ((0, 86), (64, 86)), ((20, 40), (30, 50))]:
            reader = dcp.SliceReader(path, md)
            local = torch.full(shape, float("nan"))
            assert reader.read_region(key, local, lo)
            reader.close()
            region = full[lo[0]:lo[0] + shape[0], lo[1]:lo[1] + shape[1]]
            assert torch.equal(local, region), (step, lo, shape)
            assert reader.nbytes == region.numel() * 4, (step, lo, shape, reader.nbytes)  # its bytes, no more
        reader = dcp.SliceReader(path, md)  # another dtype (--dtype bfloat16): through a buffer, converted
        local = torch.zeros((64, 86), dtype=torch.bfloat16)
        assert reader.read_region(key, local, (0, 86))
        reader.close()
        assert torch.equal(local, full[:, 86:].to(torch.bfloat16))


def test_hf_names_under_a_model_prefix(run, tmp_path):
    """A DCP saved from an HF model's own state dict under ``model.`` (accelerate's FSDP SHARDED_STATE_DICT): HF's
    names, no permutation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from support.titan_ckpt import STEPS, save, step_weights

    path = tmp_path / "pytorch_model_fsdp_0"
    save({"model": step_weights(STEPS["step-1"][1])}, path)
    plan = dcp.check(str(path), AutoConfig.from_pretrained(run["assets"]))
    assert (plan.naming, plan.prefix) == ("hf", "model.") and not any(e.permute for e in plan.entries.values())
    m = dcp.from_pretrained(str(path), str(run["assets"]))
    ref = AutoModelForCausalLM.from_pretrained(run["hf/step-1"])
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("wrap", ["model_and_optim", "app_state"])
def test_optimizer_state_saved_beside_the_model_is_ignored(run, tmp_path, wrap):
    """torch's ``get_state_dict(model, optimizer)`` saved as ``{"model": ..., "optim": ...}``, or inside torch's DCP
    recipe's ``AppState`` (``app.model.``, ``app.optim.``): the ``optim.state.<fqn>.exp_avg`` entries were refused
    as an unknown entry, and ``app.model.`` as no name of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from support.titan_ckpt import STEPS, save, step_weights

    state = step_weights(STEPS["step-1"][1])
    optim = {"state": {n: {"exp_avg": torch.zeros_like(t), "step": torch.tensor(1.0)} for n, t in state.items()},
             "param_groups": [{"lr": 0.1, "params": list(state)}]}
    full = {"model": state, "optim": optim}
    save(full if wrap == "model_and_optim" else {"app": full}, tmp_path / "step-1")
    plan = dcp.check(str(tmp_path / "step-1"), AutoConfig.from_pretrained(run["assets"]))
    assert plan.prefix == ("model." if wrap == "model_and_optim" else "app.model.") and plan.naming == "hf"
    assert not any("optim" in e.key for e in plan.entries.values())
    m = dcp.from_pretrained(str(tmp_path / "step-1"), str(run["assets"]))
    ref = AutoModelForCausalLM.from_pretrained(run["hf/step-1"])
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


def test_a_tied_models_own_state_dict_loads_its_embedding_once_and_verifies_the_head(tied, tmp_path, monkeypatch):
    """A tied model's ``state_dict()`` holds the embedding as ``lm_head.weight`` too (torchtitan: ``output.weight``):
    that name is no parameter of the config's model, so it was refused. It is the embedding's twin now: not loaded,
    compared with it; a twin that differs (a checkpoint of an untied model) or has another shape is refused in one
    line, through the slice reader (in blocks: the difference is in a later one) and through DCP's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mpitp.replica import dcp_load
    from mpitp.replica.loading import load_model
    from support import STORIES
    from support.titan_ckpt import save

    config = AutoConfig.from_pretrained(STORIES)
    expect = {"step-1": ("hf", "", "model.embed_tokens.weight", "lm_head.weight"),
              "step-2": ("torchtitan", "", "tok_embeddings.weight", "output.weight"),
              "step-3": ("hf", "model.", "model.model.embed_tokens.weight", "model.lm_head.weight")}
    for step, (naming, prefix, key, twin) in expect.items():
        plan = dcp.check(str(tied / step), config)
        assert (plan.naming, plan.prefix) == (naming, prefix), step
        assert plan.entries["model.embed_tokens.weight"] == dcp.Entry(key, None, twin), step
        assert "lm_head.weight" not in plan.entries and sum(e.twin is not None for e in plan.entries.values()) == 1
    monkeypatch.setattr(dcp_load, "TWIN_BLOCK", 3 * 64 * 4)  # compared three rows a read
    ref = AutoModelForCausalLM.from_pretrained(STORIES)
    m = load_model(str(tied / "step-1"), 1, "cpu", "auto", hf_assets=str(STORIES))
    assert m.lm_head.weight is m.model.embed_tokens.weight  # the tie gives the head
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values(), strict=True))

    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state["lm_head.weight"][400, 3] += 1e-3  # one element, past the first blocks of rows
    save(state, tmp_path / "untied")
    for parse in (dcp.SliceReader._parse, lambda *a: None):  # the slice reader's blocks, then DCP's reader
        monkeypatch.setattr(dcp.SliceReader, "_parse", staticmethod(parse))
        with pytest.raises(UsageError) as exc:
            load_model(str(tmp_path / "untied"), 1, "cpu", "auto", hf_assets=str(STORIES))
        assert "lm_head.weight differs from model.embed_tokens.weight in the checkpoint, but the config ties them" \
            in str(exc.value) and "\n" not in str(exc.value)
    state["lm_head.weight"] = state["lm_head.weight"][:500]
    save(state, tmp_path / "short")
    with pytest.raises(UsageError) as exc:
        dcp.check(str(tmp_path / "short"), config)
    assert ("lm_head.weight has shape [500, 64] in the checkpoint, but the config's model ties lm_head.weight to "
            "model.embed_tokens.weight of shape [512, 64]") in str(exc.value) and "\n" not in str(exc.value)


def test_unparsed_chunks_go_to_dcps_own_reader(run, monkeypatch):
    """A chunk the slice reader does not parse (compressed, another serialisation) is read by DCP's reader: the
    same weights."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(dcp.SliceReader, "_parse", staticmethod(lambda *a: None))
    m = dcp.from_pretrained(str(run["step-1"]), str(run["assets"]))
    ref = AutoModelForCausalLM.from_pretrained(run["hf/step-1"])
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


@pytest.mark.mpi
def test_a_packed_projections_shard_is_read_part_by_part_at_tp2(tmp_path):
    """GPT-2's ``c_attn``, MPT's ``Wqkv``, Mamba's ``in_proj`` are split part by part (``_StridedShard``); torch's
    chunk list puts such a shard where a plain ``Shard`` would lie, and the slice reader read those rows: GPT-2 saved
    by ``dcp.save`` scored 5% off lm-eval at tp=2 (arc_easy doc 0: -195.389 for -193.298), MPT 16%. Each rank's
    shard, by the slice reader and by the fallback for unparsed chunks, must be what ``distribute_tensor`` gives."""
    from support.mpi import explain, run_mpi_script

    proc = run_mpi_script(2, Path(__file__).parent / "mpi" / "strided_shards.py", [str(tmp_path), "dcp"], timeout=120)
    assert proc.returncode == 0 and "strided dcp ok: 9 checks" in proc.stdout, explain(proc)


def _variant(run, tmp_path, edit) -> str:
    """step-1's tensors, edited, saved as another DCP folder beside the run's assets."""
    from transformers import AutoConfig

    from support.titan_ckpt import STEPS, save, step_weights

    state = dcp.hf_to_titan_names(step_weights(STEPS["step-1"][1]), AutoConfig.from_pretrained(run["assets"]))
    edit(state)
    out = tmp_path / "bad-step"
    save(state, out)
    return str(out)


@pytest.mark.parametrize("what,edit,expect", [
    ("unknown", lambda s: s.update({"layers.0.attention.wqkv.weight": torch.zeros(2, 2)}),
     "unknown torchtitan parameter layers.0.attention.wqkv.weight for a 'llama' model"),
    ("shape", lambda s: s.update({"tok_embeddings.weight": torch.zeros(500, 64)}),
     "tok_embeddings.weight has shape [500, 64] in the checkpoint, but the config's model has "
     "model.embed_tokens.weight of shape [512, 64]"),
    ("missing", lambda s: s.pop("norm.weight"), "the checkpoint has no tensor for model.norm.weight"),
])
def test_bad_names_refused_naming_the_parameter(run, tmp_path, what, edit, expect):
    from mpitp.replica.loading import load_config, load_model

    path = _variant(run, tmp_path, edit)
    config = load_config(path, hf_assets=str(run["assets"]))
    for attempt in (lambda: dcp.check(path, config),  # rank 0's check, from .metadata
                    lambda: load_model(path, 1, "cpu", hf_assets=str(run["assets"]))):  # and every rank's load
        with pytest.raises(UsageError) as exc:
            attempt()
        assert expect in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("damage", ["missing", "truncated", "chunk_gone"])
def test_a_missing_or_truncated_shard_file_refused_in_one_line(run, tmp_path, damage):
    """An incomplete copy of a 2-rank save: a ``__1_0.distcp`` gone was a ``FileNotFoundError`` traceback from the
    load on every rank, one cut to 20000 bytes an ``EOFError`` from DCP's reader; now one line from the check. A
    ``.metadata`` missing one of a tensor's chunks was loaded with that region unwritten (and checked as ready)."""
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from mpitp.replica.loading import load_config, load_model

    bad = tmp_path / "step-1"
    shutil.copytree(run["step-1"], bad)
    shard = bad / "__1_0.distcp"
    size = shard.stat().st_size
    if damage == "chunk_gone":
        metadata = dcp.read_metadata(str(bad))
        key = "layers.0.feed_forward.w2.weight"
        chunk = metadata.state_dict_metadata[key].chunks.pop(1)
        metadata.storage_data.pop(MetadataIndex(key, chunk.offsets))
        (bad / ".metadata").write_bytes(pickle.dumps(metadata))
        expect = f"{key}'s chunks in .metadata hold "
    elif damage == "missing":
        shard.unlink()
        expect = "cannot read __1_0.distcp, which holds model tensors .metadata indexes (No such file or directory)"
    else:
        os.truncate(shard, 20000)
        expect = f"__1_0.distcp is 20000 bytes, but .metadata indexes model tensors in it up to byte {size} "
    config = load_config(str(bad), hf_assets=str(run["assets"]))
    for attempt in (lambda: dcp.check(str(bad), config),
                    lambda: load_model(str(bad), 1, "cpu", hf_assets=str(run["assets"]))):
        with pytest.raises(UsageError) as exc:
            attempt()
        assert expect in str(exc.value) and "\n" not in str(exc.value)


def test_torchtitans_saved_rotary_table_is_not_read(run, tmp_path):
    """Older torchtitan's full checkpoints hold its persistent ``freqs_cis`` buffer (complex64) beside the weights:
    it was refused as 'unknown torchtitan parameter freqs_cis'. HF's model computes its own, so it is skipped."""
    from transformers import AutoModelForCausalLM

    from mpitp.replica.loading import load_config, load_model

    path = _variant(run, tmp_path, lambda s: s.update({"freqs_cis": torch.ones(64, 4, dtype=torch.complex64)}))
    assert "freqs_cis" not in {e.key for e in dcp.check(path, load_config(path, hf_assets=str(run["assets"])))
                               .entries.values()}
    m = load_model(path, 1, "cpu", hf_assets=str(run["assets"]))
    ref = AutoModelForCausalLM.from_pretrained(run["hf/step-1"])
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


def test_foreign_formats_and_missing_assets_refused(run, tmp_path):
    from mpitp.replica.loading import load_config

    mega = tmp_path / "iter_0000100"
    mega.mkdir()
    (mega / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (mega / ".metadata").write_bytes(b"x")
    (mega / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(UsageError, match="Megatron-LM distributed checkpoint .* convert it to a Hugging Face folder"):
        load_config(str(mega))
    fsdp1 = tmp_path / "fsdp1"
    fsdp1.mkdir()
    (fsdp1 / "pytorch_model_fsdp_rank0.bin").write_bytes(b"x")
    with pytest.raises(UsageError, match="FSDP1 per-rank state .*accelerate merge-weights"):
        load_config(str(fsdp1))
    lone = tmp_path / "lone" / "step-5"
    shutil.copytree(run["step-1"], lone)
    with pytest.raises(UsageError, match="without a config.json beside it: give --hf-assets DIR"):
        load_config(str(lone))
    shutil.copyfile(run["assets"] / "config.json", lone.parent / "config.json")  # the run's parent folder
    assert load_config(str(lone)).num_hidden_layers == 5
    with pytest.raises(UsageError, match="--hf-assets applies to torch DCP checkpoint folders only"):
        load_config(str(run["hf/step-1"]), hf_assets=str(run["assets"]))


class _Hostile:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_pickle_runs_nothing(run, tmp_path):
    """``.metadata`` is a pickle, which torch's own reader loads with ``pickle.load``: a crafted one would run code
    on every rank. Refused as one line, and the command never runs."""
    import pickle

    from mpitp.replica.loading import load_config

    bad = tmp_path / "step-66"
    shutil.copytree(run["step-2"], bad)
    marker = tmp_path / "ran"
    (bad / ".metadata").write_bytes(pickle.dumps(_Hostile(marker)))
    config = load_config(str(bad), hf_assets=str(run["assets"]))
    with pytest.raises(UsageError) as exc:
        dcp.check(str(bad), config)
    assert "cannot read the torch DCP .metadata file: it names posix.system" in str(exc.value)
    assert "\n" not in str(exc.value) and not marker.exists()


def test_metadata_of_torch_1_13_names_the_old_package(run, tmp_path, monkeypatch):
    """Before torch 2.0 DCP lived in ``torch.distributed._shard.checkpoint``: its ``.metadata`` names the classes
    there, and torch's reader still loads it; it was refused as a class 'DCP metadata does not hold', which could
    run code. Written here by pickling today's metadata with the classes' old module names."""
    import pickle
    import sys

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    from transformers import AutoConfig, AutoModelForCausalLM

    old = tmp_path / "step-1"
    shutil.copytree(run["step-1"], old)
    metadata = dcp.read_metadata(str(old))
    for d in ("storage_meta", "version"):  # torch 1.13's Metadata had neither
        metadata.__dict__.pop(d, None)
    for module, classes in ((md, [c for c in vars(md).values() if isinstance(c, type) and c.__module__ == md.__name__]),
                            (fs, [fs._StorageInfo])):
        name = module.__name__.replace("torch.distributed.", "torch.distributed._shard.")
        monkeypatch.setitem(sys.modules, name, module)
        for c in classes:
            monkeypatch.setattr(c, "__module__", name)
    (old / ".metadata").write_bytes(pickle.dumps(metadata))
    monkeypatch.undo()
    assert b"torch.distributed._shard.checkpoint.metadata" in (old / ".metadata").read_bytes()
    assert dcp.check(str(old), AutoConfig.from_pretrained(run["assets"])).naming == "torchtitan"
    m = dcp.from_pretrained(str(old), str(run["assets"]))
    ref = AutoModelForCausalLM.from_pretrained(run["hf/step-1"])
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))


def test_fingerprint_tokenizer_and_watch(run, tmp_path):
    """The weights identity is of the bytes read (.metadata, the shards, the assets' config); the tokenizer is the
    assets'; a step counts as complete for --watch once its .metadata exists."""
    from mpitp.evaluation import fingerprint
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.jobs import watch
    from mpitp.jobs.sweep import tokenizer_key

    assets = str(run["assets"])
    d1 = fingerprint.detail(str(run["step-1"]), hf_assets=assets)
    assert set(d1["model_files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "hf-assets/config.json",
                                      "hf-assets/generation_config.json"}
    assert "tokenizer.json" in d1["tokenizer_files"]
    ids = {s: fingerprint.identity(str(run[s]), hf_assets=assets)["weights"] for s in ("step-1", "step-2")}
    assert ids["step-1"] != ids["step-2"]
    keys = {tokenizer_key(EvalConfig(model=str(run[s]), hf_assets=assets)) for s in ("step-1", "step-2", "step-10")}
    assert len(keys) == 1 and None not in keys  # every step shares the assets' tokenizer (and its token ids)

    partial = tmp_path / "step-7"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"shard being written")
    assert watch._readiness(str(partial))[0] is None
    assert watch._readiness(str(run["step-2"]))[0] is not None


def test_a_dcp_step_is_staged_with_its_index_and_finds_its_assets_from_the_source(run):
    """``--stage-dir`` copies ``.metadata`` (hidden) and the ``*.distcp`` shards; loading from the copy takes the
    assets folder resolved from the original path (the copy has no parent with a config.json)."""
    from mpitp.evaluation.runner import _with_assets
    from mpitp.evaluation.settings import EvalConfig
    from mpitp.replica.staging import model_files

    assert model_files(str(run["step-1"])) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    step = run["step-2"]
    (step.parent / "config.json").write_bytes((run["assets"] / "config.json").read_bytes())
    try:
        cfg = EvalConfig(model=str(step))
        assert _with_assets(cfg, "/stage/step-2-abc").hf_assets == str(step.parent)
        assert _with_assets(cfg, str(step)) is cfg  # not staged: the loader resolves it as ever
    finally:
        (step.parent / "config.json").unlink()


def test_check_and_info_take_hf_assets(run, tmp_path, monkeypatch):
    """``mpitp check --model STEP --hf-assets DIR`` reads the config and tokenizer from the assets and checks the
    ``.metadata`` against the config as ``mpitp eval`` does (offline, before the queue); ``mpitp info --pp``
    splits a DCP model's layers from its assets' config."""
    from types import SimpleNamespace

    from click.testing import CliRunner

    from mpitp.cli import info
    from mpitp.cli.check import check_command
    from mpitp.parallel import runtime

    step, assets = str(run["step-2"]), str(run["assets"])

    def check(*args):
        res = CliRunner().invoke(check_command, [*args])
        return res.exit_code, " ".join(res.output.split())

    code, out = check("--model", step, "--hf-assets", assets)
    assert (code, out) == (0, f"mpitp check: ready offline: no tasks; model {step}")
    code, out = check("--model", step)
    assert code == 2 and "a torch DCP checkpoint without a config.json beside it: give --hf-assets DIR" in out
    bad = _variant(run, tmp_path, lambda s: s.update({"tok_embeddings.weight": torch.zeros(500, 64)}))
    code, out = check("--model", bad, "--hf-assets", assets)
    assert code == 2 and "tok_embeddings.weight has shape [500, 64] in the checkpoint" in out
    code, out = check("--model", str(run["hf/step-2"]), "--hf-assets", assets)
    assert code == 2 and "--hf-assets applies to torch DCP checkpoint folders only" in out

    monkeypatch.setattr(runtime, "agree", lambda fn, *args, **kwargs: fn())  # rank 0's check, no MPI world
    rt = SimpleNamespace(layout=SimpleNamespace(pp=2), world=SimpleNamespace(comm=None), timeout=1.0)
    assert info._stage_split(rt, step, assets) == info._stage_split(rt, str(run["hf/step-2"]))
    with pytest.raises(UsageError, match="give --hf-assets DIR"):
        info._stage_split(rt, step)
    assert any("--hf-assets" in p.opts for p in info.info_command.params)


def test_sweep_prefetch_reads_a_dcp_steps_shards(run):
    """A sweep reads the next checkpoint into the page cache while the current one is evaluated: for a DCP step,
    its ``*.distcp`` shards (it found none before, so the next step's load read from storage)."""
    from mpitp.jobs.sweep import weight_files

    assert [p.rsplit("/", 1)[-1] for p in weight_files(str(run["step-1"]))] == ["__0_0.distcp", "__1_0.distcp"]
    assert [p.rsplit("/", 1)[-1] for p in weight_files(str(run["hf/step-1"]))] == ["model.safetensors"]


def test_hf_assets_is_a_declared_setting():
    from mpitp.evaluation.settings import EvalConfig, cli_options, job_fields

    assert "hf_assets" in job_fields()
    assert any(spec["flags"] == ("--hf-assets",) for _, spec in cli_options())
    assert EvalConfig(model="m", hf_assets="a").identity()["hf_assets"] == "a"
    assert "hf_assets" not in EvalConfig(model="m").identity()  # files written before it still resume
    assert EvalConfig(hf_assets="a").load_kwargs() == {"hf_assets": "a"}


# ------------------------------------------------------------------------------------------------ MPI


def _reference(model_dir) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mpitp.tasks.demo import demo_tasks_dir

    torch.set_num_threads(2)
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32", tasks=TASKS,
                                   limit=LIMIT, batch_size=4, device="cpu", log_samples=True, bootstrap_iters=0,
                                   task_manager=TaskManager(include_path=demo_tasks_dir()))


def _eval_args(model: str | None, run, out: str) -> list[str]:
    from mpitp.tasks.demo import demo_tasks_dir

    return ["eval", *(["--model", model] if model else []), "--hf-assets", str(run["assets"]),
            "--tasks", ",".join(TASKS), "--include-path", demo_tasks_dir(), "--limit", str(LIMIT),
            "--batch-size", "4", "--dtype", "float32", "--bootstrap-iters", "0", "--output", out]


def _assert_parity(reference: dict, path: str) -> float:
    from support.parity import compare_requests, mpitp_requests, reference_requests

    got = mpitp_requests(path, TASKS)
    worst, problems = compare_requests(reference_requests(reference["samples"]), got)
    assert not problems, "\n".join(problems[:20])
    assert len(got) >= 2 * LIMIT
    return worst


def _assert_half_read(stderr: str, run) -> None:
    """At tp=2 each rank reads about half the model's tensor bytes: its TP slices (the replicated norms are a few
    KiB), plus ``.metadata`` whole and each chunk record's zip directory and pickle (under 1 KiB a chunk): bounded
    here by half the model + ``.metadata`` + 128 KiB (measured: 44 KiB over; with the zip directory parsed through
    an 8 KiB read buffer it was ~1 MB a rank, 87% of the model; DCP's own reader reads every tensor whole).
    ``rchar`` from ``MPITP_TEST_IO_REPORT``, around each checkpoint's load; step-1's (the first) also counts the
    imports of the first load, so steps 2 and 10 are judged."""
    io = {}
    # Not anchored to a line's start: the launcher forwards each rank's stderr in chunks, so another rank's long
    # write may be cut around one of these (each is one write of a few dozen bytes, never cut itself).
    for phase, rank, rchar in re.findall(r"io: (before loading|model loaded): rank=(\d) \S+ \S+ rchar=(\d+)", stderr):
        io.setdefault(int(rank), []).append((phase, int(rchar)))
    counts = {r: len(v) for r, v in io.items()}
    assert counts == {r: 6 for r in range(4)}, f"{counts}\n{stderr[-3000:]}"
    for i, step in ((1, "step-2"), (2, "step-10")):
        md = dcp.read_metadata(str(run[step]))
        model = sum(math.prod(shape) * dtype.itemsize for shape, dtype in dcp.model_tensors(md).values())
        bound = model / 2 + (run[step] / ".metadata").stat().st_size + (128 << 10)
        read = {r: v[2 * i + 1][1] - v[2 * i][1] for r, v in io.items()}
        assert all(n <= bound for n in read.values()), (step, model, bound, read)
        print(f"{step}: {model / 2**20:.2f} MiB of model tensors, read per rank {read} (bound {bound:.0f})")


@pytest.mark.mpi
@pytest.mark.slow
def test_sweep_of_dcp_steps_at_tp2_dp2_matches_lm_eval_on_the_hf_twins(run, tmp_path):
    from support.mpi import explain, run_mpi

    out = tmp_path / "out"
    proc = run_mpi(4, [*_eval_args(str(run["step-1"].parent / "step-*"), run, f"{out}/"), "--tp", "2"],
                   timeout=900, cwd=str(tmp_path), env={"MPITP_TEST_IO_REPORT": "1"})
    assert proc.returncode == 0, explain(proc)
    _assert_half_read(proc.stderr, run)
    assert "sweep: 3/3 checkpoints ok" in proc.stdout, explain(proc)
    assert "torchtitan names under 'model.'" in proc.stderr, explain(proc)  # step-10, read as such
    assert " token encodings reused from earlier" in proc.stderr, explain(proc)  # one tokenizer: the assets'
    rows = json.loads((out / "sweep-summary.json").read_text())["checkpoints"]
    assert [r["name"] for r in rows] == ["step-1", "step-2", "step-10"]  # natural order
    worst = 0.0
    for step in ("step-1", "step-2", "step-10"):
        worst = max(worst, _assert_parity(_reference(run[f"hf/{step}"]), str(out / f"{step}.h5")))
        with h5py.File(out / f"{step}.h5") as f:
            assert f.attrs["status"] == "complete"
            fp = json.loads(f.attrs["fingerprint_json"])
            assert ".metadata" in fp["model_files"] and "tokenizer.json" in fp["tokenizer_files"]
            assert f.attrs["tokenizer"] == str(run["assets"])
    print(f"DCP sweep tp=2 x dp=2: 3 steps, max relative |d ll| = {worst:.2e}, wall {proc.elapsed:.1f} s")


@pytest.mark.mpi
@pytest.mark.slow
def test_tied_models_own_state_dict_at_tp2_pp2_matches_lm_eval_on_its_hf_folder(tied, tmp_path):
    """An outside tester's case: ``dcp.save(model.state_dict())`` of a tied model was refused for every step
    (``lm_head.weight names no parameter of the config's llama model``). A sweep of the three ``tied`` steps at
    tp=2 x pp=2 (one replica on 4 ranks: each stage's TP ranks hold half the embedding and compare it with their half
    of the saved head; the last stage's head is the tied embedding there): every request equals single-process
    ``lm_eval --model hf`` on stories260K's own folder."""
    from support import STORIES
    from support.mpi import explain, run_mpi

    out = tmp_path / "out"
    args = _eval_args(str(tied / "step-*"), {"assets": STORIES}, f"{out}/")
    proc = run_mpi(4, [*args, "--tp", "2", "--pp", "2"], timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    assert "sweep: 3/3 checkpoints ok" in proc.stdout, explain(proc)
    reference = _reference(STORIES)
    worst = max(_assert_parity(reference, str(out / f"{step}.h5")) for step in ("step-1", "step-2", "step-3"))
    print(f"tied DCP sweep tp=2 x pp=2: 3 steps, max relative |d ll| = {worst:.2e}, wall {proc.elapsed:.1f} s")


def _complete(path) -> bool:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("status") == "complete"
    except OSError:
        return False


@pytest.mark.mpi
@pytest.mark.slow
def test_watch_at_pp2_evaluates_a_step_written_later_once(run, tmp_path):
    """``--watch run/checkpoint`` at pp=2: the step already there (a full training state: each stage reads only its
    layers' tensors, the optimizer state beside them never), then a step torchtitan writes while the watcher runs
    (shards first, ``.metadata`` last after a pause: not taken before it is there), evaluated once; both equal
    single-process ``lm_eval --model hf`` on their HF twins."""
    import subprocess
    import sys
    import time

    from support import OFFLINE_ENV
    from support.mpi import mpi_env, mpiexec_cmd
    from support.titan_ckpt import write_late_step

    watched = tmp_path / "checkpoint"
    shutil.copytree(run["step-2"], watched / "step-2")
    out = tmp_path / "out"
    cmd = [*mpiexec_cmd(2), sys.executable, "-m", "mpitp", *_eval_args(None, run, f"{out}/{{name}}.h5"),
           "--watch", str(watched), "--watch-idle", "15", "--pp", "2"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                            env={**os.environ, **OFFLINE_ENV, **mpi_env()})
    try:
        deadline = time.monotonic() + 600
        while not _complete(out / "step-2.h5"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.5)
        write_late_step(run["assets"], watched / "step-20", 20, tmp_path / "hf-step-20", pause_s=3)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.monotonic() - t0
    why = f"exit {proc.returncode}\n--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-6000:]}"
    assert proc.returncode == 0, why
    rows = json.loads((out / "sweep-summary.json").read_text())["checkpoints"]
    assert [(r["name"], r["status"]) for r in rows] == [("step-2", "complete"), ("step-20", "complete")], why
    assert len(re.findall(r"=== checkpoint \d+/\d+: \S*step-20 ->", stderr)) == 1, why  # evaluated once
    worst = max(_assert_parity(_reference(run["hf/step-2"]), str(out / "step-2.h5")),
                _assert_parity(_reference(tmp_path / "hf-step-20"), str(out / "step-20.h5")))
    with h5py.File(out / "step-20.h5") as f:  # evaluated from the finished files: the fingerprint is the final one
        assert set(json.loads(f.attrs["fingerprint_json"])["model_files"]) >= {".metadata", "__0_0.distcp",
                                                                               "__1_0.distcp"}
    print(f"DCP --watch pp=2: 2 steps (one written during the watch), max relative |d ll| = {worst:.2e}, "
          f"wall {wall:.1f} s")



@pytest.mark.mpi
@pytest.mark.slow
def test_dcp_load_peaks_no_higher_than_its_hf_twin_at_tp2(tmp_path):
    """Issue 39: at tp=2 each rank reads its slices into its own shard, never the whole model beside it. A 21M-
    parameter Llama (84 MB in fp32: well above the allocator's noise), its HF twin and its DCP step, each loaded by
    ``mpiexec -n 2`` (``tests/mpi/load_peak.py``): the peak RSS the load adds on each rank (``VmHWM`` reset just before
    it, every local parameter read once after it: DCP's anonymous memory against the twin's mapped file pages and
    pread shards). Measured: DCP 1.34x the rank's shard on both ranks, the twin 1.68-1.93x; a reader that built the
    whole state dict before filling the shard would add the model (2x the shard) on top."""
    import json

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from support import STORIES
    from support.mpi import explain, run_mpi_script
    from support.titan_ckpt import save

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(tmp_path / "hf")
    save(dcp.hf_to_titan_names(model.state_dict(), config), tmp_path / "step")
    del model
    script = Path(__file__).parent / "mpi" / "load_peak.py"
    ratio = {}
    for kind, path in (("hf", tmp_path / "hf"), ("dcp", tmp_path / "step")):
        proc = run_mpi_script(2, script, [str(path), str(tmp_path / "hf")], timeout=300)
        assert proc.returncode == 0, explain(proc)
        ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert sorted(r["rank"] for r in ranks) == [0, 1], explain(proc)
        assert all(20e6 < r["bytes"] < 60e6 for r in ranks), ranks  # each rank holds about half the 84 MB
        assert all(r["embed_taken"] and r["embed_exact"] for r in ranks), ranks  # taken, bit for bit
        ratio[kind] = {r["rank"]: r["gain"] / r["bytes"] for r in ranks}
    print("peak RSS a tp=2 load adds per rank, x its shard's bytes: " + ", ".join(
        f"rank {r}: DCP {ratio['dcp'][r]:.2f}, HF twin {ratio['hf'][r]:.2f}" for r in (0, 1)))
    for r in (0, 1):
        assert ratio["dcp"][r] <= max(ratio["hf"][r], 1.0) * 1.25 and ratio["dcp"][r] < 1.6, ratio
