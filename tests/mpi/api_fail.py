"""Under mpiexec: mpitp.evaluate in a training script whose leader fails inside a forward (fault drill).

argv: MODEL_DIR INCLUDE_PATH OUT_FILE TIMEOUT. The failure comes from ``MPITP_TEST_RAISE_IN_FORWARD`` (set by the
test); the script's own excepthook aborts the job, as a training script using mpitp's should.
"""

import sys

import mpitp
from mpitp.errors import install_excepthook

install_excepthook()
model_dir, include_path, out, timeout = sys.argv[1:5]
rt = mpitp.start(tp=2, threads=1, timeout=float(timeout))
model = mpitp.load_model(model_dir, rt.layout.tp, rt.device, "float32")
mpitp.evaluate(model, model_dir, ["mpitp_demo_mc"], include_path=include_path, limit=6, batch_size=1, output=out,
               bootstrap_iters=0, timeout=float(timeout))
print(f"rank {rt.world.rank} done")
