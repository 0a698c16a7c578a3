"""Bring up a rank: MPI world and layout (:func:`make_launch`), then device, thread count and the replica's torch world
(:func:`replica_world`, the one owner of that world), in that order.

Also the one pattern for bad input under MPI: :func:`agree` runs a check on rank 0 and broadcasts its verdict, so a
usage error is printed once and every rank leaves with status 2 together instead of some ranks waiting forever.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from mpitp.errors import UsageError, exit_bound, report_and_abort
from mpitp.parallel import check_ep
from mpitp.parallel import comm as mpicomm
from mpitp.parallel.layout import Layout, make_layout
from mpitp.parallel.netaddr import iface_objection
from mpitp.parallel.replica_group import ReplicaGroup, init_replica_group
from mpitp.parallel.world import World, world_from_comm

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpi4py import MPI

log = logging.getLogger("mpitp")
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class Launch:
    """A rank's place in the job before torch starts: the MPI world, the dp x pp x tp layout and what was asked for
    the torch side. Rank 0's input checks run with it, so a refused run never starts torch on any rank."""

    world: World
    layout: Layout
    device: str | None  # the request (None: a GPU per rank where there are enough, else the CPU)
    threads: int
    timeout: float
    ep: int = 1  # --ep: the TP group's ranks share each layer's experts (1: every rank a TP slice of every expert)
    stage_dir: str | None = None  # --stage-dir: where each node copies a local model before loading (None: in place)


