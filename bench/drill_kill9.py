"""Drill: kill -9 of global rank 0 at a random instant of a real ``mpiexec`` evaluation, N tries.

Question (issue 17): does a SIGKILL of the only writer at any instant leave a readable results file, and does
``--resume`` then give the results of an uninterrupted run? One uninterrupted reference run first; then each try
launches the run (or resumes the file the previous try left) and SIGKILLs rank 0 at a random instant: two tries in
three within half a second after the file holds a random number of rows (chunks landing and being journalled), the
third uniformly over the reference run's time from its first snapshot to its end (also lm-eval's metrics, the final
snapshot and teardown), and checks that the file (if it
exists yet) opens with ``mpitp inspect``-grade readers (snapshot + journal, every row whole). After the last try the
file is resumed to the end and compared with ``mpitp inspect diff`` (exit 0 = same within tolerance).

Run: ``python bench/drill_kill9.py --tries 10`` (4 ranks, dp 2 x tp 2, the built-in demo; ~1 min a try on a loaded
2-core VM). Last line: ``RATIO kill9_readable <readable tries>/<tries>``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

ARGS = ["eval", "--demo", "--tp", "2", "--batch-size", "1", "--limit", "20", "--bootstrap-iters", "0",
        "--timeout", "120"]
# Rank 0 sleeps 0.5 s after each chunk it computes (the fault drills' hook), so that dispatch, not start-up and
# teardown, fills most of a run and most kills land while chunks are landing and being journalled.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "MPITP_REQUEST_CACHE": "0",
       "MPITP_TEST_STALL": "between_chunks:0.5"}


def mpiexec() -> str:
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def launch(n: int, extra: list[str], cwd: str) -> subprocess.Popen:
    """Output to a file (a pipe nobody reads while the drill sleeps would fill up and stall the run)."""
    log = open(os.path.join(cwd, "launch.log"), "wb")
    proc = subprocess.Popen([mpiexec(), "-n", str(n), sys.executable, "-m", "mpitp", *ARGS, *extra], cwd=cwd,
                            env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log.name
    return proc


def output(proc) -> str:
    return Path(proc.log_path).read_text(errors="replace")


def rank0_pid(proc: subprocess.Popen, timeout: float = 120) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if child.environ().get("PMI_RANK") == "0":
                    return child.pid
            except (psutil.Error, OSError):
                continue
        time.sleep(0.05)
    return None


def wait_written(proc, path: str, since: float, timeout: float = 900) -> float:
    """Wait until this launch's writer has written ``path`` (its first snapshot: the file's mtime is after the
    launch); returns that moment. Kills before it would only hit start-up, where the file is not touched."""
    wall_since = time.time() - (time.monotonic() - since)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if os.stat(path).st_mtime >= wall_since:
                return time.monotonic()
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    return time.monotonic()


def rows(path: str) -> int:
    from mpitp.results.rows import request_counts

    try:
        return sum(request_counts(path).values())
    except (OSError, KeyError):
        return 0


def readable(path: str) -> tuple[bool, str]:
    from mpitp.results.rows import load_rows
    from mpitp.results.schema import REQUEST_FIELDS

    if not os.path.exists(path):
        return True, "no file yet"
    try:
        attrs, tasks = load_rows(path)
        n = 0
        for cols in tasks.values():
            lens = {len(cols[k]) for k in REQUEST_FIELDS}
            assert len(lens) == 1, lens
            n += lens.pop()
        return True, f"status {attrs.get('status')}, {n} rows"
    except Exception as exc:  # noqa: BLE001 - the drill reports it
        return False, f"{type(exc).__name__}: {exc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    d = tempfile.mkdtemp(prefix="drill_kill9-")
    try:
        ref = os.path.join(d, "reference.h5")
        t0 = time.monotonic()
        p = launch(4, ["--output", ref], d)
        t_file = wait_written(p, ref, t0)
        p.wait(timeout=900)
        ref_wall = time.monotonic() - t0
        window = ref_wall - (t_file - t0)  # from the first snapshot to the end of the job
        assert p.returncode == 0, output(p)[-3000:]
        print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; reference run {ref_wall:.1f} s "
              f"(launch to exit; {window:.1f} s from its first snapshot), {readable(ref)[1]}; two tries in three "
              f"strike "
              f"once a random number of rows has landed, the third uniformly over that window", flush=True)
        total = rows(ref)
        path = os.path.join(d, "killed.h5")
        ok = 0
        for t in range(args.tries):
            resume = os.path.exists(path)
            if resume and readable(path)[1].startswith("status complete"):
                os.remove(path)  # the previous try finished before its kill: start again
                resume = False
            t_launch = time.monotonic()
            proc = launch(4, ["--output", path] + (["--resume"] if resume else []), d)
            pid = rank0_pid(proc)
            wait_written(proc, path, t_launch)
            if t % 3 == 2:  # anywhere in the writer's lifetime (also metrics, final snapshot, teardown)
                how = "after its first snapshot"
                delay = rng.uniform(0.0, window)
                time.sleep(delay)
            else:  # while chunks land: once the file holds a random number of rows, within half a second
                target = rng.randrange(total)
                while proc.poll() is None and rows(path) <= target:
                    time.sleep(0.02)
                delay = rng.uniform(0.0, 0.5)
                time.sleep(delay)
                how = f"after row {target + 1} of {total} landed"
            finished = proc.poll() is not None
            if pid is not None and not finished:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    finished = True
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            good, what = readable(path)
            ok += good
            journal = os.path.exists(path + ".journal")
            print(f"try {t + 1}: {'resume' if resume else 'fresh'}, kill -9 of rank 0 {delay:.2f} s {how}"
                  f"{' (the run had already ended)' if finished else ''}: "
                  f"{'readable' if good else 'UNREADABLE'} ({what}; journal {'present' if journal else 'absent'})",
                  flush=True)
        t0 = time.monotonic()
        p = launch(4, ["--output", path] + (["--resume"] if os.path.exists(path) else []), d)
        p.wait(timeout=900)
        assert p.returncode == 0, output(p)[-3000:]
        reused = [line for line in output(p).splitlines() if "resume: reusing" in line]
        diff = subprocess.run([sys.executable, "-m", "mpitp", "inspect", "diff", path, ref], capture_output=True,
                              text=True, env=ENV)
        print(f"final resume {time.monotonic() - t0:.1f} s ({'; '.join(x.split('resume: ')[-1] for x in reused)}); "
              f"inspect diff vs reference: exit {diff.returncode}: {diff.stdout.strip().splitlines()[-1:]}")
        print(f"RATIO kill9_readable {ok}/{args.tries}" + ("" if diff.returncode == 0 else " (DIFF FAILED)"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
