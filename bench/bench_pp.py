"""Pipeline vs tensor parallelism on 4 ranks: mpitp dp=2 x pp=2 vs dp=2 x tp=2 (and dp=4 x tp=1 for context).

    python bench/bench_pp.py [--limit 40] [--batch-size 8] [--reps 2] [--no-dp4] [--model small|big]

Same model (by default the random-weight Llama h512/l8 with the GPT-2 vocabulary, 76.8M params; ``--model big``:
h1024/l16, 308.5M params, where the weights weigh more against the ~0.38 GB of libraries per rank), same task
(``hellaswag_local``, 4 loglikelihood requests per document), same 4 ranks (``mpiexec -n 4``), one torch thread per
rank; only the layout inside a model replica changes:

* ``--pp 2 --tp 1``: each replica is two pipeline stages (stage 0: embedding + layers 0-3; stage 1: layers 4-7, final
  norm and head, scoring); every batch is cut into ``2 * pp`` micro-batches whose activations go stage to stage over
  gloo point-to-point (``pp_bytes`` in ``/stats``);
* ``--tp 2 --pp 1``: each replica is a TP group sharding every layer and the head (two all-reduces per layer, counted
  by neither ``tp_bytes`` nor ``pp_bytes``: those are transformers' own);
* ``--tp 1`` (dp=4): four whole replicas, no model parallelism at all (context; ``--no-dp4`` skips it).

The runs alternate (pp, tp, dp4, pp, tp, dp4, ...). Per run: wall time of the whole ``mpitp eval`` call inside the
processes (slowest rank; checks, stage/shard loading, lm-eval on rank 0, the forwards, HDF5), its CPU time summed
over the 4 ranks, throughput (requests and scored tokens per second of that wall time), the DP groups' busy time,
each rank's peak RSS (``getrusage``) and, from ``/stats``, the bytes sent between stages and over the TP group.
Accuracy (``acc``, ``acc_norm``) is read back from each run's HDF5 file and the per-request log-likelihoods of every
layout are compared with the first pp run's (they must agree to float32 rounding).

Four ranks on a 2-core machine means two ranks per core: a rank that waits (a pipeline bubble, a TP all-reduce
partner that is descheduled) leaves its core to the other replica, so wall-time throughput here says more about the
total CPU work of each layout than about its latency on dedicated cores; the CPU column is shown for that reason.

Last lines: ``RATIO pp2_vs_tp2_throughput <pp requests/s / tp requests/s>`` (median of the paired ratios, i.e. tp
wall / pp wall) and ``RATIO pp2_vs_tp2_peak_rss <max pp rank peak RSS / max tp rank peak RSS>`` (median).
"""

from __future__ import annotations

import math

import common

TASK = "hellaswag_local"
N = 4
MODELS = {"small": common.small_model, "big": common.big_model}


def read_results(path: str) -> tuple[dict, dict]:
    """(metrics of TASK, {(doc_id, idx): loglikelihood}) from an mpitp HDF5 results file."""
    import h5py

    with h5py.File(path, "r", locking=False) as f:
        g = f["tasks"][TASK]
        metrics = {}
        for k, v in g["metrics"].attrs.items():
            try:
                metrics[k] = float(v)
            except (TypeError, ValueError):  # "N/A" stderr and the like
                pass
        req = g["requests"]
        ll = {(int(d), int(i)): float(x) for d, i, x in zip(req["doc_id"][()], req["idx"][()],
                                                                req["loglikelihood"][()])}
    return metrics, ll


def max_abs_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return math.inf
    return max((abs(a[k] - b[k]) for k in a), default=0.0)


