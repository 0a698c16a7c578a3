"""A leaderboard-sized suite offline: ``mpitp eval --tasks mmlu --data-dir DATA`` at tp=2 on an MMLU-shaped DATA
(57 made-up subjects in the generic layout), every subtask and group aggregate equal to lm-eval run in-process on
the same files."""

from __future__ import annotations

import json

import pytest

from support import STORIES
from support.mpi import explain, run_mpi
from support.offline_data import mmlu_dir, mmlu_subjects
from support.parity import close, compare_metrics


@pytest.mark.mpi
@pytest.mark.slow
def test_mmlu_from_data_dir_at_tp2_matches_lm_eval(tmp_path):
    import lm_eval
    import torch

    from mpitp.results.schema import open_h5
    from mpitp.tasks.index import task_manager
    from mpitp.tasks.layout import write_overrides

    data = mmlu_dir(tmp_path / "data", rows=2)
    out = tmp_path / "mmlu.h5"
    proc = run_mpi(2, ["eval", "--model", str(STORIES), "--tasks", "mmlu", "--data-dir", str(data), "--tp", "2",
                       "--num_fewshot", "1", "--dtype", "float32", "--bootstrap-iters", "0", "--output", str(out)],
                   timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)

    yamls = write_overrides(["mmlu"], data, tmp_path / "yamls", num_fewshot=1)
    torch.set_num_threads(2)
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={STORIES},dtype=float32", tasks=["mmlu"],
                                  num_fewshot=1, batch_size=1, device="cpu", bootstrap_iters=0,
                                  task_manager=task_manager(include_path=[str(tmp_path / "yamls")]))
    subtasks = sorted(f"mmlu_{s}" for s in mmlu_subjects())
    assert len(subtasks) == 57 and sorted(yamls) == subtasks
    assert not compare_metrics(ref["results"], str(out), subtasks)
    with open_h5(str(out)) as f:
        got = json.loads(f.attrs["results_json"])["results"]
    groups = ["mmlu", "mmlu_humanities", "mmlu_other", "mmlu_social_sciences", "mmlu_stem"]
    assert set(got) == set(ref["results"]) == set(subtasks) | set(groups)
    for name in groups:
        assert close(got[name]["acc,none"], ref["results"][name]["acc,none"]), name
    for name in subtasks:  # 2 docs each, 1 shot from the subject's dev row
        assert ref["n-samples"][name]["effective"] == 2, name
