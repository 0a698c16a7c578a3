"""Checkpoints read once per node: ``--stage-dir DIR`` copies the model to node-local storage before loading.

With several ranks per node on a shared filesystem, every rank opens and reads the checkpoint there: four ranks of a
node ask the shared filesystem for the same files (whatever the node's page cache keeps of them), all at once, at the
moment every node of the job does the same. With ``--stage-dir`` one rank per node (node-local rank 0) copies the
model's files into ``DIR/<name>-<key>/`` while the node's other ranks wait; then every rank loads from that copy, so
the shared filesystem serves each file once per node and the node's ranks share the copy's pages.

Rank 0 plans the copy once (:func:`plan_stage`: the files transformers reads, and a key of their content); each
node's leader writes it (:func:`stage`):

- temp files are created with ``O_EXCL | O_NOFOLLOW`` inside the stage folder, fsync'd and ``os.replace``'d into
  place, and the marker :data:`MARKER` (the key, every file's size and the SHA-256 of the bytes copied) is written last
  the same way: a folder without a matching marker is never loaded from, and a crash leaves at most temp files
  (removed by the next stage);
- an existing complete stage with the same key is reused (a second run, or another job of the node, copies nothing);
- the stage folder is opened with ``O_NOFOLLOW`` and every name in it is used relative to that descriptor: a
  symlink in DIR (to a folder elsewhere, or in place of a file) is passed over or replaced, never followed.

Stages on a shared node (``DIR`` on a sticky 1777 ``/tmp``) are not trusted until checked: a stage's name and key are
computed from public facts (path, sizes, mtimes, headers), so anyone can create ``DIR/<name>-<key>/`` first, with a
marker and zeroed weights (or a ``modeling_*.py`` for ``trust_remote_code``) of the right sizes.

- **A stage is used only if it is yours and private**: the folder (opened ``O_NOFOLLOW``), any subfolder, the marker
  and every file, checked by ``fstat`` on the descriptors read, must belong to this user and be writable by nobody
  else. A stage is never shared between users: each stages their own copy.
- **Anything else is passed over, not refused**: one warning line (logged by rank 0 for every node) names it and the
  stage goes beside it, into ``<name>-<key>-u<uid>``, else a fresh folder with a random suffix (used by this run only).
  Refusing would let anyone stop your runs by creating one folder in ``/tmp``, and you cannot remove another user's
  folder from a sticky directory.
- **``DIR`` itself** must belong to you or root, and be sticky (like ``/tmp``) if group or others can write to it;
  else one line refuses it: another user could rename your checked stage away and put theirs in its place before the
  ranks load it. That includes a sticky ``DIR`` of another user's (anyone can create ``/tmp/mpitp`` first, and a
  sticky folder's owner may still rename what is in it). A ``DIR`` mpitp creates is 0700.
- **Modes**: stage folders are 0700 (an older stage of yours is tightened to 0700 when reused) and files 0600, whatever
  the source's modes and the umask: a model kept in a private folder stays private on the node.
- **Content, not sizes**: the marker records the SHA-256 of each file computed from the bytes as they were copied, and
  a reuse reads every staged file again (through the checked descriptor, a few files at a time on threads) and
  compares: a stage whose content changed after the copy, same sizes or not, is copied again. Cost: one read of the
  model from node-local storage on the node leader; with a warm page cache 2-3 ms for stories260K and 85-145 ms for a
  100 MB file (SHA-256 bound, about 1 GB/s a thread, on a busy 2-core machine), so ~15 s for 14 GB on one thread,
  less for a sharded checkpoint (:data:`HASH_THREADS` files at once); a reuse used to cost nothing.
- **The fingerprint is of the bytes loaded**: the results file fingerprints the source
  (:mod:`mpitp.evaluation.fingerprint`: size, safetensors header, sampled blocks). The key includes the source's
  sampled digests, and after copying a file its copy's sampled digest must equal the planned one (else the source
  changed during the copy: one line), so what the results file records is what the stage holds.
- **Between check and load**: after staging, the leader checks that the stage's path still names the folder it
  checked (device and inode, yours, private), and every rank of the node checks the folder again before loading.
  Nobody else can write inside a 0700 folder of yours or (``DIR`` sticky or private) rename it.

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
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mpitp import digest
from mpitp.digest import sampled_sha
from mpitp.errors import UsageError

log = logging.getLogger("mpitp")

MARKER = ".mpitp-stage-complete"
"""Written last into a stage folder: JSON with the key, each file's size and the SHA-256 of the bytes copied into it
(``sha256``). A folder without it is incomplete."""
TEMP_PREFIX = ".mpitp-tmp-"
EXTRA_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py", ".tiktoken", ".vocab")
"""Besides weights: config, shard index, generation config, tokenizer files, remote code."""
DCP_METADATA = ".metadata"
SMALL = 1 << 20
COPY_BLOCK = 8 << 20
FOLDER_MODE, FILE_MODE = 0o700, 0o600
HASH_THREADS = 4
"""Staged files re-hashed at once on a reuse (hashlib releases the GIL: a sharded checkpoint is read in parallel)."""


@dataclass(frozen=True)
class StagePlan:
    """What to copy from where (paths relative to ``source``), and the folder name ``<name>-<key>``."""

    source: str
    files: tuple[tuple[str, int], ...]  # (relative path, size)
    folder: str
    key: str
    samples: tuple[str, ...] = ()  # per file: the sampled digest the results file's fingerprint records (sampled_sha)

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
    ``subfolder`` (``--model_args subfolder=``). Hidden files are left out, but for a torch DCP checkpoint's
    ``.metadata`` (its index, staged with the ``*.distcp`` shards)."""
    out = []
    for sub in dict.fromkeys(["", subfolder or ""]):
        where = os.path.join(directory, sub) if sub else directory
        if not os.path.isdir(where):
            continue
        names = sorted(n for n in os.listdir(where) if not n.startswith(".") and os.path.isfile(os.path.join(where, n)))
        chosen = set(_weight_files(where)) | {n for n in names if n.endswith(EXTRA_SUFFIXES)}
        if os.path.isfile(os.path.join(where, DCP_METADATA)):  # a torch DCP checkpoint: its index and its shards
            names.append(DCP_METADATA)
            chosen |= {DCP_METADATA} | {n for n in names if n.endswith(".distcp")}
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


