"""Expert parallelism (``--ep``) against TP alone, per rank, on four mixture-of-experts shapes (issue 40).

    python bench/bench_ep.py [--hidden 256] [--experts 8] [--layers 4] [--tokens 512]

Builds Mixtral-, Qwen3-MoE-, OLMoE- and GPT-OSS-shaped models at random (the GPT-2 vocabulary, ``--experts`` experts
per layer, 2 routed per token), then, under ``mpiexec -n 2`` for each model and each of tp=2 and tp=2 with ``--ep 2``:
``mpitp.start`` + ``mpitp.load_model`` (the loading path of ``mpitp eval``), and per rank the bytes of its own
parameters, the peak RSS the load added (``VmHWM`` reset before it), the seconds of one forward over ``--tokens``
tokens (best of 3) and the bytes its collectives carried in that forward (every ``torch.distributed`` collective
entry point counted for the duration of the forward: a measurement, not a change). Parity per request at tp=2 ep=2
against lm-eval is ``tests/test_architectures.py::test_experts_spread_over_ranks_match_lm_eval``.

Last line: ``RATIO ep_param_bytes <ep / tp-only, mean over the shapes>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss")


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1]) << 10


def child(model: str, ep: int, tokens: int) -> None:
    """One rank: load at tp=2 (``ep``), then time one forward and count its collectives' bytes."""
    import torch
    import torch.distributed as dist
    import transformers.modeling_utils  # noqa: F401 - imports are not the load's memory
    from mpi4py import MPI
    from torch.distributed.tensor import DTensor

    import mpitp

    with mpitp.start(tp=2, device="cpu", threads=1) as rt:
        MPI.COMM_WORLD.Barrier()
        base = _rss("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        m = mpitp.load_model(model, tp=2, device=rt.device, dtype="float32", ep=ep)
        local = [p.to_local() if isinstance(p, DTensor) else p for p in m.parameters()]
        gain = _rss("VmHWM:") - base
        ids = (torch.arange(tokens).view(1, tokens) * 7919) % 50000
        counted = {"bytes": 0, "calls": 0}
        names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_gather",
                 "broadcast")
        saved = {n: getattr(dist, n) for n in names}

        def counting(fn):
            def wrapped(tensor, *args, **kwargs):
                t = tensor if isinstance(tensor, torch.Tensor) else args[0] if args else None
                if isinstance(t, torch.Tensor):
                    counted["bytes"] += t.numel() * t.element_size()
                counted["calls"] += 1
                return fn(tensor, *args, **kwargs)
            return wrapped

        best = float("inf")
        with torch.no_grad():
            m(input_ids=ids[:, :16])  # warm
            for rep in range(3):
                if rep == 0:
                    for n in names:
                        setattr(dist, n, counting(saved[n]))
                t0 = time.perf_counter()
                m(input_ids=ids)
                best = min(best, time.perf_counter() - t0)
                if rep == 0:
                    for n in names:
                        setattr(dist, n, saved[n])
        print("EP " + json.dumps({"rank": rt.world.rank, "param_bytes": sum(t.numel() * t.element_size()
                                                                          for t in local),
                                  "load_peak": gain, "forward_s": best, "coll_bytes": counted["bytes"],
                                  "coll_calls": counted["calls"]}), flush=True)


def build(shape: str, out: Path, hidden: int, experts: int, layers: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(HERE.parent.parent / "shared" / "tokenizers" / "gpt2"))
    cfg = AutoConfig.for_model(shape, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                               moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=hidden // 8, num_local_experts=experts,
                               num_experts=experts, num_experts_per_tok=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return sum(p.numel() for p in m.parameters())


def main() -> None:
    if os.environ.get("MPITP_BENCH_EP_CHILD"):
        child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ep-"))
    mpiexec = Path(sys.executable).parent / "mpiexec"
    rows, ratios = [], []
    for shape in SHAPES:
        n = build(shape, work / shape, args.hidden, args.experts, args.layers)
        got = {}
        for ep in (1, 2):
            proc = subprocess.run([str(mpiexec), "-n", "2", sys.executable, __file__, str(work / shape), str(ep),
                                   str(args.tokens)], capture_output=True, text=True,
                                  env=dict(os.environ, MPITP_BENCH_EP_CHILD="1"))
            ranks = [json.loads(line[3:]) for line in proc.stdout.splitlines() if line.startswith("EP ")]
            if len(ranks) != 2:
                sys.exit(f"{shape} ep={ep}: {proc.stderr[-3000:]}")
            got[ep] = ranks
        for ep, ranks in got.items():
            r = max(ranks, key=lambda x: x["param_bytes"])
            rows.append((shape, f"{n / 1e6:.1f}M", "tp=2 ep=2" if ep == 2 else "tp=2", r["param_bytes"] / 2**20,
                         max(x["load_peak"] for x in ranks) / 2**20, max(x["forward_s"] for x in ranks),
                         r["coll_bytes"] / args.tokens, r["coll_calls"]))
        ratios.append(max(x["param_bytes"] for x in got[2]) / max(x["param_bytes"] for x in got[1]))
    print(f"{'shape':10s} {'params':>7s} {'layout':>10s} {'MiB/rank':>9s} {'load peak MiB':>14s} "
          f"{'forward s':>10s} {'coll B/token':>13s} {'coll calls':>11s}")
    for shape, n, lay, mib, peak, fwd, bpt, calls in rows:
        print(f"{shape:10s} {n:>7s} {lay:>10s} {mib:9.1f} {peak:14.1f} {fwd:10.3f} {bpt:13.0f} {calls:11d}")
    print(f"RATIO ep_param_bytes {sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()
