"""``--batch_size auto`` vs a sweep of fixed batch sizes, on a short task and a long one, tp=2.

    python bench/bench_auto_batch.py [--limit 40] [--long-limit 2] [--sizes 1,4,16,64] [--reps 1]

Model: the random-weight Llama h512/l8 with the GPT-2 vocabulary (~77M params), ``mpiexec -n 2 mpitp eval --tp 2``,
one torch thread per rank. Tasks: ``arc_easy_local`` (multiple choice, ~30-80-token requests) and ``wikitext_local``
(rolling log-likelihood, 1024-token windows). For each task, every fixed size and ``auto`` run back to back;
throughput is tokens scored per second of compute (the DP group's ``busy_s`` from the HDF5 ``/stats``, so start-up,
loading and lm-eval's request building are left out), and the whole-eval wall time is shown beside it.

Last line: ``RATIO auto_batch <min over the two tasks of auto's throughput / the best fixed size's>`` (target >= 0.8).
"""

from __future__ import annotations

import common

TASKS = ("arc_easy_local", "wikitext_local")


def main() -> None:
    ap = common.parser(__doc__, limit=40, reps=1)
    ap.add_argument("--long-limit", type=int, default=2, help="--limit for the long task (wikitext documents)")
    ap.add_argument("--sizes", default="1,4,16,64")
    args = ap.parse_args()
    model = common.small_model()
    sizes = [int(s) for s in args.sizes.split(",")] + ["auto"]
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), tp=2, sizes {sizes}")
    rows, ratios = [], []
    for task in TASKS:
        limit = args.long_limit if task == "wikitext_local" else args.limit
        best: dict = {}
        for rep in range(1, args.reps + 1):
            for size in sizes:
                r = common.run_mpitp(2, model, task, tp=2, batch_size=size, limit=limit,
                                     label=f"{task} batch {size}")
                st = r["h5_stats"]
                tput = sum(st["tokens_scored"]) / max(1e-9, max(st["busy_s"]))
                best.setdefault(size, []).append(tput)
                rows.append([task, rep, str(size), tput, max(st["busy_s"]), r["time_s"], int(sum(st["forwards"]))])
        tputs = {s: common.median(v) for s, v in best.items()}
        fixed = max((s for s in tputs if s != "auto"), key=lambda s: tputs[s])
        ratio = tputs["auto"] / tputs[fixed]
        ratios.append(ratio)
        rows.append([task, "", f"auto / best fixed ({fixed})", ratio, "", "", ""])
    common.say(common.fmt_table(rows, ["task", "rep", "batch size", "tokens/s (busy)", "busy s", "eval wall s",
                                       "forwards"]))
    worst = min(ratios)
    common.say(f"target: auto >= 0.8x the best fixed size on both tasks: {'MET' if worst >= 0.8 else 'MISSED'}")
    common.say(common.loadavg())
    common.say(f"RATIO auto_batch {worst:.3f}")


if __name__ == "__main__":
    main()
