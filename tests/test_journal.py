"""Crash safety of the results writer (:mod:`mpitp.results.store` + :mod:`mpitp.results.journal`) without MPI: a real
writer in a real child process, killed with SIGKILL at random instants; torn journal tails cut at every byte.

The full-run drill (kill -9 of rank 0 of a real ``mpiexec`` evaluation, then ``--resume`` and ``inspect diff``) is
``bench/drill_kill9.py``; ``tests/test_faults.py`` kills rank 0 mid-run once.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mpitp.results.journal import journal_path, read_journal
from mpitp.results.rows import load_rows, read_requests, request_counts
from mpitp.results.schema import REQUEST_FIELDS
from mpitp.results.store import ResultWriter

META = dict(model="m", tokenizer="t", dtype="float32", world_size=1, tp=1, dp=1, config_json="{}")
TASKS = ("t_mc", "t_gen")
CHUNKS, PER_CHUNK = 600, 50


def rows_of(c: int) -> dict[str, list[dict]]:
    out = {t: [] for t in TASKS}
    for i in range(PER_CHUNK):
        n = c * PER_CHUNK + i
        gen = n % 7 == 0
        out[TASKS[gen]].append(dict(doc_id=n, idx=n % 3, kind="generate_until" if gen else "loglikelihood",
                                    loglikelihood=math.nan if gen else -0.25 * n, is_greedy=bool(n % 2),
                                    generation=f"gen {n} \u00e9\n" if gen else "", n_tokens=n % 40,
                                    args_hash=f"{n:016x}"))
    return out


CHILD = textwrap.dedent("""
    import sys, time
    sys.path[:0] = {paths!r}
    from test_journal import META, CHUNKS, rows_of
    from mpitp.results.store import ResultWriter
    path, resume, snap = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3])
    w = ResultWriter(path, META, resume=resume, snapshot_interval_s=snap)
    have = {{k[1] for k in w.stored_rows()}}
    def say(line):  # one write per whole line, so a kill cannot leave "durable" without its number
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()
    say(f"started {{len(have)}}")
    for c in range(CHUNKS):
        todo = {{t: [r for r in rs if r["doc_id"] not in have] for t, rs in rows_of(c).items()}}
        if not any(todo.values()):
            continue
        for t, rs in todo.items():
            w.append(t, rs)
        if c % 5 == 0:
            w.flush()
            say(f"durable {{c}}")
        time.sleep(0.002)
    w.finish({{"results": {{}}}}, 1.0)
    say("done")
