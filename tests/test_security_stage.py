"""Stage directories (``--stage-dir``, :mod:`mpitp.replica.staging`) on a node other users share (issue 37, 2 and 3).

A stage's folder name and key come from public facts (the model's path, sizes, mtimes, headers), so on a shared
sticky ``/tmp`` another user can create ``DIR/<name>-<key>/`` first: a marker and zeroed weights (or a
``modeling_*.py`` for ``trust_remote_code``) of the right sizes. These tests plant such stages (as root here:
``os.chown`` to uid 65534 stands for the other user) and stages of this user whose bytes changed after the copy, and
check that none is loaded from; and that a model kept private stays private on the node. They call the staging
functions directly; the launch across nodes (a planted stage on one node passed over, a warning line on rank 0) is
``tests/test_staging.py::test_each_node_stages_once``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from mpitp.evaluation import fingerprint
from mpitp.replica import staging
from support import STORIES

OTHER = 65534  # nobody: the other user of the node
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root (os.chown)")
EVIL = b"import os\nos.system('touch /tmp/pwned')\n"


@pytest.fixture(autouse=True)
def _stories(shared_dir):
    """Every test stages a copy of the real stories260K (skipped where ../shared is missing)."""


def _source(tmp_path, stories=STORIES):
    """A copy of the real stories260K with remote code beside it (``modeling_tiny.py``, staged as a ``.py``)."""
    src = tmp_path / "models" / "stories"
    shutil.copytree(stories, src)
    (src / "modeling_tiny.py").write_text("# the model's own code\n" + "x = 1\n" * 20)
    return src


def _shared_root(tmp_path):
    """``DIR`` as on a shared node: a sticky folder everyone can write to, like /tmp."""
    root = tmp_path / "scratch"
    root.mkdir()
    root.chmod(0o1777)
    return root


def _zeroed(data: bytes) -> bytes:
    """The same safetensors file with every tensor byte zero (header kept: it still loads, as zeros)."""
    n = 8 + int.from_bytes(data[:8], "little")
    return data[:n] + bytes(len(data) - n)


def _same_size_code(size: int) -> bytes:
    return (EVIL + b"#" * size)[:size]


def _plant(folder, plan, uid=OTHER):
    """What another user leaves at ``folder``: the plan's files (weights zeroed, remote code replaced, sizes kept) and
    a marker that describes them, digests included; every entry theirs, folders 0777."""
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    sha = {}
    for rel, size in plan.files:
        data = (Path(plan.source) / rel).read_bytes()
        if rel.endswith(".safetensors"):
            data = _zeroed(data)
        elif rel.endswith(".py"):
            data = _same_size_code(size)
        assert len(data) == size
        (folder / rel).write_bytes(data)
        (folder / rel).chmod(0o666)
        sha[rel] = hashlib.sha256(data).hexdigest()
    marker = {"key": plan.key, "source": plan.source, "files": [list(x) for x in plan.files], "sha256": sha}
    (folder / staging.MARKER).write_text(json.dumps(marker))
    for entry in [folder, *folder.iterdir()]:
        os.chown(entry, uid, uid, follow_symlinks=False)
    return sha


def _same_as_source(path, plan) -> bool:
    return all((Path(plan.source) / rel).read_bytes() == open(os.path.join(path, rel), "rb").read()
               for rel, _ in plan.files)


@as_root
def test_another_users_stage_is_not_reused(tmp_path):
    """The attack: the run used to say "every node reused its stage" and load the zeroed weights and the planted code.
    Now the planted folder is passed over (one note naming it and its owner) and the model is staged beside it; the
    planted files are left alone, and a rank's last check refuses a folder of theirs."""
    src, root = _source(tmp_path), _shared_root(tmp_path)
    plan = staging.plan_stage(str(src))
    assert "modeling_tiny.py" in dict(plan.files)
    planted = root / plan.folder
    planted_sha = _plant(planted, plan)

    path, copied = staging.stage(plan, str(root))
    assert copied == plan.nbytes, "another user's stage was reused"
    assert path == str(root / f"{plan.folder}-u{os.geteuid()}") and _same_as_source(path, plan)
    for rel, _ in plan.files:  # theirs, untouched
        assert hashlib.sha256((planted / rel).read_bytes()).hexdigest() == planted_sha[rel]
        assert os.stat(planted / rel).st_uid == OTHER

    notes = []
    assert staging.stage(plan, str(root), notes) == (path, 0)  # our own stage beside it is reused
    assert notes == [f"{planted} belongs to uid {OTHER}, not to you (uid {os.geteuid()}): not used as a stage",
                     f"staging into {path} instead"]
    with pytest.raises(OSError, match=f"belongs to uid {OTHER}"):
        staging.check_folder(str(planted))


