"""``mpitp prefetch`` end to end against a local server speaking the Hub's API (``tests/support/hub_server.py``,
``HF_ENDPOINT`` pointing at it): datasets from the Hub's parquet conversion into the generic layout, the model
snapshot into ``--models-dir``, a manifest, then ``mpitp check`` (network blocked) says ready."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys

import pytest

from support import STORIES
from support.hub_server import FakeHub
from support.offline_data import boolq_rows, copa_rows, mmlu_rows


def parquet(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.mark.mpi  # `python -m mpitp` processes
def test_prefetch_fetches_into_the_layout_writes_a_manifest_and_checks(tmp_path):
    import pyarrow.parquet as pq

    with FakeHub() as hub:
        hub.repos[("dataset", "cais/mmlu")] = {
            f"{s}/{split}/0000.parquet": parquet(mmlu_rows(s, n)) for s in ("abstract_algebra", "anatomy", "virology")
            for split, n in (("test", 2), ("dev", 1))}
        hub.repos[("dataset", "aps/super_glue")] = {  # boolq's validation in two parts: joined into one file
            "boolq/validation/0000.parquet": parquet(boolq_rows(4)[:2]),
            "boolq/validation/0001.parquet": parquet(boolq_rows(4)[2:]),
            "boolq/train/0000.parquet": parquet(boolq_rows(3)),
            "copa/validation/0000.parquet": parquet(copa_rows(2))}
        hub.repos[("model", "tiny/stories260K")] = {f.name: f.read_bytes() for f in STORIES.iterdir() if f.is_file()}
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                                "TRANSFORMERS_OFFLINE")}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"))
        data, models = tmp_path / "data", tmp_path / "models"
        p = subprocess.run([sys.executable, "-m", "mpitp", "prefetch", "--tasks", "mmlu_abstract_algebra,mmlu_anatomy,"
                            "boolq", "--data-dir", str(data), "--model", "tiny/stories260K", "--models-dir",
                            str(models), "--num_fewshot", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "mpitp check: ready offline: boolq, mmlu_abstract_algebra, mmlu_anatomy; model " \
           f"{models}/tiny/stories260K" in p.stdout, p.stdout
    folder = data / "aps/super_glue/boolq"
    assert sorted(f.name for f in folder.iterdir()) == ["train.parquet", "validation.parquet"]
    assert pq.read_table(folder / "validation.parquet").to_pylist() == boolq_rows(4)
    assert pq.read_table(data / "cais/mmlu/anatomy/dev.parquet").to_pylist() == mmlu_rows("anatomy", 1)
    assert not (data / "cais/mmlu/virology").exists() and not (data / "aps/super_glue/copa").exists()
    assert (models / "tiny/stories260K/model.safetensors").read_bytes() == (STORIES / "model.safetensors").read_bytes()

    files = json.loads((data / "mpitp-manifest.json").read_text())["files"]
    by_path = {e["path"]: e for e in files}
    val = by_path[str(folder / "validation.parquet")]
    assert val["what"] == "dataset aps/super_glue/boolq validation"
    assert val["revision"] == FakeHub.commit("aps/super_glue")
    assert val["source"] == ("hf://datasets/aps/super_glue@refs/convert/parquet/boolq/validation/0000.parquet+"
                             "boolq/validation/0001.parquet")
    weights = by_path[str(models / "tiny/stories260K/model.safetensors")]
    assert weights["revision"] == FakeHub.commit("tiny/stories260K")
    for e in files:
        body = open(e["path"], "rb").read()
        assert (e["size"], e["sha256"]) == (len(body), hashlib.sha256(body).hexdigest()), e["path"]
    assert len(files) == 2 + 2 * 2 + 7  # boolq's 2 splits, 2 subjects x 2 splits, the model's 7 files


TINY_METRIC = '''"""A tiny exact-match metric in the shape of evaluate's ``exact_match`` (served by the test Hub)."""

import datasets
import evaluate


class MpitpTinyMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="exact match", citation="", inputs_description="predictions and references, strings",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        return {"exact_match": sum(p.strip() == r.strip() for p, r in zip(predictions, references))
                / len(predictions)}
'''

TASK_UTILS = '''import evaluate
import nltk


def process_results(doc, results):
    """The run's metric module (evaluate.load, from the HF modules cache offline) and nltk data (as ifeval's punkt)."""
    match = evaluate.load("mpitp_tiny_match").compute(predictions=[results[0]], references=[doc["answer"]])
    nltk.data.find("tokenizers/mpitp_tiny")
    return {"tiny_match": match["exact_match"]}
