"""Under mpiexec (2 ranks): mpitp.evaluate refusing bad settings on every rank alike (a document index past the
task's end and a chat template's name the tokenizer lacks, found by rank 0 alone once the run is under way and
relayed; an ``output`` that exists only in rank 0's working folder, with ``overwrite=False``), a run after them, then
one rank leaving ``with mpitp.start()`` with an error while the other waits for it in a collective. No excepthook of
mpitp's.

argv: MODEL_DIR INCLUDE_PATH TMP_DIR
"""

import os
import sys

from transformers import AutoTokenizer

import mpitp
from mpitp.errors import UsageError

model_dir, include_path, tmp = sys.argv[1:4]
with mpitp.start(tp=2, threads=1) as rt:
    model = mpitp.load_model(model_dir, rt.layout.tp, rt.device, "float32")
    for tasks, kw in ((["no_such_task"], {"limit": 2}), (["mpitp_demo_mc"], {"limit": 0}),
                      (["mpitp_demo_mc"], {"samples": {"mpitp_demo_mc": [99]}})):
        try:
            mpitp.evaluate(model, model_dir, tasks, include_path=include_path, timeout=600, **kw)
        except UsageError as exc:
            print(f"rank {rt.world.rank} refused: {exc}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # two named templates, neither the one asked for
    tokenizer.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "{{ messages[0]['content'] }}"}
    try:
        mpitp.evaluate(model, tokenizer, ["mpitp_demo_mc"], include_path=include_path, limit=2, timeout=600,
                       apply_chat_template="nope")
    except UsageError as exc:
        print(f"rank {rt.world.rank} refused: {exc}", flush=True)
    here, mine = os.getcwd(), os.path.join(tmp, f"rank{rt.world.rank}")  # each rank its own working folder
    os.makedirs(mine)
    if rt.world.rank == 0:
        open(os.path.join(mine, "out.h5"), "wb").close()
    os.chdir(mine)
    try:
        mpitp.evaluate(model, model_dir, ["mpitp_demo_mc"], include_path=include_path, limit=2, timeout=600,
                       output="out.h5", overwrite=False)
    except UsageError as exc:
        print(f"rank {rt.world.rank} refused: {exc}", flush=True)
    os.chdir(here)
    res = mpitp.evaluate(model, model_dir, ["mpitp_demo_mc"], include_path=include_path, limit=2, timeout=600)
    print(f"rank {rt.world.rank} scored after the refusals: {res is not None}", flush=True)
    if rt.world.rank == 1:
        raise ValueError("planted on rank 1 only")
    mpitp.evaluate(model, model_dir, ["mpitp_demo_mc"], include_path=include_path, limit=2, timeout=600)
print(f"rank {rt.world.rank} went on")
