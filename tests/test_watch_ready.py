"""``--watch``: when a checkpoint counts as written, what happens to one that failed, to a watched folder that goes,
and which ``--watch-idle`` is refused.

The checkpoints are written by ``save_pretrained`` (a tiny random Llama; shards with a small ``max_shard_size``), then
cut back to what a training job has written at some moment: Hugging Face writes ``config.json``, the shards one by
one, the ``*.index.json`` last. The scanner is rank 0's and MPI-free; one launch checks the loop around it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from mpitp.jobs.watch import Scanner, _readiness


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama saved whole (one ``model.safetensors``) and in seven shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=64))
    d = tmp_path_factory.mktemp("saved")
    model.save_pretrained(d / "single")
    model.save_pretrained(d / "sharded", max_shard_size="5KB")
    assert len(list((d / "sharded").glob("model-*-of-00007.safetensors"))) == 7
    return {"single": d / "single", "sharded": d / "sharded"}


def _partial(src: Path, dst: Path, names) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy2(src / n, dst / n)
    return dst


def _scans(scanner: Scanner, n: int = 3) -> list[list[str]]:
    """``n`` scans, as the watch makes them :data:`mpitp.jobs.watch.POLL_S` apart (the files do not change)."""
    return [scanner.stable() for _ in range(n)]


@pytest.fixture
def warnings_of_mpitp():
    """The warnings the ``mpitp`` logger emits (it does not propagate once a launch set it up)."""
    got: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())
    logger = logging.getLogger("mpitp")
    logger.addHandler(handler)
    yield got
    logger.removeHandler(handler)


def test_a_sharded_save_caught_mid_write_is_ready_once_every_shard_and_the_index_exist(saved, tmp_path):
    src, ck = saved["sharded"], tmp_path / "ck"
    step = _partial(src, ck / "step-5", ["config.json", "model-00001-of-00007.safetensors"])
    scanner = Scanner(str(ck))
    assert _scans(scanner) == [[], [], []]  # the old rule: one *.safetensors and no index = complete
    assert scanner.waiting == {str(step): "model-00002-of-00007.safetensors not written yet (and 5 more)"}
    _partial(src, step, [f"model-0000{i}-of-00007.safetensors" for i in range(2, 8)])
    assert _scans(scanner) == [[], [], []]
    assert scanner.waiting[str(step)] == "every shard but no *.index.json yet (written last)"
    with open(src / "model-00007-of-00007.safetensors", "rb") as f:  # the last shard, half written
        data = f.read()
    (step / "model-00007-of-00007.safetensors").write_bytes(data[: len(data) // 2])
    _partial(src, step, ["model.safetensors.index.json"])
    assert _scans(scanner) == [[], [], []]
    assert scanner.waiting[str(step)].startswith("model-00007-of-00007.safetensors: ")
    _partial(src, step, ["model-00007-of-00007.safetensors", "generation_config.json"])
    assert _scans(scanner) == [[], [str(step)], [str(step)]]  # unchanged over two scans, then handed out
    assert scanner.waiting == {}


def test_an_index_that_lists_a_shard_not_written_yet_is_not_ready(saved, tmp_path):
    step = _partial(saved["sharded"], tmp_path / "step-1", ["config.json", "model.safetensors.index.json",
                                                            "model-00001-of-00007.safetensors"])
    assert _readiness(str(step))[0] is None


def test_a_truncated_safetensors_is_never_ready_however_long_its_size_stays(saved, tmp_path):
    src = saved["single"] / "model.safetensors"
    data = src.read_bytes()
    ck = tmp_path / "ck"
    step = _partial(saved["single"], ck / "step-6", ["config.json"])
    scanner = Scanner(str(ck))
    header_end = 8 + int.from_bytes(data[:8], "little")
    for cut, why in ((len(data) - 1, f"{len(data) - 1} bytes where its header declares {len(data)}"),
                     (header_end - 10, f"{header_end - 10} bytes, its header alone needs {header_end}"),
                     (5, "5 bytes, shorter than the header length")):
        (step / "model.safetensors").write_bytes(data[:cut])
        assert _scans(scanner) == [[], [], []], cut
        assert scanner.waiting == {str(step): f"model.safetensors: {why}"}
    (step / "model.safetensors").write_bytes(data)
    assert _scans(scanner, 2) == [[], [str(step)]]


def test_safetensors_headers_that_are_not_whole_or_too_long(saved, tmp_path):
    from mpitp.jobs.watch import safetensors_incomplete

    data = (saved["single"] / "model.safetensors").read_bytes()
    f = tmp_path / "x.safetensors"
    assert safetensors_incomplete(str(saved["single"] / "model.safetensors")) == ""
    f.write_bytes(data + b"\0")
    assert safetensors_incomplete(str(f)) == f"{len(data) + 1} bytes where its header declares {len(data)}"
    f.write_bytes((2**40).to_bytes(8, "little") + data[8:])  # eight stray bytes must not make it read 1 TB
    assert safetensors_incomplete(str(f)) == f"a header of {2**40} bytes claimed (over 100 MB: not read)"
    f.write_bytes((12).to_bytes(8, "little") + b'{"a": [1, 2' + b"\0" * 64)
    assert safetensors_incomplete(str(f)) == "its header is not valid JSON"
    f.write_bytes((2).to_bytes(8, "little") + b"{}")  # no tensor at all: whole, and empty
    assert safetensors_incomplete(str(f)) == ""


def test_a_failed_checkpoint_is_looked_at_again_once_its_files_change(saved, tmp_path):
    ck = tmp_path / "ck"
    step = str(_partial(saved["single"], ck / "step-7", ["config.json", "model.safetensors"]))
    scanner = Scanner(str(ck))
    assert _scans(scanner, 2) == [[], [step]]
    scanner.settle(step, failed=True)
    assert _scans(scanner) == [[], [], []]  # the files it failed with: not evaluated again
    config = json.loads((ck / "step-7" / "config.json").read_text())
    (ck / "step-7" / "config.json").write_text(json.dumps({**config, "rope_theta": 20000.0}))  # the writer fixed it
    assert _scans(scanner, 2) == [[], [step]]
    scanner.settle(step, failed=False)
    os.utime(ck / "step-7" / "config.json", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert _scans(scanner) == [[], [], []]  # evaluated: done for this watch, whatever happens to its files


def test_a_watched_folder_that_disappears_counts_as_empty_with_one_warning(saved, tmp_path, warnings_of_mpitp):
    ck = tmp_path / "ck"
    step = str(_partial(saved["single"], ck / "step-1", ["config.json", "model.safetensors"]))
    scanner = Scanner(str(ck))
    assert _scans(scanner, 2) == [[], [step]]
    shutil.rmtree(ck)
    assert _scans(scanner) == [[], [], []]
    assert warnings_of_mpitp == [f"watch: {ck} cannot be read (No such file or directory): counted as empty until "
                                 "it comes back or --watch-idle runs out"]
    step2 = str(_partial(saved["single"], ck / "step-2", ["config.json", "model.safetensors"]))
    assert _scans(scanner, 2) == [[], [step2]]  # back: its new checkpoints are found
    assert len(warnings_of_mpitp) == 1


def test_a_torch_dcp_step_is_ready_once_its_metadata_exists(tmp_path):
    step = tmp_path / "ck" / "step-10"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"\0" * 64)
    scanner = Scanner(str(tmp_path / "ck"))
    assert _scans(scanner) == [[], [], []]
    assert scanner.waiting == {str(step): "no .metadata yet (torch DCP writes it last)"}
    (step / ".metadata").write_bytes(b"\0" * 16)
    assert _scans(scanner, 2) == [[], [str(step)]]


def test_watch_idle_that_would_never_end_is_refused():
    from mpitp.errors import UsageError
    from mpitp.jobs.watch import MAX_IDLE_S, check_idle

    for value, message in ((float("inf"), "--watch-idle: must be a finite number of seconds, got inf"),
                           (1e12, "--watch-idle: must be at most 604800 s (a week), got 1e+12")):
        with pytest.raises(UsageError) as info:
            check_idle(value)
        assert str(info.value) == message
    check_idle(MAX_IDLE_S)
    check_idle(0.5)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_watch_waits_for_half_written_steps_retries_a_fixed_one_and_outlives_its_folder(shared_dir, tmp_path):
    """One launch: step-5, a sharded save caught after its first shard, is evaluated once it is whole (not failed at
    once); step-6, whose config names no known architecture, fails, and is evaluated again when the writer fixes its
    config; the watched folder then goes (``rm -rf``): one warning, the idle time runs out, the summary is written."""
    from transformers import AutoModelForCausalLM

    from mpitp.tasks.demo import demo_tasks_dir
    from support.launch import Launch
    from support.mpi import run_mpi
    from test_sweep import _complete, _wait_for

    stories = shared_dir / "models" / "stories260K"
    full, ck, out = tmp_path / "full", tmp_path / "ck", tmp_path / "out"
    AutoModelForCausalLM.from_pretrained(stories).save_pretrained(full, max_shard_size="600KB")
    tokenizer = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    for n in tokenizer:
        shutil.copyfile(stories / n, full / n)
    step5 = _partial(full, ck / "step-5", ["config.json", "model-00001-of-00002.safetensors", *tokenizer])
    step6 = _partial(stories, ck / "step-6", ["model.safetensors", *tokenizer])
    config = json.loads((stories / "config.json").read_text())
    (step6 / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    args = ["eval", "--watch", str(ck), "--watch-idle", "20", "--include-path", demo_tasks_dir(), "--tasks",
            "mpitp_demo_mc", "--limit", "3", "--output", f"{out}/{{name}}.h5"]
    with Launch(1, args, cwd=str(tmp_path)) as job:
        assert _wait_for(lambda: f"checkpoint {step6} failed" in job.stderr, 300, job.proc), job.explain()
        _partial(full, step5, ["model-00002-of-00002.safetensors", "model.safetensors.index.json"])
        shutil.copyfile(stories / "config.json", step6 / "config.json")
        assert _wait_for(lambda: _complete(out / "step-5.h5") and _complete(out / "step-6.h5"), 300, job.proc), \
            job.explain()
        shutil.rmtree(ck)
        proc = job.finish(300)
    assert proc.returncode == 0, job.explain()
    rows = json.loads((out / "sweep-summary.json").read_text())["checkpoints"]
    assert sorted((r["name"], r["status"]) for r in rows) == [("step-5", "complete"), ("step-6", "complete")]
    assert f"checkpoint {step5} failed" not in proc.stderr and "Traceback" not in proc.stderr, job.explain()
    assert proc.stderr.count(f"watch: {ck} cannot be read (No such file or directory)") == 1, job.explain()

    # --watch-idle that would never end: one line, before any checkpoint is looked at
    ck.mkdir()
    proc = run_mpi(1, [*args[:4], "1e12", *args[5:]], timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "mpitp: error: --watch-idle: must be at most 604800 s (a week), " \
        "got 1e+12"


def test_a_checkpoint_another_user_made_in_a_shared_watched_folder_is_skipped(saved, tmp_path, monkeypatch,
                                                                              warnings_of_mpitp):
    """In a watched folder others may write (sticky scratch, a group's space), a step-9 folder planted by uid 4242
    was evaluated into the summary, and with --trust_remote_code its ``auto_map`` Python ran as this user; now only
    folders of this user, root or the watched folder's owner are evaluated, the rest skipped with one warning."""
    ck = tmp_path / "ck"
    mine = str(_partial(saved["single"], ck / "step-1", ["config.json", "model.safetensors"]))
    planted = str(_partial(saved["single"], ck / "step-9", ["config.json", "model.safetensors"]))
    real = os.lstat

    def lstat(path, *args, **kwargs):  # step-9 as another user made it (no chown needed to run as anyone)
        st = real(path, *args, **kwargs)
        return os.stat_result((*st[:4], 4242, *st[5:])) if os.fspath(path) == planted else st

    monkeypatch.setattr(os, "lstat", lstat)
    scanner = Scanner(str(ck))
    assert _scans(scanner) == [[], [mine], [mine]]
    said = f"watch: skipped {planted}: made by uid 4242, neither this user"
    assert len(warnings_of_mpitp) == 1 and warnings_of_mpitp[0].startswith(said), warnings_of_mpitp
