"""Fuzzing the readers of results files and journals (issue 27): a file from anyone must end as the readers' one-line
error (:class:`~mpitp.results.untrusted.BadInput`, or the :class:`~mpitp.errors.UsageError` of ``--resume`` and
``rescore``) or be
read: never a traceback, never a hang, never memory beyond a bound.

A real two-task results file and a real killed run's snapshot + journal are written once by the real
:class:`~mpitp.results.store.ResultWriter`; each case damages a copy with a fixed seed (random byte flips, an
attribute or dataset replaced by a value of a random type, a journal record of a random shape with a valid CRC) and
the reader paths run on it in a forked child: ``inspect``'s table, CSV and JSON, and one of: its requests and
samples, ``diff`` with its paired statistics, ``--resume``'s check, ``rescore``'s reading. The child runs under
``RLIMIT_AS`` (what it has plus :data:`MEMORY_BOUND`) and is killed after :data:`CASE_TIMEOUT_S`; HDF5's C library
is exercised too, so a crash there shows as a signal, not as a lost pytest. Two cases also go through the
``mpitp inspect`` command as a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
import traceback

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mpitp.errors import UsageError  # noqa: E402
from mpitp.evaluation.checks import check_resumable  # noqa: E402
from mpitp.evaluation.rescore import _config as rescore_config  # noqa: E402
from mpitp.evaluation.rescore import _stored_rows as stored_rows  # noqa: E402
from mpitp.evaluation.settings import EvalConfig  # noqa: E402
from mpitp.results.diff import diff_runs, render_diff, render_statistics  # noqa: E402
from mpitp.results.journal import MAGIC, frame, journal_path  # noqa: E402
from mpitp.results.reader import BadInput, load, load_samples  # noqa: E402
from mpitp.results.render import lm_eval_json, render_csv, render_requests, render_summary  # noqa: E402
from mpitp.results.store import ResultWriter  # noqa: E402
from test_inspect import META, make_file  # noqa: E402

SEED = 27
MEMORY_BOUND = 1 << 30  # bytes of address space a case may add to what the process already has
CASE_TIMEOUT_S = 20.0
CFG = EvalConfig(model="synthetic/model", tasks=["syn_mc", "syn_gen"], limit=3)


def read_everything(path: str, paths: str = "rdc") -> None:
    """The reader paths of ``inspect`` (table, CSV, JSON; ``r``: requests and samples), ``diff`` with its statistics
    (``d``), ``--resume``'s check (``c``) and ``rescore``'s reading (``s``) on ``path``; only their one-line errors
    escape."""
    try:
        run = load(path)
        render_summary(run, None)
        render_csv(run, None)
        lm_eval_json(run, None)
        for task in run.tasks if "r" in paths else ():
            render_requests(path, task, None)
            load_samples(path, task)
        if "d" in paths:
            diffs, only = diff_runs(run, run, 1e-6, 1e-5)
            render_diff(run, run, diffs, only, 1e-6, 1e-5, 5)
            render_statistics(run, run, [d.task for d in diffs], 20, 1)
    except BadInput:
        pass
    if "c" in paths:
        try:
            check_resumable(path, CFG)
        except UsageError:
            pass
    if "s" in paths:
        try:
            rescore_config(path, None, None)
            stored_rows(path)
        except UsageError:
            pass


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_case(path: str, paths: str) -> str | None:
    """None when the readers (:func:`read_everything`) ended well on ``path`` in a forked child; else what went
    wrong."""
    r, w = os.pipe()
    limit = _vm_size() + MEMORY_BOUND
    pid = os.fork()
    if pid == 0:  # the child: bounded memory, report through the pipe, never return into pytest
        os.close(r)
        code = 0
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            read_everything(path, paths)
        except BaseException:  # noqa: BLE001 - anything else is the failure this test looks for
            os.write(w, traceback.format_exc()[-3000:].encode())
            code = 3
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + CASE_TIMEOUT_S
    status = None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return f"hung for {CASE_TIMEOUT_S:g} s"
        else:
            time.sleep(0.002)
    with os.fdopen(r, "rb") as f:
        report = f.read().decode(errors="replace")
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return report or (None if os.WEXITSTATUS(status) == 0 else f"exit status {os.WEXITSTATUS(status)}")


# ------------------------------------------------------------------------------------------------ damage

def random_value(rng: random.Random):
    return rng.choice([
        np.arange(rng.randrange(0, 4)), np.zeros((2, 2)), np.int64(-(2**62)), rng.random() * 1e300, float("nan"),
        "text\x1b[2J", b"\xff\xfe", True, "", "null", "[1, 2]", '{"results": [1]}', '{"a": {"b": null}}',
        json.dumps({"results": {"syn_mc": [1]}, "n-samples": {"syn_mc": "x"}}), np.array([b"a", b"b"]), 2**40,
    ])


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind < 5:
        return [None, rng.randrange(-5, 2**40), rng.random(), "s\x00\x1b", True][kind]
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 6:
        keys = ["doc_id", "idx", "seq", "tasks", "syn_mc", "results", "x"]
        return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(3))}
    return {"syn_mc": {"doc_id": [1], "idx": random_json(rng, depth + 1)}}


def mutate_json(rng: random.Random, obj):
    """``obj`` with one nested value (or the whole) replaced by random JSON."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        k = rng.choice(list(obj))
        return {**obj, k: mutate_json(rng, obj[k])}
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        i = rng.randrange(len(obj))
        return obj[:i] + [mutate_json(rng, obj[i])] + obj[i + 1:]
    return random_json(rng)


