"""Reference numbers from single-process ``lm_eval --model hf`` and the parity rule every layout must meet."""

from __future__ import annotations

import math

import numpy as np


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    """The project's parity rule: ``|d| <= rel * max(1, |ll|)`` (TP reorders float sums: not bitwise)."""
    return abs(a - b) <= rel * max(1.0, abs(b))


def reference_requests(samples: dict) -> dict:
    """``{(task, doc_id, idx): (ll, is_greedy, generation)}`` from lm-eval's logged samples."""
    out = {}
    for task, rows in samples.items():
        for s in rows:
            for idx, resp in enumerate(s["resps"]):
                r = resp[0]
                if isinstance(r, str):
                    out[(task, int(s["doc_id"]), idx)] = (math.nan, False, r)
                elif isinstance(r, (list, tuple)):
                    out[(task, int(s["doc_id"]), idx)] = (float(r[0]), bool(r[1]), "")
                else:
                    out[(task, int(s["doc_id"]), idx)] = (float(r), None, "")
    return out


def mpitp_requests(path: str, tasks) -> dict:
    from mpitp.results.rows import read_requests

    out = {}
    for task in tasks:
        cols = read_requests(path, task)
        for i in range(len(cols["doc_id"])):
            out[(task, int(cols["doc_id"][i]), int(cols["idx"][i]))] = (
                float(cols["loglikelihood"][i]), bool(cols["is_greedy"][i]), str(cols["generation"][i]))
    return out


def compare_requests(ref: dict, got: dict) -> tuple[float, list[str]]:
    """Max relative |d ll| and a list of human-readable mismatches (empty when parity holds)."""
    problems, worst = [], 0.0
    if set(ref) != set(got):
        problems.append(f"request keys differ: missing {sorted(set(ref) - set(got))[:5]}, "
                        f"extra {sorted(set(got) - set(ref))[:5]}")
    for key in sorted(set(ref) & set(got)):
        (rl, rg, rt), (gl, gg, gt) = ref[key], got[key]
        if not math.isnan(rl):
            worst = max(worst, abs(gl - rl) / max(1.0, abs(rl)))
            if not close(gl, rl):
                problems.append(f"{key}: ll {gl!r} vs reference {rl!r}")
            if rg is not None and gg != rg:
                problems.append(f"{key}: is_greedy {gg} vs reference {rg}")
        elif gt != rt:
            problems.append(f"{key}: generation {gt!r} vs reference {rt!r}")
    return worst, problems


def compare_metrics(ref_results: dict, path: str, tasks) -> list[str]:
    from mpitp.results.rows import read_metrics

    problems = []
    for task in tasks:
        got = read_metrics(path, task)
        for k, v in ref_results[task].items():
            if k == "alias" or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            g = got.get(k)
            if g is None or (isinstance(g, str)):
                problems.append(f"{task}/{k}: missing in mpitp file ({g!r})")
            elif not (np.isnan(v) and np.isnan(g)) and not close(float(g), float(v)):
                problems.append(f"{task}/{k}: {g} vs reference {v}")
    return problems
