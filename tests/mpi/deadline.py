"""Deadlines and idle CPU of mpitp's polled waits.

Run: mpiexec -n N python tests/mpi/deadline.py      (N >= 2; the last rank is the slow one)

1. barrier, deadline 2 s, slow rank sleeps 5 s: every other rank raises DeadlineError naming the phase within
   deadline + 2 s; afterwards the world resynchronises (the slow rank's barrier matches the abandoned one).
2. the same sleep with a 20 s deadline completes on every rank; while waiting a rank uses well under 30% of one
   core (process CPU time over wall time), i.e. it does not busy-spin.
3. bcast_obj whose root sleeps past a 1 s deadline: the receivers raise DeadlineError naming the phase.
4. the idle-CPU check of 2. for a rank waiting 3 s in bcast_obj for a late root.
5. gather_obj under one 2 s deadline, rank r sending after 1.2 * r s (each one late by less than the deadline, all
   together by more): the root raises DeadlineError at 2 s, not N x 2 s.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import mpitp.parallel.comm as mc
from mpitp.errors import DeadlineError, install_excepthook

from _checks import Checks, say

install_excepthook()
check = Checks()
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SLOW = SIZE - 1
RESYNC = 20.0


def expect_deadline(fn, timeout, phase):
    """Run ``fn`` (which waits ``timeout`` s on a late peer); it must raise DeadlineError naming ``phase``."""
    t0 = time.monotonic()
    try:
        fn()
    except DeadlineError as exc:
        took = time.monotonic() - t0
        msg = str(exc)
        check(timeout <= took < timeout + 2.0, f"{phase}: DeadlineError after {took:.2f} s, deadline {timeout} s")
        check(f"'{phase}'" in msg, f"{phase}: message names the phase: {msg}")
        check(f"{timeout:g} s" in msg, f"{phase}: message names the timeout: {msg}")
        return took
    check(False, f"{phase}: no DeadlineError (returned after {time.monotonic() - t0:.2f} s)")


def cpu_share(fn):
    """(wall s, process CPU s) spent in ``fn``."""
    w0, c0 = time.monotonic(), time.process_time()
    fn()
    return time.monotonic() - w0, time.process_time() - c0


def main():
    t_start = time.monotonic()
    mc.barrier(WORLD, timeout=RESYNC, phase="start")

    # 1. deadline 2 s, the slow rank 5 s late. (On a Dup of the world: the others' abandoned Ibarrier requests are
    #    never freed, and MPICH reports leaked references to builtin communicators at finalize.)
    phase = "deadline test barrier"
    dup = WORLD.Dup()
    if RANK == SLOW:
        time.sleep(5.0)
        mc.barrier(dup, timeout=RESYNC, phase=phase)  # matches the barrier the others gave up on
    else:
        took = expect_deadline(lambda: mc.barrier(dup, timeout=2.0, phase=phase), 2.0, phase)
        say(f"  barrier deadline: DeadlineError after {took:.2f} s")
    mc.barrier(WORLD, timeout=RESYNC, phase="resync 1")

    # 2. same sleep, large deadline: completes. The waiting ranks must not busy-spin meanwhile.
    phase = "patient barrier"
    if RANK == SLOW:
        time.sleep(5.0)
    took, cpu = cpu_share(lambda: mc.barrier(WORLD, timeout=RESYNC, phase=phase))
    if RANK != SLOW:
        check(4.5 <= took < 15.0, f"{phase}: waited {took:.2f} s for a rank 5 s late")
        check(cpu < 0.3 * took, f"{phase}: busy-spins: {cpu:.2f} s CPU in {took:.2f} s wall")
        say(f"  barrier with a 20 s deadline: completed after {took:.2f} s, "
            f"{cpu:.3f} s CPU ({100 * cpu / took:.1f}%)")

    # 3. bcast_obj whose root is late: receivers give up after 1 s and name the phase. On a communicator of its
    #    own, and the late root then sends only a header announcing no payload: that completes the Ibcast the
    #    receivers abandoned without starting payload Bcasts they would never join.
    phase = "deadline test bcast"
    late = WORLD.Dup()
    if RANK == SLOW:
        time.sleep(2.5)
        mc.wait(late.Ibcast(np.zeros(mc._HEADER_SLOTS, dtype=np.int64), root=SLOW), RESYNC, "late header")
    else:
        expect_deadline(lambda: mc.bcast_obj(None, late, root=SLOW, timeout=1.0, phase=phase), 1.0, phase)
    mc.barrier(WORLD, timeout=RESYNC, phase="resync 3")

    # 4. idle CPU of a receiver waiting 3 s for a late bcast_obj root.
    if RANK == SLOW:
        time.sleep(3.0)
        mc.bcast_obj("payload", WORLD, root=SLOW, timeout=RESYNC, phase="late bcast")
    else:
        wall, cpu = cpu_share(lambda: check(
            mc.bcast_obj(None, WORLD, root=SLOW, timeout=RESYNC, phase="late bcast") == "payload", "late bcast"))
        check(wall >= 2.5, f"bcast_obj: waited {wall:.2f} s for a root 3 s late")
        check(cpu < 0.3 * wall, f"bcast_obj: busy-spins: {cpu:.2f} s CPU in {wall:.2f} s wall")
        say(f"  idle bcast_obj: {cpu:.3f} s CPU in {wall:.2f} s wall ({100 * cpu / wall:.1f}%)")

    # 5. gather_obj: one deadline for the whole gather. On a Dup: the late senders' messages land on it unreceived.
    phase = "deadline test gather"
    gat = WORLD.Dup()
    if RANK == 0:
        took = expect_deadline(lambda: mc.gather_obj("x", gat, root=0, timeout=2.0, phase=phase), 2.0, phase)
        say(f"  gather_obj deadline: DeadlineError after {took:.2f} s")
    else:
        time.sleep(1.2 * RANK)
        mc.isend_obj(RANK, 0, mc._GATHER_TAG, gat)  # small: delivered eagerly, never received
    mc.barrier(WORLD, timeout=RESYNC, phase="resync 5")

    mc.barrier(WORLD, timeout=RESYNC, phase="end")
    total = WORLD.allreduce(check.count)
    say(f"OK deadline: {SIZE} ranks, {total} checks, {time.monotonic() - t_start:.1f} s")


if __name__ == "__main__":
    main()
