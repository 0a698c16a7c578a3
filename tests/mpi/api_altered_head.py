"""Under mpiexec (dp replicas, tp=1): mpitp.evaluate on a model whose forward changes its logits in a way the
vocab-parallel head does not know (the logits scaled by 1.5, as an unknown architecture's logit step would).

argv: MODEL_DIR INCLUDE_PATH. Prints "REFUSED: <message>" on every rank when the head check refuses it.
"""

import os
import sys

import mpitp
from mpitp.errors import UsageError, install_excepthook

install_excepthook()
model_dir, include_path = sys.argv[1:3]
rt = mpitp.start(tp=1, threads=1)
model = mpitp.load_model(model_dir, 1, rt.device, "float32")
plain_forward = model.forward


def scaled_forward(*args, **kwargs):
    out = plain_forward(*args, **kwargs)
    out.logits = out.logits * 1.5
    return out


def say(line: str) -> None:
    """One write of the whole line: both ranks share the launcher's stdout, and print's separate write of the
    newline let the two lines interleave into one ("rank 0: ...rank 1: ...")."""
    os.write(1, (line + "\n").encode())


model.forward = scaled_forward
try:
    mpitp.evaluate(model, model_dir, ["arc_easy_local"], include_path=include_path, limit=1, bootstrap_iters=0)
    say(f"rank {rt.world.rank}: NOT REFUSED")
except UsageError as exc:
    say(f"rank {rt.world.rank}: REFUSED: {exc}")
