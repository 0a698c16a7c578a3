"""The walk of the runtime object: which of mpitp's functions receive it, from the entry point down, on rank 0.

    python bench/rt_walk.py [-n 2] -- eval --demo --tp 2 --limit 2

Runs the command under ``mpiexec`` with a profile hook on rank 0 that records every call of an mpitp function taking
the runtime (an argument whose class is :class:`mpitp.parallel.runtime.Runtime`), with the nearest such function
below it on the stack as its caller. It prints:

- stops: distinct functions that receive the runtime, and the files they live in;
- climbs: calls from a function on a lower floor of ARCHITECTURE.md's "Layers" (tests/test_layers.py's FLOORS) to one
  on a higher floor (a callback: the runtime handed back up);
- returns: calls into another file that the walk had already visited (the walk leaving a file and coming back).

A runtime built once and handed down reads as few stops, no climbs and few returns. Issue 38 counts this walk before
and after the runtime got one owner (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = str(HERE.parent / "mpitp") + os.sep
RUNTIME_TYPES = {("mpitp.parallel.runtime", "Runtime"), ("mpitp.parallel.runtime", "Launch")}


def _child(out: str, argv: list[str]) -> None:
    """Rank 0 records its walk to ``out`` (JSON lines: caller, callee); every rank runs ``mpitp`` as usual."""
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    calls: list[tuple[str | None, str]] = []
    stack: list[tuple[object, str | None]] = []  # (frame, stop name or None)

    def takes_runtime(frame) -> bool:
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        for name in code.co_varnames[:n]:
            value = frame.f_locals.get(name)
            t = type(value)
            if (t.__module__, t.__name__) in RUNTIME_TYPES:
                return True
        return False

    def hook(frame, event, arg):
        if event == "call":
            name = None
            if frame.f_code.co_filename.startswith(PACKAGE) and takes_runtime(frame):
                rel = frame.f_code.co_filename[len(PACKAGE):]
                name = f"{rel}::{frame.f_code.co_qualname}"
                caller = next((s for _, s in reversed(stack) if s), None)
                calls.append((caller, name))
            stack.append((frame, name))
        elif event == "return":
            while stack and stack[-1][0] is not frame:
                stack.pop()
            if stack:
                stack.pop()

    if rank == 0:
        sys.setprofile(hook)
        import threading

        threading.setprofile(None)
    from mpitp.cli import main

    try:
        main(argv)
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        if rank == 0:
            Path(out).write_text("\n".join(json.dumps(c) for c in calls))


def _floor_of(rel: str) -> int:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_layers import FLOORS

    unit = rel.split("/")[0] + "/" if "/" in rel else rel
    return next(i for i, floor in enumerate(FLOORS) if unit in floor)


def summarise(calls: list[tuple[str | None, str]]) -> dict:
    stops, files, visited = [], [], set()
    climbs, returns = [], 0
    for caller, callee in calls:
        f_callee = callee.split("::")[0]
        if callee not in stops:
            stops.append(callee)
        if f_callee not in files:
            files.append(f_callee)
        if caller is not None:
            f_caller = caller.split("::")[0]
            if _floor_of(f_callee) > _floor_of(f_caller):
                climbs.append(f"{caller} -> {callee}")
            if f_callee != f_caller and f_callee in visited:
                returns += 1
        visited.add(f_callee)
    return dict(calls=len(calls), stops=len(stops), files=len(files), climbs=len(set(climbs)),
                climb_list=sorted(set(climbs)), returns=returns, stop_list=stops)


def main() -> None:
    if os.environ.get("MPITP_RT_WALK_OUT"):
        _child(os.environ["MPITP_RT_WALK_OUT"], sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    out = tempfile.mktemp(suffix=".jsonl")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, MPITP_RT_WALK_OUT=out)
    proc = subprocess.run([str(mpiexec), "-n", str(args.n), sys.executable, __file__, *argv], env=env,
                          capture_output=True, text=True)
    if not os.path.exists(out):
        sys.exit(f"no walk recorded (exit {proc.returncode}): {proc.stderr[-2000:]}")
    calls = [tuple(json.loads(line)) for line in Path(out).read_text().splitlines() if line]
    os.unlink(out)
    s = summarise(calls)
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print(f"mpitp {' '.join(argv)} (exit {proc.returncode}): {s['calls']} calls, {s['stops']} stops in "
          f"{s['files']} files, {s['climbs']} climbs, {s['returns']} returns to a visited file")
    for c in s["climb_list"]:
        print("  climb:", c)
    for st in s["stop_list"]:
        print("  stop:", st)


if __name__ == "__main__":
    main()
