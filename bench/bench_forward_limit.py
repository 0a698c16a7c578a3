"""How close mpitp's compute is to the limit: its busy time against the same forwards run alone, in one process.

    python bench/bench_forward_limit.py [--workloads rolling,mc,gen] [--layouts tp1,tp2,dp2,pp2] [--reps 1]
                                        [--pure-reps 3] [--rolling-limit 2] [--mc-limit 20] [--gen-limit 4]
                                        [--max-gen-toks 32] [--model small|big] [--tree DIR]

Why: the other benches compare mpitp with lm-eval, which says nothing about what mpitp itself loses around its
forwards (tokenising, batching, the control messages, the TP/PP traffic, HF ``generate``'s Python per step). Here
each cell is one ``mpitp eval`` run with ``MPITP_TEST_FORWARD_LOG`` (:func:`mpitp.testing.log_forward`): every DP
leader writes down the shape of each forward its replica ran. The bench then replays exactly those shapes with random
token ids through ``AutoModelForCausalLM`` in this process, same checkpoint, float32, torch threads = the layout's
rank count (the cores mpitp had), and compares:

* ``busy_s``: mpitp's own busy seconds (``/stats/busy_s`` of the results file: the DP group's time inside
  ``MPITPLM.compute``), the largest over DP groups, since groups run at the same time;
* ``pure_s``: the replay. A scoring forward (``score`` line: ``batch`` sequences of ``seq`` ids, ``scored``
  positions) is the base model over ``[batch, seq]``, the LM head over the scored positions only, a log-softmax and
  the targets' entries: the least any scorer computes. A prefix-shared tree (``branches`` > 0) is fed as what
  mpitp fed, ``[batch, seq]`` packed positions, in plain causal attention: the tree's masked attention is part of
  mpitp's cost. A ``generate`` line is a prefill (``past`` 0: a fresh KV cache; a padded batch mpitp prefilled row
  by row logs one line per prompt length, each its own forward, their caches then joined left-padded) or a decode
  step of ``seq`` new ids on the cache, head on the last position only (``logits_to_keep=1``), then argmax.
  ``pure_s`` is the median of ``--pure-reps`` replays, after one untimed warm-up forward.

Workloads (the bench's offline tasks, ``common.include_path``; random-weight Llama h512/l8, GPT-2 vocabulary):
``rolling`` = ``wikitext_local`` (lm-eval's rolling windows of 1024 tokens), ``mc`` = ``hellaswag_local`` (four
endings per context: mpitp packs them as trees), ``gen`` = ``gsm8k_local`` (greedy, 5-shot prompt,
``max_gen_toks`` from ``--max-gen-toks``). Layouts: ``tp1`` (1 rank), ``tp2``, ``dp2``, ``pp2`` (2 ranks each).

Table per workload x layout: forwards, tokens fed, busy_s, pure_s, ratio = busy / pure (target <= 1.2); with
``--reps`` > 1 each repetition runs mpitp then its replay, and the median of the paired ratios is reported.
Lines: ``RATIO forward_limit_<workload>_<layout> <ratio>`` per cell, and last ``RATIO forward_limit_max <worst>``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import common

WORKLOADS = {
    "rolling": dict(task="wikitext_local", batch_size=1, limit="rolling_limit"),
    "mc": dict(task="hellaswag_local", batch_size=8, limit="mc_limit"),
    "gen": dict(task="gsm8k_local", batch_size=2, limit="gen_limit"),
}
LAYOUTS = {  # name: (ranks, run_mpitp keywords)
    "tp1": (1, dict(tp=1)),
    "tp2": (2, dict(tp=2)),
    "dp2": (2, dict(tp=1)),
    "pp2": (2, dict(tp=1, extra=["--pp", "2"])),
}
TARGET = 1.2


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1, help="mpitp runs per cell, each replayed (paired ratios)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--rolling-limit", type=int, default=2, help="wikitext documents")
    ap.add_argument("--mc-limit", type=int, default=20, help="hellaswag documents (4 rows each)")
    ap.add_argument("--gen-limit", type=int, default=4, help="gsm8k questions")
    ap.add_argument("--max-gen-toks", type=int, default=32)
    ap.add_argument("--pure-reps", type=int, default=3, help="replays per mpitp run (their median is pure_s)")
    ap.add_argument("--model", choices=("small", "big"), default="small",
                    help="small: 77M Llama, GPT-2 vocabulary (the head a third of the work); big: 309M, 16 layers")
    ap.add_argument("--tree", default=None, help="run mpitp from this checkout (PYTHONPATH): an earlier commit's "
                                                 "`git archive <rev> mpitp | tar -x -C DIR`, for before/after")
    args = ap.parse_args()
    for name, known in (("workloads", WORKLOADS), ("layouts", LAYOUTS)):
        bad = set(getattr(args, name).split(",")) - set(known)
        if bad:
            ap.error(f"unknown {name}: {', '.join(sorted(bad))} (known: {', '.join(known)})")
    return args


def run_cell(model: str, workload: str, layout: str, args) -> tuple[dict, list[dict]]:
    """One ``mpitp eval`` with the forward log on; returns the run and the log's lines, each DP group's in order."""
    spec = WORKLOADS[workload]
    ranks, kw = LAYOUTS[layout]
    log = common.CACHE / "out" / f"forwards-{workload}-{layout}-{time.monotonic_ns()}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    gen = f"max_gen_toks={args.max_gen_toks}" if workload == "gen" else None
    run = common.run_mpitp(ranks, model, spec["task"], batch_size=spec["batch_size"],
                           limit=getattr(args, spec["limit"]), gen_kwargs=gen, label=f"mpitp {layout} {workload}",
                           env={"MPITP_TESTING": "1", "MPITP_TEST_FORWARD_LOG": str(log)}, tree=args.tree, **kw)
    lines = [json.loads(x) for x in Path(log).read_text().splitlines() if x.strip()] if log.exists() else []
    log.unlink(missing_ok=True)
    Path(run["output"]).unlink(missing_ok=True)
    lines.sort(key=lambda x: x["dp"])  # stable: each DP group's forwards stay in the order they ran
    return run, lines


class Replay:
    """The logged forwards as plain single-process forwards of the same checkpoint (inputs drawn before timing)."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.base = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.vocab = int(self.model.config.vocab_size)
        self.gen = torch.Generator().manual_seed(0)

    def _ids(self, *shape: int):
        return self.torch.randint(0, self.vocab, shape, generator=self.gen)

    def inputs(self, lines: list[dict]) -> list[tuple]:
        """Per line: (kind, ids, scored positions, targets) for scoring, (kind, ids, past) for generation."""
        out = []
        for x in lines:
            ids = self._ids(x["batch"], x["seq"])
            if x["kind"] == "score":
                sel = self.torch.randint(0, x["batch"] * x["seq"], (x["scored"],), generator=self.gen)
                out.append(("score", ids, sel, self._ids(x["scored"])))
            else:
                out.append(("generate", ids, x["past"]))
        return out

    def run(self, inputs: list[tuple]) -> int:
        """Run the forwards once; returns how many decode steps' cache length differed from the log's ``past``."""
        torch = self.torch
        from transformers import DynamicCache

        cache, mismatched, pending = None, 0, []
        with torch.no_grad():
            for item in inputs:
                if item[0] == "score":
                    _, ids, sel, tgt = item
                    h = self.base(input_ids=ids, use_cache=False).last_hidden_state
                    logits = self.head(h.reshape(-1, h.shape[-1]).index_select(0, sel)).float()
                    logits.log_softmax(-1).gather(1, tgt[:, None])
                    logits.argmax(-1)
                    continue
                _, ids, past = item
                if past == 0:  # a prefill, or one prompt length's rows of a prefill that went row by row
                    pending.append(DynamicCache(config=self.model.config))
                    self.model(input_ids=ids, cache=pending[-1], use_cache=True, logits_to_keep=1).logits.argmax(-1)
                    continue
                if pending:  # the call's decode steps: one cache of all its rows, as mpitp places them
                    cache, pending = self._merged(pending), []
                mismatched += int(cache is None or cache.get_seq_length() != past)
                self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        return mismatched

    def _merged(self, caches: list):
        """One cache of the rows of ``caches`` (rows of different prompt lengths), each left-padded with zeros to
        the longest, as :mod:`mpitp.replica.ragged_prefill` places them; a single cache as it is."""
        if len(caches) == 1:
            return caches[0]
        from transformers import DynamicCache

        torch = self.torch
        longest = max(c.get_seq_length() for c in caches)
        out = DynamicCache(config=self.model.config)
        for i in range(len(caches[0].layers)):
            def padded(name):
                return torch.cat([torch.nn.functional.pad(getattr(c.layers[i], name),
                                                          (0, 0, longest - c.get_seq_length(), 0)) for c in caches])
            out.update(padded("keys"), padded("values"), i)
        return out

    def time(self, lines: list[dict], threads: int, reps: int) -> tuple[list[float], int]:
        """Seconds of ``reps`` replays with ``threads`` torch threads, after one untimed warm-up forward (mpitp's
        head check and prefix probe warm its model before its busy time starts); and the cache lengths that
        drifted. Several replays: on a shared machine one can land in someone else's burst."""
        self.torch.set_num_threads(threads)
        inputs = self.inputs(lines)
        self.run(inputs[:1])
        times, mismatched = [], 0
        for _ in range(reps):
            t0 = time.perf_counter()
            mismatched = self.run(inputs)
            times.append(time.perf_counter() - t0)
        return times, mismatched


