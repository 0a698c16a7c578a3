"""Wrong numbers are refused, never written: the head check after loading, NaN/inf logits, cache-forking generate
modes with TP workers or stages. Real mpiexec, real stories260K, real lm-eval tasks on ../shared data."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from support import STORIES
from support.mpi import explain, run_mpi, run_mpi_script

pytestmark = pytest.mark.mpi  # every test here launches mpiexec

MPI_DIR = Path(__file__).resolve().parent / "mpi"


def _eval(n, extra, test_tasks, out, tasks="arc_easy_local", env=None):
    return run_mpi(n, ["eval", "--model", str(STORIES), "--tasks", tasks, "--include-path", test_tasks, "--limit",
                       "2", "--bootstrap-iters", "0", "--output", str(out), "--timeout", "120", *extra], env=env,
                   timeout=600)


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_altered_head_is_refused(layout, test_tasks, tmp_path):
    """The head's weight shard scaled by 1% after loading (the env hook): the run is refused with one line naming
    the model type and the difference, exit 2 everywhere, nothing written."""
    out = tmp_path / "out.h5"
    proc = _eval(2, layout, test_tasks, out, env={"MPITP_TEST_ALTER_HEAD": "1.01"})
    assert proc.returncode == 2, explain(proc)
    lines = [ln for ln in proc.stderr.splitlines() if "head check failed" in ln]
    assert len(lines) == 1, explain(proc)
    assert "model type 'llama'" in lines[0] and "differs from the model's own logits by up to" in lines[0], lines
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    print(lines[0], f"({proc.elapsed:.1f} s)")


def test_api_model_with_unknown_logit_step_is_refused(test_tasks):
    """mpitp.evaluate on a model whose own forward scales its logits (an architecture step mpitp does not know):
    every replica (dp=2) refuses."""
    proc = run_mpi_script(2, MPI_DIR / "api_altered_head.py", [str(STORIES), test_tasks], timeout=600)
    assert proc.returncode == 0, explain(proc)
    refused = [ln for ln in proc.stdout.splitlines() if "REFUSED: head check failed for model type 'llama'" in ln]
    assert len(refused) == 2 and {ln.split(":")[0] for ln in refused} == {"rank 0", "rank 1"}, explain(proc)


def test_skip_head_check_and_nan_logits_refused_naming_the_request(test_tasks, tmp_path):
    """NaN logits (an fp16 overflow, simulated) past --skip-head-check: one line naming task, doc and request."""
    out = tmp_path / "nan.h5"
    proc = _eval(2, ["--tp", "2", "--skip-head-check"], test_tasks, out, env={"MPITP_TEST_ALTER_HEAD": "nan"})
    assert proc.returncode == 2, explain(proc)
    assert "--skip-head-check: the vocab-parallel head is not compared" in proc.stderr, explain(proc)
    lines = [ln for ln in proc.stderr.splitlines() if "non-finite log-likelihood" in ln]
    assert len(lines) == 1 and "task arc_easy_local, doc 0, request 0" in lines[0], explain(proc)
    assert "Traceback" not in proc.stderr and "IndexError" not in proc.stderr


def test_nan_logits_in_greedy_generation_refused(test_tasks, tmp_path):
    out = tmp_path / "nan-gen.h5"
    proc = _eval(2, ["--tp", "2", "--skip-head-check", "--gen-kwargs", "max_gen_toks=4"], test_tasks, out,
                 tasks="gsm8k_local", env={"MPITP_TEST_ALTER_HEAD": "nan"})
    assert proc.returncode == 2, explain(proc)
    assert "non-finite logits (NaN/inf) while generating" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr and "IndexError" not in proc.stderr


@pytest.mark.parametrize("kwargs", ["num_beams=2", "prompt_lookup_num_tokens=3", "penalty_alpha=0.6,top_k=4"])
def test_cache_forking_gen_kwargs_refused_at_checks(kwargs, test_tasks, tmp_path):
    out = tmp_path / "beams.h5"
    proc = _eval(2, ["--tp", "2", "--gen-kwargs", kwargs], test_tasks, out, tasks="gsm8k_local")
    assert proc.returncode == 2, explain(proc)
    first = kwargs.split(",")[0]
    assert f"mpitp: error: --gen-kwargs: {first} is not supported with tp=2 pp=1" in proc.stderr, explain(proc)
    assert "Loading weights" not in proc.stderr  # refused before loading
    assert not out.exists()


def test_task_yaml_num_beams_refused_at_runtime(test_tasks, tmp_path):
    """A task whose own YAML asks for beams passes the checks (lm-eval reads it later): refused when it reaches
    generation with TP workers, one line, exit 2."""
    inc = tmp_path / "tasks"
    inc.mkdir()
    cfg = yaml.safe_load((Path(test_tasks) / "gsm8k_local.yaml").read_text())
    cfg["task"] = "gsm8k_beams_local"
    cfg["generation_kwargs"] = {"until": ["Question:"], "do_sample": False, "num_beams": 2, "max_gen_toks": 4}
    (inc / "gsm8k_beams_local.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "yaml-beams.h5"
    proc = run_mpi(2, ["eval", "--model", str(STORIES), "--tasks", "gsm8k_beams_local", "--include-path", str(inc),
                       "--limit", "1", "--bootstrap-iters", "0", "--tp", "2", "--output", str(out), "--timeout",
                       "120"], timeout=600)
    assert proc.returncode == 2, explain(proc)
    assert "generation_kwargs: num_beams=2 is not supported with tp=2 pp=1" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr
