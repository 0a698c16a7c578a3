"""Data-parallel scaling: mpitp dp=2 (``mpiexec -n 2``, tp=1) vs dp=1 (``mpiexec -n 1``), same everything else.

    python bench/bench_dp_scaling.py [--limit 200] [--batch-size 8] [--reps 2]

Task ``hellaswag_local`` (4 loglikelihood requests per document), model: the random-weight Llama h512/l8 with the
GPT-2 vocabulary, one torch thread per rank; the runs alternate. Timed inside each process, imports excluded: the
whole ``mpitp eval`` call (checks, model load on every rank, lm-eval's request building and metrics on rank 0 -- the
serial part -- and the dispatched forwards). Also shown: the compute-phase speed-up, dp=1 ``busy_s`` over the
slowest dp=2 group's ``busy_s`` (from the HDF5 ``/stats``).

On this 2-core machine dp=2 needs both cores for the whole run; any other load on the machine takes them from the
dp=2 run first, so the ratio is bounded by what the machine leaves free (see the CPU column).

The CPU-time figure (dp=1's CPU time over the busier dp=2 rank's) is what the speed-up would be on two free cores
if no rank ever waited for the other: an upper bound, but one that does not depend on the other load.

Last line: ``RATIO dp_scaling <t(dp=1) / t(dp=2)>`` (median of the paired ratios; target >= 1.8).
"""

from __future__ import annotations

import common

TASK = "hellaswag_local"


def main() -> None:
    ap = common.parser(__doc__, limit=200, batch_size=8)
    args = ap.parse_args()
    model = common.small_model()
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), {TASK} --limit {args.limit}, "
               f"batch size {args.batch_size}, tp=1")
    rows, t1, t2, b1, b2, c1, c2 = [], [], [], [], [], [], []
    for rep in range(1, args.reps + 1):
        one = common.run_mpitp(1, model, TASK, tp=1, batch_size=args.batch_size, limit=args.limit)
        two = common.run_mpitp(2, model, TASK, tp=1, batch_size=args.batch_size, limit=args.limit)
        t1.append(one["time_s"])
        t2.append(two["time_s"])
        b1.append(max(one["h5_stats"]["busy_s"]))
        b2.append(max(two["h5_stats"]["busy_s"]))
        c1.append(one["cpu_s"])
        c2.append(max(r["cpu_s"] for r in two["ranks"]))
        for label, r in (("mpitp dp=1", one), ("mpitp dp=2", two)):
            st = r["h5_stats"]
            busy = "/".join(f"{x:.1f}" for x in st["busy_s"])
            reqs = "/".join(str(int(x)) for x in st["requests"])
            rows.append(common.run_row(rep, label, r) + [busy, reqs])
        rows.append([rep, "  speed-up dp1 / dp2", t1[-1] / t2[-1], f"{c1[-1] / c2[-1]:.3f} (busiest rank)",
                     one["outer_s"] / two["outer_s"], "", f"{b1[-1] / b2[-1]:.3f}", ""])
    common.say(common.fmt_table(rows, common.RUN_HEADER + ["busy s per group", "requests per group"]))
    ratio = common.paired(t1, t2)
    common.say(f"paired speed-up: whole eval (wall) {ratio:.3f}, compute phase (busy) {common.paired(b1, b2):.3f}, "
               f"CPU time dp=1 / busiest dp=2 rank {common.paired(c1, c2):.3f}")
    common.say(f"target: >= 1.8x: {'MET' if ratio >= 1.8 else 'MISSED'}")
    common.say(common.loadavg())
    common.say(f"RATIO dp_scaling {ratio:.3f}")


if __name__ == "__main__":
    main()
