"""Checkpoints read once per node: ``--stage-dir DIR`` copies the model to node-local storage before loading.

With several ranks per node on a shared filesystem, every rank opens and reads the checkpoint there: four ranks of a
node ask the shared filesystem for the same files (whatever the node's page cache keeps of them), all at once, at the
moment every node of the job does the same. With ``--stage-dir`` one rank per node (node-local rank 0) copies the
model's files into ``DIR/<name>-<key>/`` while the node's other ranks wait; then every rank loads from that copy, so
the shared filesystem serves each file once per node and the node's ranks share the copy's pages.

Rank 0 plans the copy once (:func:`plan_stage`: the files transformers reads, and a key of their content); each
node's leader writes it (:func:`stage`):

- temp files are created with ``O_EXCL | O_NOFOLLOW`` inside the stage folder, fsync'd and ``os.replace``'d into
  place, and the marker :data:`MARKER` (the key and every file's size) is written last the same way: a folder without a
  matching marker is never loaded from, and a crash leaves at most temp files (removed by the next stage);
- an existing complete stage with the same key is reused (a second run, or another job of the node, copies nothing);
- the stage folder is opened with ``O_NOFOLLOW`` and every name in it is used relative to that descriptor: a
  symlink in DIR (to a folder elsewhere, or in place of a file) is refused or replaced, never followed.

``DIR`` is expanded on each rank (``~``, ``$VARS``, ``{node}``: the node's name), so ``--stage-dir '$TMPDIR/mpitp'``
names each node's own scratch directory. Only a local model directory or a model already in the local Hugging Face
cache is staged; a hub id to download is loaded as before (said once on rank 0).

Without ``--stage-dir`` nothing changes. A cheaper variant (node-local rank 0 reads the weights sequentially to warm
the page cache while the others wait) was measured and dropped: the page cache already serves a node's ranks each
page once, and the warm-up read whole files (87.6 MB) where the ranks touch only their pages (35 MB), for the same
load time (bench/README.md, "Checkpoints read once per node").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass

from mpitp.errors import UsageError

log = logging.getLogger("mpitp")

MARKER = ".mpitp-stage-complete"
"""Written last into a stage folder: JSON with the key and each file's size. A folder without it is incomplete."""
TEMP_PREFIX = ".mpitp-tmp-"
EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py", ".tiktoken", ".vocab")
"""Besides weights: config, shard index, generation config, tokenizer files, remote code."""
SMALL = 1 << 20
COPY_BLOCK = 8 << 20


@dataclass(frozen=True)
class StagePlan:
    """What to copy from where (paths relative to ``source``), and the folder name ``<name>-<key>``."""

    source: str
    files: tuple[tuple[str, int], ...]  # (relative path, size)
    folder: str
    key: str

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


def _weight_files(directory: str) -> list[str]:
    """The weight files transformers would read: safetensors when there are any, else ``*.bin`` (a snapshot that has
    both, or TF/Flax/ONNX exports beside them, copies only what is loaded)."""
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    safetensors = [n for n in names if n.endswith(".safetensors")]
    return safetensors or [n for n in names if n.endswith(".bin")]


def model_files(directory: str, subfolder: str | None = None) -> list[str]:
    """Relative paths of the files to stage: weights, config, tokenizer and generation files, at the top level and in
    ``subfolder`` (``--model_args subfolder=``). Hidden files are left out."""
    out = []
    for sub in dict.fromkeys(["", subfolder or ""]):
        where = os.path.join(directory, sub) if sub else directory
        if not os.path.isdir(where):
            continue
        names = sorted(n for n in os.listdir(where) if not n.startswith(".") and os.path.isfile(os.path.join(where, n)))
        chosen = set(_weight_files(where)) | {n for n in names if n.endswith(EXTRA_SUFFIXES)}
        out += [os.path.join(sub, n) if sub else n for n in names if n in chosen]
    return sorted(out)


