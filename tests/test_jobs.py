"""``mpitp run JOB.yaml`` under a real 4-rank ``mpiexec``, the shipped ``jobs/demo.yaml``, ``--data-dir`` against the
hand-written offline tasks, ``mpitp tasks --data-dir`` and ``mpitp info``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from mpitp.jobs.jobfile import load_job  # noqa: E402
from mpitp.results.rows import read_metrics, read_requests  # noqa: E402
from mpitp.results.schema import open_h5  # noqa: E402
from support import OFFLINE_ENV, REPO, STORIES  # noqa: E402
from support.mpi import explain, run_mpi  # noqa: E402
from support.parity import close  # noqa: E402

pytestmark = pytest.mark.mpi  # every test here launches mpiexec

DEMO_TASKS = ("mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen")


def mpitp_cli(*args, timeout=120, cwd=None) -> subprocess.CompletedProcess:
    """``python -m mpitp ARGS`` as a plain process (commands that need no MPI world)."""
    return subprocess.run([sys.executable, "-m", "mpitp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **OFFLINE_ENV}, cwd=cwd)


def summary(stdout: str) -> tuple[str, dict[str, dict]]:
    """The job summary printed by rank 0: its headline and ``{run: {tp, pp, status, wall, output}}``."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("job ") and "runs ok" in line)
    head, table = lines[start], lines[start + 1:]
    assert table[0].split()[:4] == ["run", "tp", "pp", "status"] and set(table[1]) <= {"-", " "}, table[:2]
    rows = {}
    for line in table[2:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == 6, line
        rows[cells[0]] = dict(tp=int(cells[1]), pp=int(cells[2]), status=cells[3], wall=cells[4], output=cells[5])
    return head, rows


def h5_attrs(path) -> dict:
    with open_h5(str(path)) as f:
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}


# ------------------------------------------------------------------------------------------------ a job file

JOB = """\
defaults:
  model: demo
  tasks: [mpitp_demo_mc, mpitp_demo_ppl, mpitp_demo_gen]
  dtype: float32
  limit: 3
  seed: 1234
  gen_kwargs:              # a mapping, with a list: reaches lm-eval as it is
    until: ["\\n\\n", "Question:"]
    max_gen_toks: 5
runs:
  - name: good-tp1
    tp: 1
    output: out/good-tp1.h5
  - name: bad-tp3          # 3 does not divide the 4 ranks of the world
    tp: 3
    output: out/bad-tp3.h5
  - name: good-tp2
    tp: 2
    output: out/good-tp2.h5
"""