def flip_bytes(rng: random.Random, src: str, dst: str) -> None:
    data = bytearray(open(src, "rb").read())
    for _ in range(rng.randint(1, 6)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    open(dst, "wb").write(bytes(data))


def _objects(f) -> list[str]:
    names = ["/"]
    f.visit(names.append)
    return names


def retype(rng: random.Random, src: str, dst: str) -> None:
    """A copy of ``src`` with one attribute or dataset replaced by a value of a random type."""
    with open(src, "rb") as a, open(dst, "wb") as b:
        b.write(a.read())
    with h5py.File(dst, "a") as f:
        name = rng.choice(_objects(f))
        obj = f[name]
        if isinstance(obj, h5py.Dataset) and rng.random() < 0.5:
            del f[name]
            value = random_value(rng)
            f.create_dataset(name, data=value, dtype=h5py.string_dtype() if isinstance(value, str) else None)
            return
        keys = list(obj.attrs)
        if not keys:
            obj.attrs["x"] = random_value(rng)
            return
        key = rng.choice(keys)
        old = obj.attrs[key]
        if isinstance(old, str) and old[:1] in "[{" and rng.random() < 0.6:
            obj.attrs[key] = json.dumps(mutate_json(rng, json.loads(old)))
        else:
            obj.attrs[key] = random_value(rng)


def journal_case(rng: random.Random, running: str, dst: str) -> None:
    """A copy of a killed run with one more journal record of a random shape (a valid CRC), or flipped bytes in
    its journal with every CRC recomputed, or a header of a random shape."""
    with open(running, "rb") as a, open(dst, "wb") as b:
        b.write(a.read())
    data = open(journal_path(running), "rb").read()
    what = rng.randrange(3)
    if what == 0:
        good = {"seq": 99, "tasks": {"syn_mc": {"doc_id": [5], "idx": [0], "kind": ["loglikelihood"],
                                               "loglikelihood": [-1.0], "is_greedy": [True], "generation": [""],
                                               "n_tokens": [2], "args_hash": ["h"]}}}
        data += frame(mutate_json(rng, good))
    elif what == 1:
        with h5py.File(running, "r") as f:
            run_id = f.attrs["run_id"]
        header = mutate_json(rng, {"run_id": run_id, "base_seq": 0})
        data = MAGIC + frame(header) + data[len(MAGIC) + len(frame({"run_id": run_id, "base_seq": 0})):]
    else:
        body = bytearray(json.dumps([1, {"seq": 5, "tasks": {"syn_mc": {"doc_id": [1, 2]}}}]).encode())
        for _ in range(rng.randint(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(32, 127)
        data += frame(body.decode("latin-1"))
    open(journal_path(dst), "wb").write(data)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    complete = make_file(d / "complete.h5")
    running = str(d / "running.h5")
    w = ResultWriter(running, META)
    w.append("syn_mc", [dict(doc_id=d_, idx=0, kind="loglikelihood", loglikelihood=-1.0, is_greedy=True,
                             generation="", n_tokens=3, args_hash=f"h{d_}") for d_ in range(3)])
    w.flush()
    w.close()  # killed mid-run: the snapshot and its journal
    for path in (complete, running):  # the readers' lazy imports done once here, not in every forked case
        read_everything(path)
    return d, complete, running


@pytest.mark.slow  # 250 forked cases: ~20-25 s on 2 cores
def test_fuzzed_files_end_as_one_line_errors(originals):
    d, complete, running = originals
    rng = random.Random(SEED)
    failures = []
    cases = ([("flip", i) for i in range(100)] + [("retype", i) for i in range(100)]
             + [("journal", i) for i in range(50)])
    t0 = time.monotonic()
    for kind, i in cases:
        case = str(d / f"{kind}-{i}.h5")
        if kind == "flip":
            flip_bytes(rng, complete, case)
        elif kind == "retype":
            retype(rng, complete, case)
        else:
            journal_case(rng, running, case)
        problem = run_case(case, rng.choice(["r", "d", "c", "s"]))  # each path on a quarter of the cases: seconds
        if problem:
            failures.append(f"{kind} case {i} ({case}): {problem}")
        else:
            for p in (case, journal_path(case)):
                if os.path.exists(p):
                    os.remove(p)
    assert not failures, f"{len(failures)} of {len(cases)} cases failed (seed {SEED}):\n" + "\n".join(failures[:5])
    assert time.monotonic() - t0 < 120  # a few hundred cases take seconds; far beyond that is a regression


def test_fuzzed_file_through_the_command(originals, tmp_path):
    """The command itself, as a user runs it: a damaged file and a damaged journal end as one line and status 2."""
    d, complete, running = originals
    bad = str(tmp_path / "bad.h5")
    with open(complete, "rb") as a, open(bad, "wb") as b:
        b.write(a.read())
    with h5py.File(bad, "a") as f:
        f.attrs["results_json"] = json.dumps({"results": {"syn_mc": [1]}})
    journal = str(tmp_path / "journal.h5")
    with open(running, "rb") as a, open(journal, "wb") as b:
        b.write(a.read())
    with open(journal_path(running), "rb") as a, open(journal_path(journal), "wb") as b:
        b.write(a.read() + frame([1, 2]))
    for path, args in ((bad, []), (journal, ["--task", "syn_mc", "--requests"])):
        proc = subprocess.run([sys.executable, "-m", "mpitp", "inspect", path, *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"mpitp: error: {path} is not an mpitp results file ("), \
            proc.stderr
