"""Key-by-key comparison of lm-eval's output files (``--output_path``) written by two runs of the same work.

Only what describes the moment or the host may differ (dates, durations, environment text, the device); every other
key must be present in both, strings and booleans equal, numbers within ``rel`` (fp32 parity: 1e-5).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

VOLATILE = {"date", "start_time", "end_time", "total_evaluation_time_seconds", "pretty_env_info", "git_hash",
            "upper_git_hash", "device"}
"""Keys that record when or where a run happened, not what it computed."""

BY_DESIGN = {"batch_sizes"}
"""Keys mpitp fills differently on purpose: ``--batch_size auto`` picks a size per length bucket (lm-eval: one)."""

ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""A function's repr in a task config (``<function process_docs at 0x7f...>``) differs from process to process."""

EXP_STDERR_REL = 1e-4
"""Bootstrapped stderr of perplexity: exp() of resampled means magnifies a 1e-7 log-likelihood difference about
tenfold (lambada, 2 docs: 1.1e-5 relative); the perplexity itself and every log-likelihood are held to ``rel``."""


def compare(a, b, path: str = "", rel: float = 1e-5, out: list | None = None,
            aliases: tuple[str, str] | None = None) -> list[str]:
    """Differences between two JSON values, as ``path: what`` lines (empty when they match). ``aliases``: a path
    prefix of the first run's and of the second's that stand for the same place (each run's own work folder)."""
    out = [] if out is None else out
    if aliases and isinstance(a, str) and isinstance(b, str):
        a, b = a.replace(aliases[0], "<work>"), b.replace(aliases[1], "<work>")
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in VOLATILE or k in BY_DESIGN:
                continue
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'second' if k not in a else 'first'}")
                continue
            tol = max(rel, EXP_STDERR_REL) if "perplexity_stderr" in str(k) else rel
            compare(a[k], b[k], f"{path}/{k}", tol, out, aliases)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{path}[{i}]", rel, out, aliases)
    elif isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        if a != b:
            out.append(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * max(1.0, abs(a), abs(b))):
            out.append(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, str) and isinstance(b, str):
        if ADDRESS.sub("", a) != ADDRESS.sub("", b) and not _numbers_equal(a, b, rel):
            out.append(f"{path}: {a[:80]!r} vs {b[:80]!r}")
    elif a != b:
        out.append(f"{path}: {a!r} vs {b!r}")
    return out


def _numbers_equal(a: str, b: str, rel: float) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return abs(x - y) <= rel * max(1.0, abs(x), abs(y))


def output_files(root: Path) -> dict[str, Path]:
    """lm-eval's files under an ``--output_path``, keyed by name with the timestamp taken out."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.suffix in (".json", ".jsonl"):
            stem = p.name.rsplit("_", 1)[0]
            files[str(p.parent.relative_to(root) / (stem + p.suffix))] = p
    return files


def compare_output_dirs(mine: Path, ref: Path, rel: float = 1e-5, aliases: tuple[str, str] | None = None) -> list[str]:
    """Same file names (timestamps aside) and, file by file, the same keys and values."""
    a, b = output_files(mine), output_files(ref)
    diffs = [f"file {k}: only in {'mpitp' if k in a else 'lm-eval'}" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        if k.endswith(".jsonl"):
            ra = [json.loads(line) for line in a[k].read_text().splitlines()]
            rb = [json.loads(line) for line in b[k].read_text().splitlines()]
            key = lambda r: (r.get("doc_id"), json.dumps(r.get("arguments"), sort_keys=True))  # noqa: E731
            compare(sorted(ra, key=key), sorted(rb, key=key), k, rel, diffs, aliases)
        else:
            compare(json.loads(a[k].read_text()), json.loads(b[k].read_text()), k, rel, diffs, aliases)
    return diffs
