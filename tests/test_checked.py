"""Issue 28, item 3: :func:`mpitp.evaluation.checks.check_all` returns a :class:`Checked` that owns the claim on the
output and gives it back on leaving its ``with`` block, however the block ends (a sweep's next checkpoint, or the
user's next run, must be able to claim the file)."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest

from mpitp.errors import UsageError
from mpitp.evaluation.checks import Checked
from mpitp.results.claim import claim_output, claim_path


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "raises"])
def test_checked_gives_back_its_claim(tmp_path, fails):
    out = str(tmp_path / "run.h5")
    with pytest.raises(RuntimeError) if fails else nullcontext():
        with Checked(out, "tok", claim=claim_output(out)) as checked:
            with pytest.raises(UsageError, match="is being written by another mpitp process"):
                claim_output(out)  # held while the run lasts
            if fails:
                raise RuntimeError("the load failed")
    assert checked.claim is None and not os.path.lexists(claim_path(out))
    claim_output(out).release()  # free for the next run
    checked.release()  # idempotent

