"""``mpitp prefetch``: on a node with network, fetch what ``mpitp check`` would find missing, as plain files.

- **Datasets** go into the generic ``--data-dir`` layout (:mod:`mpitp.tasks.layout`) as one parquet file per split,
  from the Hub's parquet conversion of the dataset (the ``refs/convert/parquet`` revision every Hub dataset has,
  also those with loading scripts: ``<config>/<split>/NNNN.parquet``), through ``huggingface_hub``. Plain files, not
  the shared HF cache: safe on parallel filesystems whose locks do nothing, and easy to copy to another cluster.
  Only the tasks whose needed splits DATA lacks are fetched.
- **The model** (weights, config, tokenizer) with ``huggingface_hub.snapshot_download``: into the HF cache, or into
  ``--models-dir/<model>`` (then pass that path as ``--model``).
- **A manifest** (``mpitp-manifest.json`` in DATA, else in the models dir): per file what it is, where it came from,
  the revision, size and sha256, so a copy can be verified and the campaign cited.

Then ``mpitp check`` runs on the result (network blocked) and its verdict is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mpitp.results.safefile import temp_beside, write_replace

PARQUET_REVISION = "refs/convert/parquet"
MANIFEST = "mpitp-manifest.json"


@dataclass(frozen=True)
class ManifestEntry:
    """One fetched file: ``what`` (``dataset cais/mmlu/abstract_algebra test`` or ``model gpt2``), ``source`` (the
    Hub repo and file), ``revision`` (the commit it was read at), ``path`` (where it is now), size and sha256."""

    what: str
    source: str
    revision: str
    path: str
    size: int
    sha256: str


def _entry(what: str, source: str, revision: str, path: Path) -> ManifestEntry:
    from mpitp.tasks.demo.model import _sha256_file

    return ManifestEntry(what, source, revision, str(path), path.stat().st_size, _sha256_file(path))


def _commit_of(cached: str) -> str:
    """The commit a file was downloaded at: its HF cache path is ``.../snapshots/<commit>/<file>``."""
    parts = Path(cached).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else "?"


def fetch_dataset(leaf, data_dir: Path, cache: str) -> list[ManifestEntry]:
    """Every split ``leaf`` names, from the Hub's parquet conversion, into ``leaf.folder(data_dir)``."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.hf_api import RepoFile

    config = leaf.dataset_name or "default"
    wanted = {s for _, s in leaf.splits}
    parts: dict[str, list[str]] = {}
    for f in HfApi().list_repo_tree(leaf.dataset_path, path_in_repo=config, recursive=True, repo_type="dataset",
                                    revision=PARQUET_REVISION):
        bits = f.path.split("/")
        if isinstance(f, RepoFile) and f.path.endswith(".parquet") and len(bits) == 3 and bits[1] in wanted:
            parts.setdefault(bits[1], []).append(f.path)
    missing = sorted(wanted - set(parts))
    if not parts:
        raise FileNotFoundError(f"{leaf.dataset_path} has no parquet files for config {config} on the Hub")
    folder = leaf.folder(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for split, files in sorted(parts.items()):
        local = [hf_hub_download(leaf.dataset_path, f, repo_type="dataset", revision=PARQUET_REVISION,
                                 cache_dir=cache) for f in sorted(files)]
        target = folder / f"{split}.parquet"
        fd, tmp = temp_beside(str(target))  # a new file of a random name: a data dir may be shared (never via a link)
        os.close(fd)
        try:
            if len(local) == 1:
                shutil.copyfile(local[0], tmp)
            else:  # one file per split: the layout's
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.concat_tables([pq.read_table(p) for p in local]), tmp)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        src = f"hf://datasets/{leaf.dataset_path}@{PARQUET_REVISION}/" + ("+".join(sorted(files)))
        out.append(_entry(f"dataset {leaf.dataset_path}/{config} {split}", src, _commit_of(local[0]), target))
    for split in missing:
        print(f"mpitp prefetch: {leaf.dataset_path}/{config} has no {split} split on the Hub")
    return out


def fetch_model(model: str, revision: str | None, models_dir: str | None) -> tuple[str, list[ManifestEntry]]:
    """The model snapshot: (the path to pass as ``--model`` then, or the repo id when it went to the HF cache;
    manifest entries)."""
    from huggingface_hub import snapshot_download

    local_dir = str(Path(models_dir) / model) if models_dir else None
    path = Path(snapshot_download(model, revision=revision, local_dir=local_dir))
    commit = _commit_of(str(path)) if not local_dir else (revision or "main")
    if local_dir:
        from huggingface_hub import HfApi

        commit = HfApi().model_info(model, revision=revision).sha or commit
    entries = [_entry(f"model {model}", f"hf://{model}/{f.relative_to(path)}", commit, f.resolve())
               for f in sorted(path.rglob("*")) if f.is_file() and ".cache" not in f.relative_to(path).parts]
    return (local_dir or model), entries


def write_manifest(path: Path, entries: list[ManifestEntry]) -> None:
    """Add ``entries`` to the manifest at ``path`` (a file fetched again replaces its old entry)."""
    old = []
    if path.is_file():
        try:
            old = json.loads(path.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            old = []
    merged = {e["path"]: e for e in old if isinstance(e, dict) and "path" in e}
    merged.update({e.path: asdict(e) for e in entries})
    write_replace(str(path), json.dumps({"format": 1, "files": sorted(merged.values(), key=lambda e: e["path"])},
                                        indent=1).encode())


def prefetch(spec, models_dir: str | None = None, echo=print) -> tuple[object, list[ManifestEntry]]:
    """Fetch what ``spec`` (:class:`mpitp.evaluation.readiness.CheckSpec`) lacks; (the spec to check, entries)."""
    from dataclasses import replace

    from mpitp.tasks.layout import resolve_all

    entries: list[ManifestEntry] = []
    if spec.tasks and spec.data_dir:
        data = Path(spec.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        res = resolve_all(spec.tasks, data, list(spec.include_path) or None, spec.num_fewshot)
        todo = [leaf for leaf in res.leaves if leaf.hub and leaf.name not in res.configs]
        with tempfile.TemporaryDirectory(prefix="mpitp-prefetch-") as cache:
            for leaf in todo:
                echo(f"dataset {leaf.dataset_path}" + (f"/{leaf.dataset_name}" if leaf.dataset_name else "")
                     + f" (task {leaf.name}) -> {leaf.folder(data.resolve())}")
                entries += fetch_dataset(leaf, data.resolve(), cache)
    if spec.model and not Path(spec.model).exists():
        echo(f"model {spec.model} -> {Path(models_dir) / spec.model if models_dir else 'the HF cache'}")
        path, got = fetch_model(spec.model, spec.revision, models_dir)
        entries += got
        spec = replace(spec, model=path)
    where = Path(spec.data_dir) if spec.data_dir else Path(models_dir) if models_dir else None
    if where is not None and entries:
        write_manifest(where / MANIFEST, entries)
        echo(f"manifest: {where / MANIFEST} ({len(entries)} files)")
    return spec, entries
