"""Under mpiexec -n 2: the peak RSS one tp=2 load adds on each rank (issue 39: DCP against its HF twin).

argv: MODEL ASSETS. ``mpitp.start(tp=2)``, the imports a first load makes, ``VmHWM`` reset, ``mpitp.load_model``,
every local parameter read once (transformers maps an HF folder's safetensors: untouched pages are not resident
yet), then one JSON line per rank, all printed by rank 0: the peak the load added and the bytes of the rank's own
parameters; and whether the vocabulary-split input embedding was taken by mpitp's summed lookup
(:mod:`mpitp.replica.vocab_embedding`) and gives, for ids spread over both ranks' rows, exactly the rows of the
whole (gathered) embedding.
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
gain = rss("VmHWM:") - base
embed = m.get_input_embeddings()
v = int(embed.weight.shape[0])
ids = torch.tensor([[0, v // 2 - 1, v // 2, v - 1], [1, 97, v - 97, v // 2 + 1]])  # both ranks' rows and edges
with torch.no_grad():
    exact = torch.equal(embed(ids), torch.nn.functional.embedding(ids, embed.weight.full_tensor()))
row = {"rank": rt.world.rank, "gain": gain, "bytes": sum(t.numel() * t.element_size() for t in local),
       "embed_taken": "forward" in vars(embed) and "vocab_embedding" in embed.forward.__module__, "embed_exact": exact}
rows = MPI.COMM_WORLD.gather(row, root=0)  # printed by rank 0 alone: two ranks' lines can reach mpiexec's stdout merged
if rt.world.rank == 0:
    for r in rows:
        print(json.dumps(r), flush=True)
MPI.COMM_WORLD.Barrier()
