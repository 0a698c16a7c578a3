"""Which device a rank computes on: one pure function of what was asked and what the rank sees.

Kept apart from torch so every case is testable without a GPU: ``plan_device(requested, local_rank, visible)``
where ``visible`` is the number of GPUs *this process* sees (``torch.cuda.device_count()``, which already honours
``CUDA_VISIBLE_DEVICES``: a launcher that gives each task one GPU, such as SLURM ``--gpus-per-task=1``, leaves every
rank seeing one, numbered 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpitp.errors import UsageError


@dataclass(frozen=True)
class DevicePlan:
    device: str  # "cpu" or "cuda:<index among the visible GPUs>"
    set_device: bool  # make it the process's current CUDA device (every CUDA rank, also dp-only ones: otherwise
    # each creates a context on GPU 0)
    hide_gpus: bool  # "cpu" asked for on a node with GPUs: hide them (CUDA_VISIBLE_DEVICES="") before CUDA starts,
    # or transformers' distributed loading (tp or pp > 1) picks the accelerator itself and puts shards on cuda:r


def plan_device(requested: str | None, local_rank: int, visible: int | None) -> DevicePlan:
    """``requested`` is ``--device`` (None: a GPU if any is visible, else the CPU); ``visible`` may be None when
    ``requested`` is ``cpu`` (GPUs are not even counted then, so that hiding them still takes effect)."""
    req = (requested or "auto").strip().lower()
    if req == "cpu":
        return DevicePlan("cpu", set_device=False, hide_gpus=True)
    n = visible or 0
    if req == "auto":
        return DevicePlan(f"cuda:{local_rank % n}", True, False) if n else DevicePlan("cpu", False, False)
    if req == "cuda":
        if not n:
            raise UsageError("--device cuda: no CUDA device is visible to this process (torch sees 0; check "
                             "CUDA_VISIBLE_DEVICES and the CUDA build of torch)")
        # Ranks sharing a node share its visible GPUs round robin; with one GPU per task every rank gets cuda:0.
        return DevicePlan(f"cuda:{local_rank % n}", True, False)
    if req.startswith("cuda:"):
        index = req.split(":", 1)[1]
        if not index.isdigit():
            raise UsageError(f"--device {requested}: expected cuda:<index>")
        if int(index) >= n:
            raise UsageError(f"--device {requested}: this process sees {n} CUDA device(s) (indices 0..{n - 1} "
                             f"after CUDA_VISIBLE_DEVICES)" if n else
                             f"--device {requested}: no CUDA device is visible to this process")
        return DevicePlan(req, True, False)
    raise UsageError(f"--device {requested}: expected cpu, cuda or cuda:<index>")
