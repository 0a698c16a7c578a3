"""One torch.distributed world per TP replica, brokered over MPI.

torch.distributed carries only TP tensor traffic. Each TP group is its *own* default torch world (rank = tp_rank,
world size = tp) because transformers' TP loading (``distributed_config=DistributedConfig(tp_size=N)``) builds its
device mesh from the default world and silently ignores a DP x TP mesh. The TP leader opens a TCPStore on an
ephemeral port of the loopback interface (a TP group never spans nodes) and broadcasts the port over the TP MPI
communicator, so users never set ``MASTER_ADDR``/``MASTER_PORT`` and concurrent replicas never collide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from . import comm as mpicomm
from .layout import Layout

LOOPBACK = "127.0.0.1"


@dataclass
class TPGroup:
    """Handle on this rank's TP torch world. ``group`` None means the default world (what we create)."""

    size: int
    rank: int
    backend: str
    device: str
    group: object = None

    @property
    def active(self) -> bool:
        return self.size > 1


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_tp_group(layout: Layout, device: str, timeout: float) -> TPGroup:
    """Initialise torch.distributed for this rank's TP group (no-op for tp=1). Collective over the TP group."""
    backend = backend_for(device)
    if layout.tp == 1:
        return TPGroup(size=1, rank=0, backend=backend, device=device)
    import torch
    import torch.distributed as dist

    # A dead peer must surface as an error, not a hang: NCCL async error handling on.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    td = timedelta(seconds=timeout)
    if layout.is_leader:
        store = dist.TCPStore(LOOPBACK, 0, world_size=layout.tp, is_master=True, timeout=td,
                              wait_for_workers=False)
        port = store.port
    else:
        port = None
    port = mpicomm.bcast_obj(port, layout.tp_comm, root=0, timeout=timeout, phase="TP group rendezvous")
    if not layout.is_leader:
        store = dist.TCPStore(LOOPBACK, port, world_size=layout.tp, is_master=False, timeout=td)
    local = device.split(":", 1)[1] if device.startswith("cuda:") else str(layout.tp_rank)
    # transformers' TP loading reads these to build its mesh from the default world.
    os.environ.update(RANK=str(layout.tp_rank), WORLD_SIZE=str(layout.tp), LOCAL_RANK=local,
                      LOCAL_WORLD_SIZE=str(layout.tp), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend=backend, store=store, rank=layout.tp_rank, world_size=layout.tp,
                            timeout=td, **kwargs)
    return TPGroup(size=layout.tp, rank=layout.tp_rank, backend=backend, device=device)


def destroy_tp_group(group: TPGroup) -> None:
    if group.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
