"""One torch.distributed world per model replica (DP group), brokered over MPI.

torch.distributed carries only the replica's tensor traffic: TP collectives and, with pp > 1, the activations
between pipeline stages. Each DP group is its *own* default torch world (rank = rank in the replica, world size =
pp * tp) because transformers' distributed loading (``DistributedConfig(tp_size, pp_size)``) builds its device mesh
(pp, ..., tp) from the default world and silently ignores a DP x TP mesh. The replica leader opens a TCPStore on an
ephemeral port (bound to that one address, never all interfaces: :func:`master_store`) and broadcasts the port
over the replica's MPI communicator, so users never set
``MASTER_ADDR``/``MASTER_PORT`` and concurrent replicas never collide. The store listens on the loopback interface
when the whole replica is on one node (always so for pp=1: a TP group never spans nodes); when pipeline stages sit on
other nodes, on an address of the leader other nodes can reach (:mod:`mpitp.parallel.netaddr`: ``MPITP_STORE_ADDR``, the
interface ``GLOO_SOCKET_IFNAME`` names, a non-loopback host address, else the first physical interface's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from mpitp.parallel import comm as mpicomm
from mpitp.parallel.layout import Layout

if TYPE_CHECKING:
    from torch.distributed import TCPStore

LOOPBACK = "127.0.0.1"


@dataclass
class ReplicaGroup:
    """Handle on this rank's torch world: the whole replica (``size = pp * tp`` ranks, this rank ``rank`` in it) and,
    inside it, the TP group of this rank's pipeline stage (``tp_size`` ranks, this rank ``tp_rank``).

    ``tp_group`` is the torch process group of the stage's TP ranks; None means the default world, which is the TP
    group itself without stages (and with one rank per stage no TP collective runs).
    """

    size: int
    rank: int
    tp_size: int
    tp_rank: int
    backend: str
    device: str
    tp_group: object = None

    @property
    def active(self) -> bool:
        """A torch world exists (the replica has more than one rank)."""
        return self.size > 1


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def spans_nodes(layout: Layout) -> bool:
    node = layout.world.node_of_rank
    return len({node[r] for r in layout.replica_ranks}) > 1


def master_store(addr: str, size: int, timeout: timedelta) -> TCPStore:
    """The replica leader's TCPStore, listening on ``addr`` only (loopback, or the node address peers use).

    Why a socket of our own: TCPStore given a host and port 0 binds every interface (``*:port``), so anybody who can
    reach the node could connect to the unauthenticated store and rewrite the rendezvous. Bound here and handed over
    (``master_listen_fd``), it listens where the replica's ranks connect and nowhere else. It stays up with the world:
    NCCL and gloo exchange their connection details through it for every later group and point-to-point pair.
    """
    import socket

    import torch.distributed as dist

    family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here
    try:
        return dist.TCPStore(addr, port, world_size=size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def init_replica_group(layout: Layout, device: str, timeout: float) -> ReplicaGroup:
    """Initialise torch.distributed for this rank's replica (no-op for one rank). Collective over the replica."""
    backend = backend_for(device)
    size = layout.replica_size
    if size == 1:
        return ReplicaGroup(size=1, rank=0, tp_size=1, tp_rank=0, backend=backend, device=device)
    import torch
    import torch.distributed as dist

    # A dead peer must surface as an error, not a hang: NCCL async error handling on.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    td = timedelta(seconds=timeout)
    comm, rank = layout.replica_comm, layout.replica_rank
    addr = LOOPBACK  # the store's, when the whole replica is on one node (always so for pp=1)
    if spans_nodes(layout):  # every rank, before gloo binds its sockets: the node network, not the host name's
        from mpitp.parallel.netaddr import use_node_network

        addr = use_node_network()  # not the host name's resolution: 127.0.1.1 on Debian-style /etc/hosts
    if rank == 0:
        store = master_store(addr, size, td)
        where = (addr, store.port)
    else:
        where = None
    addr, port = mpicomm.bcast_obj(where, comm, root=0, timeout=timeout, phase="TP group rendezvous")
    if rank != 0:
        store = dist.TCPStore(addr, port, world_size=size, is_master=False, timeout=td)
    local = device.split(":", 1)[1] if device.startswith("cuda:") else str(rank)
    # transformers' distributed loading reads these to build its mesh from the default world.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=local,
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR=addr, MASTER_PORT=str(port))
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=size, timeout=td, **kwargs)
    group = None
    if layout.pp > 1 and layout.tp > 1:
        # Every rank creates every stage's TP group, in stage order (new_group is collective over the world).
        for s in range(layout.pp):
            g = dist.new_group(ranks=list(range(s * layout.tp, (s + 1) * layout.tp)))
            if s == layout.pp_rank:
                group = g
    # gloo's full mesh connects in the background of init_process_group: a rank that returned may leave (a usage
    # error found right after start-up) while a peer is still connecting, which then dies in connectFullMesh instead
    # of exiting 2. No rank goes on before every rank of the replica has its world.
    mpicomm.barrier(comm, timeout=timeout, phase="TP group start")
    return ReplicaGroup(size=size, rank=rank, tp_size=layout.tp, tp_rank=layout.tp_rank, backend=backend,
                        device=device, tp_group=group)


def destroy_replica_group(group: ReplicaGroup) -> None:
    if group.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