@as_root
def test_planted_symlink_and_second_name_give_a_fresh_folder(tmp_path):
    """Both names mpitp would use are taken (a symlink to the other user's stage, and ``-u<uid>`` a folder of
    theirs): the stage goes into a fresh random folder, nothing is followed or written into theirs. (Refusing would
    let anyone stop the run: a folder in a sticky directory cannot be removed by another user.)"""
    src, root = _source(tmp_path), _shared_root(tmp_path)
    plan = staging.plan_stage(str(src))
    theirs = tmp_path / "theirs"
    _plant(theirs, plan)
    (root / plan.folder).symlink_to(theirs)
    os.chown(root / plan.folder, OTHER, OTHER, follow_symlinks=False)
    _plant(root / f"{plan.folder}-u{os.geteuid()}", plan)

    path, copied = staging.stage(plan, str(root))
    assert copied == plan.nbytes and _same_as_source(path, plan)
    assert os.path.dirname(path) == str(root) and os.path.basename(path).startswith(plan.folder + "-")
    assert not os.path.basename(path).endswith(f"-u{os.geteuid()}")
    notes = []
    again, copied = staging.stage(plan, str(root), notes)  # a fresh folder serves one run only
    assert again != path and copied == plan.nbytes
    assert [n.split(": not used")[0].split(" ", 1)[1] for n in notes[:2]] == [
        "is a symlink", f"belongs to uid {OTHER}, not to you (uid {os.geteuid()})"]
    assert "for this run only" in notes[2]
    assert sorted(os.listdir(theirs)) == sorted([staging.MARKER] + [f for f, _ in plan.files])
    assert (theirs / "modeling_tiny.py").read_bytes().startswith(EVIL)


def test_own_stage_with_changed_content_of_the_same_size_is_copied_again(tmp_path):
    """Sizes and the marker are not enough: each file's SHA-256, recorded from the bytes copied, is checked on reuse."""
    src = _source(tmp_path)
    plan = staging.plan_stage(str(src))
    root = tmp_path / "stage"
    path, _ = staging.stage(plan, str(root))
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "rb") as f:
        zeroed = _zeroed(f.read())
    with open(weights, "r+b") as f:  # in place: same inode, same size, same mode
        f.write(zeroed)
    assert staging.stage(plan, str(root)) == (path, plan.nbytes), "a stage with changed weights was reused"
    assert _same_as_source(path, plan)

    with open(os.path.join(path, "modeling_tiny.py"), "r+b") as f:
        f.write(_same_size_code(os.path.getsize(src / "modeling_tiny.py")))
    assert staging.stage(plan, str(root))[1] == plan.nbytes
    assert _same_as_source(path, plan)
    assert staging.stage(plan, str(root)) == (path, 0)


