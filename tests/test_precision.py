"""Reduced precision: bf16 and fp16 runs measured against the float32 result on the same requests.

Parity with lm-eval in the same dtype is not the right test: mpitp's log-softmax is float32 over the model's logits,
``HFLM``'s is in the model dtype. So both are measured against lm-eval's float32 log-likelihoods, per task: mpitp's
error must be no larger than lm-eval's, and greedy generations must be the ones lm-eval produces in that dtype (both
take the argmax of the same logits). That holds where mpitp runs the very forward lm-eval runs (tp=1, here dp=2).
With tp=2 the decoder's row-parallel matmuls sum partial products in the model dtype on each rank before the
all-reduce: a different rounding of the body, not of the head, so the tp=2 figures are measured and printed (the
README has them) and only required finite. One MPI launch: a job file with one run per dtype and layout.
"""

from __future__ import annotations

import math

import pytest

from support import STORIES
from support.mpi import explain, run_mpi
from support.parity import mpitp_requests, reference_requests

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # every test here launches mpiexec

TASKS = ["arc_easy_local", "lambada_openai_local", "wikitext_local", "gsm8k_local"]
LIMIT = 3
GEN_KWARGS = "max_gen_toks=24"
DTYPES = ["bfloat16", "float16"]
# In bf16 the decoder body itself rounds differently with another batch composition (mpitp's token-balanced chunks over
# dp=2 are not lm-eval's batches): measured, arc_easy's mean error was 3.10e-3 for mpitp and 2.65e-3 for lm-eval while
# the float32 log-softmax made lambada's and wikitext's clearly smaller. Per task the head must not make things worse
# beyond that body noise; summed over the tasks mpitp's error must be no larger than lm-eval's.
BODY_SLACK = 1.25


def _lm_eval(dtype: str, include: str, tm):
    import lm_eval

    res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={STORIES},dtype={dtype}", tasks=TASKS,
                                  limit=LIMIT, batch_size=4, device="cpu", gen_kwargs=GEN_KWARGS, log_samples=True,
                                  bootstrap_iters=0, task_manager=tm)
    return reference_requests(res["samples"])


def _errors(truth: dict, got: dict, task: str) -> tuple[float, float]:
    """(mean, max) |d ll| relative to max(1, |ll|) over the task's scored requests."""
    ds = [abs(got[k][0] - v[0]) / max(1.0, abs(v[0])) for k, v in truth.items()
          if k[0] == task and not math.isnan(v[0])]
    return sum(ds) / len(ds), max(ds)


@pytest.fixture(scope="module")
def measured(test_tasks, tmp_path_factory):
    import torch
    import yaml
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(2)
    tm = TaskManager(include_path=test_tasks)
    refs = {d: _lm_eval(d, test_tasks, tm) for d in ["float32", *DTYPES]}
    tmp = tmp_path_factory.mktemp("precision")
    runs = [dict(name=f"stories-{d}-tp{tp}", dtype=d, tp=tp, output=str(tmp / f"{d}-tp{tp}.h5"))
            for d in DTYPES for tp in (1, 2)]
    job = tmp / "precision.yaml"
    job.write_text(yaml.safe_dump(dict(defaults=dict(model=str(STORIES), tasks=TASKS, include_path=test_tasks,
                                                     limit=LIMIT, batch_size=4, gen_kwargs=GEN_KWARGS),
                                       runs=runs), sort_keys=False))
    proc = run_mpi(2, ["run", str(job)], timeout=1200)
    assert proc.returncode == 0, explain(proc)
    got = {(d, tp): mpitp_requests(str(tmp / f"{d}-tp{tp}.h5"), TASKS) for d in DTYPES for tp in (1, 2)}
    return refs, got


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduced_precision_error_no_larger_than_lm_eval(dtype, measured):
    refs, got = measured
    truth = refs["float32"]
    print(f"\n{dtype} vs float32 lm-eval, relative |d ll| (mean / max) per task:")
    failures, totals = [], [0.0, 0.0]
    for task in TASKS:
        if task == "gsm8k_local":
            continue
        lm_mean, lm_max = _errors(truth, refs[dtype], task)
        tp1_mean, tp1_max = _errors(truth, got[dtype, 1], task)
        tp2_mean, tp2_max = _errors(truth, got[dtype, 2], task)
        print(f"  {task:22s} lm-eval hf {lm_mean:.2e} / {lm_max:.2e}   mpitp tp=1 {tp1_mean:.2e} / {tp1_max:.2e}   "
              f"mpitp tp=2 {tp2_mean:.2e} / {tp2_max:.2e}")
        totals[0] += lm_mean
        totals[1] += tp1_mean
        if not tp1_mean <= BODY_SLACK * lm_mean:
            failures.append(f"{task}: mpitp tp=1 mean error {tp1_mean:.3g} > {BODY_SLACK} x lm-eval's {lm_mean:.3g}")
        if not math.isfinite(tp2_mean):
            failures.append(f"{task}: mpitp tp=2 error not finite")
    if not totals[1] <= totals[0]:
        failures.append(f"mpitp tp=1 error summed over tasks {totals[1]:.3g} > lm-eval's {totals[0]:.3g}")
    gens = {k: v[2] for k, v in refs[dtype].items() if k[0] == "gsm8k_local"}
    for tp in (1, 2):
        same = sum(got[dtype, tp][k][2] == g for k, g in gens.items())
        vs32 = sum(got[dtype, tp][k][2] == truth[k][2] for k in gens)
        print(f"  gsm8k_local generations, mpitp tp={tp}: {same}/{len(gens)} equal to lm-eval hf {dtype}, "
              f"{vs32}/{len(gens)} equal to float32")
        if tp == 1 and same != len(gens):
            failures.append(f"tp=1 greedy generations differ from lm-eval's in {dtype}")
    assert not failures, "\n".join(failures)
