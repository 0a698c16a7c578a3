"""gsm8k-shaped generation, launch to exit: mpitp tp=2 vs lm-eval HF ``tp_plan=auto`` (2 torchrun ranks).

    python bench/bench_gsm8k.py [--limit 16] [--batch-sizes 1,16] [--reps 2] [--max-gen-toks 64] [--no-parity]
                                [--tree DIR]

Task ``gsm8k_local`` (the stock gsm8k YAML over the real test split, 5-shot from the train split: prompts of 650 to
1150 GPT-2 tokens, left-truncated to 960 = 1024 - 64 by lm-eval), greedy, ``--gen-kwargs max_gen_toks=64``. Model:
the bench's random-weight Llama h512/l8 with the GPT-2 vocabulary (``common.small_model()``).

Per batch size and repetition, back to back (alternating, so a slow phase of the shared machine hits both):
(1) ``mpiexec -n 2 ... mpitp eval --tp 2``, (2) ``torchrun --nproc-per-node 2`` lm-eval ``--model hf`` with
``tp_plan=auto``, both with the same ``--batch-size``. Launch to exit is the time of the whole command (launcher,
imports, load, generation, exit). Once per batch size (``--no-parity`` skips it): single-process lm-eval at that
batch size, the reference: mpitp's generations must equal its generations, string for string (greedy).

Also printed, from mpitp's forward log (``MPITP_TEST_FORWARD_LOG``, first repetition): generate forwards, prefill
forwards and prefill tokens, decode forwards and the rows they computed; and how many generations stopped early
(fewer than ``max_gen_toks`` tokens: a stop string or EOS).

Last lines: ``RATIO gsm8k_tp2_bs<B> <mpitp / lm-eval launch-to-exit>`` per batch size (median of the paired
ratios), then ``RATIO gsm8k_tp2 <ratio at the batch size fastest for each>``.
"""

from __future__ import annotations

import json
import os
import tempfile

import common

TASK = "gsm8k_local"


def _mpitp_generations(r: dict) -> list[str]:
    import h5py

    with h5py.File(r["output"], "r", locking=False) as f:
        g = f[f"tasks/{TASK}/requests"]
        order = sorted(range(len(g["doc_id"])), key=lambda i: int(g["doc_id"][i]))
        return [g["generation"][i].decode() for i in order]


def _forward_counts(path: str) -> dict:
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    gen = [r for r in rows if r["kind"] == "generate"]
    pre = [r for r in gen if r["past"] == 0]
    dec = [r for r in gen if r["past"] > 0]
    return dict(forwards=len(gen), prefills=len(pre), prefill_tokens=sum(r["tokens"] for r in pre),
                decodes=len(dec), decode_rows=sum(r["batch"] for r in dec))


def main() -> None:
    ap = common.parser(__doc__, limit=16, reps=2, limit_help="gsm8k questions")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-gen-toks", type=int, default=64)
    ap.add_argument("--no-parity", action="store_true", help="skip the single-process lm-eval reference runs")
    ap.add_argument("--tree", default=None, help="import mpitp from this checkout (PYTHONPATH), e.g. a copy of an "
                    "earlier commit for the before figures (git archive <rev> mpitp | tar -x -C DIR)")
    args = ap.parse_args()
    model = common.small_model()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    gk = f"max_gen_toks={args.max_gen_toks}"
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), {TASK} 5-shot, --limit {args.limit}, "
               f"{gk}, tp=2, batch sizes {sizes}")
    rows, best_m, best_l, ratios = [], {}, {}, {}
    for bs in sizes:
        tm, tl = [], []
        ref = None
        if not args.no_parity:
            ref = common.run_lm_eval(model, TASK, batch_size=bs, limit=args.limit, gen_kwargs=gk, log_samples=True,
                                     label="lm_eval 1 process")
            rows.append(common.run_row(0, f"bs={bs} lm_eval hf 1 process (reference)", ref))
        for rep in range(1, args.reps + 1):
            log = os.path.join(tempfile.mkdtemp(prefix="gsm8k-fwd-"), "forwards.jsonl")
            env = {"MPITP_TESTING": "1", "MPITP_TEST_FORWARD_LOG": log} if rep == 1 else {}
            m = common.run_mpitp(2, model, TASK, tp=2, batch_size=bs, limit=args.limit, gen_kwargs=gk, env=env,
                                 tree=args.tree)
            lt = common.run_lm_eval(model, TASK, batch_size=bs, limit=args.limit, nproc=2, tp_plan=True,
                                    gen_kwargs=gk, log_samples=True)
            rows.append(common.run_row(rep, f"bs={bs} mpitp tp=2", m))
            rows.append(common.run_row(rep, f"bs={bs} lm_eval hf tp_plan=auto", lt))
            tm.append(m["outer_s"])
            tl.append(lt["outer_s"])
            common.say(f"bs={bs} rep {rep}: mpitp {m['outer_s']:.1f} s, lm_eval tp_plan {lt['outer_s']:.1f} s, "
                       f"ratio {tm[-1] / tl[-1]:.3f}; {common.loadavg()}")
            if rep == 1:
                gens = _mpitp_generations(m)
                theirs = lt["ranks"][0].get("generations", [])
                line = f"bs={bs}: identical generations mpitp vs lm_eval tp_plan: " \
                       f"{sum(a == b for a, b in zip(gens, theirs))}/{len(gens)}"
                if ref is not None:
                    mine = ref["ranks"][0].get("generations", [])
                    line += f", mpitp vs lm_eval 1 process: {sum(a == b for a, b in zip(gens, mine))}/{len(gens)}"
                common.say(line)
                counts = _forward_counts(log)
                n = m["stats"][0]["tokens_generated"] if m.get("stats") else 0
                common.say(f"bs={bs}: mpitp forwards {counts}; tokens generated {n} of "
                           f"{args.limit * args.max_gen_toks} at most")
        ratios[bs] = common.paired(tm, tl)
        best_m[bs], best_l[bs] = common.median(tm), common.median(tl)
    common.say(common.fmt_table(rows, common.RUN_HEADER))
    for bs in sizes:
        common.say(f"bs={bs}: mpitp {best_m[bs]:.1f} s, lm_eval tp_plan {best_l[bs]:.1f} s (medians), paired ratio "
                   f"{ratios[bs]:.3f}")
    bm, bl = min(best_m, key=best_m.get), min(best_l, key=best_l.get)
    best = best_m[bm] / best_l[bl]
    common.say(f"fastest: mpitp at bs={bm} {best_m[bm]:.1f} s, lm_eval tp_plan at bs={bl} {best_l[bl]:.1f} s: "
               f"{best:.3f}  target <= 0.6: {'MET' if best <= 0.6 else 'MISSED'}")
    common.say(common.loadavg())
    for bs in sizes:
        common.say(f"RATIO gsm8k_tp2_bs{bs} {ratios[bs]:.3f}")
    common.say(f"RATIO gsm8k_tp2 {best:.3f}")


if __name__ == "__main__":
    main()