def test_private_model_gets_a_private_stage(tmp_path):
    """A model in a 0700 folder (files 0600 and 0640), staged under umask 0: ``DIR`` mpitp creates, the stage folder
    and its subfolder are 0700, every file (marker included) 0600. A stage left 0755 by an older mpitp is tightened
    when reused."""
    src = _source(tmp_path)
    (src / "sub").mkdir()
    (src / "sub" / "config.json").write_text((src / "config.json").read_text())
    for p in src.rglob("*"):
        p.chmod(0o700 if p.is_dir() else 0o600)
    (src / "tokenizer.json").chmod(0o640)
    src.chmod(0o700)
    plan = staging.plan_stage(str(src), subfolder="sub")
    assert "sub/config.json" in dict(plan.files)
    root = tmp_path / "node-local" / "mpitp"
    old = os.umask(0)
    try:
        path, _ = staging.stage(plan, str(root))
    finally:
        os.umask(old)
    modes = {os.path.relpath(os.path.join(d, n), path): stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode)
             for d, dirs, files in os.walk(path) for n in dirs + files}
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert modes == {"sub": 0o700, **{rel: 0o600 for rel, _ in plan.files}, staging.MARKER: 0o600}

    os.chmod(path, 0o755)
    assert staging.stage(plan, str(root)) == (path, 0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


@as_root
def test_stage_dir_through_a_link_another_user_made_is_refused(tmp_path):
    """``--stage-dir project/stage`` where ``project`` is group-writable and ``stage`` is a link another user made,
    to a private folder of yours (it passes every check of ``DIR``): the model was staged where they pointed."""
    src = _source(tmp_path)
    plan = staging.plan_stage(str(src))
    shared, yours = tmp_path / "project", tmp_path / "yours"
    shared.mkdir()
    shared.chmod(0o777)
    yours.mkdir(mode=0o700)
    for root in (shared / "stage", shared / "via" / "stage"):
        link = shared / root.relative_to(shared).parts[0]
        link.symlink_to(yours)
        os.chown(link, OTHER, OTHER, follow_symlinks=False)
        with pytest.raises(OSError, match=rf"^{link} is a link made by uid {OTHER}, not by you \(uid 0\) or root: "
                                          r"mpitp does not stage through it"):
            staging.stage(plan, str(root))
        assert os.listdir(yours) == []
        link.unlink()
    (shared / "stage").symlink_to(yours)  # a link of your own: followed, as before
    assert staging.stage(plan, str(shared / "stage"))[1] == plan.nbytes


def test_stage_dir_others_can_write_must_be_sticky_and_yours_or_roots(tmp_path):
    """``DIR`` 0777 without the sticky bit: anyone could rename a checked stage away and put theirs in its place before
    the ranks load it. A sticky ``DIR`` of another user's: its owner still can (anyone can create ``/tmp/mpitp``
    first). Both refused with one line naming the folder and why; nothing is staged. Sticky and yours (or root's,
    like /tmp): fine."""
    src = _source(tmp_path)
    plan = staging.plan_stage(str(src))
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(OSError, match=rf"^{root} can be written by other users and is not sticky \(mode 0777\): one "
                                      r"of them could put their own stage in place of yours after mpitp checks it"):
        staging.stage(plan, str(root))
    assert os.listdir(root) == []
    root.chmod(0o1777)
    assert staging.stage(plan, str(root))[1] == plan.nbytes
    if os.geteuid() == 0:
        os.chown(root, OTHER, OTHER)
        with pytest.raises(OSError, match=rf"^{root} belongs to uid {OTHER}, not to you \(uid 0\) or root: its owner "
                                          r"could put"):
            staging.stage(plan, str(root))


def test_results_fingerprint_is_of_the_bytes_staged(tmp_path):
    """The results file fingerprints the source (:func:`mpitp.evaluation.fingerprint.model_files`). Weights over 1 MiB
    rewritten in place, same size, mtime put back: the old key (sizes, mtimes, safetensors headers) did not change and
    the old stage was loaded while the file recorded the new weights. The key now holds the fingerprint's sampled
    digests; a source that changes between the plan and the copy is refused."""
    src = _source(tmp_path)
    head = json.dumps({"w": {"dtype": "F32", "shape": [600_000], "data_offsets": [0, 2_400_000]}}).encode()
    head += b" " * (-len(head) % 8)
    (src / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + os.urandom(2_400_000))
    root = tmp_path / "stage"
    plan = staging.plan_stage(str(src))
    path, _ = staging.stage(plan, str(root))

    def staged_fp(where):
        return {k: v for k, v in fingerprint.model_files(where).items() if k in dict(plan.files)}

    assert staged_fp(path) == staged_fp(str(src))
    weights = src / "model.safetensors"
    st = os.stat(weights)
    with open(weights, "r+b") as f:
        f.seek(st.st_size - 64)
        f.write(bytes(64))  # the last tensor's last values: the header stays
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    plan2 = staging.plan_stage(str(src))
    path2, copied = staging.stage(plan2, str(root))
    assert copied == plan2.nbytes and staged_fp(path2) == staged_fp(str(src)), "the stale stage was loaded"

    with open(weights, "r+b") as f:  # changed after rank 0 planned: the copy is not what the plan describes
        f.seek(st.st_size - 64)
        f.write(b"\x01" * 64)
    with pytest.raises(OSError, match="model.safetensors changed while it was copied"):
        staging.stage(plan2, str(tmp_path / "stage-b"))


def test_stage_replaced_during_the_copy_is_not_returned(tmp_path, monkeypatch):
    """Between the checks and the load: the stage folder is renamed away while the files are copied and another
    folder is put at its name. The leader's last check (device and inode of the folder it wrote) refuses it."""
    src = _source(tmp_path)
    plan = staging.plan_stage(str(src))
    root = _shared_root(tmp_path)
    copy_into, last = staging._copy_into, plan.files[-1][0]

    def swapping(src_path):
        fill = copy_into(src_path)

        def swap_then_fill(fd):
            if src_path.endswith(last):
                os.rename(root / plan.folder, root / "moved")
                (root / plan.folder).mkdir(mode=0o700)
            return fill(fd)

        return swap_then_fill

    monkeypatch.setattr(staging, "_copy_into", swapping)
    with pytest.raises(OSError, match="is no longer the folder mpitp staged into"):
        staging.stage(plan, str(root))
