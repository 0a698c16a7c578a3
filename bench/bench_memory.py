"""Peak memory per rank: mpitp tp=2 (2 ranks, each loads only its shard) vs lm-eval's HFLM in one process.

    python bench/bench_memory.py [--model large|big|xl] [--limit 5] [--reps 2]

Model: a random-weight Llama with the GPT-2 vocabulary in float32, so the weights dominate: by default ``large``,
~1.02B parameters (hidden 2048, 16 layers; 4.06 GB), or ``big``, ~309M (hidden 1024, 16 layers; 1.23 GB), where the
~0.4 GB of libraries every process carries are still a quarter of lm-eval's peak. Task ``hellaswag_local`` with a
small ``--limit`` (batch 1): the evaluation itself adds little. Peak RSS = ``getrusage(RUSAGE_SELF).ru_maxrss`` of
each rank at its end (``bench/_driver.py``); the "after imports" column is the peak before the timed call, i.e. the
interpreter + torch + transformers + lm-eval (+ mpi4py) share that no sharding can remove; "end RSS anon/file" splits
each rank's RSS at its end into private memory and file-backed pages (shared libraries and the pages of the
memory-mapped checkpoint in use; mpitp's tp > 1 ranks read their strided shards with ``pread``, see
``mpitp.replica.loading``).

Last line: ``RATIO memory_tp2 <max peak RSS over mpitp's ranks / lm_eval's peak RSS>`` (median over repetitions;
target <= 0.6).
"""

from __future__ import annotations

import common

TASK = "hellaswag_local"
MODELS = {"large": common.large_model, "big": common.big_model, "xl": common.xl_model}


def main() -> None:
    ap = common.parser(__doc__, limit=5)
    ap.add_argument("--model", choices=sorted(MODELS), default="large",
                    help="large: ~1.02B params (default); big: ~309M params")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    args = ap.parse_args()
    model = MODELS[args.model]()
    n = common.n_params(model)
    common.say(common.machine())
    common.say(f"model {model}: {n / 1e6:.1f}M params = {n * 4 / 2**20:.0f} MiB float32; {TASK} --limit {args.limit}")
    rows, ratios = [], []
    for rep in range(1, args.reps + 1):
        m = common.run_mpitp(2, model, TASK, tp=2, batch_size=1, limit=args.limit, timeout=args.timeout)
        ref = common.run_lm_eval(model, TASK, batch_size=1, limit=args.limit, timeout=args.timeout)
        for label, r in (("mpitp tp=2, 2 ranks", m), ("lm_eval hf, one process", ref)):
            base = " ".join(f"{x['base_rss_kb'] / 1024:.0f}" for x in r["ranks"])
            split = " ".join(f"{x['end_rss_mb'].get('RssAnon', 0):.0f}/{x['end_rss_mb'].get('RssFile', 0):.0f}"
                             for x in r["ranks"])
            rows.append(common.run_row(rep, label, r) + [base, split])
        ratios.append(max(m["peak_rss_mb"]) / max(ref["peak_rss_mb"]))
        rows.append([rep, "  ratio mpitp max rank / lm_eval", "", "", "", f"{ratios[-1]:.3f}", ""])
    common.say(common.fmt_table(rows, common.RUN_HEADER + ["RSS MB after imports", "end RSS anon/file MB"]))
    ratio = common.median(ratios)
    common.say(f"peak RSS ratio (max mpitp rank / lm_eval process): {ratio:.3f}  target <= 0.6: "
               f"{'MET' if ratio <= 0.6 else 'MISSED'}")
    common.say(common.loadavg())
    common.say(f"RATIO memory_tp2 {ratio:.3f}")


if __name__ == "__main__":
    main()
