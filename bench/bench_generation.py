"""Greedy generation of 256 new tokens: mpitp tp=2 vs lm-eval HF ``tp_plan=auto`` (2 torchrun ranks), and mpitp's
KV cache on vs off.

    python bench/bench_generation.py [--limit 1] [--batch-size 1] [--reps 2] [--no-cache-runs]

Task ``gen256_local`` (bench-only, written by :func:`common.include_path`): the first 600 characters (~150 tokens)
of WikiText-2 test documents as prompts, ``max_gen_toks: 256``, ``do_sample: false`` and a stop string that never
occurs, so every request decodes exactly 256 tokens (checked: tokens = requests x 256). Model: the random-weight
Llama h512/l8 with the GPT-2 vocabulary.

Throughput = new tokens / time inside ``_model_generate`` (HF ``generate``; for mpitp including the mirroring of
every forward to its TP worker), measured on the rank that drives generation (see ``bench/_driver.py``).

Per repetition, back to back: (1) mpitp tp=2, (2) lm-eval tp_plan=auto, (3) mpitp tp=2 with the KV cache off, all
with ``--limit`` prompts and ``--batch-size``.

1. mpitp tp=2 vs lm-eval tp_plan=auto. Target: mpitp's tokens/s >= 0.9x lm-eval's. Use ``--batch-size 1`` (the
   default) for the per-step comparison: with batches, mpitp's dispatcher cuts the requests into ~4 chunks per DP group
   before batching (``mpitp.evaluation.dispatch.make_chunks``), so ``--limit 4 --batch-size 4`` runs 3 generate calls
   (1 + 1 + 2 prompts, 768 decode steps) where lm-eval runs one (256 steps); the "generate calls" column shows it.
2. KV cache on vs off inside mpitp (tp=2). ``--gen-kwargs use_cache=False``
   cannot do it (lm-eval's ``HFLM._model_generate`` passes ``use_cache=True`` itself: "got multiple values for
   keyword argument 'use_cache'"), so the driver's ``--no-cache`` forces ``use_cache=False`` on the ``generate`` call;
   mpitp's mirroring then ships the whole growing ``input_ids`` each step (stories260K, 256 steps: 787 kB of TP
   broadcasts instead of 8 kB). Target: cache on >= 3x tokens/s.

Last line: ``RATIO generation_tp2 <mpitp tokens/s / lm_eval tokens/s>`` (median of the paired ratios).
"""

from __future__ import annotations

import common

TASK = "gen256_local"
NEW = 256


def _gen(r: dict) -> tuple[float, int, int]:
    root = r["ranks"][0]
    return root.get("gen_s", float("nan")), root.get("gen_tokens", 0), root.get("gen_calls", 0)


HEADER = common.RUN_HEADER + ["generate calls", "generate s", "new tokens", "tokens/s"]


def _row(rep, label, r, expect_tokens) -> tuple[list, float]:
    gs, gt, gc = _gen(r)
    if gt != expect_tokens:
        common.say(f"WARNING: {label} generated {gt} tokens, expected {expect_tokens}")
    return common.run_row(rep, label, r) + [gc, gs, gt, gt / gs], gt / gs


def _same_generations(m: dict, ref: dict) -> str:
    import h5py

    with h5py.File(m["output"], "r", locking=False) as f:
        g = f[f"tasks/{TASK}/requests"]
        order = sorted(range(len(g["doc_id"])), key=lambda i: int(g["doc_id"][i]))
        mt = [g["generation"][i].decode() for i in order]
    lt = ref["ranks"][0].get("generations", [])
    return f"{sum(a == b for a, b in zip(mt, lt))}/{len(mt)}"


def main() -> None:
    ap = common.parser(__doc__, limit=1, batch_size=1, limit_help="prompts per run")
    ap.add_argument("--no-cache-runs", action="store_true", help="skip the KV cache off runs")
    args = ap.parse_args()
    model = common.small_model()
    expect = args.limit * NEW
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), {TASK}: {NEW} new tokens per prompt, "
               f"--limit {args.limit} --batch-size {args.batch_size}, tp=2")
    rows, tps_m, tps_l, tps_off = [], [], [], []
    for rep in range(1, args.reps + 1):
        m = common.run_mpitp(2, model, TASK, tp=2, batch_size=args.batch_size, limit=args.limit)
        ref = common.run_lm_eval(model, TASK, batch_size=args.batch_size, limit=args.limit, nproc=2, tp_plan=True,
                               log_samples=True)
        row, x = _row(rep, "mpitp tp=2 (KV cache on)", m, expect)
        rows.append(row)
        tps_m.append(x)
        row, x = _row(rep, "lm_eval hf tp_plan=auto", ref, expect)
        rows.append(row)
        tps_l.append(x)
        rows.append([rep, "  ratio mpitp / lm_eval", "", "", "", "", "", "", "", tps_m[-1] / tps_l[-1]])
        if rep == 1:
            common.say(f"identical generations mpitp vs lm_eval: {_same_generations(m, ref)}")
        if not args.no_cache_runs:
            o = common.run_mpitp(2, model, TASK, tp=2, batch_size=args.batch_size, limit=args.limit, no_cache=True,
                                 label="mpitp cache off")
            row, x = _row(rep, "mpitp tp=2 KV cache OFF", o, expect)
            rows.append(row)
            tps_off.append(x)
            rows.append([rep, "  ratio cache on / off", "", "", "", "", "", "", "", tps_m[-1] / tps_off[-1]])
    common.say(common.fmt_table(rows, HEADER))
    ratio = common.paired(tps_m, tps_l)
    common.say(f"mpitp / lm_eval tokens/s (paired median): {ratio:.3f}  target >= 0.9: "
               f"{'MET' if ratio >= 0.9 else 'MISSED'}")
    if tps_off:
        cache_ratio = common.paired(tps_m, tps_off)
        common.say(f"mpitp KV cache on / off tokens/s (paired median): {cache_ratio:.3f}  target >= 3: "
                   f"{'MET' if cache_ratio >= 3 else 'MISSED'}")
        common.say(f"RATIO generation_kv_cache {cache_ratio:.3f}")
    common.say(common.loadavg())
    common.say(f"RATIO generation_tp2 {ratio:.3f}")

if __name__ == "__main__":
    main()
