"""A packed projection's shard (``_StridedShard``: GPT-2's ``c_attn``, MPT's ``Wqkv``, Mamba's ``in_proj``) at
tp=2, where torch's chunk list puts it where a plain ``Shard`` would lie (rank 1: rows 2-7 of 12, where it holds 2,
3, 6, 7, 10, 11). ``dcp``: filled from a DCP checkpoint, by the slice reader and by the fallback for chunks it does not
parse, each rank's local tensor must be what ``distribute_tensor`` gives it. ``adapter``: the index a LoRA merge
takes of the whole ``B @ A`` (:func:`mpitp.replica.adapters._local_part`) must pick those same rows.

Run: mpiexec -n 2 python tests/mpi/strided_shards.py DIR dcp|adapter      (DIR: an empty scratch folder)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp_save
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from mpitp.errors import install_excepthook
from mpitp.replica import adapters, dcp_load
from mpitp.replica.dcp_read import SliceReader, read_metadata

from _checks import Checks, say

install_excepthook()
check = Checks()
# name -> (global tensor, split dim, parts): a Linear's [q | k | v] rows, a Conv1D's columns, a packed bias
TENSORS = {"wqkv": (torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5), 0, 3),
           "c_attn": (torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12), 1, 3),
           "in_proj.bias": (torch.arange(8, dtype=torch.float32), 0, 2)}


def main():
    comm, folder, mode = MPI.COMM_WORLD, sys.argv[1], sys.argv[2]
    if comm.rank == 0:
        dcp_save.save({k: t for k, (t, _, _) in TENSORS.items()}, checkpoint_id=f"{folder}/ck", no_dist=True)
    comm.Barrier()
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=comm.rank, world_size=comm.size)
    mesh = init_device_mesh("cpu", (comm.size,))
    path = f"{folder}/ck"
    metadata = read_metadata(path)
    for name, (full, dim, parts) in TENSORS.items():
        placement = [_StridedShard(dim, split_factor=parts)]
        want = distribute_tensor(full, mesh, placement).to_local()
        if mode == "adapter":
            local, index = adapters._local_part(distribute_tensor(full, mesh, placement))
            check(torch.equal(full[index], want) and torch.equal(local, want), f"{name}: the merge's index on "
                  f"rank {comm.rank} picks {full[index].flatten().tolist()}, it holds {want.flatten().tolist()}")
            continue
        for how in ("slice reader", "fallback"):
            target = distribute_tensor(torch.zeros_like(full), mesh, placement)
            if how == "slice reader":
                reader = SliceReader(path, metadata)
                check(reader.fill(name, target), f"{name}: the slice reader declined it")
                reader.close()
            else:
                dcp_load._fill_strided(target, name, path, metadata)
            got = target.to_local()
            check(torch.equal(got, want), f"{name} by the {how}: rank {comm.rank} holds {got.flatten().tolist()}, "
                                          f"expected {want.flatten().tolist()}")
    dist.destroy_process_group()
    say(f"strided {mode} ok: {check.count} checks")


if __name__ == "__main__":
    main()