def main() -> None:
    ap = common.parser(__doc__, limit=40, batch_size=8)
    ap.add_argument("--no-dp4", action="store_true", help="skip the dp=4 x tp=1 context runs")
    ap.add_argument("--model", choices=sorted(MODELS), default="small",
                    help="small: 76.8M params (default); big: 308.5M params")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    args = ap.parse_args()
    model = MODELS[args.model]()
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), {TASK} --limit {args.limit}, "
               f"batch size {args.batch_size}, {N} ranks, one torch thread each")

    layouts = [("dp2 x pp2", dict(tp=1, extra=["--pp", "2"])), ("dp2 x tp2", dict(tp=2))]
    if not args.no_dp4:
        layouts.append(("dp4 x tp1", dict(tp=1)))
    runs: dict[str, list[dict]] = {name: [] for name, _ in layouts}
    rows, detail = [], []
    reference_ll = None
    for rep in range(1, args.reps + 1):
        for name, kw in layouts:
            r = common.run_mpitp(N, model, TASK, batch_size=args.batch_size, limit=args.limit, timeout=args.timeout,
                                 label=f"mpitp {name}", **kw)
            st = r["h5_stats"] or {}
            r["metrics"], ll = read_results(r["output"])
            if reference_ll is None:
                reference_ll = ll
            r["ll_diff"] = max_abs_diff(ll, reference_ll)
            r["requests"] = int(sum(st.get("requests", [0])))
            r["tokens"] = int(sum(st.get("tokens_scored", [0])))
            r["busy"] = max(st.get("busy_s", [0.0]))
            runs[name].append(r)
            rows.append([rep, name, r["time_s"], r["cpu_s"], r["requests"] / r["time_s"], r["tokens"] / r["time_s"],
                         "/".join(f"{x:.1f}" for x in st.get("busy_s", [])),
                         f"{max(r['peak_rss_mb']):.0f}", " ".join(f"{x:.0f}" for x in r["peak_rss_mb"]),
                         "/".join(f"{x / 1e6:.2f}" for x in st.get("pp_bytes", [0] * len(st.get("busy_s", [])))),
                         "/".join(f"{x / 1e6:.2f}" for x in st.get("tp_bytes", [])),
                         f"{r['metrics'].get('acc,none', float('nan')):.4f} / "
                         f"{r['metrics'].get('acc_norm,none', float('nan')):.4f}"])
            cpu_ranks = " ".join(f"{x['cpu_s']:.1f}" for x in r["ranks"])
            base_ranks = " ".join(f"{x['base_rss_kb'] / 1024:.0f}" for x in r["ranks"])
            split = " ".join(f"{x['end_rss_mb'].get('RssAnon', 0):.0f}/{x['end_rss_mb'].get('RssFile', 0):.0f}"
                             for x in r["ranks"])
            detail.append(f"rep {rep} {name}: {r['requests']} requests, {r['tokens']} tokens scored, "
                          f"forwards/group {st.get('forwards')}, requests/group {st.get('requests')}; per rank: "
                          f"CPU s {cpu_ranks}, RSS after imports MB {base_ranks}, end RSS anon/file MB {split}; "
                          f"max |loglik - first pp run| {r['ll_diff']:.2e}; launch-to-exit {r['outer_s']:.1f} s")
        common.say(f"[rep {rep} done] {common.loadavg()}")

    header = ["rep", "layout", "eval wall s", "CPU s (4 ranks)", "requests/s", "scored tokens/s", "busy s per group",
              "max peak RSS MB", "peak RSS MB per rank", "pp MB per group", "tp MB per group", "acc / acc_norm"]
    common.say(common.fmt_table(rows, header))
    for line in detail:
        common.say(line)

    pp, tp = runs["dp2 x pp2"], runs["dp2 x tp2"]
    thr = common.paired([r["time_s"] for r in tp], [r["time_s"] for r in pp])  # = pp req/s / tp req/s
    cpu = common.paired([r["cpu_s"] for r in pp], [r["cpu_s"] for r in tp])
    busy = common.paired([r["busy"] for r in tp], [r["busy"] for r in pp])
    rss = common.median([max(a["peak_rss_mb"]) / max(b["peak_rss_mb"]) for a, b in zip(pp, tp)])
    common.say(f"pp / tp (median of paired ratios): throughput (whole eval) {thr:.3f}, compute phase "
               f"(tp busy / pp busy) {busy:.3f}, CPU time pp / tp {cpu:.3f}, max peak RSS {rss:.3f}")
    if "dp4 x tp1" in runs:
        d4 = runs["dp4 x tp1"]
        vs_tp = common.paired([r["time_s"] for r in tp], [r["time_s"] for r in d4])
        vs_pp = common.paired([r["time_s"] for r in pp], [r["time_s"] for r in d4])
        mem = common.median([max(a["peak_rss_mb"]) / max(b["peak_rss_mb"]) for a, b in zip(d4, tp)])
        common.say(f"dp4 for context: throughput dp4 / tp2 {vs_tp:.3f}, dp4 / pp2 {vs_pp:.3f}; "
                   f"max peak RSS dp4 / tp2 {mem:.3f}")
    accs = {name: sorted({round(r["metrics"].get("acc,none", math.nan), 6) for r in rs}) for name, rs in runs.items()}
    same = len({tuple(v) for v in accs.values()}) == 1 and all(len(v) == 1 for v in accs.values())
    worst = max(r["ll_diff"] for rs in runs.values() for r in rs)
    common.say(f"accuracy per layout {accs}: {'identical' if same else 'DIFFERENT'}; "
               f"max |loglik difference| over all runs and requests {worst:.2e}")
    common.say(common.loadavg())
    common.say(f"RATIO pp2_vs_tp2_throughput {thr:.3f}")
    common.say(f"RATIO pp2_vs_tp2_peak_rss {rss:.3f}")


if __name__ == "__main__":
    main()
