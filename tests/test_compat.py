"""mpitp's reach into lm-eval, transformers, torch, click and Python (mpitp.compat): every target exists in the
installed versions, every patch is undone after use, and prefix sharing leaves transformers' global ``"sdpa"``
attention alone. That nothing reaches them elsewhere: tests/test_compat_scan.py."""

from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch

from mpitp import compat

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "..", "shared", "models", "stories260K")


def _originals() -> dict:
    """Each target's current object, read as :func:`compat.replaced` reads it (a property stays a property)."""
    out = {}
    for key, t in compat.TARGETS.items():
        owner, last = t.owner()
        out[key] = vars(owner)[last] if last in vars(owner) else getattr(owner, last)
    return out


def test_every_target_exists_in_the_installed_versions():
    """A release that renames one of them is refused at start-up instead of silently running unpatched."""
    assert compat.missing() == []
    for t in compat.TARGETS.values():
        owner, last = t.owner()
        assert hasattr(owner, last), t.name
    compat.check()


def test_a_missing_target_is_one_line_naming_the_supported_range():
    gone = compat.Target("lm-eval", "lm_eval.evaluator", "_no_such_function", compat.LM_EVAL, "mpitp.x")
    optional = compat.Target("lm-eval", "lm_eval.evaluator", "_nor_this", compat.LM_EVAL, "mpitp.y", optional=True)
    lines = compat.missing({"a": gone, "b": optional})
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "lm_eval.evaluator._no_such_function" in lines[0] and f"lm-eval{compat.LM_EVAL}" in lines[0], lines[0]


def test_a_target_checked_at_use_is_left_out_of_the_start_up_check_and_refused_where_it_is_used(monkeypatch):
    """The DCP reader's private class is checked where a DCP checkpoint is read (importing its module costs every
    other run 40 ms of rank 0's start): start-up passes without it, its first use refuses in the same one line."""
    from mpitp.errors import UsageError

    assert compat.TARGETS["torch.distributed.checkpoint.filesystem._StorageInfo"].at_use
    gone = compat.Target("torch", "torch.serialization", "_no_such_class", compat.TORCH, "mpitp.z", at_use=True)
    monkeypatch.setitem(compat.TARGETS, gone.name, gone)
    compat.check()
    with pytest.raises(UsageError, match=r"^torch\.serialization\._no_such_class \(used by mpitp\.z\) is missing"):
        compat.require(gone.name)
    compat.require("torch.distributed.checkpoint.filesystem._StorageInfo")


def test_every_patch_is_undone_after_use_even_on_error():
    """Each of mpitp's context managers replaces its target inside the block and puts the very same object back."""
    from lm_eval.tasks import TaskManager

    from mpitp.evaluation.envinfo import EnvInfoEarly
    from mpitp.evaluation.eval_docs import listed_once
    from mpitp.evaluation.requestcache import used
    from mpitp.evaluation.templates import compiled_once
    from mpitp.jobs.readiness_guard import block_network
    from mpitp.jobs.sweep import memoize_task_loading
    from mpitp.replica.loading import strided_shards_with_pread
    from mpitp.replica.pipeline import _tp_plan_without_stubs
    from mpitp.results.docscores import capture

    before = _originals()
    tm = TaskManager.__new__(TaskManager)  # the memo patches one instance: no task index needed to check that
    load = "lm_eval.tasks.TaskManager.load"
    blocks = {"lm_eval.api.task.Task.eval_docs": listed_once, "lm_eval.utils.apply_template": compiled_once,
              "lm_eval.evaluator._process_results": capture,
              "lm_eval.caching.cache.PATH": lambda: used("/tmp/mpitp-test-cache"),
              "torch.utils.collect_env.get_pretty_env_info": EnvInfoEarly,
              "lm_eval.evaluator.get_git_commit_hash": EnvInfoEarly,
              "lm_eval.loggers.utils.get_commit_from_path": EnvInfoEarly,
              "transformers.modeling_utils.safe_open": strided_shards_with_pread,
              "transformers.distributed.mixin.apply_tensor_parallelism": _tp_plan_without_stubs,
              load: lambda: memoize_task_loading(tm, {}),
              **dict.fromkeys(("socket.socket.connect", "socket.socket.connect_ex", "socket.getaddrinfo"),
                              lambda: block_network([]))}
    assert set(blocks) <= set(compat.TARGETS), set(blocks) - set(compat.TARGETS)
    for key, block in blocks.items():
        with contextlib.suppress(KeyError), block():
            inside = _originals()
            if key == load:
                assert "load" in vars(tm)
            else:
                assert inside[key] is not before[key], key
            raise KeyError(key)  # leaving by an exception restores too
        assert _originals() == before, key
        assert "load" not in vars(tm)


