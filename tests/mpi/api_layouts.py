"""Under mpiexec -n 4: what mpitp.evaluate does before any evaluation, on the real code path.

argv: MODEL_DIR CALLS.
1. ``CALLS`` times :func:`mpitp.evaluation.api.layout_for` (the communicator-building part of every evaluate call), as a
   training loop evaluating that many times would: MPICH's ~2,048 context ids must not run out (they did after
   ~500 calls when every call built new communicators). Alternating tp=1 and tp=2 models: two cached layouts.
2. One torch world over the 4 ranks and the model sharded tp=2 with a (dp_replicate=2, tp=2) mesh by transformers:
   mpitp.evaluate refuses it clearly on every rank (collective UsageError), without evaluating.
"""

import sys
import time

from mpi4py import MPI

import mpitp
from mpitp.errors import UsageError, install_excepthook
from mpitp.evaluation.api import layout_for

install_excepthook()
model_dir, calls = sys.argv[1], int(sys.argv[2])
rank = MPI.COMM_WORLD.Get_rank()


def _no_torch_check(model):
    """layout_for for a tp=2 model before any torch world exists (its torch-world check is exercised below)."""
    import mpitp.evaluation.api as api

    check, api.check_torch_world = api.check_torch_world, lambda layout, group: None
    try:
        return layout_for(model, None, None)
    finally:
        api.check_torch_world = check



class Sharded:
    tp_size = 2  # what transformers sets on a TP-sharded model


t0 = time.monotonic()
seen = {1: set(), 2: set()}
for i in range(calls):
    model = Sharded() if i % 2 else object()  # a whole model (tp=1) and a sharded one, as if alternating
    tp = 2 if i % 2 else 1
    layout, group = layout_for(model, None, None) if tp == 1 else _no_torch_check(model)
    assert layout.tp == tp and layout.dp == 4 // tp and group is None, layout
    seen[tp].add(id(layout.tp_comm))
assert len(seen[1]) == len(seen[2]) == 1, seen  # built once per layout, then reused
if rank == 0:
    print(f"LAYOUTS {calls} layout_for calls in {time.monotonic() - t0:.1f} s", flush=True)

mpitp.start(tp=4, threads=1)  # one torch world over all 4 ranks (mpitp's own replica world with tp=4)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_size=2,
                                                                                             dp_replicate_size=2))
t0 = time.monotonic()
try:
    mpitp.evaluate(model, model_dir, ["mpitp_demo_mc"], limit=2)
    print(f"rank {rank} NOT REFUSED", flush=True)
except UsageError as exc:
    assert exc.collective
    # one write per line: under PYTHONUNBUFFERED print's text and newline are two, and another rank's line can land
    # between them (the test reads these lines with a regex)
    sys.stdout.write(f"rank {rank} REFUSED in {time.monotonic() - t0:.2f} s: {exc}\n")