""")


def _child(path, resume: bool, snap: float) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(paths=[here, os.path.dirname(here)])
    return subprocess.Popen([sys.executable, "-c", code, str(path), "1" if resume else "0", str(snap)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _expected() -> dict[str, dict]:
    out = {}
    for c in range(CHUNKS):
        for t, rs in rows_of(c).items():
            for r in rs:
                out[(t, r["doc_id"])] = r
    return out


def _check_rows(path, expected) -> int:
    """Every row in the file is one of the expected rows, exactly, and none twice; returns how many."""
    _, tasks = load_rows(str(path))
    n = 0
    for t, cols in tasks.items():
        ids = cols["doc_id"]
        assert len(set(ids.tolist())) == len(ids), f"duplicate rows in {t}"
        for i in range(len(ids)):
            want = expected[(t, int(ids[i]))]
            for k in REQUEST_FIELDS:
                got = cols[k][i]
                if k == "loglikelihood" and math.isnan(want[k]):
                    assert math.isnan(got)
                else:
                    assert got == want.get(k, 0 if k == "repeat" else None), (t, k, got, want.get(k))  # repeat: 0
        n += len(ids)
    return n


@pytest.mark.slow
def test_sigkill_at_random_instants_leaves_a_readable_file_and_resume_completes(tmp_path):
    """10 SIGKILLs of a writing process at random instants (a bounded-rate and an eager snapshot policy in turn,
    so kills land in snapshots and journal rotations too; every third from the launch): after each, the file opens,
    holds only whole correct rows, at least every row the writer had flushed before the kill; the next run resumes
    it. The last run completes: every row once, equal to the expected rows, no journal left."""
    expected = _expected()
    path = tmp_path / "killed.h5"
    rng = random.Random(17)
    report = []
    for attempt in range(10):
        snap = 0.0 if attempt % 2 else 60.0
        if path.exists() and load_rows(str(path))[0]["status"] == "complete":
            path.unlink()  # a try that finished before its kill: start the next from scratch
        child = _child(path, resume=path.exists(), snap=snap)
        lines = []
        if attempt % 3 == 2:  # from the launch: may land in start-up, the resume's load or its first snapshot
            time.sleep(rng.uniform(0.1, 2.0))
        else:  # once it writes (rows, journal records, fsyncs, snapshots, rotations): a random point of the run
            target = rng.randrange(CHUNKS)
            for line in iter(child.stdout.readline, ""):
                lines.append(line)
                if line.startswith("done") or (line.startswith("durable") and int(line.split()[1]) >= target):
                    break
            time.sleep(rng.uniform(0.0, 0.05))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        # the rest through the same reader (communicate would bypass what readline already buffered); only whole
        # lines count: a line cut by the kill says nothing about what was flushed
        lines += child.stdout.read().splitlines(keepends=True)
        child.stderr.read()
        durable = [int(m[1]) for line in lines if (m := re.fullmatch(r"durable (\d+)\n", line))]
        if not path.exists():
            report.append(f"kill {attempt}: before the first snapshot")
            continue
        n = _check_rows(path, expected)
        # rows flushed before the kill survive it (chunk c's flush covers chunks 0..c of this attempt)
        assert n >= min(len(expected), (durable[-1] + 1) * PER_CHUNK if durable else 0), (n, durable[-1:])
        report.append(f"kill {attempt} (snapshot interval {snap:g} s): {n} rows readable, "
                      f"journal {'present' if os.path.exists(journal_path(str(path))) else 'absent'}")
    child = _child(path, resume=path.exists(), snap=60.0)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0 and "done" in out, err
    assert _check_rows(path, expected) == len(expected)
    assert load_rows(str(path))[0]["status"] == "complete"
    assert not os.path.exists(journal_path(str(path)))
    print("\n".join(report))


@pytest.mark.slow
def test_torn_journal_tail_is_ignored_at_every_cut(tmp_path):
    """Cut the journal's last record at every byte: readers see exactly the rows of the whole records before it,
    and a resume appends after them (the torn journal is replaced, not appended to)."""
    path = tmp_path / "torn.h5"
    w = ResultWriter(str(path), META)
    for c in range(3):
        for t, rs in rows_of(c).items():
            w.append(t, rs)
        w.flush()
    w.close()
    jp = journal_path(str(path))
    whole = open(jp, "rb").read()
    _, records = read_journal(jp)
    assert len(records) == 3
    last_len = len(whole) - len(whole[: whole.rfind(b'{"seq":3') - 8])
    two_chunks = 2 * PER_CHUNK
    for cut in range(1, last_len):
        with open(jp, "wb") as f:
            f.write(whole[: len(whole) - cut])
        assert sum(request_counts(str(path)).values()) == two_chunks, cut
    with open(jp, "wb") as f:  # a flipped byte inside the last record: its checksum fails
        f.write(whole[:-5] + bytes([whole[-5] ^ 0xFF]) + whole[-4:])
    assert sum(request_counts(str(path)).values()) == two_chunks
    w = ResultWriter(str(path), META, resume=True)
    assert len(w.stored_rows()) == two_chunks
    for t, rs in rows_of(2).items():
        w.append(t, rs)
    w.flush()
    w.close()
    assert sum(request_counts(str(path)).values()) == 3 * PER_CHUNK
    got = read_requests(str(path), "t_mc")
    assert np.all(np.diff(got["doc_id"]) > 0)


def test_journal_of_another_run_is_ignored(tmp_path):
    """A journal left by an earlier run (another ``run_id``) beside a new file adds nothing to it."""
    path = tmp_path / "a.h5"
    w = ResultWriter(str(path), META)
    for t, rs in rows_of(0).items():
        w.append(t, rs)
    w.close()
    old = open(journal_path(str(path)), "rb").read()
    w2 = ResultWriter(str(path), META)  # --overwrite: a new run
    w2.close()
    with open(journal_path(str(path)), "wb") as f:
        f.write(old)
    assert request_counts(str(path)) == {}
    with pytest.raises(KeyError):
        read_requests(str(path), "t_mc")


def test_a_journal_is_read_record_by_record_within_its_cap(tmp_path, monkeypatch):
    """A journal is untrusted (it sits beside a results file in a shared folder): read a record at a time, so memory
    follows its whole records, never the file's size (a valid head and a 1 GiB sparse tail: read at once before, a
    MemoryError's traceback at 30 GiB) or a length a record declares; and the writer keeps to the same cap, splitting
    what it records at once into records of the same seq (checked with the cap made 2,000 bytes)."""
    import tracemalloc

    from mpitp.results import journal

    path = tmp_path / "j.h5"
    w = ResultWriter(str(path), META)
    w.record(lambda: rows_of(0))  # one record
    w.close()
    jp = journal_path(str(path))
    with open(jp, "ab") as f:
        f.write(journal._FRAME.pack(journal.MAX_RECORD_BYTES + 1, 0))
    os.truncate(jp, 1 << 30)
    tracemalloc.start()
    try:
        header, records = read_journal(jp)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert header is not None and len(records) == 1 and peak < 8 << 20, (len(records), peak)
    assert sum(request_counts(str(path)).values()) == PER_CHUNK

    monkeypatch.setattr(journal, "MAX_RECORD_BYTES", 2000)
    path = tmp_path / "split.h5"
    w = ResultWriter(str(path), META)
    for c in range(2):
        w.record(lambda c=c: rows_of(c))
        w.flush()
    w.close()
    _, records = read_journal(journal_path(str(path)))
    assert len(records) > 4 and {r["seq"] for r in records} == {1, 2}, [r["seq"] for r in records]
    assert max(len(json.dumps(r, separators=(",", ":"), ensure_ascii=False).encode()) for r in records) <= 2000
    got = read_requests(str(path), "t_mc")
    assert sorted(got["doc_id"].tolist()) == [n for c in range(2) for n in range(c * PER_CHUNK, (c + 1) * PER_CHUNK)
                                             if n % 7]


FULL_CHILD = textwrap.dedent("""
    import os, sys
    sys.path[:0] = {paths!r}
    from mpitp.errors import install_excepthook
    install_excepthook()  # as under mpitp eval: a failure h5py reports from a deallocation used to abort here
    from test_journal import META, rows_of
    from mpitp.results.store import ResultWriter
    path, step = sys.argv[1], sys.argv[2]
    w = ResultWriter(path, META, snapshot_interval_s=1e9)
    for c in range(3):
        for t, rs in rows_of(c).items():
            w.append(t, rs)
    w.flush()
    fd = os.open(os.path.join(os.path.dirname(path), "filler"), os.O_WRONLY | os.O_CREAT)
    try:  # the rest of the file system
        while os.write(fd, bytes(4096)):
            pass
    except OSError:
        os.close(fd)
    try:
        if step == "finish":  # the last snapshot, as in a run that completes
            w.finish({{"results": {{}}}}, 1.0)
        elif step == "save":  # a snapshot whose caller waits for it
            w.save()
        else:
            for c in range(3, 40):
                for t, rs in rows_of(c).items():
                    w.append(t, rs)
                w.flush()
    except Exception as exc:
        print(type(exc).__name__, exc)
