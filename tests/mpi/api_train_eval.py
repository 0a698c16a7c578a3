"""Under mpiexec: a training script that holds its own TP-sharded model and calls mpitp.evaluate between steps.

argv: MODEL_DIR INCLUDE_PATH OUT_DIR. Writes OUT_DIR/eval1.h5, OUT_DIR/eval2.h5 and, per DP group, the final
weights to OUT_DIR/saved-dp<g> (for the CLI comparison done by the test).
"""

import sys

import torch

import mpitp
from mpitp.errors import install_excepthook

install_excepthook()
model_dir, include_path, out_dir = sys.argv[1:4]
TASKS = ["mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen"]

rt = mpitp.start(tp=2, threads=1)
model = mpitp.load_model(model_dir, rt.layout.tp, rt.device, "float32")
model.train()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
batch = torch.tensor([[1, 400, 20, 30, 50, 60, 70, 80, 90, 100]])


def step() -> float:
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return float(out.loss)


losses = [step()]
attention = model.config._attn_implementation
first = mpitp.evaluate(model, model_dir, TASKS, include_path=include_path, limit=6, batch_size=2,
                       output=f"{out_dir}/eval1.h5", bootstrap_iters=0, gen_kwargs="max_gen_toks=12")
assert model.training, "evaluate must restore training mode"
assert model.config._attn_implementation == attention, "evaluate must give the model back its attention function"
losses += [step(), step()]
second = mpitp.evaluate(model, model_dir, TASKS, include_path=include_path, limit=6, batch_size=2,
                        output=f"{out_dir}/eval2.h5", bootstrap_iters=0, gen_kwargs="max_gen_toks=12")
assert model.training
model.save_pretrained(f"{out_dir}/saved-dp{rt.layout.dp_rank}")  # exactly the weights eval2 saw
losses.append(step())  # and training goes on afterwards
assert losses[-1] < losses[0], f"training did not progress: {losses}"
if rt.world.rank == 0:
    assert first is not None and second is not None
    assert first["results"]["mpitp_demo_mc"] is not None
    print("LOSSES", losses)
else:
    assert first is None and second is None
print(f"rank {rt.world.rank} done")