def content_key(source: str, files: list[str]) -> tuple[tuple[tuple[str, int], ...], str, tuple[str, ...]]:
    """((file, size) ..., a 12-hex key, each file's sampled digest): the same files with the same sizes, modification
    times, headers (small files: contents) and sampled blocks give the same key, so a checkpoint rewritten in place is
    staged again rather than reused. Reading whole multi-GB shards for a hash would cost what the stage saves; the
    sampled blocks are those the results file's fingerprint reads (1 MiB a file), so the two agree."""
    entries, sized, samples = [], [], []
    for rel in files:
        path = os.path.join(source, rel)
        st = os.stat(path)
        sample = sampled_sha(path, st.st_size)
        entries.append((rel, st.st_size, st.st_mtime_ns, _file_digest(path, st.st_size), sample))
        sized.append((rel, st.st_size))
        samples.append(sample)
    text = json.dumps([os.path.realpath(source), entries])
    return tuple(sized), hashlib.sha256(text.encode()).hexdigest()[:12], tuple(samples)


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
    sized, key, samples = content_key(source, files)
    base = model.rstrip("/").replace("/", "--") if source != os.path.abspath(os.path.expanduser(model)) \
        else os.path.basename(source.rstrip("/"))
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._") or "model"
    return StagePlan(source=source, files=sized, folder=f"{name[:80]}-{key}", key=key, samples=samples)