""")


@pytest.fixture
def full_fs(tmp_path):
    """A 1 MiB tmpfs of its own (root only: skipped where mounting is not allowed), unmounted after."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("step", ["finish", "save", "journal"])
def test_a_full_disk_ends_in_one_line_with_no_temporary_and_nothing_lost(full_fs, step):
    """A real full file system under the snapshot (HDF5 reported it from a deallocation: mpitp's excepthook aborted
    mid-write with a traceback, its temporary left filling the disk; ``save`` never returned) and under the journal
    (a bare OSError, wrapped in a RuntimeError): one
    :class:`ResultsWriteError` line naming the file, the errno and what is kept; no temporary left; once space is
    freed, the file and its journal hold every row flushed before, and a resume takes them."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = full_fs / "x.h5"
    child = subprocess.run([sys.executable, "-c", FULL_CHILD.format(paths=[here, os.path.dirname(here)]), str(path),
                            step], capture_output=True, text=True, timeout=20)
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    what = f"the results file {path}" if step != "journal" else f"the results journal {path}.journal"
    assert child.stdout.startswith(f"ResultsWriteError cannot write {what}: No space left on device (errno 28); "), \
        child.stdout
    assert "--resume" in child.stdout
    os.remove(full_fs / "filler")
    assert sorted(os.listdir(full_fs)) == ["x.h5", "x.h5.journal"]  # nothing else: no temporary
    want = sum(len(rs) for c in range(3) for rs in rows_of(c).values())
    assert sum(request_counts(str(path)).values()) >= want
    w = ResultWriter(str(path), META, resume=True)
    assert len(w.stored_rows()) >= want
    w.close()


def test_a_journal_refused_at_the_start_says_resume_the_snapshot_it_left(full_fs, tmp_path):
    """The probe (session 29): the first snapshot written, the journal refused (a full disk): the line said "run
    again", and running again was refused (the output exists: --resume or --overwrite). It says --resume now, and a
    resume once space is freed takes the file. The tmpfs is filled to leave room for the snapshot alone."""
    from mpitp.results.store import ResultsWriteError

    ResultWriter(str(tmp_path / "probe.h5"), META).close()
    need = -(-os.path.getsize(tmp_path / "probe.h5") // 4096)
    st = os.statvfs(full_fs)
    with open(full_fs / "filler", "wb") as f:
        f.write(bytes((st.f_bavail - need) * st.f_frsize))
    with pytest.raises(ResultsWriteError) as info:
        ResultWriter(str(full_fs / "x.h5"), META, snapshot_interval_s=1e9)
    assert str(info.value).startswith(f"cannot write the results journal {full_fs}/x.h5.journal: No space left on "
                                      "device (errno 28); nothing of this run was computed yet: free space and run "
                                      "again with --resume"), info.value
    os.remove(full_fs / "filler")
    ResultWriter(str(full_fs / "x.h5"), META, resume=True).close()


def test_an_output_folder_removed_mid_run_is_one_line_saying_the_rows_are_lost(tmp_path):
    """The probe (session 29): the output's folder removed while the run wrote (``rm -rf`` of the wrong folder): the
    next snapshot raised ENOENT, a traceback (only a full, read-only or failing disk was one line). Now one line:
    neither file is there, what landed is lost, run again."""
    import shutil

    from mpitp.results.store import ResultsWriteError

    out = tmp_path / "gone"
    out.mkdir()
    w = ResultWriter(str(out / "x.h5"), META, snapshot_interval_s=1e9)
    for t, rs in rows_of(0).items():
        w.append(t, rs)
    w.flush()
    shutil.rmtree(out)
    with pytest.raises(ResultsWriteError) as info:
        w.save()
    assert str(info.value) == (f"cannot write the results file {out}/x.h5: No such file or directory (errno 2); "
                               f"neither {out}/x.h5 nor its journal is there any more: the rows that landed are lost: "
                               "see who removed the folder and run again"), info.value
