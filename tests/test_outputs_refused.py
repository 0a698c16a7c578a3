"""``mpitp run`` refuses an output it cannot read as an mpitp results file (exit 2 from every rank, the file
untouched); ``mpitp inspect`` reports a bug of its own as a bug, not as a damaged file."""

from __future__ import annotations

import hashlib
import os

import h5py
import numpy as np
import pytest

from support.mpi import explain, run_mpi

JOB = """\
defaults:
  model: demo
  tasks: [mpitp_demo_mc]
  limit: 2
runs:
  - name: first
    output: {first}
  - name: second
    output: {second}
"""


def _fingerprint(path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mtime_ns


SWEEP = """\
  - name: sweep
    models: [ck/step-1, ck/step-2]
    output: {pattern}
"""


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["not-hdf5", "hdf5-without-status", "sweep-file"])
def test_run_refuses_a_foreign_output(kind, tmp_path):
    """The foreign file is the second run's output (or one checkpoint's file of a third run, a sweep: found only at
    the sweep's turn, after the first runs had run, it failed that run, exit 1): the refusal comes before the first
    run loads anything."""
    foreign = tmp_path / ("step-2.h5" if kind == "sweep-file" else "second.h5")
    if kind != "hdf5-without-status":
        foreign.write_bytes(b"my notes, not HDF5\n" * 10)
        reason = "not an mpitp results file (Unable to synchronously open file"
    else:
        with h5py.File(foreign, "w") as f:
            f.attrs["owner"] = "another program"
            f["data"] = [1, 2, 3]
        reason = "not an mpitp results file (no 'status' attribute)"
    before = _fingerprint(foreign)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(first=tmp_path / "first.h5", second=tmp_path / "second.h5" if kind == "sweep-file"
                              else foreign) + (SWEEP.format(pattern=tmp_path / "{name}.h5") if kind == "sweep-file"
                                               else ""))
    proc = run_mpi(2, ["run", str(job)], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 2, explain(proc)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpitp: error:")]
    assert len(lines) == 1 and f"output {foreign} exists and is {reason}" in lines[0], explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    assert _fingerprint(foreign) == before
    assert not (tmp_path / "first.h5").exists()  # refused before any run
    print(f"{kind}: exit 2 in {proc.elapsed:.1f} s, file untouched: {lines[0]}")


def test_inspect_reports_its_own_bugs(tmp_path, monkeypatch):
    """A TypeError raised by inspect's own code while reading a sound file propagates (a bug to fix), where a
    damaged file gives the one-line "not an mpitp results file"."""
    import mpitp.results.reader as ins
    from mpitp.results.store import ResultWriter

    path = tmp_path / "ok.h5"
    writer = ResultWriter(str(path), {"model": "m"})
    writer.append("t", [dict(doc_id=0, idx=0, kind="loglikelihood", loglikelihood=-1.0, is_greedy=True, generation="",
                             n_tokens=1, args_hash="h")])
    writer.save()  # the rows into the HDF5 snapshot (not only the journal), so that /tasks/t exists below
    writer.close()
    assert ins.load(str(path)).attrs["status"] == "running"
    with h5py.File(path, "a") as f:  # a foreign attribute whose bytes are not UTF-8: shown, printable
        f.attrs["foreign"] = np.bytes_(b"caf\xe9")
    shown = ins.load(str(path)).attrs["foreign"]
    assert shown == "caf\ufffd" and shown.encode("utf-8")

    def bug(v, errors=None):
        raise TypeError("a bug in inspect")

    monkeypatch.setattr("mpitp.results.schema.py_value", bug)  # the decoder load() uses for every attribute
    with pytest.raises(TypeError, match="a bug in inspect"):
        ins.load(str(path))
    monkeypatch.undo()
    with h5py.File(path, "a") as f:  # a foreign layout: /tasks/t a dataset, not a group
        del f["tasks/t"]
        f["tasks/t"] = [1, 2]
    with pytest.raises(ins.BadInput, match="is not an mpitp results file"):
        ins.load(str(path))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_output_on_a_filesystem_that_makes_no_files_is_named_as_such():
    """procfs answers a new file with ENOENT: the line said "/proc: No such file or directory" of a folder that
    exists."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import check_output
    from mpitp.evaluation.settings import EvalConfig

    with pytest.raises(UsageError) as err:
        check_output(EvalConfig(model="m", tasks=["t"], output="/proc/mpitp-results.h5"))
    assert str(err.value) == "cannot write output /proc/mpitp-results.h5: /proc: no files can be created there"


@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("flag", ["overwrite", "resume"])
def test_an_output_that_is_not_a_regular_file_is_refused(kind, flag, tmp_path):
    """``--output /dev/null --overwrite`` (as root) renamed the results file over the device: /dev/null became a
    regular file for every process on the machine. A FIFO or socket at the output is refused the same way."""
    import socket

    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import check_output
    from mpitp.evaluation.settings import EvalConfig

    out = tmp_path / "out.h5"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(out))
        sock.close()
    with pytest.raises(UsageError) as err:
        check_output(EvalConfig(model="m", tasks=["t"], output=str(out), **{flag: True}))
    assert str(err.value) == f"output {out} is not a regular file (a device, FIFO or socket): choose another --output"
    assert not os.path.isfile(out) and os.path.exists(out)


def test_an_output_link_to_a_device_is_still_replaced_not_followed(tmp_path):
    """A link at the output is replaced by the rename (its target untouched): it stays allowed with --overwrite."""
    from mpitp.evaluation.checks import check_output
    from mpitp.evaluation.settings import EvalConfig

    out = tmp_path / "out.h5"
    out.symlink_to("/dev/null")
    assert check_output(EvalConfig(model="m", tasks=["t"], output=str(out), overwrite=True)) == str(out)


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_an_output_under_a_broken_link_is_one_line(link, tmp_path):
    """``--output dang/x.h5`` with ``dang`` a dangling (or looping) link passed the check, then the claim's
    ``os.makedirs`` raised FileExistsError: a traceback on rank 0, exit 1."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import check_output
    from mpitp.evaluation.settings import EvalConfig

    bad = tmp_path / "dang"
    bad.symlink_to(tmp_path / "nowhere" if link == "dangling" else bad)
    with pytest.raises(UsageError) as err:
        check_output(EvalConfig(model="m", tasks=["t"], output=str(bad / "sub" / "x.h5")))
    assert str(err.value) == f"cannot write output {bad}/sub/x.h5: {bad} is not a directory (a link to nothing)"
