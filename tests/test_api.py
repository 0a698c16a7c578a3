"""mpitp.evaluate inside a running MPI training job: no reload, state restored, equal to the CLI on the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from support import REPO, STORIES
from support.mpi import explain, run_mpi, run_mpi_script
from support.parity import compare_requests, mpitp_requests

pytestmark = pytest.mark.mpi  # every test here launches mpiexec

TASKS = ["mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen"]
DEMO_TASKS = str(REPO / "mpitp" / "tasks" / "demo" / "tasks")


@pytest.mark.slow
def test_evaluate_between_training_steps(shared_dir, tmp_path):
    proc = run_mpi_script(4, Path(__file__).parent / "mpi" / "api_train_eval.py",
                          [str(STORIES), DEMO_TASKS, str(tmp_path)], timeout=400)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("done") == 4
    # lm-eval's warnings about a pre-built model describe mpitp's call, not the user's run (each rank printed two)
    assert "already-initialized" not in proc.stderr and "is not of type `str`" not in proc.stderr, explain(proc)
    one = mpitp_requests(str(tmp_path / "eval1.h5"), TASKS)
    two = mpitp_requests(str(tmp_path / "eval2.h5"), TASKS)
    assert set(one) == set(two) and len(one) > 20
    import h5py

    with h5py.File(tmp_path / "eval1.h5", "r") as f:  # the dtype the model was loaded in, not "auto"
        assert f.attrs["dtype"] == "float32", f.attrs["dtype"]
    # The weights changed between the calls, so the numbers must too: evaluate saw the live model, not a copy.
    d = [abs(one[k][0] - two[k][0]) for k in one if not np.isnan(one[k][0])]
    assert max(d) > 1e-4

    # mpitp eval on the weights saved right after the second call gives the second call's numbers.
    out = tmp_path / "cli.h5"
    cli = run_mpi(4, ["eval", "--model", str(tmp_path / "saved-dp0"), "--tokenizer", str(STORIES), "--tasks",
                      ",".join(TASKS), "--include-path", DEMO_TASKS, "--limit", "6", "--batch-size", "2",
                      "--bootstrap-iters", "0", "--gen-kwargs", "max_gen_toks=12", "--dtype", "float32",
                      "--tp", "2", "--output", str(out)], timeout=300)
    assert cli.returncode == 0, explain(cli)
    worst, problems = compare_requests(two, mpitp_requests(str(out), TASKS))
    assert not problems, problems[:10]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "saved-dp0" / "model.safetensors"))
    b = load_file(str(tmp_path / "saved-dp1" / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    print(f"evaluate twice between SGD steps (4 ranks, tp=2): {len(one)} requests per call, the calls differ by up "
          f"to {max(d):.3g} in ll; mpitp eval on the saved weights vs the 2nd call: max relative |d ll| {worst:.2e}")


def test_bad_settings_are_refused_on_every_rank_and_one_rank_failing_ends_the_job(tmp_path):
    """Without mpitp's excepthook: an unknown task and ``limit=0`` found by rank 0 alone once the other rank served
    left it in a collective for the deadline (an hour by default); now both raise UsageError on every rank before any
    work. A ``samples`` index past the task's end, which rank 0 meets only once lm-eval builds the requests, is relayed
    to the other rank (its TP worker), which raises it too (it waited for rank 0 for ever when the caller caught it),
    as is a chat template's name the tokenizer lacks (met as lm-eval's run began, outside the relay: a hang too);
    so is an ``output`` that exists where rank 0 writes it, with ``overwrite=False``: each rank looked for it itself,
    and a rank in a working folder without it waited for rank 0's verdict until the deadline (here it took the next
    call's verdict for this one's and ran on out of step, rank 0 'went on'). The next call scores.
    Then rank 1 leaves ``with mpitp.start()`` with an error while rank 0 waits for it: the job ends at once, naming it
    (before: rank 1 waited in MPI_Finalize and rank 0 in the collective, for ever)."""
    proc = run_mpi_script(2, Path(__file__).parent / "mpi" / "api_refusals.py", [str(STORIES), DEMO_TASKS,
                                                                                 str(tmp_path)], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "went on" not in out, explain(proc)
    for rank in (0, 1):
        assert f"rank {rank} refused: unknown task 'no_such_task'" in out, explain(proc)
        assert f"rank {rank} refused: mpitp.evaluate: limit=0: must be > 0, got 0" in out, explain(proc)
        assert f"rank {rank} refused: --samples mpitp_demo_mc: document 99 does not exist" in out, explain(proc)
        assert (f"rank {rank} refused: --apply_chat_template: the tokenizer cannot apply a chat template: The "
                "specified chat template 'nope' is not available") in out, explain(proc)
        assert f"rank {rank} refused: mpitp.evaluate: output out.h5 already exists (pass overwrite=True)" in out, \
            explain(proc)
        assert f"rank {rank} scored after the refusals: {rank == 0}" in out, explain(proc)
    assert "[rank 1] mpitp: fatal ValueError: planted on rank 1 only" in out, explain(proc)
    assert proc.elapsed < 60, proc.elapsed
