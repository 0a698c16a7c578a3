"""Rank 0's tail of one evaluation, after every group has reported its stats: write the results, then report them.

Writing and reporting are separate steps because they fail differently and are wanted separately: the HDF5 file and
lm-eval's own output files are the run's record (a caller of :func:`mpitp.evaluate` may never look at the console),
while the report is lm-eval's tables plus mpitp's lines on the DP groups, the head check, prefix sharing and the
phases, for the person watching the log.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mpitp.errors import exit_bound
from mpitp.evaluation.phases import PhaseClock
from mpitp.evaluation.provenance import redact
from mpitp.results.speed import count
from mpitp.results.untrusted import shown

if TYPE_CHECKING:
    from mpitp.replica.stats import GroupStats

#: Seconds the final snapshot of the results file may take (it holds every row; seconds even for 40k requests).
FINAL_WRITE_WAIT_S = 600.0


@dataclass
class RootResult:
    """What rank 0's evaluation (:class:`mpitp.evaluation.runner._RootRun`) hands to the tail: lm-eval's results,
    the results file's writer (None without a file), rank 0's seconds per phase, the settings, lm-eval's loggers
    (None when ``--output_path`` and the trackers are off) and the per-document scores captured on the way."""

    results: dict
    writer: object | None
    phases: dict
    cfg: object
    loggers: dict | None = None
    doc_scores: dict = field(default_factory=dict)


def finish_root(result: RootResult, all_stats: list[GroupStats], wall: float, head_check_s: float | None = None,
                sharing: str | None = None, head_kept: bool = False, chunks: str | None = None,
                stage_head: str | None = None, prefill: str | None = None) -> None:
    """Write the results (:func:`write_results`), then report them (:func:`report`)."""
    if head_check_s is not None and not head_kept:
        result.phases["head_check"] = head_check_s
    write_results(result, all_stats, wall)
    report(result, all_stats, wall, head_check_s, sharing, head_kept, chunks, stage_head, prefill)


def write_results(result: RootResult, all_stats: list[GroupStats], wall: float) -> None:
    """The HDF5 file's tasks, per-document scores, stats and final snapshot, then lm-eval's output files."""
    res, writer, phases = result.results, result.writer, result.phases
    if writer is not None:
        for task, cfgd in res.get("configs", {}).items():
            metrics = {k: v for k, v in res["results"].get(task, {}).items() if k != "alias"}
            n = res.get("n-samples", {}).get(task, {})
            writer.write_task(task, dict(output_type=cfgd.get("output_type"),
                                         num_fewshot=res.get("n-shot", {}).get(task, 0),
                                         n_docs=n.get("effective", n.get("original", 0))), metrics,
                              samples=res.get("samples", {}).get(task))
            if task in result.doc_scores:
                writer.write_doc_scores(task, result.doc_scores[task])
        writer.write_stats([s.file_row() for s in all_stats])
        serialisable = {k: res[k] for k in ("results", "configs", "versions", "n-shot", "higher_is_better",
                                            "n-samples", "config", "groups", "group_subtasks") if k in res}
        phases["writing"] += writer.busy_s  # the writer thread's seconds, off the dispatch path
        phases["wall"], phases["max_group_busy"] = wall, max((s.busy_s for s in all_stats), default=0.0)
        writer.extra_attrs(phases_json=json.dumps({k: round(v, 4) for k, v in phases.items()}))
        speed = all_stats[0].speed if all_stats else None  # rank 0's record (mpitp.evaluation.requestlog)
        if speed is not None:
            writer.extra_attrs(speed_json=json.dumps(speed))
        t0 = time.perf_counter()
        # The last write may sit in a hung shared filesystem holding the interpreter lock (h5py does): bounded from
        # outside the interpreter, so the job ends with one line instead of at walltime.
        with exit_bound("writing the final results file", FINAL_WRITE_WAIT_S):
            writer.finish(redact(serialisable), wall)  # lm-eval's config holds model_args: no token in the file
        phases["final_snapshot"] = time.perf_counter() - t0
    if result.loggers:
        from mpitp.evaluation.outputs import write_lm_eval_outputs

        write_lm_eval_outputs(res, result.cfg, result.loggers)


def report(result: RootResult, all_stats: list[GroupStats], wall: float, head_check_s: float | None = None,
           sharing: str | None = None, head_kept: bool = False, chunks: str | None = None,
           stage_head: str | None = None, prefill: str | None = None) -> None:
    """The console report: lm-eval's header and tables (its loggers end after them, as under ``lm_eval``), one line
    per DP group, the totals, the head check, prefix sharing, pipeline chunks (``chunks``: with stages, ``"on"`` or
    why not), where the LM head runs (``stage_head``: with stages, ``"spread"`` or why not), how rank 0's group
    prefilled a left-padded generation batch (``prefill``: :meth:`~mpitp.replica.ragged_prefill.RaggedPrefill.summary`,
    None when it met none) and rank 0's phases."""
    from lm_eval.utils import make_table

    res, writer = result.results, result.writer
    if result.loggers:
        from mpitp.evaluation.outputs import header_line

        print(header_line(result.cfg, res))
    print(make_table(res))
    if "groups" in res:
        print(make_table(res, "groups"))
    if result.loggers:
        from mpitp.evaluation.outputs import finish_loggers

        finish_loggers(result.loggers)
    total_busy = sum(s.busy_s for s in all_stats)
    for g, s in enumerate(all_stats):
        per_tok = s.tp_score_bytes / max(1, s.tokens_scored)
        stages = f", stage traffic {s.pp_bytes / 1e6:.2f} MB" if s.pp_bytes else ""
        print(f"DP group {g}: {count(s.requests)} requests, {s.tokens_scored} tokens scored, "
              f"{s.tokens_generated} generated, busy {s.busy_s:.1f} s, TP traffic {s.tp_bytes / 1e6:.2f} MB "
              f"({per_tok:.1f} B/scored token in scoring reductions){stages}")
    where = f"; results: {shown(writer.path)}" if writer is not None else ""
    print(f"wall {wall:.1f} s, busy {total_busy:.1f} s over {len(all_stats)} group(s){where}")
    if head_check_s is None:
        print("head check: skipped (--skip-head-check): log-likelihoods not verified against the model's own logits")
    else:
        from mpitp.replica.headcheck import PROBE_SHAPE

        rows, cols = PROBE_SHAPE
        if head_kept:
            print("head check: passed on this base model before its first adapter; this adapter changes none of the "
                  "head's parameters")
        else:
            print(f"head check: passed in {head_check_s:.2f} s (one extra forward of a {rows}x{cols}-token probe per "
                  f"replica)")
    rows_in, read = sum(s.row_tokens for s in all_stats), sum(s.tokens_read for s in all_stats)
    if sharing is None:
        print(f"prefix sharing: on; the forwards read {read} input tokens for rows of {rows_in}"
              + (f" ({read / rows_in:.0%})" if rows_in else ""))
    else:
        print(f"prefix sharing: {sharing}")
    if chunks == "on":
        print("pipeline chunks: on; batches of fewer rows than twice the stages go through them in chunks of "
              "positions, so the stages overlap")
    elif chunks:
        print(f"pipeline chunks: {chunks}")
    if stage_head == "spread":
        print("pipeline head: spread over the stages; every rank scores its slice of the vocabulary")
    elif stage_head:
        print(f"pipeline head: {stage_head}")
    if prefill == "row by row":
        print("generation prefill: row by row; a left-padded batch's prompts went through unpadded (DP group 0)")
    elif prefill:
        print(f"generation prefill: {prefill}")
    print(PhaseClock.describe(result.phases, wall, all_stats))
    latency = (all_stats[0].speed or {}).get("latency") if all_stats else None
    if latency:
        print("request latency (dispatch to result on rank 0): "
              + ", ".join(f"{k} {v:.3g} s" for k, v in latency.items()))