@dataclass(frozen=True, kw_only=True)
class Runtime(Launch):
    """Everything a rank needs to take part in an evaluation: a :class:`Launch` with its device picked and the
    replica's torch world up. Built once by :func:`replica_world` (or :func:`start`) and passed explicitly, never
    stored globally or changed; :meth:`close` tears its torch world down (also on leaving a ``with`` block)."""

    device: str = "cpu"  # the device this rank runs on
    replica_group: ReplicaGroup | None = None
    cudnn_sdp_before: bool | None = None  # torch's cuDNN attention switch before this run turned it off (CUDA only)

    def close(self) -> None:
        """Tear down the replica's torch world so the next run may use another layout. Idempotent."""
        from mpitp.parallel.replica_group import destroy_replica_group

        if self.cudnn_sdp_before is not None:
            import torch

            torch.backends.cuda.enable_cudnn_sdp(self.cudnn_sdp_before)
        if self.replica_group is not None:
            # gloo/NCCL teardown talks to the replica's peers and holds the interpreter lock: bounded like
            # MPI_Finalize.
            with exit_bound("tearing down the replica's torch world"):
                destroy_replica_group(self.replica_group)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close; but an exception leaving the block on this rank alone first ends the whole job, naming it
        (:func:`mpitp.errors.report_and_abort`, as ``mpitp eval``'s excepthook does): its peers may sit in a
        collective it will never join, and a script's rank leaving with an error held them there until the
        deadline (an hour by default; in ``MPI_Finalize``, for ever). A refusal every rank raised together
        (a collective :class:`~mpitp.errors.UsageError`), ``sys.exit`` and the end of a generator leave normally.
        Only ``with mpitp.start() as rt`` reaches here: the commands' runs own their world through
        :func:`replica_world`."""
        collective = isinstance(exc, UsageError) and exc.collective
        if exc is not None and not collective and not isinstance(exc, (SystemExit, GeneratorExit)):
            report_and_abort(exc)
        self.close()


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, all_ranks: bool, level: int = logging.INFO) -> None:
    """Rank 0 logs; other ranks only log when ``all_ranks`` (then every line carries its rank)."""
    handler = logging.StreamHandler(sys.stderr)
    fmt = "[rank %(rank)d] %(message)s" if all_ranks else "%(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    handler.addFilter(_RankFilter(rank))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(level if (rank == 0 or all_ranks) else logging.ERROR)
    if not getattr(sys.stderr, "isatty", lambda: False)():
        # A batch log, not a terminal: tqdm bars (lm-eval's own too) would be carriage-return redraws glued into one
        # line; mpitp's progress is a plain line every few seconds there instead (mpitp.evaluation.progress).
        os.environ.setdefault("TQDM_DISABLE", "1")
    if rank != 0 and not all_ranks:
        # Libraries below us chatter on every rank; only rank 0 speaks unless asked otherwise.
        for name in ("lm-eval", "lm_eval", "transformers", "accelerate", "datasets", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ["TQDM_DISABLE"] = "1"
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def agree(check: Callable[[], _T], comm: MPI.Comm, timeout: float, phase: str) -> _T:
    """Run ``check()`` on rank 0 only and share its result or its :class:`UsageError` with every rank."""
    verdict = None
    if comm.Get_rank() == 0:
        try:
            verdict = ("ok", check())
        except UsageError as exc:
            verdict = ("usage", str(exc))
    verdict = mpicomm.bcast_obj(verdict, comm, root=0, timeout=timeout, phase=phase)
    if verdict[0] == "usage":
        raise UsageError(verdict[1], collective=True)
    return verdict[1]


def make_launch(tp: int = 1, pp: int = 1, device: str | None = None, threads: int | None = None,
                timeout: float = mpicomm.DEFAULT_TIMEOUT, world: World | None = None, comm: MPI.Comm | None = None,
                iface: str | None = None, stage_dir: str | None = None, ep: int = 1) -> Launch:
    """The MPI side of a rank: its world (``world``, else one from ``comm``) and layout. Collective over it; every rank
    calls it with the same arguments. A layout that does not fit the world is refused on every rank alike.

    Pass ``world`` to reuse one (a job file runs several layouts, one after another, in the same MPI world).
    ``iface`` names the network interface between nodes: it becomes ``MPITP_IFACE``
    (:mod:`mpitp.parallel.netaddr`), which the torch world reads when a replica spans nodes. ``stage_dir`` (else
    ``MPITP_STAGE_DIR``) is where each node copies the model before loading (:mod:`mpitp.replica.staging`).
    """
    if iface:
        os.environ["MPITP_IFACE"] = iface
    world = world or world_from_comm(comm)
    why = iface_objection(dict(os.environ), world.node_name)  # each node its own interfaces
    why = mpicomm.first_objection(why, world.comm, timeout, phase="checking --iface")
    if why is not None:
        raise UsageError(why, collective=True)
    try:
        layout = make_layout(world, tp, pp)
    except UsageError as exc:
        raise UsageError(str(exc), collective=True) from None
    try:
        check_ep(ep, tp)
    except UsageError as exc:
        raise UsageError(str(exc), collective=True) from None
    return Launch(world=world, layout=layout, device=device, threads=threads or world.default_threads,
                  timeout=timeout, ep=ep, stage_dir=stage_dir or os.environ.get("MPITP_STAGE_DIR") or None)


def open_replica(launch: Launch) -> Runtime:
    """Pick this rank's device, set torch's threads and bring up the replica's torch world. Collective over the
    world; the caller owns the result (:meth:`Runtime.close`, or use :func:`replica_world`)."""
    import torch

    plan, why = None, None
    try:
        plan = _device_plan(launch.device, launch.world.local_rank)
    except UsageError as exc:
        why = str(exc) if launch.world.rank == 0 else f"rank {launch.world.rank} on {launch.world.node_name}: {exc}"
    # Ranks may see different GPUs, so each decides; the first refusal is everyone's, printed once (each rank's own
    # abort printed it once per rank).
    why = mpicomm.first_objection(why, launch.world.comm, launch.timeout, phase="choosing the device")
    if why is not None:
        raise UsageError(why, collective=True)
    torch.set_num_threads(launch.threads)
    cudnn_before = None
    if plan.device.startswith("cuda"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        cudnn_before = _sdpa_without_cudnn()
    if plan.set_device:
        torch.cuda.set_device(torch.device(plan.device))
    group = init_replica_group(launch.layout, plan.device, launch.timeout)
    return Runtime(world=launch.world, layout=launch.layout, device=plan.device, threads=launch.threads,
                   timeout=launch.timeout, ep=launch.ep, stage_dir=launch.stage_dir, replica_group=group,
                   cudnn_sdp_before=cudnn_before)


def _sdpa_without_cudnn() -> bool:
    """Take cuDNN out of ``scaled_dot_product_attention``'s backends for the run; return the switch's old value.

    torch 2.11 on Hopper sends half-precision SDPA to cuDNN first, and cuDNN builds an execution plan for every new
    shape: an evaluation's shapes change with every batch's length and every greedy step's cache length, so each
    call pays a plan build. Measured on an H200 (bench/README.md, GPU drill): 64 greedy tokens for 8 rows of the
    77M bench Llama in bfloat16 took 5.6 s with cuDNN, 0.7 s without (flash/efficient attention), and mpitp's whole
    bfloat16 drill 86 s against 16 s in float32. float32 never reaches cuDNN, so parity runs are unchanged."""
    import torch

    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    return before


@contextmanager
def replica_world(launch: Launch) -> Iterator[Runtime]:
    """The one owner of a run's torch world: built on entry (after rank 0's checks, which need only ``launch``),
    torn down once on exit, however the run ends. Every path (``eval``, sweeps, adapter sweeps, ``--watch``, each
    run of a job file) runs inside one of these."""
    rt = open_replica(launch)
    try:
        yield rt
    finally:
        rt.close()


def start(tp: int = 1, device: str | None = None, threads: int | None = None,
          timeout: float = mpicomm.DEFAULT_TIMEOUT, comm: MPI.Comm | None = None, world: World | None = None,
          pp: int = 1, iface: str | None = None, stage_dir: str | None = None) -> Runtime:
    """The public :func:`mpitp.start`: :func:`make_launch` and :func:`open_replica` in one call, for a script that
    builds and evaluates its own model. Collective. Use the result in a ``with`` block (or call ``close()``) to tear
    its torch world down; an exception that leaves the block on one rank ends the job (:meth:`Runtime.__exit__`)."""
    _check_start(threads, timeout)
    return open_replica(make_launch(tp=tp, pp=pp, device=device, threads=threads, timeout=timeout, world=world,
                                    comm=comm, iface=iface, stage_dir=stage_dir))


def _check_start(threads, timeout) -> None:
    """:func:`start`'s numbers, checked as ``mpitp eval --threads/--timeout`` are, before any collective (every rank
    holds the same values, so each refuses alike): ``threads=-1`` and ``threads="2"`` were a RuntimeError from
    ``torch.set_num_threads`` after the world was built (the job aborted), ``threads=0`` silently meant the default,
    and ``timeout=-1`` a DeadlineError traceback from the first wait. ``timeout=None`` waits without a deadline."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UsageError(f"mpitp.start: threads={threads!r}: expected a positive integer (or None: the cores per "
                         "node / ranks per node)", collective=True)
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if timeout is not None and not (number and 0 < timeout < float("inf")):
        raise UsageError(f"mpitp.start: timeout={timeout!r}: expected a positive number of seconds (or None: no "
                         "deadline)", collective=True)