def _file_digest(path: str, size: int) -> str:
    """Small files whole; a safetensors file by its header (names, dtypes, shapes, offsets); size and mtime besides."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SMALL:
            h.update(f.read())
        elif path.endswith(".safetensors"):
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(n, 100 * SMALL)))
    return h.hexdigest()[:16]


def content_key(source: str, files: list[str]) -> tuple[tuple[tuple[str, int], ...], str]:
    """((file, size) ..., a 12-hex key): the same files with the same sizes, modification times and headers (small
    files: contents) give the same key, so a checkpoint rewritten in place is staged again rather than reused. Reading
    whole multi-GB shards for a hash would cost what the stage saves."""
    entries, sized = [], []
    for rel in files:
        path = os.path.join(source, rel)
        st = os.stat(path)
        entries.append((rel, st.st_size, st.st_mtime_ns, _file_digest(path, st.st_size)))
        sized.append((rel, st.st_size))
    text = json.dumps([os.path.realpath(source), entries])
    return tuple(sized), hashlib.sha256(text.encode()).hexdigest()[:12]


def local_source(model: str, revision: str | None = None) -> str | None:
    """The local directory of ``model``: itself, or its snapshot in the local Hugging Face cache (never downloads)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.abspath(path)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a hub id: nothing local to stage
        return None


def plan_stage(model: str, revision: str | None = None, subfolder: str | None = None) -> StagePlan | None:
    """Rank 0's plan for every node, or None when the model is not on local storage (it is then loaded as before)."""
    source = local_source(model, revision)
    if source is None:
        return None
    if subfolder and (os.path.isabs(subfolder) or ".." in subfolder.split("/")):
        return None  # loaded as given: a stage holds the model's own folder only
    files = model_files(source, subfolder)
    if not files:
        return None
    sized, key = content_key(source, files)
    base = model.rstrip("/").replace("/", "--") if source != os.path.abspath(os.path.expanduser(model)) \
        else os.path.basename(source.rstrip("/"))
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._") or "model"
    return StagePlan(source=source, files=sized, folder=f"{name[:80]}-{key}", key=key)


