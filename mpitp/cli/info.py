"""``mpitp info``: the layout table, so users can check a launch before spending an allocation on it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import click

from mpitp.cli.options import runtime_options
from mpitp.results.texttable import format_table

if TYPE_CHECKING:
    from mpitp.parallel.runtime import Runtime

log = logging.getLogger("mpitp")


@click.command(name="info")
@runtime_options
@click.option("--model", default=None, help="With --pp: print which decoder layers each stage of this model holds.")
@click.option("--hf-assets", "--hf_assets", "hf_assets", default=None,
              help="A torch DCP --model's config.json folder (as mpitp eval --hf-assets).")
def info_command(tp: int, pp: int, device: str | None, threads: int | None, timeout: float, log_all_ranks: bool,
                 iface: str | None, model: str | None, hf_assets: str | None) -> None:
    """Print the dp x pp x tp layout, the nodes with the address each uses, the MPI library and the torch backend
    (rank 0 prints)."""
    if hf_assets and not model:
        raise click.UsageError("--hf-assets goes with --model (a torch DCP checkpoint folder)")
    run_info(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout, log_all_ranks=log_all_ranks,
             model=model, iface=iface, hf_assets=hf_assets)


def layout_rows(rt: Runtime) -> list[dict] | None:
    """Gather one row per rank on global rank 0 (None elsewhere)."""
    from mpitp.parallel import comm as mpicomm
    from mpitp.parallel.netaddr import node_network

    lay = rt.layout
    address, iface = node_network()
    row = dict(rank=rt.world.rank, node=rt.world.node_name, node_index=rt.world.node_index,
               address=address if iface is None else f"{address} ({iface})",
               local_rank=rt.world.local_rank, dp_rank=lay.dp_rank, pp_rank=lay.pp_rank, tp_rank=lay.tp_rank,
               role="leader" if lay.is_leader else ("stage-leader" if lay.tp_rank == 0 else "worker"),
               device=rt.device, threads=rt.threads)
    return mpicomm.gather_obj(row, rt.world.comm, root=0, timeout=rt.timeout, phase="info gather")


def _span(values) -> str:
    """``0-3`` for a run of integers, ``0,2`` otherwise."""
    values = sorted(set(values))
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def node_rows(rows: list[dict]) -> list[dict]:
    """One row per node: its ranks, the address it uses for traffic with other nodes, and which DP groups, pipeline
    stages and TP groups live there (a TP group is named ``dp.stage``; it never spans nodes)."""
    out = []
    for index in sorted({r["node_index"] for r in rows}):
        mine = [r for r in rows if r["node_index"] == index]
        out.append(dict(node=mine[0]["node"], ranks=f"{len(mine)} ({_span(r['rank'] for r in mine)})",
                        address=mine[0]["address"], dp_groups=_span(r["dp_rank"] for r in mine),
                        pp_stages=_span(r["pp_rank"] for r in mine),
                        tp_groups=" ".join(sorted({f"{r['dp_rank']}.{r['pp_rank']}" for r in mine}))))
    return out


def _stage_split(rt: Runtime, model: str, hf_assets: str | None = None) -> str | None:
    """The layer split of ``model`` over the stages (checked like ``mpitp eval`` checks it; a torch DCP folder's
    config from ``hf_assets``)."""
    from mpitp.parallel.runtime import agree
    from mpitp.replica.loading import load_config
    from mpitp.replica.pipeline import check_pp, describe_split, num_layers

    def check() -> str:
        config = load_config(model, hf_assets=hf_assets)
        check_pp(config, rt.layout.pp)
        return describe_split(num_layers(config), rt.layout.pp)

    return agree(check, rt.world.comm, rt.timeout, "checking the model's stages")


def run_info(tp: int, device: str | None, threads: int | None, timeout: float, log_all_ranks: bool, pp: int = 1,
             model: str | None = None, iface: str | None = None, hf_assets: str | None = None) -> None:
    import torch

    from mpitp.parallel import comm as mpicomm
    from mpitp.parallel.launch import binding_warning, oversubscription_warning
    from mpitp.parallel.runtime import make_launch, replica_world, setup_logging
    from mpitp.parallel.world import mpi_implementation, mpi_library_version, world_from_comm

    rank = world_from_comm().rank
    setup_logging(rank, log_all_ranks)
    launch = make_launch(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout, iface=iface)
    split = _stage_split(launch, model, hf_assets) if model else None
    with replica_world(launch) as rt:
        rows = layout_rows(rt)
        # Prove the TP torch worlds are live: one all_reduce per TP group.
        backend = rt.replica_group.backend if rt.replica_group.active else "none (tp=1)"
        if rt.replica_group.active:
            import torch.distributed as dist

            t = torch.ones(1, device=rt.device)
            dist.all_reduce(t)
            assert int(t.item()) == rt.layout.replica_size
        if rt.world.rank == 0:
            lay = rt.layout
            stages = f" x pp {lay.pp}" if lay.pp > 1 else ""
            print(f"mpitp {__import__('mpitp').__version__}: world {rt.world.size} = dp {lay.dp}{stages} x tp {lay.tp} "
                  f"on {rt.world.n_nodes} node(s), launcher: {rt.world.launcher}")
            impl = mpi_implementation()
            print(f"MPI: {impl} ({mpi_library_version()})")
            crowded = max(((r["node"], sum(1 for x in rows if x["node"] == r["node"])) for r in rows),
                          key=lambda x: x[1])
            w = rt.world
            crowding = oversubscription_warning(crowded[1], w.cores_per_node, impl, w.launcher)
            binding = binding_warning(w.cores_per_node, w.launcher_cores, impl, w.launcher)
            for node, warning in ((crowded[0], crowding), (w.node_name, binding)):
                if warning:
                    print(f"warning: node {node}: {warning}")
            print(f"torch {torch.__version__}, TP backend: {backend}, timeout {rt.timeout:g} s")
            print(format_table(node_rows(rows), ["node", "ranks", "address", "dp_groups", "pp_stages", "tp_groups"]))
            print(format_table(rows, ["rank", "node", "local_rank", "dp_rank", "pp_rank", "tp_rank", "role", "device",
                                      "threads"]))
            if split:
                print(f"pipeline split of {model}: {split}")
        mpicomm.barrier(rt.world.comm, rt.timeout, phase="info end")
