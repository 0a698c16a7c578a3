"""Rolling loglikelihood with tp=2: mpitp on 2 MPI ranks vs lm-eval's HFLM with ``tp_plan=auto`` on 2 torchrun ranks.

    python bench/bench_rolling_tp2.py [--limit 2] [--reps 2] [--batch-size 1] [--tree DIR]

Task ``wikitext_local`` (WikiText-2 test documents, lm-eval's disjoint rolling windows of max_length = 1024 tokens),
model: the random-weight Llama h512/l8 with the GPT-2 vocabulary (50257). Both sides load the same checkpoint in
float32, run one torch thread per rank and the same lm-eval task code; the runs alternate (A B A B ...).

Timed (inside each process, after imports): mpitp ``mpitp.cli.main([...eval...])`` (TP world, sharded load, lm-eval,
HDF5) vs lm-eval ``TaskManager`` + ``simple_evaluate(model="hf", model_args="pretrained=...,tp_plan=auto")``
(transformers' TP load under torchrun/gloo, then every rank runs lm-eval's full loop on its shard). The slowest
rank's time is reported.

Where the difference comes from: lm-eval's TP model ends in transformers' ``colwise_gather_output`` LM head, so
every rank all-gathers the full [batch, 1024, 50257] float32 logits (206 MB per window) and computes a full
log-softmax; mpitp scores only the target positions on each rank's vocabulary shard and combines 16 B per token.

Last lines: ``RATIO rolling_tp2 <lm_eval time / mpitp time>`` (median over repetitions of the paired ratio), then
``RATIO rolling_tp2_peak_rss <mpitp's largest rank peak RSS / lm-eval's>`` (median over repetitions).
"""

from __future__ import annotations

import common


def main() -> None:
    ap = common.parser(__doc__, limit=2, batch_size=1, limit_help="wikitext documents")
    ap.add_argument("--tree", default=None, help="import mpitp from this checkout (PYTHONPATH), e.g. an earlier "
                    "commit's for the before figures (git archive <rev> mpitp | tar -x -C DIR)")
    args = ap.parse_args()
    model = common.small_model()
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), wikitext_local --limit {args.limit}, "
               f"batch size {args.batch_size}, tp=2")
    rows, t_mpitp, t_lm, c_mpitp, c_lm, rss = [], [], [], [], [], []
    metric = "word_perplexity,none"
    for rep in range(1, args.reps + 1):
        m = common.run_mpitp(2, model, "wikitext_local", tp=2, batch_size=args.batch_size, limit=args.limit,
                             tree=args.tree)
        ref = common.run_lm_eval(model, "wikitext_local", batch_size=args.batch_size, limit=args.limit, nproc=2,
                               tp_plan=True)
        t_mpitp.append(m["time_s"])
        t_lm.append(ref["time_s"])
        c_mpitp.append(m["cpu_s"])
        c_lm.append(ref["cpu_s"])
        rss.append(max(m["peak_rss_mb"]) / max(ref["peak_rss_mb"]))
        rows.append(common.run_row(rep, "mpitp tp=2 (mpiexec -n 2)", m))
        rows.append(common.run_row(rep, "lm_eval hf tp_plan=auto (torchrun x2)", ref))
        rows.append([rep, "  ratio lm_eval / mpitp", ref["time_s"] / m["time_s"], ref["cpu_s"] / m["cpu_s"],
                     ref["outer_s"] / m["outer_s"], ""])
        if rep == 1:
            st = m["h5_stats"]
            ppl_m = [x for x in m["stdout"].splitlines() if "word_perplexity" in x]
            common.say(f"mpitp: {int(st['tokens_scored'][0])} tokens scored in {int(st['forwards'][0])} forwards, "
                       f"busy {st['busy_s'][0]:.1f} s; {ppl_m[0].strip() if ppl_m else ''}")
            common.say(f"lm_eval: word_perplexity {ref['ranks'][0]['results']['wikitext_local'][metric]:.4f}")
    common.say(common.fmt_table(rows, common.RUN_HEADER))
    ratio = common.paired(t_lm, t_mpitp)
    common.say(f"median eval wall: mpitp {common.median(t_mpitp):.2f} s, lm_eval tp_plan {common.median(t_lm):.2f} s; "
               f"paired wall ratio {ratio:.3f}, paired CPU-time ratio {common.paired(c_lm, c_mpitp):.3f}")
    common.say(f"target: mpitp >= 1.5x faster: {'MET' if ratio >= 1.5 else 'MISSED'}")
    common.say(common.loadavg())
    common.say(f"RATIO rolling_tp2 {ratio:.3f}")
    common.say(f"RATIO rolling_tp2_peak_rss {common.median(rss):.3f}")

if __name__ == "__main__":
    main()