def expand_dir(stage_dir: str, node_name: str) -> str:
    """``~``, ``$VARS`` and ``{node}`` expanded on this rank: node-local scratch often has a per-node name."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(stage_dir.replace("{node}", node_name))))


# --------------------------------------------------------------------------------------------------- the copy


def _open_folder(root: str, folder: str) -> int:
    """A descriptor of ``root/folder`` (created if missing), refusing a symlink or anything but a directory there."""
    os.makedirs(root, exist_ok=True)
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            os.mkdir(folder, 0o755, dir_fd=rootfd)
        except FileExistsError:
            pass
        try:
            return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=rootfd)
        except OSError as exc:
            if os.path.islink(os.path.join(root, folder)):
                raise OSError(f"{os.path.join(root, folder)} is a symlink; mpitp does not follow symlinks in the "
                              f"stage directory (remove it)") from None
            raise OSError(f"{os.path.join(root, folder)} is not a directory ({exc.strerror})") from None
    finally:
        os.close(rootfd)


def _read_marker(dfd: int) -> dict | None:
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            return json.loads(f.read(SMALL))
        except ValueError:
            return None


def _complete(dfd: int, plan: StagePlan) -> bool:
    """The marker matches the plan and every file is a regular file (not a symlink) of the planned size."""
    import stat

    marker = _read_marker(dfd)
    if not marker or marker.get("key") != plan.key or [tuple(x) for x in marker.get("files", [])] != list(plan.files):
        return False
    for rel, size in plan.files:
        try:
            st = os.stat(rel, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
    return True


def _write_atomic(dfd: int, rel: str, fill) -> int:
    """Create a temp file (``O_EXCL``, no symlink followed) beside ``rel``, ``fill(fd)`` it, fsync, rename it into
    place: a reader sees the old file or the whole new one, never a part."""
    parent = os.path.dirname(rel)
    pfd = dfd
    if parent:
        for part in parent.split("/"):
            try:
                os.mkdir(part, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
            if pfd != dfd:
                os.close(pfd)
            pfd = nfd
    name = os.path.basename(rel)
    tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=pfd)
    try:
        try:
            n = fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
    except BaseException:
        with _quiet():
            os.unlink(tmp, dir_fd=pfd)
        raise
    finally:
        if pfd != dfd:
            os.close(pfd)
    return n


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        return kind is not None and issubclass(kind, OSError)


def _copy_into(src_path: str):
    def fill(fd: int) -> int:
        total = 0
        buf = bytearray(COPY_BLOCK)
        view = memoryview(buf)
        with open(src_path, "rb", buffering=0) as src:
            while n := src.readinto(buf):
                out = 0
                while out < n:
                    out += os.write(fd, view[out:n])
                total += n
        return total

    return fill


def _remove_temps(dfd: int) -> None:
    """Temp files a killed stage left (older than an hour: a live stage of another job may be writing its own)."""
    for name in os.listdir(dfd):
        if name.startswith(TEMP_PREFIX):
            with _quiet():
                if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime > 3600:
                    os.unlink(name, dir_fd=dfd)


def stage(plan: StagePlan, root: str) -> tuple[str, int]:
    """Copy the plan's files into ``root/<folder>`` unless a complete stage with the same key is there.

    Returns (the stage's path, bytes copied: 0 when reused). Raises ``OSError`` (the caller words it)."""
    dfd = _open_folder(root, plan.folder)
    try:
        if _complete(dfd, plan):
            return os.path.join(root, plan.folder), 0
        _remove_temps(dfd)
        copied = 0
        for rel, size in plan.files:
            n = _write_atomic(dfd, rel, _copy_into(os.path.join(plan.source, rel)))
            if n != size:
                raise OSError(f"{os.path.join(plan.source, rel)} changed while it was copied ({size} bytes "
                              f"planned, {n} read)")
            copied += n
        os.fsync(dfd)
        marker = json.dumps({"key": plan.key, "source": plan.source, "files": [list(x) for x in plan.files]}).encode()
        _write_atomic(dfd, MARKER, lambda fd: os.write(fd, marker))
        os.fsync(dfd)
        return os.path.join(root, plan.folder), copied
    finally:
        os.close(dfd)


# -------------------------------------------------------------------------------------------- the collective part


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return " ".join(str(exc).split()) or type(exc).__name__


def staged_model(model: str, stage_dir: str | None, world, timeout: float, revision: str | None = None,
                 subfolder: str | None = None) -> str:
    """The path every rank loads ``model`` from: its stage on this node's ``stage_dir``, or ``model`` itself when no
    stage is asked for or the model is not local. Collective over ``world.comm``.

    Each node's local rank 0 copies (or finds a complete stage) while the node's other ranks wait on ``node_comm``
    (a deadline naming the phase); then every rank learns every node's outcome, so one node's failure (no space, an
    unwritable directory) ends the run on every rank as one :class:`UsageError` line from rank 0."""
    from mpitp.parallel import comm as mpicomm
    from mpitp.parallel.runtime import agree

    if not stage_dir:
        return model
    plan = agree(lambda: plan_stage(model, revision, subfolder), world.comm, timeout, "planning the model's stage")
    if plan is None:
        if world.rank == 0:
            log.warning("--stage-dir: %s is not a local directory or in the local Hugging Face cache; loading it "
                        "without a stage", model)
        return model
    root = expand_dir(stage_dir, world.node_name)
    path, err, copied, t0 = os.path.join(root, plan.folder), None, 0, time.perf_counter()
    if world.local_rank == 0:
        try:
            path, copied = stage(plan, root)
        except Exception as exc:  # noqa: BLE001 - any failure to stage is reported as one line, on every rank
            err = f"node {world.node_name}: cannot stage {model} into {root}: {_why(exc)}"
    mpicomm.barrier(world.node_comm, timeout, phase=f"staging the model on node {world.node_name}")
    errors = mpicomm.gather_obj((err, copied), world.comm, root=0, timeout=timeout, phase="staging the model")
    summary = None
    if errors is not None:
        summary = (next((e for e, _ in errors if e), None), sum(c for _, c in errors))
    first, total = mpicomm.bcast_obj(summary, world.comm, root=0, timeout=timeout, phase="staging the model")
    if first:
        raise UsageError(f"--stage-dir: {first}", collective=True)
    if world.rank == 0:
        log.info("stage: %s (%.1f MB) in %s on each of %d node(s): %.1f MB copied in all (%.1f s, waits included)%s",
                 model, plan.nbytes / 1e6, path, world.n_nodes, total / 1e6, time.perf_counter() - t0,
                 "" if total else ", every node reused its stage")
    return path

