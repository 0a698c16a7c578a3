"""One rank, no parallelism: mpitp (``mpiexec -n 1``, tp=1) vs lm-eval's HFLM in one process, same batch size.

    python bench/bench_single_rank.py [--limit 50] [--batch-size 8] [--reps 2]

Task ``hellaswag_local`` (real HellaSwag validation, 4 loglikelihood requests per document), model: the random-weight
Llama h512/l8 with the GPT-2 vocabulary (50257), float32, one torch thread each; the runs alternate.

Timed inside each process, imports excluded (see ``bench/_driver.py``): mpitp's whole ``mpitp eval`` call (checks,
model load, lm-eval on rank 0, dispatch to its own group, HDF5 file) vs ``TaskManager`` + ``simple_evaluate(model=
"hf", model_args="pretrained=...,device=cpu,dtype=float32")`` (model load and the same lm-eval task code). Both
include the model load (~1-2 s); mpitp's internal ``wall`` and ``busy`` (forwards only) are printed too.

Both processes are single-threaded and, with one rank, wait on no peer: the CPU time of the timed call is the time
it would take on a core of its own, whereas its wall time on a shared machine depends on what else got scheduled
(the two wall ratios of a pair have differed by 2x here). So the ratio uses CPU time; the wall ratio is printed too.

Last line: ``RATIO single_rank <mpitp CPU time / lm_eval CPU time>`` (median of the paired ratios; target <= 1.05).
"""

from __future__ import annotations

import common

TASK = "hellaswag_local"


def main() -> None:
    ap = common.parser(__doc__, limit=50, batch_size=8)
    args = ap.parse_args()
    model = common.small_model()
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), {TASK} --limit {args.limit}, "
               f"batch size {args.batch_size}, 1 rank, 1 thread")
    rows, tm, tl, cm, cl = [], [], [], [], []
    acc = "acc,none"
    for rep in range(1, args.reps + 1):
        m = common.run_mpitp(1, model, TASK, tp=1, batch_size=args.batch_size, limit=args.limit)
        ref = common.run_lm_eval(model, TASK, batch_size=args.batch_size, limit=args.limit)
        tm.append(m["time_s"])
        tl.append(ref["time_s"])
        cm.append(m["cpu_s"])
        cl.append(ref["cpu_s"])
        rows.append(common.run_row(rep, f"mpitp -n 1 (wall {m['mpitp_wall_s']:.1f}, busy "
                                        f"{m['h5_stats']['busy_s'][0]:.1f} s)", m))
        rows.append(common.run_row(rep, "lm_eval hf, one process", ref))
        rows.append([rep, "  ratio mpitp / lm_eval", m["time_s"] / ref["time_s"], m["cpu_s"] / ref["cpu_s"],
                     m["outer_s"] / ref["outer_s"], ""])
        if rep == 1:
            line = [x for x in m["stdout"].splitlines() if x.startswith("|hellaswag_local")]
            common.say("mpitp:   " + (line[0] if line else "?"))
            common.say(f"lm_eval: acc {ref['ranks'][0]['results'][TASK][acc]:.4f}")
    common.say(common.fmt_table(rows, common.RUN_HEADER))
    wall = common.paired(tm, tl)
    ratio = common.paired(cm, cl)
    common.say(f"paired ratios mpitp / lm_eval: eval CPU time {ratio:.3f}, eval wall time {wall:.3f}")
    common.say(f"target: mpitp <= 1.05x lm_eval's time (CPU): {'MET' if ratio <= 1.05 else 'MISSED'}; "
               f"(wall): {'MET' if wall <= 1.05 else 'MISSED'}")
    common.say(common.loadavg())
    common.say(f"RATIO single_rank {ratio:.3f}")


if __name__ == "__main__":
    main()
