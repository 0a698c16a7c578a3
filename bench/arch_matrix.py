"""The full architecture matrix: every causal-LM type of the installed transformers, built tiny and at random
(tests/support/arch.py), run by mpitp at tp=1 dp=2, tp=2 and pp=2 (two ranks; one MPI launch per layout, a job file
with one run per model) and compared request by request with single-process lm-eval (``--model hf``).

    python bench/arch_matrix.py [--work DIR] [--only a,b] [--table docs/model-support.md]

Prints one row per type: where its TP plan comes from (transformers, mpitp's own: mpitp/replica/tp_plans.py, none),
its PP plan, and per layout parity (the largest relative |d ll| against lm-eval) or mpitp's one-line refusal, or why
the type is not in the matrix (not a plain decoder, cannot be built small). A run that dies with a traceback ends
its launch (a fatal error on one rank aborts the job); this script records it as ``failed`` and starts the layout's
job again without it (finished runs are skipped: their results files are complete), so one failure never hides the
rest. ``--table`` writes the generated support table (docs/model-support.md). CI runs a subset of
it (tests/test_architectures.py: the types the table lacks among them; MPITP_MATRIX_FULL=1 runs all) and fails
on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support import arch as A  # noqa: E402


def _mpirun(layout: A.Layout, job: Path) -> subprocess.CompletedProcess:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    return subprocess.run([str(mpiexec), "-n", str(layout.ranks), sys.executable, "-m", "mpitp", "run", str(job)],
                          capture_output=True, text=True, env={**os.environ, **layout.env()})


def _last_started(output: str) -> str | None:
    found = re.findall(r"=== run \d+/\d+: (\S+)", output)
    return found[-1] if found else None


def run_layout(models: dict[str, Path], refs: dict, layout: A.Layout, include: str, work: Path) -> dict:
    """Every model at ``layout``; a launch that dies is started again without the run it died in."""
    out = work / layout.key
    out.mkdir(exist_ok=True)
    todo, failed, logs, t0 = dict(models), {}, [], time.time()
    while todo:
        job = A.job_file(work / f"matrix-{layout.key}.yaml", todo, include, out, layout.tp, layout.pp)
        proc = _mpirun(layout, job)
        text = proc.stdout + proc.stderr
        logs.append(text)
        if proc.returncode == 0 or A.TRACEBACK not in text:
            break
        died = _last_started(text)
        name = next((n for n in todo if layout.run_name(n) == died), None)
        if name is None:
            break
        lines = [ln for ln in text.splitlines() if "mpitp: fatal" in ln]
        failed[name] = A.Outcome("failed", "traceback: " + (lines[0].split("fatal ", 1)[-1][:150] if lines else "?"))
        (out / f"{name}.h5").unlink(missing_ok=True)
        todo = {n: d for n, d in todo.items() if n not in failed}
    text = "\n".join(logs)
    (work / f"log-{layout.key}.txt").write_text(text)
    result = A.outcomes({n: d for n, d in models.items() if n not in failed}, refs, layout, text, out)
    result.update(failed)
    print(f"layout {layout.key}: {len(models)} models, {len(logs)} launch(es), {time.time() - t0:.0f} s", flush=True)
    return result


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    import transformers

    transformers.logging.set_verbosity_error()
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--table", default=None, help="write the generated support table here (docs/model-support.md)")
    ap.add_argument("--from-dump", default=None, help="only write the table, from a CI test run's MPITP_MATRIX_DUMP")
    args = ap.parse_args()
    if args.from_dump:
        return from_dump(Path(args.from_dump), args.table)
    work = Path(args.work or tempfile.mkdtemp(prefix="arch-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    from support.tasks import materialize_test_tasks

    include = materialize_test_tasks(work / "tasks")
    archs = A.architectures()
    if args.only:
        archs = [a for a in archs if a.model_type in args.only.split(",")]
    excluded, unbuilt, models = {}, {}, {}
    for arch in archs:
        why = A.not_plain_decoder(arch)
        if why:
            excluded[arch.model_type] = why
            continue
        try:
            A.build(arch, work / "models" / arch.model_type)
            models[arch.model_type] = work / "models" / arch.model_type
        except Exception as exc:  # noqa: BLE001 - the reason is the row
            unbuilt[arch.model_type] = A.first_line(exc)
    print(f"built {len(models)} models: {time.time() - t0:.0f} s", flush=True)
    references = A.References(include)
    refs = {}
    for name, d in list(models.items()):
        try:
            refs[name] = references(d)
        except Exception as exc:  # noqa: BLE001
            unbuilt[name] = f"lm-eval hf cannot score it: {A.first_line(exc)}"
            del models[name]
    print(f"references: {time.time() - t0:.0f} s", flush=True)
    cells: dict[str, dict[str, A.Outcome]] = {n: {} for n in models}
    for layout in A.LAYOUTS:
        for name, outcome in run_layout(models, refs, layout, include, work).items():
            cells[name][layout.key] = outcome
    (work / "matrix.json").write_text(json.dumps({n: {k: vars(o) for k, o in c.items()} for n, c in cells.items()},
                                                 indent=1))
    table = A.support_table(archs, excluded, unbuilt, cells)
    print(f"\ntotal {time.time() - t0:.0f} s\n\n{table}")
    if args.table:
        Path(args.table).write_text(A.SUPPORT_HEADER + table)


def from_dump(folder: Path, table_path: str | None) -> None:
    """The table from ``MPITP_MATRIX_DUMP=DIR python -m pytest tests/test_architectures.py``: one run, both uses."""
    reg = json.loads((folder / "registry.json").read_text())
    cells: dict[str, dict[str, A.Outcome]] = {}
    for layout in A.LAYOUTS:
        for name, o in json.loads((folder / f"{layout.key}.json").read_text()).items():
            cells.setdefault(name, {})[layout.key] = A.Outcome(**o)
    table = A.support_table(A.architectures(), reg["excluded"], reg["unbuilt"], cells)
    print(table)
    if table_path:
        Path(table_path).write_text(A.SUPPORT_HEADER + table)


if __name__ == "__main__":
    main()
