"""``mpitp prefetch``: on a node with network, fetch what ``mpitp check`` would find missing, as plain files.

- **Datasets** go into the generic ``--data-dir`` layout (:mod:`mpitp.tasks.layout`) as one parquet file per split,
  from the Hub's parquet conversion of the dataset (the ``refs/convert/parquet`` revision every Hub dataset has,
  also those with loading scripts: ``<config>/<split>/NNNN.parquet``), through ``huggingface_hub``. Plain files, not
  the shared HF cache: safe on parallel filesystems whose locks do nothing, and easy to copy to another cluster.
  Only the tasks whose needed splits DATA lacks are fetched.
- **The model** (weights, config, tokenizer) with ``huggingface_hub.snapshot_download``: into the HF cache, or into
  ``--models-dir/<model>`` (then pass that path as ``--model``).
- **``evaluate`` metric modules** (``rouge``, ``code_eval``, ...) into the HF modules cache
  (``$HF_HOME/modules/evaluate_modules``, ``HF_MODULES_CACHE``), by ``evaluate``'s own loader from the Hub space
  ``evaluate-metric/<name>`` (through ``HF_ENDPOINT``): where ``evaluate.load`` finds them offline. So the run must
  see the same ``HF_HOME`` (or ``HF_MODULES_CACHE``) as the prefetch: a module is a few kB of Python, nothing a
  parallel filesystem's locks can spoil, and a folder elsewhere would need every run to point ``HF_MODULES_CACHE``
  at it, which transformers' remote code uses too.
- **nltk data** (ifeval's ``punkt_tab``, ...) into ``DATA/nltk_data`` with nltk's own downloader, from
  ``--nltk-index`` (nltk's index by default; a mirror's ``index.xml`` otherwise). ``mpitp check``, ``mpitp eval
  --data-dir`` and ``mpitp submit``'s scripts put that folder on ``NLTK_DATA``. nltk refuses index and package URLs
  on loopback or private addresses (its SSRF guard) unless they come through a proxy the operator trusts
  (``http_proxy`` with ``NLTK_ALLOW_PROXIED_URLOPEN=1``).
- **A manifest** (``mpitp-manifest.json`` in DATA, else in the models dir): per file what it is, where it came from,
  the revision, size and sha256, so a copy can be verified and the campaign cited.

Which metric modules and nltk packages are needed is not a hand list: ``mpitp check`` (network blocked, in its own
process) finds them by running the tasks' metrics on stand-ins and names them in its JSON report; prefetch fetches
what it names and checks again, until the check names nothing new it can fetch, then prints its verdict. (A task may
need a second one only after the first is there: ifeval's nltk data is looked for after its metric runs.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mpitp.results.safefile import temp_beside, write_replace

if TYPE_CHECKING:
    import subprocess

    from mpitp.jobs.readiness_spec import CheckSpec
    from mpitp.tasks.layout import LeafTask

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
    from mpitp.digest import sha256_file

    return ManifestEntry(what, source, revision, str(path), path.stat().st_size, sha256_file(path))


def _commit_of(cached: str) -> str:
    """The commit a file was downloaded at: its HF cache path is ``.../snapshots/<commit>/<file>``."""
    parts = Path(cached).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else "?"


def fetch_dataset(leaf: LeafTask, data_dir: Path, cache: str) -> list[ManifestEntry]:
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


def fetch_metric(name: str) -> list[ManifestEntry]:
    """The ``evaluate`` module ``name`` into the HF modules cache, by ``evaluate``'s own loader (the Hub space
    ``evaluate-metric/<name>``, or ``-comparison``/``-measurement``, as ``evaluate.load(name)`` looks)."""
    from evaluate import config as evaluate_config
    from evaluate.loading import evaluation_module_factory, init_dynamic_modules

    module = evaluation_module_factory(name)
    parts = module.module_path.split(".")  # evaluate_modules.metrics.evaluate-metric--<name>.<hash>.<name>
    path = Path(init_dynamic_modules()).joinpath(*parts[1:-1], parts[-1] + ".py")
    space = parts[2].replace("--", "/")
    return [_entry(f"metric {name}", f"{evaluate_config.HF_ENDPOINT}/spaces/{space}", module.hash, path)]


def fetch_nltk(package: str, folder: Path, index_url: str | None) -> list[ManifestEntry]:
    """nltk's ``package`` into ``folder`` by nltk's own downloader (its index ``index_url``, nltk's default when
    None); raises when it did not get it (nltk's downloader otherwise prints and returns False)."""
    import io

    from nltk.downloader import Downloader

    dl = Downloader(server_index_url=index_url or None)
    errors = io.StringIO()  # nltk prints its errors there
    folder.mkdir(parents=True, exist_ok=True)
    if not dl.download(package, download_dir=str(folder), quiet=True, raise_on_error=True, print_error_to=errors):
        raise RuntimeError(f"nltk could not fetch {package} from {dl.url}: {' '.join(errors.getvalue().split())}")
    info = dl.info(package)
    revision = getattr(info, "sha256_checksum", None) or info.checksum or "?"
    archive = folder / info.filename
    files = [archive] if archive.is_file() else sorted(f for f in archive.with_suffix("").rglob("*") if f.is_file())
    return [_entry(f"nltk {package}", info.url, revision, f) for f in files]


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


def prefetch(spec: CheckSpec, models_dir: str | None = None,
             echo: Callable[[str], object] = print) -> tuple[CheckSpec, list[ManifestEntry]]:
    """Fetch what ``spec`` (:class:`mpitp.jobs.readiness.CheckSpec`) lacks; (the spec to check, entries)."""
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
    _write_manifest(spec, models_dir, entries, echo)
    return spec, entries


def _write_manifest(spec, models_dir, entries, echo) -> None:
    where = Path(spec.data_dir) if spec.data_dir else Path(models_dir) if models_dir else None
    if where is not None and entries:
        write_manifest(where / MANIFEST, entries)
        echo(f"manifest: {where / MANIFEST} ({len(entries)} files)")


def check_argv(spec: CheckSpec, json_out: str | None = None) -> list[str]:
    """``python -m mpitp check`` with ``spec``'s options (and ``--json-out``), isolated from the working directory
    (:mod:`mpitp.isolated`)."""
    from mpitp.isolated import mpitp_argv

    argv = mpitp_argv("check")
    if spec.tasks:
        argv += ["--tasks", ",".join(spec.tasks)]
    for flag, value in (("--data-dir", spec.data_dir), ("--model", spec.model), ("--tokenizer", spec.tokenizer),
                        ("--revision", spec.revision), ("--num_fewshot", spec.num_fewshot), ("--json-out", json_out)):
        if value is not None:
            argv += [flag, str(value)]
    for path in spec.include_path:
        argv += ["--include_path", path]
    return argv + ["--apply_chat_template"] * spec.apply_chat_template + \
        ["--trust_remote_code"] * spec.trust_remote_code


ROUNDS = 3
"""Fetch rounds at most, each followed by a check: a need can show only once the one before it is met (a task's
metric module, then its nltk data)."""


def fetch_until_ready(spec: CheckSpec, models_dir: str | None, nltk_index: str | None,
                      echo: Callable[[str], object] = print) -> subprocess.CompletedProcess[str]:
    """Run ``mpitp check`` (its own process: network blocked, offline variables) and fetch the metric modules and
    nltk data it names, until it names nothing new to fetch; the last check's ``CompletedProcess``."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "HF_ENDPOINT"}
    tried: set[tuple[str, str]] = set()
    entries: list[ManifestEntry] = []
    with tempfile.TemporaryDirectory(prefix="mpitp-prefetch-") as tmp:
        out = os.path.join(tmp, "check.json")
        for round_ in range(ROUNDS + 1):
            done = subprocess.run(check_argv(spec, out), env=env, capture_output=True, text=True, check=False)
            try:
                with open(out, encoding="utf-8") as fh:
                    problems = json.load(fh)["problems"]
                os.unlink(out)
            except (OSError, ValueError, KeyError):
                problems = []
            todo = sorted({(kind, p[kind]) for p in problems for kind in ("metric", "nltk") if p.get(kind)} - tried)
            if not todo or round_ == ROUNDS:
                break
            for kind, name in todo:
                tried.add((kind, name))
                try:
                    if kind == "metric":
                        echo(f"metric {name} -> the HF modules cache")
                        entries += fetch_metric(name)
                    else:
                        echo(f"nltk {name} -> {nltk_folder(spec)}")
                        entries += fetch_nltk(name, nltk_folder(spec), nltk_index)
                except Exception as exc:  # noqa: BLE001 - one line; the final check says what is still missing
                    echo(f"mpitp prefetch: {kind} {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    _write_manifest(spec, models_dir, entries, echo)
    return done


def nltk_folder(spec: CheckSpec) -> Path:
    from mpitp.tasks.layout import nltk_folder as folder

    return folder(spec.data_dir)
