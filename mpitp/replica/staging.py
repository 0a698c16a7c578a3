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
marker and zeroed weights (or a ``modeling_*.py`` for ``trust_remote_code``) of the right sizes. What makes a stage
usable (yours and private, ``DIR`` yours or root's, modes 0700/0600, anything else passed over with one warning, not
refused) is in :mod:`mpitp.replica.stage_folder`; what it holds and its key, in :mod:`mpitp.replica.stage_plan`.

- **Content, not sizes**: the marker records the SHA-256 of each file computed from the bytes as they were copied, and
  a reuse reads every staged file again (through the checked descriptor, a few files at a time on threads) and
  compares: a stage whose content changed after the copy, same sizes or not, is copied again. Cost: one read of the
  model from node-local storage on the node leader; with a warm page cache 2-3 ms for stories260K and 85-145 ms for a
  100 MB file (SHA-256 bound, about 1 GB/s a thread, on a busy 2-core machine), so ~15 s for 14 GB on one thread,
  less for a sharded checkpoint (:data:`~mpitp.replica.stage_folder.HASH_THREADS` files at once); a reuse used to
  cost nothing.
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
import time
from typing import TYPE_CHECKING

from mpitp.digest import sampled_sha
from mpitp.errors import UsageError
from mpitp.replica.stage_folder import (
    MARKER,
    TEMP_PREFIX,
    check_folder,
    is_complete,
    open_stage,
    remove_temps,
    write_atomic,
)
from mpitp.replica.stage_plan import StagePlan, expand_dir, model_files, plan_stage

if TYPE_CHECKING:
    from mpitp.parallel.world import World

__all__ = [  # what callers and tests use from here; the folder's checks and the plan live in their own modules
    "MARKER", "TEMP_PREFIX", "StagePlan", "check_folder", "expand_dir", "model_files", "plan_stage", "stage",
    "staged_model",
]

log = logging.getLogger("mpitp")

COPY_BLOCK = 8 << 20


# --------------------------------------------------------------------------------------------------- the copy


def _copy_into(src_path: str):
    """``fill`` for :func:`write_atomic`: copies ``src_path``; returns (bytes copied, their SHA-256, the copy's
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


def stage(plan: StagePlan, root: str, notes: list[str] | None = None) -> tuple[str, int]:
    """Copy the plan's files into this user's stage folder in ``root`` unless a complete stage with the same key is
    there (checked: owner, modes, SHA-256 of every file).

    Returns (the stage's path, bytes copied: 0 when reused). Raises ``OSError`` (the caller words it). A folder passed
    over (another user's, a symlink, ...) adds a line to ``notes``."""
    notes = [] if notes is None else notes
    dfd, name = open_stage(root, plan, notes)
    path = os.path.join(root, name)
    try:
        if is_complete(dfd, plan):
            check_folder(path, os.fstat(dfd))
            return path, 0
        remove_temps(dfd)
        copied, sha = 0, {}
        for (rel, size), sample in zip(plan.files, plan.samples or [None] * len(plan.files)):
            src = os.path.join(plan.source, rel)
            n, sha[rel], copy_sample = write_atomic(dfd, rel, _copy_into(src))
            if n != size:
                raise OSError(f"{src} changed while it was copied ({size} bytes planned, {n} read)")
            if sample is not None and copy_sample != sample:
                raise OSError(f"{src} changed while it was copied (its content differs from what rank 0 planned and "
                              f"the results file fingerprints)")
            copied += n
        os.fsync(dfd)
        marker = json.dumps({"key": plan.key, "source": plan.source, "files": [list(x) for x in plan.files],
                             "sha256": sha}).encode()
        write_atomic(dfd, MARKER, lambda fd: os.write(fd, marker))
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


def staged_model(model: str, stage_dir: str | None, world: World, timeout: float, revision: str | None = None,
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
    # the node's ranks learn where the leader staged (not always <folder>: see "passed over" in stage_folder's docs)
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

