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