def warm_imports(world: World) -> bool:
    """Ranks with a core to spare import torch and transformers' model code before they wait for rank 0's checks, so
    that :func:`open_replica` and the load find them done: a node's first ``cores`` ranks (local rank below the
    node's core count; on rank 0's node rank 0 checks on one of those cores). The others wait idle: on an
    oversubscribed node (the README's demo, 4 ranks on 2 cores) more importers would take CPU from rank 0's checks
    and slow a refused run. Extra importers at a lower CPU priority were measured and do not help: the ranks
    ``mpiexec`` starts sit in separate scheduler groups (autogroups), between which nice values do not count (three
    nice-19 spinners took rank 0's checks from 4.8 to 8.4 s). The imports run in the main thread: in a thread they
    could deadlock with the main thread's own imports on a package's import cycles. True where this rank imported
    (its caller may then warm the model's own code: :func:`mpitp.replica.loading.warm_model_code`)."""
    if not warms_imports(world):
        return False
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    return True


def warms_imports(world: World) -> bool:
    """Whether this rank imports the model code before it waits for rank 0's checks (:func:`warm_imports`)."""
    return world.rank != 0 and world.local_rank < world.cores_per_node


#: The least time a rank that has loaded the model waits at the barrier for the others, whatever ``--timeout`` says:
#: on an oversubscribed node the ranks other than 0 import torch and transformers' model code during the load
#: (:func:`warm_imports` leaves it to them there), which takes them seconds longer than rank 0 (measured: over 8 s
#: with 4 ranks on 2 loaded cores). A short ``--timeout`` is meant for the request phases, not for that.
LOAD_SKEW_S = 30.0


def barrier_after_load(rt: Runtime, refused: UsageError | None = None) -> None:
    """Every rank has its shard: a deadline from this rank's own end of loading (ranks load the same bytes and
    finish close together, while a node whose link went down during the load would otherwise hold every rank here),
    at least :data:`LOAD_SKEW_S`. ``refused``: this rank's load refused what it found (an adapter this layout cannot
    merge, say); the first refusal in rank order is raised on every rank alike, so it is printed once, not once per
    rank that met it."""
    deadline = None if rt.timeout is None else max(rt.timeout, LOAD_SKEW_S)
    first = mpicomm.first_objection(None if refused is None else str(refused), rt.world.comm, deadline,
                                    phase="model loading")
    if first is not None:
        raise UsageError(first, collective=True)


def _device_plan(device: str | None, local_rank: int):
    """:func:`mpitp.parallel.device.plan_device` for this process; hides the GPUs (before CUDA starts) when it says
    so."""
    import torch

    from mpitp.parallel.device import plan_device

    # GPUs are not counted for "cpu": counting starts CUDA, after which hiding them would no longer take effect.
    wants_cpu = (device or "").strip().lower() == "cpu"
    plan = plan_device(device, local_rank, None if wants_cpu else
                       torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if plan.hide_gpus:
        if torch.cuda.is_initialized():
            raise UsageError("--device cpu: CUDA was already initialised in this process, so its GPUs cannot be "
                             "hidden from transformers' sharded loading; choose the device before using CUDA")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return plan
