"""Under mpiexec -n 2: the peak RSS one tp=2 load adds on each rank (issue 39: DCP against its HF twin).

argv: MODEL ASSETS. ``mpitp.start(tp=2)``, the imports a first load makes, ``VmHWM`` reset, ``mpitp.load_model``,
every local parameter read once (transformers maps an HF folder's safetensors: untouched pages are not resident
yet), then one JSON line per rank: the peak the load added and the bytes of the rank's own parameters.
"""

import json
import sys

import torch
import torch.distributed.checkpoint  # noqa: F401 - the imports a first load makes are not the load's memory
import transformers.modeling_utils  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
from mpi4py import MPI
from torch.distributed.tensor import DTensor

import mpitp
import mpitp.replica.dcp  # noqa: F401
from mpitp.errors import install_excepthook

install_excepthook()
model, assets = sys.argv[1:3]
rt = mpitp.start(tp=2, device="cpu", threads=1)


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1]) << 10


MPI.COMM_WORLD.Barrier()
base = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) from here
m = mpitp.load_model(model, tp=2, device=rt.device, dtype="float32", hf_assets=assets if model != assets else None)
local = [p.to_local() if isinstance(p, DTensor) else p for p in m.parameters()]
touched = sum(float(t.detach().sum()) for t in local)
print(json.dumps({"rank": rt.world.rank, "gain": rss("VmHWM:") - base,
                  "bytes": sum(t.numel() * t.element_size() for t in local)}), flush=True)
MPI.COMM_WORLD.Barrier()