#: mpitp's own verdicts on what it ran (its summary lines), kept in the cell's line: a run whose probe turned prefix
#: sharing or pipeline chunks off is slower for that reason, and says so (one rolling pp=2 run took 2x, session 21)
SWITCHES = r"^(?:prefix sharing|pipeline chunks): (?:on|off[^;\n]*)"


def summarise(workload: str, layout: str, run: dict, lines: list[dict]) -> dict:
    """The cell's mpitp side: busy (largest DP group's), forwards and tokens logged, /stats forwards to check."""
    st = run["h5_stats"] or {}
    busy = st.get("busy_s", [0.0])
    return dict(workload=workload, layout=layout, busy=max(busy), busy_groups=busy, forwards=len(lines),
                tokens=sum(x["tokens"] for x in lines), stats_forwards=int(sum(st.get("forwards", [0]))),
                wall=run["time_s"], row_tokens=int(sum(st.get("row_tokens", [0]))),
                tokens_read=int(sum(st.get("tokens_read", [0]))),
                switches=re.findall(SWITCHES, run["stdout"] + run["stderr"], re.M))


def describe(cell: dict, ratio: float) -> str:
    """The cell's line: times, every replay (their spread shows the machine's load), the tokens and the checks."""
    replays = " ".join(f"{t:.2f}" for t in cell["pure_all"])
    out = (f"[{cell['workload']} {cell['layout']}] eval wall {cell['wall']:.1f} s, busy {cell['busy']:.2f} s, "
           f"pure {cell['pure']:.2f} s (replays {replays}), ratio {ratio:.3f}")
    if cell["workload"] != "gen":  # scoring: what prefix sharing saved, what padding cost
        out += (f"; tokens read {cell['tokens_read']} (rows alone: {cell['row_tokens']}), fed with padding "
                f"{cell['tokens']}")
        if cell["stats_forwards"] != cell["forwards"]:
            out += f" (/stats counts {cell['stats_forwards']} forwards: the log and the file disagree)"
    if cell["mismatched"]:
        out += f"; {cell['mismatched']} cache lengths differed from the log"
    return "; ".join([out, *cell["switches"]])