'''

NLTK_HOST = "http://nltk-mirror.invalid"


def nltk_zip() -> bytes:
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:  # one folder named as the package, as nltk's packages are
        zf.writestr("mpitp_tiny/", "")
        zf.writestr("mpitp_tiny/README", "a made-up nltk package for mpitp's tests\n")
    return buf.getvalue()


def nltk_index(body: bytes) -> bytes:
    import zipfile

    unzipped = sum(i.file_size for i in zipfile.ZipFile(io.BytesIO(body)).infolist())
    return (f'<?xml version="1.0"?>\n<nltk_data>\n<packages>\n<package id="mpitp_tiny" name="tiny" '
            f'subdir="tokenizers" url="{NLTK_HOST}/packages/tokenizers/mpitp_tiny.zip" size="{len(body)}" '
            f'unzipped_size="{unzipped}" checksum="{hashlib.md5(body).hexdigest()}" '
            f'sha256_checksum="{hashlib.sha256(body).hexdigest()}" unzip="1" />\n</packages>\n'
            f'<collections>\n</collections>\n</nltk_data>\n').encode()


@pytest.mark.slow  # four `mpitp check` processes (three rounds of prefetch, then one alone)
@pytest.mark.mpi  # `python -m mpitp` processes
def test_prefetch_fetches_the_metric_module_and_nltk_data_the_check_finds(tmp_path):
    """A task whose metric needs an `evaluate` module (from a Hub space) and nltk data (as ifeval's punkt_tab): the
    check finds both missing by running the metric (no hand list), prefetch fetches the module into the HF modules
    cache and the nltk package into DATA/nltk_data from --nltk-index, and the final check says ready."""
    tasks, data = tmp_path / "tasks", tmp_path / "data"
    tasks.mkdir()
    data.mkdir()
    rows = tasks / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"q{i}", "answer": "A"}) + "\n" for i in range(3)))
    (tasks / "utils.py").write_text(TASK_UTILS)
    (tasks / "mpitp_tiny_offline.yaml").write_text(
        f"task: mpitp_tiny_offline\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {rows}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\nprocess_results: !function utils.process_results\n"
        "metric_list:\n  - metric: tiny_match\n    aggregation: mean\n    higher_is_better: true\n")
    body = nltk_zip()
    with FakeHub() as hub:
        hub.repos[("space", "evaluate-metric/mpitp_tiny_match")] = {"mpitp_tiny_match.py": TINY_METRIC.encode()}
        hub.web[f"{NLTK_HOST}/index.xml"] = nltk_index(body)
        hub.web[f"{NLTK_HOST}/packages/tokenizers/mpitp_tiny.zip"] = body
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                                "TRANSFORMERS_OFFLINE", "NLTK_DATA")}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_UPDATE_DOWNLOAD_COUNTS="0",
                   http_proxy=hub.url, no_proxy="127.0.0.1,localhost", NLTK_ALLOW_PROXIED_URLOPEN="1")
        argv = [sys.executable, "-m", "mpitp", "prefetch", "--tasks", "mpitp_tiny_offline", "--include_path",
                str(tasks), "--data-dir", str(data), "--nltk-index", f"{NLTK_HOST}/index.xml"]
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        asked = list(hub.requests)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "mpitp check: ready offline: mpitp_tiny_offline" in p.stdout, p.stdout + p.stderr
    assert "metric mpitp_tiny_match -> the HF modules cache" in p.stdout
    assert f"nltk mpitp_tiny -> {data.resolve()}/nltk_data" in p.stdout
    assert f"GET {NLTK_HOST}/packages/tokenizers/mpitp_tiny.zip" in asked
    assert any(r.startswith("GET /spaces/evaluate-metric/mpitp_tiny_match/resolve/") for r in asked), asked
    assert (data / "nltk_data/tokenizers/mpitp_tiny/README").is_file()
    modules = list((tmp_path / "hf/modules/evaluate_modules/metrics/evaluate-metric--mpitp_tiny_match").glob(
        "*/mpitp_tiny_match.py"))
    assert [m.read_text() for m in modules] == [TINY_METRIC]
    files = {e["what"]: e for e in json.loads((data / "mpitp-manifest.json").read_text())["files"]}
    assert sorted(files) == ["metric mpitp_tiny_match", "nltk mpitp_tiny"]
    assert files["nltk mpitp_tiny"]["sha256"] == hashlib.sha256(body).hexdigest()
    assert files["metric mpitp_tiny_match"]["source"] == f"{hub.url}/spaces/evaluate-metric/mpitp_tiny_match"

    # the check on its own, as submit runs it: without DATA/nltk_data the nltk package is named, with its fetch
    env = {k: v for k, v in env.items() if k not in ("HF_ENDPOINT", "http_proxy")}
    (data / "nltk_data").rename(tmp_path / "elsewhere")
    p = subprocess.run([sys.executable, "-m", "mpitp", "check", "--tasks", "mpitp_tiny_offline", "--include_path",
                        str(tasks), "--data-dir", str(data)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.splitlines()[1:] == [
        f"  task mpitp_tiny_offline: needs the nltk data mpitp_tiny (not in {data}/nltk_data); fetch it: mpitp "
        f"prefetch --tasks mpitp_tiny_offline --data-dir {data} --include_path {tasks}"], p.stderr