@pytest.mark.slow
@pytest.mark.openmpi
def test_job_with_a_failing_run(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "out"
    good = {"good-tp1": (out / "good-tp1.h5", 1), "good-tp2": (out / "good-tp2.h5", 2)}
    reason = "tp=3 does not divide world size 4"

    # 1. every run is attempted: two complete, one recorded as failed, exit status 1
    p = run_mpi(4, ["run", str(job)], timeout=600, cwd=str(tmp_path))
    assert p.returncode == 1, explain(p)
    head, rows = summary(p.stdout)
    assert head == f"job {job}: 2/3 runs ok", head
    assert list(rows) == ["good-tp1", "bad-tp3", "good-tp2"]
    assert rows["good-tp1"]["status"] == "complete" and rows["good-tp1"]["tp"] == 1
    assert rows["good-tp2"]["status"] == "complete" and rows["good-tp2"]["tp"] == 2
    assert rows["bad-tp3"]["status"] == f"FAILED: {reason}" and rows["bad-tp3"]["tp"] == 3
    assert rows["bad-tp3"]["output"] == str(out / "bad-tp3.h5")
    assert f"run bad-tp3 failed: {reason}" in p.stderr
    assert p.stderr.count("=== run ") == 3 and "=== run 3/3: good-tp2 (tp=2)" in p.stderr
    assert not (out / "bad-tp3.h5").exists()
    for name, (path, tp) in good.items():
        assert rows[name]["output"] == str(path)
        a = h5_attrs(path)
        assert a["status"] == "complete", name
        assert (a["world_size"], a["tp"], a["dp"]) == (4, tp, 4 // tp), name
        assert json.loads(a["config_json"])["limit"] == 3
        assert json.loads(a["config_json"])["gen_kwargs"] == {"until": ["\n\n", "Question:"], "max_gen_toks": 5}
        gen = json.loads(a["results_json"])["configs"]["mpitp_demo_gen"]["generation_kwargs"]
        assert gen["until"] == ["\n\n", "Question:"] and gen["max_gen_toks"] == 5, gen  # not the string "['\n\n', ..."
        for task in DEMO_TASKS:
            assert len(read_requests(str(path), task)["doc_id"]) >= 3
            assert read_metrics(str(path), task)["sample_len"] == 3
    d = mpitp_cli("inspect", "diff", good["good-tp1"][0], good["good-tp2"][0])  # the two layouts agree
    assert d.returncode == 0, d.stdout + d.stderr
    stamps = {name: os.stat(path).st_mtime_ns for name, (path, _) in good.items()}

    # 2. re-running skips what is complete and tries the failed run again
    p = run_mpi(4, ["run", str(job)], timeout=600, cwd=str(tmp_path))
    assert p.returncode == 1, explain(p)
    head, rows = summary(p.stdout)
    assert head == f"job {job}: 2/3 runs ok", head
    assert {n: r["status"] for n, r in rows.items()} == {
        "good-tp1": "skipped (complete)", "bad-tp3": f"FAILED: {reason}", "good-tp2": "skipped (complete)"}
    assert "=== run 1/3" not in p.stderr and "=== run 3/3" not in p.stderr
    assert {name: os.stat(path).st_mtime_ns for name, (path, _) in good.items()} == stamps

    # 3. --fail-fast stops at the failure: the run after it is not attempted, though it has work to do
    good["good-tp2"][0].unlink()
    p = run_mpi(4, ["run", str(job), "--fail-fast"], timeout=600, cwd=str(tmp_path))
    assert p.returncode == 1, explain(p)
    head, rows = summary(p.stdout)
    assert head == f"job {job}: 1/3 runs ok", head
    assert {n: r["status"] for n, r in rows.items()} == {
        "good-tp1": "skipped (complete)", "bad-tp3": f"FAILED: {reason}", "good-tp2": "not started (--fail-fast)"}
    assert "good-tp2" not in p.stderr and not good["good-tp2"][0].exists()

    # 4. a run edited after its output completed is not skipped over the old numbers: refused, naming the change
    stamp = os.stat(good["good-tp1"][0]).st_mtime_ns
    job.write_text(JOB.replace("  limit: 3\n", "  limit: 4\n"))
    p = run_mpi(4, ["run", str(job), "--fail-fast"], timeout=600, cwd=str(tmp_path))
    assert p.returncode == 1, explain(p)
    head, rows = summary(p.stdout)
    assert rows["good-tp1"]["status"] == (
        f"FAILED: cannot resume {good['good-tp1'][0]}: different settings: limit 3 in the file, 4 now; it is complete "
        "for those: give this run another output, or move the file away to recompute it"), rows["good-tp1"]
    assert os.stat(good["good-tp1"][0]).st_mtime_ns == stamp


@pytest.mark.slow
def test_shipped_demo_job(tmp_path):
    """``jobs/demo.yaml`` as shipped, with only its outputs moved out of the repository."""
    shipped_path = REPO / "jobs" / "demo.yaml"
    shipped = load_job(shipped_path)
    assert [r.name for r in shipped.runs] == ["demo-tp1", "demo-tp2", "demo-tp2-bs8-limit10"]
    for r in shipped.runs:  # run as is, it would write into the repository's results/
        assert Path(r.output).parent == REPO / "results" / "demo", r.output
    raw = yaml.safe_load(shipped_path.read_text())
    for run in raw["runs"]:
        run["output"] = str(tmp_path / "out" / Path(run["output"]).name)
    job_path = tmp_path / "demo.yaml"
    job_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    job = load_job(job_path)
    assert len(job.runs) == len(shipped.runs)
    for ours, theirs in zip(job.runs, shipped.runs):
        assert Path(ours.output).parent == tmp_path / "out"
        assert dataclasses.replace(ours, output=theirs.output) == theirs  # nothing else changed

    p = run_mpi(4, ["run", str(job_path)], timeout=600, cwd=str(tmp_path))
    assert p.returncode == 0, explain(p)
    head, rows = summary(p.stdout)
    assert head == f"job {job_path}: 3/3 runs ok", head
    n_docs = {}
    for spec in job.runs:
        assert rows[spec.name]["status"] == "complete" and rows[spec.name]["tp"] == spec.tp
        a = h5_attrs(spec.output)
        assert a["status"] == "complete" and (a["tp"], a["dp"]) == (spec.tp, 4 // spec.tp)
        assert a["dtype"] == "float32"
        with open_h5(spec.output) as f:
            n_docs[spec.name] = {t: int(f[f"tasks/{t}"].attrs["n_docs"]) for t in DEMO_TASKS}
    assert n_docs["demo-tp1"] == n_docs["demo-tp2"] and min(n_docs["demo-tp1"].values()) > 10
    assert n_docs["demo-tp2-bs8-limit10"] == {t: 10 for t in DEMO_TASKS}
    d = mpitp_cli("inspect", "diff", job.runs[0].output, job.runs[1].output)  # tp 1 and tp 2 agree
    assert d.returncode == 0, d.stdout + d.stderr
    assert not list((REPO / "results").glob("demo/*.tmp*"))


# ------------------------------------------------------------------------------------------------- --data-dir

# the documented DIR/<task>/<split>.jsonl layout, as symlinks to the shared files; gsm8k gets its test split only
DATA_LAYOUT = {
    "arc_easy/train.jsonl": "arc_easy/train.jsonl",
    "arc_easy/validation.jsonl": "arc_easy/validation.jsonl",
    "arc_easy/test.jsonl": "arc_easy/test.jsonl",
    "wikitext/test.jsonl": "wikitext2/wikitext-2-raw-v1_test_documents.jsonl",
    "gsm8k/test.jsonl": "gsm8k/test.jsonl",
}


@pytest.fixture
def data_dir(tmp_path, shared_dir) -> Path:
    root = tmp_path / "data"
    for rel, src in DATA_LAYOUT.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(shared_dir / "data" / src)
    return root


def test_tasks_lists_runnable_and_missing(data_dir):
    p = mpitp_cli("tasks", "--data-dir", data_dir)
    assert p.returncode == 0, p.stderr
    got = {line.split()[0]: line.split(None, 1)[1] for line in p.stdout.splitlines() if line.strip()}
    assert got == {
        "arc_easy": "runnable  [train=arc_easy/train.jsonl validation=arc_easy/validation.jsonl "
                    "test=arc_easy/test.jsonl]",
        "hellaswag": "missing hellaswag/validation.jsonl",
        "piqa": "missing piqa/validation.jsonl",
        "lambada_openai": "missing lambada_openai/test.jsonl",
        "wikitext": "runnable  [test=wikitext/test.jsonl]",
        "gsm8k": "missing gsm8k/train.jsonl  [test=gsm8k/test.jsonl]",
    }, p.stdout


def test_tasks_on_shared_data_as_downloaded(shared_dir):
    p = mpitp_cli("tasks", "--data-dir", shared_dir / "data")
    assert p.returncode == 0, p.stderr
    got = {line.split()[0]: line.split(None, 1)[1] for line in p.stdout.splitlines() if line.strip()}
    assert got["hellaswag"] == "runnable  [validation=hellaswag/hellaswag_val.jsonl]", p.stdout
    assert got["wikitext"] == "runnable  [test=wikitext2/wikitext-2-raw-v1_test_documents.jsonl]", p.stdout
    assert all(v.startswith("runnable") for v in got.values()) and len(got) == 6, p.stdout


@pytest.mark.slow
def test_data_dir_matches_hand_written_tasks(shared_dir, test_tasks, tmp_path):
    """``--data-dir ../shared/data`` as it is (downloaded file names) gives the hand-written YAMLs' numbers."""
    data_dir = shared_dir / "data"
    a, b = tmp_path / "data_dir.h5", tmp_path / "local.h5"
    common = ["eval", "--model", str(STORIES), "--limit", "3"]
    pa = run_mpi(2, [*common, "--tasks", "arc_easy,wikitext", "--data-dir", str(data_dir), "--output", str(a)],
                 timeout=600, cwd=str(tmp_path))
    assert pa.returncode == 0, explain(pa)
    pb = run_mpi(1, [*common, "--tasks", "arc_easy_local,wikitext_local", "--include-path", test_tasks,
                     "--output", str(b)], timeout=600, cwd=str(tmp_path))
    assert pb.returncode == 0, explain(pb)
    for stock, local in (("arc_easy", "arc_easy_local"), ("wikitext", "wikitext_local")):
        ma, mb = read_metrics(str(a), stock), read_metrics(str(b), local)
        assert ma.pop("name") == stock and mb.pop("name") == local
        assert set(ma) == set(mb) and ma["sample_len"] == 3, (ma, mb)
        for k, v in mb.items():
            assert (v == ma[k]) if isinstance(v, str) else close(ma[k], v), (stock, k, ma[k], v)
        ra, rb = read_requests(str(a), stock), read_requests(str(b), local)
        assert ra["doc_id"].tolist() == rb["doc_id"].tolist() and ra["idx"].tolist() == rb["idx"].tolist()
        assert ra["kind"].tolist() == rb["kind"].tolist() and ra["n_tokens"].tolist() == rb["n_tokens"].tolist()
        assert ra["is_greedy"].tolist() == rb["is_greedy"].tolist()
        bad = [(int(d), int(i), x, y) for d, i, x, y in
               zip(ra["doc_id"], ra["idx"], ra["loglikelihood"], rb["loglikelihood"]) if not close(x, y)]
        assert not bad, bad[:5]
    assert json.loads(h5_attrs(a)["config_json"])["data_dir"] == str(data_dir)


# ------------------------------------------------------------------------------------------------------- info


def test_info_under_mpiexec():
    p = run_mpi(4, ["info", "--tp", "2"], timeout=300)
    assert p.returncode == 0, explain(p)
    assert "world 4 = dp 2 x tp 2 on 1 node(s), launcher: mpiexec (Hydra/PMI)" in p.stdout, p.stdout
    assert "MPI: MPICH" in p.stdout
    table = [line.split() for line in p.stdout.splitlines() if re.match(r"^\d+\s", line)]
    assert [(int(r[0]), int(r[3]), int(r[5]), r[6]) for r in table] == [
        (0, 0, 0, "leader"), (1, 0, 1, "worker"), (2, 1, 0, "leader"), (3, 1, 1, "worker")], p.stdout


@pytest.mark.mpi
def test_a_run_whose_output_names_its_model_is_skipped_once_complete(tmp_path, shared_dir):
    """``output: out/{name}-x.h5`` for one model (the file is ``out/stories260K-x.h5``): read literally, the run was
    never complete, so each ``mpitp run`` loaded the model again and rewrote the complete file with a resume of 0
    requests (its wall time and speed those of the empty resume). It is skipped now, the file untouched."""
    from mpitp.tasks.demo import demo_tasks_dir

    job = tmp_path / "job.yaml"
    job.write_text(f"runs:\n  - name: one\n    model: {shared_dir / 'models' / 'stories260K'}\n"
                   f"    tasks: [mpitp_demo_mc]\n    include_path: {demo_tasks_dir()}\n    limit: 2\n"
                   "    output: out/{name}-x.h5\n")
    out = tmp_path / "out" / "stories260K-x.h5"
    p = run_mpi(1, ["run", str(job)], timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0 and h5_attrs(out)["status"] == "complete", explain(p)
    stamp = os.stat(out).st_mtime_ns
    p = run_mpi(1, ["run", str(job)], timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0, explain(p)
    assert summary(p.stdout)[1]["one"]["status"] == "skipped (complete)", p.stdout
    assert "=== run 1/1" not in p.stderr and os.stat(out).st_mtime_ns == stamp


def test_a_run_whose_tokenizer_is_refused_fails_alone(tmp_path):
    """A run asking for a chat template its tokenizer lacks, or naming a tokenizer that does not exist, is refused by
    the checks on every rank before its load: the job records it and goes on. Refused on rank 0 alone after the load,
    the chat template ended the whole job (MPI_Abort(2), no summary, the later runs never started); the missing
    tokenizer was an OSError traceback on every rank (MPI_Abort(1))."""
    job = tmp_path / "job.yaml"
    job.write_text("defaults:\n  model: demo\n  tasks: [mpitp_demo_mc]\n  limit: 2\nruns:\n"
                   "  - {name: chat, apply_chat_template: true, output: out/chat.h5}\n"
                   "  - {name: tok, tokenizer: ./no-such-tokenizer, output: out/tok.h5}\n"
                   "  - {name: plain, output: out/plain.h5}\n")
    p = run_mpi(2, ["run", str(job)], timeout=300, cwd=str(tmp_path))
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, explain(p)
    rows = summary(p.stdout)[1]
    assert rows["chat"]["status"].startswith("FAILED: --apply_chat_template: the tokenizer cannot apply a chat "
                                             "template: "), rows
    assert rows["tok"]["status"] == f"FAILED: --tokenizer {tmp_path}/no-such-tokenizer: no such directory", rows
    assert rows["plain"]["status"] == "complete", rows
    assert not (tmp_path / "out" / "chat.h5").exists() and not (tmp_path / "out" / "tok.h5").exists()