def expand_dir(stage_dir: str, node_name: str) -> str:
    """``~``, ``$VARS`` and ``{node}`` expanded on this rank: node-local scratch often has a per-node name."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(stage_dir.replace("{node}", node_name))))


# --------------------------------------------------------------------------------------------------- the copy


def _not_private(st: os.stat_result) -> str | None:
    """Why a stage entry with this ``fstat`` is not this user's alone, or None: it must belong to this user and be
    writable by nobody else (a folder others can write to may hold anything by the time it is loaded)."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _open_root(root: str) -> int:
    """A descriptor of ``DIR`` (created 0700 if missing), refused when another user could swap a stage inside it: its
    owner (other than you or root: anyone can create ``/tmp/mpitp`` first, and a sticky folder's owner may still
    rename what is in it), or anyone when it is writable by group or others without the sticky bit."""
    os.makedirs(root, FOLDER_MODE, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    mode, uid = stat.S_IMODE(st.st_mode), os.geteuid()
    why = None
    if st.st_uid not in (uid, 0):
        why = f"belongs to uid {st.st_uid}, not to you (uid {uid}) or root: its owner"
    elif mode & 0o022 and not mode & stat.S_ISVTX:
        why = f"can be written by other users and is not sticky (mode {mode:04o}): one of them"
    if why:
        os.close(fd)
        raise OSError(f"{root} {why} could put their own stage in place of yours after mpitp checks it; use a folder "
                      f"of your own (such as '$TMPDIR/mpitp') or one under a sticky folder of root's such as /tmp")
    return fd


def _claim(rootfd: int, name: str) -> tuple[int | None, str | None]:
    """(a descriptor of ``DIR/name``, None), created 0700 if missing; (None, why) when it is not a folder of this
    user's alone (a symlink, not a folder, another user's, writable by others)."""
    try:
        os.mkdir(name, FOLDER_MODE, dir_fd=rootfd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=rootfd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=rootfd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        return None, "is a symlink" if link else f"is not a directory ({exc.strerror})"
    st = os.fstat(fd)
    why = _not_private(st)
    if why:
        os.close(fd)
        return None, why
    if stat.S_IMODE(st.st_mode) != FOLDER_MODE:
        os.fchmod(fd, FOLDER_MODE)  # a stage of an older mpitp (0755), or a umask that took the owner's bits
    return fd, None


def _open_stage(root: str, plan: StagePlan, notes: list[str]) -> tuple[int, str]:
    """(a descriptor of this user's stage folder in ``root``, its name): ``<folder>``, else ``<folder>-u<uid>``, else
    a fresh ``<folder>-<random>``; each one passed over adds a line to ``notes``."""
    rootfd = _open_root(root)
    try:
        for name in (plan.folder, f"{plan.folder}-u{os.geteuid()}"):
            dfd, why = _claim(rootfd, name)
            if dfd is not None:
                if name != plan.folder:
                    notes.append(f"staging into {os.path.join(root, name)} instead")
                return dfd, name
            notes.append(f"{os.path.join(root, name)} {why}: not used as a stage")
        for _ in range(100):
            name = f"{plan.folder}-{secrets.token_hex(4)}"
            try:
                os.mkdir(name, FOLDER_MODE, dir_fd=rootfd)
            except FileExistsError:
                continue
            dfd, why = _claim(rootfd, name)
            if dfd is None:
                raise OSError(f"{os.path.join(root, name)} {why} right after mpitp created it")
            notes.append(f"staging into {os.path.join(root, name)} instead, for this run only (remove the folders "
                         f"above, or choose another --stage-dir)")
            return dfd, name
        raise OSError(f"no free name for a stage folder {plan.folder}-<random> in {root}")
    finally:
        os.close(rootfd)


def _parent(dfd: int, rel: str, create: bool) -> int:
    """A descriptor of the folder holding ``rel`` inside the stage (``dfd`` itself for a top-level file; the caller
    closes any other). Subfolders are opened ``O_NOFOLLOW`` and must be this user's alone; created 0700."""
    pfd = dfd
    sub = os.path.dirname(rel)
    for part in sub.split("/") if sub else []:
        if create:
            try:
                os.mkdir(part, FOLDER_MODE, dir_fd=pfd)
            except FileExistsError:
                pass
        try:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
        finally:
            if pfd != dfd:
                os.close(pfd)
        why = _not_private(os.fstat(nfd))
        if why:
            os.close(nfd)
            raise OSError(f"{sub} in the stage {why}")
        pfd = nfd
    return pfd


def _read_marker(dfd: int) -> dict | None:
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _not_private(st):
            return None
        try:
            marker = json.loads(f.read(SMALL))
        except ValueError:
            return None
    return marker if isinstance(marker, dict) else None


def _staged_sha(dfd: int, rel: str, size: int) -> str | None:
    """The SHA-256 of the staged ``rel``, read through the descriptor checked to be a regular file of this user's
    alone and of the planned size; None when it is not."""
    try:
        pfd = _parent(dfd, rel, create=False)
    except OSError:
        return None
    try:
        fd = os.open(os.path.basename(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=pfd)
    except OSError:
        return None
    finally:
        if pfd != dfd:
            os.close(pfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _not_private(st) or st.st_size != size:
            return None
        h = hashlib.sha256()
        digest.update_fileobj(h, f)
        return h.hexdigest()


def _complete(dfd: int, plan: StagePlan) -> bool:
    """The marker matches the plan and every file is a regular file of this user's alone, of the planned size, whose
    bytes have the SHA-256 the marker recorded when they were copied (read again now)."""
    marker = _read_marker(dfd)
    if not marker or marker.get("key") != plan.key or not isinstance(marker.get("files"), list) \
            or [tuple(x) if isinstance(x, list) else x for x in marker["files"]] != list(plan.files):
        return False
    recorded = marker.get("sha256")
    if not isinstance(recorded, dict) or any(not isinstance(recorded.get(rel), str) for rel, _ in plan.files):
        return False
    with ThreadPoolExecutor(max(1, min(HASH_THREADS, len(plan.files)))) as pool:
        found = list(pool.map(lambda f: _staged_sha(dfd, *f), plan.files))
    return all(recorded[rel] == sha for (rel, _), sha in zip(plan.files, found))


def _write_atomic(dfd: int, rel: str, fill):
    """Create a temp file (``O_EXCL``, no symlink followed, mode 0600) beside ``rel``, ``fill(fd)`` it, fsync, rename
    it into place: a reader sees the old file or the whole new one, never a part. Returns what ``fill`` returns."""
    pfd = _parent(dfd, rel, create=True)
    name = os.path.basename(rel)
    tmp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{name}"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE, dir_fd=pfd)
        try:  # from here on the temp file is ours: removed if anything fails
            try:
                os.fchmod(fd, FILE_MODE)  # whatever the umask
                out = fill(fd)
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
    return out


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, *rest):
        return kind is not None and issubclass(kind, OSError)


def _copy_into(src_path: str):
    """``fill`` for :func:`_write_atomic`: copies ``src_path``; returns (bytes copied, their SHA-256, the copy's
    sampled digest as the results file's fingerprint computes it, read back through the descriptor)."""
    def fill(fd: int) -> tuple[int, str, str]:
        total = 0
        h = hashlib.sha256()
        buf = bytearray(COPY_BLOCK)
        view = memoryview(buf)
        with open(src_path, "rb", buffering=0) as src:
            while n := src.readinto(buf):
                h.update(view[:n])
                out = 0
                while out < n:
                    out += os.write(fd, view[out:n])
                total += n
        os.lseek(fd, 0, os.SEEK_SET)
        return total, h.hexdigest(), sampled_sha(os.dup(fd), total)

    return fill


def _remove_temps(dfd: int) -> None:
    """Temp files a killed stage left (older than an hour: a live stage of another job may be writing its own)."""
    for name in os.listdir(dfd):
        if name.startswith(TEMP_PREFIX):
            with _quiet():
                if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime > 3600:
                    os.unlink(name, dir_fd=dfd)


def check_folder(path: str, same_as: os.stat_result | None = None) -> None:
    """Raise ``OSError`` unless ``path`` (not followed if a symlink) is a folder of this user's alone, and the very
    folder ``same_as`` describes when given: the check a rank makes before loading from a stage."""
    st = os.stat(path, follow_symlinks=False)
    why = "is not a directory" if not stat.S_ISDIR(st.st_mode) else _not_private(st)
    if not why and same_as is not None and (st.st_dev, st.st_ino) != (same_as.st_dev, same_as.st_ino):
        why = "is no longer the folder mpitp staged into (replaced while it was staged)"
    if why:
        raise OSError(f"{path} {why}")


def stage(plan: StagePlan, root: str, notes: list[str] | None = None) -> tuple[str, int]:
    """Copy the plan's files into this user's stage folder in ``root`` unless a complete stage with the same key is
    there (checked: owner, modes, SHA-256 of every file).

    Returns (the stage's path, bytes copied: 0 when reused). Raises ``OSError`` (the caller words it). A folder passed
    over (another user's, a symlink, ...) adds a line to ``notes``."""
    notes = [] if notes is None else notes
    dfd, name = _open_stage(root, plan, notes)
    path = os.path.join(root, name)
    try:
        if _complete(dfd, plan):
            check_folder(path, os.fstat(dfd))
            return path, 0
        _remove_temps(dfd)
        copied, sha = 0, {}
        for (rel, size), sample in zip(plan.files, plan.samples or [None] * len(plan.files)):
            src = os.path.join(plan.source, rel)
            n, sha[rel], copy_sample = _write_atomic(dfd, rel, _copy_into(src))
            if n != size:
                raise OSError(f"{src} changed while it was copied ({size} bytes planned, {n} read)")
            if sample is not None and copy_sample != sample:
                raise OSError(f"{src} changed while it was copied (its content differs from what rank 0 planned and "
                              f"the results file fingerprints)")
            copied += n
        os.fsync(dfd)
        marker = json.dumps({"key": plan.key, "source": plan.source, "files": [list(x) for x in plan.files],
                             "sha256": sha}).encode()
        _write_atomic(dfd, MARKER, lambda fd: os.write(fd, marker))
        os.fsync(dfd)
        check_folder(path, os.fstat(dfd))
        return path, copied
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
    path, err, copied, notes, t0 = None, None, 0, [], time.perf_counter()
    if world.local_rank == 0:
        try:
            path, copied = stage(plan, root, notes)
        except Exception as exc:  # noqa: BLE001 - any failure to stage is reported as one line, on every rank
            err = f"node {world.node_name}: cannot stage {model} into {root}: {_why(exc)}"
    # the node's ranks learn where the leader staged (not always <folder>: see "passed over" in the module docstring)
    path, err = mpicomm.bcast_obj((path, err), world.node_comm, root=0, timeout=timeout,
                                  phase=f"staging the model on node {world.node_name}")
    if world.local_rank != 0 and err is None:
        try:
            check_folder(path)  # what this rank loads from is still a folder of this user's alone
        except OSError as exc:
            err = f"node {world.node_name}: cannot load the stage of {model}: {_why(exc)}"
    errors = mpicomm.gather_obj((err, copied, [f"node {world.node_name}: {n}" for n in notes]), world.comm, root=0,
                                timeout=timeout, phase="staging the model")
    summary = None
    if errors is not None:
        for _, _, node_notes in errors:
            for note in node_notes:
                log.warning("--stage-dir: %s", note)
        summary = (next((e for e, _, _ in errors if e), None), sum(c for _, c, _ in errors))
    first, total = mpicomm.bcast_obj(summary, world.comm, root=0, timeout=timeout, phase="staging the model")
    if first:
        raise UsageError(f"--stage-dir: {first}", collective=True)
    if world.rank == 0:
        log.info("stage: %s (%.1f MB) in %s on each of %d node(s): %.1f MB copied in all (%.1f s, waits included)%s",
                 model, plan.nbytes / 1e6, path, world.n_nodes, total / 1e6, time.perf_counter() - t0,
                 "" if total else ", every node reused its stage")
    return path

