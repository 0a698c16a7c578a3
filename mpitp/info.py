"""``mpitp info``: the layout table, so users can check a launch before spending an allocation on it."""

from __future__ import annotations

import logging

from . import comm as mpicomm
from .runtime import setup_logging, start
from .world import mpi_library_version

log = logging.getLogger("mpitp")


def layout_rows(rt) -> list[dict] | None:
    """Gather one row per rank on global rank 0 (None elsewhere)."""
    lay = rt.layout
    row = dict(rank=rt.world.rank, node=rt.world.node_name, node_index=rt.world.node_index,
               local_rank=rt.world.local_rank, dp_rank=lay.dp_rank, tp_rank=lay.tp_rank,
               role="leader" if lay.is_leader else "worker", device=rt.device, threads=rt.threads)
    return mpicomm.gather_obj(row, rt.world.comm, root=0, timeout=rt.timeout, phase="info gather")


def format_table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines.append("  ".join("-" * widths[c] for c in columns))
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def run_info(tp, device, threads, timeout, log_all_ranks) -> None:
    import torch

    from .world import world_from_comm

    rank = world_from_comm().rank
    setup_logging(rank, log_all_ranks)
    rt = start(tp=tp, device=device, threads=threads, timeout=timeout)
    rows = layout_rows(rt)
    # Prove the TP torch worlds are live: one all_reduce per TP group.
    backend = rt.tp_group.backend if rt.tp_group.active else "none (tp=1)"
    if rt.tp_group.active:
        import torch.distributed as dist

        t = torch.ones(1, device=rt.device)
        dist.all_reduce(t)
        assert int(t.item()) == rt.layout.tp
    if rt.world.rank == 0:
        lay = rt.layout
        print(f"mpitp {__import__('mpitp').__version__}: world {rt.world.size} = dp {lay.dp} x tp {lay.tp} "
              f"on {rt.world.n_nodes} node(s), launcher: {rt.world.launcher}")
        print(f"MPI: {mpi_library_version()}")
        print(f"torch {torch.__version__}, TP backend: {backend}, timeout {rt.timeout:g} s")
        print(format_table(rows, ["rank", "node", "local_rank", "dp_rank", "tp_rank", "role", "device", "threads"]))
    mpicomm.barrier(rt.world.comm, rt.timeout, phase="info end")