def measure(model: str, replay: Replay, workload: str, layout: str, args) -> tuple[dict, float]:
    """``--reps`` x (mpitp run, then ``--pure-reps`` replays of its log): the first run's cell and the median of
    the paired busy / pure ratios."""
    threads = LAYOUTS[layout][0]
    paired, cells = [], []
    for _ in range(args.reps):
        run, lines = run_cell(model, workload, layout, args)
        cell = summarise(workload, layout, run, lines)
        times, cell["mismatched"] = replay.time(lines, threads, args.pure_reps)
        cell["pure"], cell["pure_all"] = common.median(times), times
        paired.append(cell["busy"] / cell["pure"] if cell["pure"] > 0 else float("inf"))
        cells.append(cell)
    cell = dict(cells[0], busy=common.median([c["busy"] for c in cells]),
                pure=common.median([c["pure"] for c in cells]))
    return cell, common.median(paired)


def main() -> None:
    args = arguments()
    model = common.small_model() if args.model == "small" else common.big_model()
    common.include_path()
    common.say(common.machine())
    common.say(f"model {model} ({common.n_params(model) / 1e6:.1f}M params), float32; workloads {args.workloads}, "
               f"layouts {args.layouts}; limits rolling {args.rolling_limit} docs, mc {args.mc_limit} docs, gen "
               f"{args.gen_limit} questions at max_gen_toks {args.max_gen_toks}; reps {args.reps}, pure reps "
               f"{args.pure_reps}")
    replay = Replay(model)
    rows, ratios = [], {}
    for workload in args.workloads.split(","):
        for layout in args.layouts.split(","):
            cell, ratio = measure(model, replay, workload, layout, args)
            ratios[f"{workload}_{layout}"] = ratio
            rows.append([workload, layout, LAYOUTS[layout][0], cell["forwards"], cell["tokens"], cell["busy"],
                         cell["pure"], ratio, "ok" if ratio <= TARGET else "over",
                         " ".join(f"{b:.2f}" for b in cell["busy_groups"])])
            common.say(describe(cell, ratio))
    common.say(common.fmt_table(rows, ["workload", "layout", "threads", "forwards", "tokens fed", "busy_s",
                                       "pure_s", "busy/pure", f"<= {TARGET}", "busy_s per DP group"]))
    common.say(common.loadavg())
    for name, ratio in ratios.items():
        common.say(f"RATIO forward_limit_{name} {ratio:.3f}")
    common.say(f"RATIO forward_limit_max {max(ratios.values()):.3f}")


if __name__ == "__main__":
    main()