def test_a_missing_private_name_of_an_instance_target_is_refused():
    """An ``instance`` target is there only while the class's code still names every private attribute mpitp sets."""
    there = compat.TARGETS["lm_eval.tasks.TaskManager"]
    gone = compat.Target("lm-eval", "lm_eval.tasks", "TaskManager", compat.LM_EVAL, "mpitp.x", kind="instance",
                         names=("_index", "_no_such_index"))
    assert compat.missing({"a": there}) == []
    lines = compat.missing({"b": gone})
    assert len(lines) == 1 and "_no_such_index" in lines[0] and "mpitp.x" in lines[0], lines


def test_instance_patches_are_undone_on_that_instance_only():
    """The leader's mirrored forward and the greedy head are set on one model and put back, the class untouched."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    cls_forward, head = type(model).forward, model.get_output_embeddings()
    with contextlib.suppress(KeyError), compat.replaced("torch.nn.Module.forward", lambda **kw: 1, on=model):
        assert model.forward() == 1 and type(model).forward is cls_forward
        raise KeyError
    assert "forward" not in vars(model) and type(model).forward is cls_forward
    other = torch.nn.Identity()
    with contextlib.suppress(KeyError), compat.output_head_replaced(model, other) as original:
        assert original is head and model.get_output_embeddings() is other
        raise KeyError
    assert model.get_output_embeddings() is head and head in dict(model.named_children()).values()


def test_prefix_sharing_registers_its_own_attention_and_leaves_sdpa_alone():
    """Tree attention runs under its own name on mpitp's model; transformers' "sdpa" stays the original for every
    other model in the process (a training job calling mpitp.evaluate keeps its attention)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mpitp.replica import prefix_probe
    from mpitp.replica.shard import ReplicaShard

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    mine = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    other = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    layout = types.SimpleNamespace(tp=1, pp=1, last_stage=True, first_stage=True, rank=0)
    shard = ReplicaShard(mine, layout, "cpu")
    assert prefix_probe.check_sharing(shard) is None and shard.share
    assert mine.config._attn_implementation == compat.TREE_ATTENTION
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert other.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():  # the tree model without a tree computes exactly what plain sdpa does
        assert torch.equal(mine(input_ids=ids).logits, other(input_ids=ids).logits)


def test_model_source_is_read_as_syntax_not_lines():
    """The head steps come from the forward's syntax tree: a statement over several lines (which a line-by-line
    reader saw as three unreadable pieces and no head call) is one multiplication after the head."""
    from transformers import AutoConfig, LlamaForCausalLM

    from mpitp.replica.logits import head_transform

    class Scaled(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(
                hidden_states  # logits = logits * 1000 (a comment, not a step)
            ) * self.config.logit_scale
            return logits

    cfg = AutoConfig.from_pretrained(MODEL)
    cfg.logit_scale = 0.25
    t = head_transform(Scaled(cfg))
    assert t.unknown == [] and t.logits == [("mul", 0.25)] and t.hidden == [], (t.unknown, t.describe())


def test_a_module_before_the_head_is_a_hidden_step_and_scores_the_models_logits():
    """``self.decoder(self.lm_head(hidden_states))`` (ModernBERT-decoder: a prediction head of dense, activation and
    norm before the vocabulary projection) is read as a hidden-state step; the vocab-parallel head then computes the
    model's own logits (one rank: the whole vocabulary)."""
    import torch
    from transformers import AutoConfig, ModernBertDecoderForCausalLM

    from mpitp.replica.logits import head_transform
    from mpitp.replica.scoring import TPOps, VocabParallelHead

    cfg = AutoConfig.for_model("modernbert-decoder", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = ModernBertDecoderForCausalLM(cfg).eval()
    t = head_transform(model)
    assert t.unknown == [] and t.hidden == [("module", model.lm_head)] and t.logits == [], t.describe()
    ids = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        head = VocabParallelHead.from_model(model, TPOps())
        ours = head.local_logits(out.hidden_states[-1].reshape(10, -1))
    torch.testing.assert_close(ours, out.logits.reshape(10, -1).float(), rtol=0, atol=1e-5)


def test_the_supported_ranges_are_pyprojects():
    """The range a refusal names is the one pip enforces."""
    import tomllib

    with open(os.path.join(HERE, "..", "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    for package, supported in (("lm-eval", compat.LM_EVAL), ("transformers", compat.TRANSFORMERS),
                               ("torch", compat.TORCH), ("click", compat.CLICK)):
        assert f"{package}{supported}" in deps, (package, supported, deps)
    with open(os.path.join(HERE, "..", "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["requires-python"] == compat.PYTHON
