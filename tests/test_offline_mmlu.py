"""A leaderboard-sized suite offline: ``mpitp eval --tasks mmlu,arc_challenge,boolq,copa --data-dir DATA`` at tp=2
on an MMLU-shaped DATA (57 made-up subjects in the generic layout) plus made-up ARC-Challenge, BoolQ and COPA files:
every request, subtask and group aggregate equal to lm-eval run in-process on the same files (one launch)."""

from __future__ import annotations

import json

import pytest

from support import STORIES
from support.mpi import explain, run_mpi
from support.offline_data import arc_rows, copa_rows, mmlu_dir, mmlu_subjects, small_tasks_dir, write_jsonl
from support.parity import close, compare_metrics, compare_requests, mpitp_requests, reference_requests


@pytest.mark.mpi
@pytest.mark.slow
def test_mmlu_from_data_dir_at_tp2_matches_lm_eval(tmp_path):
    import lm_eval
    import torch

    from mpitp.results.schema import open_h5
    from mpitp.tasks.index import task_manager
    from mpitp.tasks.layout import write_overrides

    data = small_tasks_dir(mmlu_dir(tmp_path / "data", rows=2))
    write_jsonl(data / "allenai/ai2_arc/ARC-Challenge/train.jsonl", arc_rows(3, "shot"))  # 1-shot: the train splits
    write_jsonl(data / "aps/super_glue/copa/train.jsonl", copa_rows(3))
    small = ["arc_challenge", "boolq", "copa"]
    out = tmp_path / "mmlu.h5"
    proc = run_mpi(2, ["eval", "--model", str(STORIES), "--tasks", "mmlu," + ",".join(small), "--data-dir", str(data),
                       "--tp", "2", "--num_fewshot", "1", "--dtype", "float32", "--bootstrap-iters", "0",
                       "--output", str(out)], timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)

    yamls = write_overrides(["mmlu", *small], data, tmp_path / "yamls", num_fewshot=1)
    torch.set_num_threads(2)
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={STORIES},dtype=float32", tasks=["mmlu", *small],
                                  num_fewshot=1, batch_size=1, device="cpu", bootstrap_iters=0, log_samples=True,
                                  task_manager=task_manager(include_path=[str(tmp_path / "yamls")]))
    subtasks = sorted(f"mmlu_{s}" for s in mmlu_subjects())
    assert len(subtasks) == 57 and sorted(yamls) == sorted(subtasks + small)
    worst, problems = compare_requests(reference_requests(ref["samples"]), mpitp_requests(str(out), subtasks + small))
    assert not problems, problems[:5]
    assert not compare_metrics(ref["results"], str(out), subtasks + small)
    with open_h5(str(out)) as f:
        got = json.loads(f.attrs["results_json"])["results"]
    groups = ["mmlu", "mmlu_humanities", "mmlu_other", "mmlu_social_sciences", "mmlu_stem"]
    assert set(got) == set(ref["results"]) == set(subtasks) | set(groups) | set(small)
    for name in groups:
        assert close(got[name]["acc,none"], ref["results"][name]["acc,none"]), name
    for name in subtasks:  # 2 docs each, 1 shot from the subject's dev row
        assert ref["n-samples"][name]["effective"] == 2, name
