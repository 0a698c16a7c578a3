"""Scaling with real compute: mpitp dp=1, 2, 4 on full hellaswag (stories260K) vs single-process lm-eval hf.

    python bench/bench_scaling.py [--batch-size 16] [--limit N] [--plain-too]

Question (issue 17): with a tiny model (so compute per group is small, as it is per group on many GPUs), how much of
a run is rank 0 alone? Runs, one after the other on the same machine (``hellaswag_local``: the real HellaSwag
validation split in ``../shared/data``, 10,042 documents, 40,168 requests; stories260K, float32):

- ``lm_eval`` single process, ``HFLM`` on CPU with 2 torch threads (the issue's baseline);
- ``mpitp`` dp=1 (``mpiexec -n 1 --threads 2``), dp=2 (``-n 2 --threads 1``), dp=4 (``-n 4 --threads 1``, two ranks
  per core on a 2-core VM).

Timed inside each process, imports excluded (``bench/_driver.py``). For each mpitp run: the slowest DP group's busy
seconds (``/stats``), the serial seconds ``wall - max group busy`` (rank 0 alone: checks, model load, lm-eval's
request building and metrics, tokenising, writing), and rank 0's phase timings (root attr ``phases_json``).

Last line: ``RATIO scaling_dp2_vs_lmeval <mpitp dp=2 time / lm-eval time>`` (target <= 0.6).
"""

from __future__ import annotations

import json

import common

TASK = "hellaswag_local"


def phases(path: str) -> dict:
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            return json.loads(f.attrs.get("phases_json", "{}"))
    except (OSError, ValueError):
        return {}


def run_lm_eval(model: str, batch_size: int, limit, threads: int) -> dict:
    spec = dict(model_args=f"pretrained={model},dtype=float32,device=cpu", tasks=[TASK],
                include_path=common.include_path(), batch_size=batch_size, limit=limit, gen_kwargs=None,
                threads=threads)
    env = common.bench_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return common._run([common.PYTHON, common.DRIVER, "lmeval", json.dumps(spec)], env, 3600,
                       f"lm_eval hf threads={threads}")


def main() -> None:
    ap = common.parser(__doc__, limit=None, batch_size=16, reps=1)
    ap.add_argument("--dp", default="1,2,4")
    ap.add_argument("--lm-eval-threads", type=int, default=2,
                    help="torch threads of the lm-eval process (2: the issue's baseline; on a loaded machine two "
                         "OpenMP threads spin-wait for each other, 1 is the fair comparison there)")
    ap.add_argument("--before", metavar="TREE", default=None,
                    help="also run mpitp from this checkout (e.g. `git archive <commit> | tar -x -C TREE`), "
                         "alternating with the current tree at each dp: before/after side by side in one run")
    ap.add_argument("--tree", default=None, help="import mpitp from this checkout instead of PYTHONPATH's")
    ap.add_argument("--no-lm-eval", action="store_true", help="skip the lm-eval reference (no ratio printed)")
    ap.add_argument("--plain-too", action="store_true",
                    help="also run each dp with --no-prefix-sharing (rows scored alone), side by side")
    args = ap.parse_args()
    model = str(common.STORIES)
    common.say(common.machine())
    common.say(f"model {model}, {TASK}" + (f" --limit {args.limit}" if args.limit else " (all documents)") +
               f", batch size {args.batch_size}")
    rows, times = [], {}
    ref = {"time_s": float("nan")}
    if not args.no_lm_eval:
        ref = run_lm_eval(model, args.batch_size, args.limit, threads=args.lm_eval_threads)
        common.say(f"lm_eval hf (1 process, {args.lm_eval_threads} threads): {ref['time_s']:.1f} s, "
                   f"CPU {ref['cpu_s']:.1f} s; "
                   f"{common.loadavg()}")
        rows.append([f"lm_eval hf, {args.lm_eval_threads} threads", ref["time_s"], 1.0, "", "", "", ""])
    trees = ([("before", args.before, [])] if args.before else []) + [("", args.tree, [])]
    if args.plain_too:
        trees.insert(0, ("plain rows", args.tree, ["--no-prefix-sharing"]))
    for dp, (name, tree, flags) in [(int(x), t) for x in args.dp.split(",") for t in trees]:
        threads = "2" if dp == 1 else "1"
        r = common.run_mpitp(dp, model, TASK, batch_size=args.batch_size, limit=args.limit,
                             extra=["--threads", threads, "--dtype", "float32"] + flags, timeout=3600, tree=tree)
        busy = max(r["h5_stats"]["busy_s"])
        ph = phases(r["output"])
        if not name:
            times[dp] = r["time_s"]
        serial = r["time_s"] - busy
        order = ("checks", "load", "requests", "tokenising", "metrics", "writing", "final_snapshot")
        detail = ", ".join(f"{k} {ph[k]:.1f}" for k in order if k in ph)
        st = r["h5_stats"] or {}
        if st.get("row_tokens") is not None and sum(st["row_tokens"]):
            detail += f"; tokens read {sum(st['tokens_read']) / sum(st['row_tokens']):.0%} of the rows'"
        label = f"mpitp dp={dp} (threads {threads})" + (f" [{name}]" if name else "")
        rows.append([label, r["time_s"], r["time_s"] / ref["time_s"], busy, serial,
                     ph.get("dispatch", float("nan")), detail])
        common.say(f"{label}: {r['time_s']:.1f} s, max group busy {busy:.1f} s, serial {serial:.1f} s "
                   f"[{detail}]; {common.loadavg()}")
    common.say(common.fmt_table(rows, ["run", "eval wall s", "time / lm-eval", "max group busy s",
                                       "wall - max busy s", "rank 0 dispatch s", "rank 0 phases s"]))
    if 2 in times and not args.no_lm_eval:
        common.say(f"RATIO scaling_dp2_vs_lmeval {times[2] / ref['time_s']:.3f}")


if __name__ == "__main__":
    main()
