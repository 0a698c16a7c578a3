"""A data directory is untrusted input (issue 37, items 1 and 9): a group shares one, and whoever may write it names
its files.

The attack: the six stock tasks find a split file by globbing (``DATA/arc_easy/*_test.jsonl``), and the override
YAML mpitp wrote for lm-eval began with a comment formatted from that file's path. A file named
``a<newline>doc_to_text: "{{ ... os.system(...) }}"<newline>description: b_test.jsonl`` ended the comment, and the
rest of its name became task keys: lm-eval renders ``doc_to_text`` with an unsandboxed Jinja environment, so building
the prompts ran the command, and ``mpitp check`` said "ready offline". Now the YAML is written by ``yaml.safe_dump``
alone and such a name is refused by name (escaped), wherever a data directory is read; ``mpitp tasks`` prints every
name escaped (a file named with terminal escapes cannot retitle or clear the terminal).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mpitp.errors import UsageError
from mpitp.jobs.readiness import CheckSpec, check
from support import STORIES
from support.mpi import explain, run_mpi
from support.offline_data import arc_rows, write_jsonl

MARKER = "PWNED"
#: A data file name that, formatted into a YAML comment, ends it and adds two task keys; the template runs a
#: command that creates MARKER in the working directory (a file name cannot hold a slash).
EVIL = ("a\ndoc_to_text: \"{{ lipsum.__globals__.os.system('touch " + MARKER + "') }}\"\n"
        "description: b_test.jsonl")
SHOWN_EVIL = EVIL.replace("\n", "\\n")  # as mpitp.results.untrusted.shown prints it
TERMINAL = "\x1b]0;owned\x07\x1b[2J_test.jsonl"  # retitles and clears a terminal that prints it raw


def plant(root: Path, name: str) -> Path:
    """DATA with arc_easy's test split only in a file called ``name`` (valid rows: it fits the task)."""
    write_jsonl(root / "arc_easy" / name, arc_rows(3, "evil"))
    return root


@pytest.fixture
def evil_data(tmp_path, monkeypatch) -> Path:
    """The attack's data directory; the test runs in tmp_path, where the command would create MARKER."""
    monkeypatch.chdir(tmp_path)
    return plant(tmp_path / "data", EVIL)


def test_check_refuses_a_data_file_named_to_write_task_keys(evil_data, tmp_path):
    report = check(CheckSpec(tasks=("arc_easy",), data_dir=str(evil_data)))
    assert not (tmp_path / MARKER).exists(), "the file name's Jinja template ran"
    assert not report.ready
    [problem] = report.problems
    assert problem.what == (f"dataset: task arc_easy data file arc_easy/{SHOWN_EVIL} has control characters in its "
                            f"name (\\n); mpitp does not read a file so named (it would end a line of the task YAML "
                            f"or of the terminal): rename or remove it")
    assert problem.fetch is None  # no download fixes a name
    # the command: not "ready offline", exit 2, the problem on one line
    from mpitp.cli.check import check_command

    done = CliRunner().invoke(check_command, ["--tasks", "arc_easy", "--data-dir", str(evil_data)])
    assert done.exit_code == 2, done.output
    assert done.output.splitlines() == ["mpitp check: not ready offline: 1 problem(s)", f"  {problem.what}"]
    assert not (tmp_path / MARKER).exists()


@pytest.mark.mpi
def test_eval_refuses_it_in_one_line_and_runs_nothing(evil_data, tmp_path):
    proc = run_mpi(2, ["eval", "--model", str(STORIES), "--tasks", "arc_easy", "--data-dir", str(evil_data),
                       "--output", "out.h5"], timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 2, explain(proc)
    assert not (tmp_path / MARKER).exists(), "the file name's Jinja template ran"
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"mpitp: error: --data-dir {evil_data}: task arc_easy data file arc_easy/{SHOWN_EVIL} has "
                     f"control characters in its name (\\n); mpitp does not read a file so named (it would end a "
                     f"line of the task YAML or of the terminal): rename or remove it"], explain(proc)
    assert not (tmp_path / "out.h5").exists()


def test_override_yaml_is_written_by_safe_dump_alone(tmp_path):
    """Whatever a path holds, the written YAML parses back to exactly the config: no name is formatted into it."""
    from mpitp.tasks.layout import write_configs

    cfg = {"include": "/lm_eval/tasks/arc/arc_easy.yaml", "task": "arc_easy", "tag": None, "dataset_path": "json",
           "dataset_name": None, "dataset_kwargs": {"data_files": {"test": f"/data/arc_easy/{EVIL}"}},
           "test_split": "test"}
    group = {"include": "/lm_eval/tasks/g.yaml", "group": "g", "task": [{"task": "t", "dataset_kwargs": cfg[
        "dataset_kwargs"]}]}
    written = write_configs({"arc_easy": cfg, "g": group}, tmp_path, f"/data\n{EVIL}")
    assert yaml.safe_load(Path(written["arc_easy"]).read_text()) == cfg
    assert yaml.safe_load(Path(written["g"]).read_text()) == group


def test_tasks_listing_prints_file_names_escaped(tmp_path):
    from mpitp.cli.tasks import tasks_command

    data = plant(tmp_path / "data", TERMINAL)
    for args in ([], ["--tasks", "arc_easy"]):  # the six stock tasks' listing, and any task named
        done = CliRunner().invoke(tasks_command, ["--data-dir", str(data), *args])
        assert "\x1b" not in done.output and "\x07" not in done.output, repr(done.output)
        assert done.output.splitlines()[0].startswith("arc_easy "), done.output
        assert "arc_easy/\\x1b]0;owned\\x07\\x1b[2J_test.jsonl has control characters in its name" in done.output
        assert done.exit_code == 0, done.output


def test_a_data_dir_resolving_to_a_name_with_control_characters_is_refused(tmp_path, monkeypatch):
    """``--data-dir`` may be a link in a group folder: where it leads is a name someone else chose."""
    from mpitp.cli.tasks import tasks_command

    monkeypatch.chdir(tmp_path)
    real = tmp_path / f"x\n{EVIL}"
    write_jsonl(real / "arc_easy" / "test.jsonl", arc_rows(3, "evil"))
    (tmp_path / "data").symlink_to(real)
    refusal = (f"--data-dir {tmp_path}/x\\n{SHOWN_EVIL} has control characters in its name (\\n); mpitp does not "
               f"read a file so named (it would end a line of the task YAML or of the terminal): rename or remove it")
    for args in ([], ["--tasks", "arc_easy"]):
        done = CliRunner().invoke(tasks_command, ["--data-dir", "data", *args])
        assert done.exit_code == 2, done.output
        assert done.output.splitlines()[-1] == f"Error: {refusal}", done.output
    report = check(CheckSpec(tasks=("arc_easy",), data_dir="data"))
    assert [p.line() for p in report.problems] == [refusal]
    assert not (tmp_path / MARKER).exists()


def test_honest_names_still_serve(tmp_path):
    """Spaces and non-ASCII letters are printable: a file named as people download them is still found."""
    from mpitp.tasks.offline import split_files

    data = plant(tmp_path / "données", "ARC Easy – test.jsonl")
    assert split_files(data, "arc_easy") == {"test": data.resolve() / "arc_easy" / "ARC Easy – test.jsonl"}


def test_a_huge_file_without_newlines_beside_the_split_is_read_only_so_far(tmp_path):
    """A data file is tried for a split by its first row's keys: a planted ``*.jsonl`` of no newline (1 GiB, sparse)
    beside the real file was one "line" read whole (2.1 GB of memory for ``mpitp tasks``; 30 GiB: killed). Only its
    first :data:`mpitp.tasks.offline.FIRST_ROW_BYTES` are read now, so it does not fit and the real file serves."""
    import tracemalloc

    from mpitp.tasks.offline import FIRST_ROW_BYTES, split_files

    data = plant(tmp_path / "data", "ARC-Easy_test.jsonl")
    with open(data / "arc_easy" / "zz_test.jsonl", "wb") as f:
        f.truncate(1 << 30)
    tracemalloc.start()
    try:
        found = split_files(data, "arc_easy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == {"test": data.resolve() / "arc_easy" / "ARC-Easy_test.jsonl"}
    assert peak < 2 * FIRST_ROW_BYTES + (8 << 20), peak


@pytest.mark.parametrize("task", ["arc_easy", "boolq"])
def test_a_data_dir_whose_path_is_a_glob_pattern_is_refused(task, tmp_path):
    """``datasets`` expands glob characters in ``data_files``: ``--data-dir 'd*x'`` also read the rows of a
    neighbour's ``dEVILx`` (another user's, where the parent is shared), and ``d[1]`` matched nothing (a traceback)."""
    ours, theirs = tmp_path / "d*x", tmp_path / "dEVILx"
    for root in (ours, theirs):
        plant(root, "test.jsonl")
        write_jsonl(root / "aps" / "super_glue" / "boolq" / "validation.jsonl",
                    [{"question": "q", "passage": "p", "idx": 0, "label": 1}])
    report = check(CheckSpec(tasks=(task,), data_dir=str(ours)))
    assert not report.ready
    assert [p.what for p in report.problems] == [
        f"--data-dir {ours} has glob characters in its path (*): datasets would read every file the pattern matches, "
        "not just the ones in it; use a path without them"], report.problems


def test_a_data_dir_that_is_a_link_loop_is_one_line(tmp_path):
    """A link in a group folder pointing at itself: ``Path.resolve`` raised RuntimeError, a traceback (exit 1) from
    ``mpitp tasks``, ``mpitp check`` and ``mpitp prefetch``; ``mpitp eval`` already said "no such directory"."""
    from mpitp.cli.check import check_command
    from mpitp.cli.tasks import tasks_command

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for args in ([], ["--tasks", "arc_easy,boolq"]):
        done = CliRunner().invoke(tasks_command, ["--data-dir", str(loop), *args])
        assert done.exit_code == 2 and f"--data-dir {loop}: no such directory" in done.output, done.output
        assert isinstance(done.exception, SystemExit), done.exception
    done = CliRunner().invoke(check_command, ["--tasks", "arc_easy", "--data-dir", str(loop)])
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), (done.output, done.exception)
    assert done.output.splitlines() == ["mpitp check: not ready offline: 1 problem(s)",
                                        f"  --data-dir {loop}: no such directory"]


def test_a_data_dir_that_is_a_file_is_named_so_by_every_command(tmp_path):
    """The probe (session 29): a file given as ``--data-dir`` was "no such directory" from check and tasks (and eval)
    and "not a directory" from prefetch; one rule now says which, escaped (eval's line did not escape the name)."""
    from mpitp.cli.check import check_command
    from mpitp.cli.tasks import tasks_command
    from mpitp.evaluation.checks import offline_include
    from mpitp.evaluation.settings import EvalConfig

    afile = tmp_path / "data\x1b.txt"
    afile.write_text("x")
    said = "--data-dir " + str(afile).replace("\x1b", "\\x1b") + ": not a directory"
    for args in ([], ["--tasks", "arc_easy,boolq"]):
        done = CliRunner().invoke(tasks_command, ["--data-dir", str(afile), *args])
        assert done.exit_code == 2 and said in done.output, done.output
    done = CliRunner().invoke(check_command, ["--tasks", "arc_easy", "--data-dir", str(afile)])
    assert done.exit_code == 2 and done.output.splitlines()[1:] == [f"  {said}"], done.output
    with pytest.raises(UsageError, match="^" + re.escape(said) + "$"):
        offline_include(EvalConfig(model="m", tasks=["arc_easy"], data_dir=str(afile)))
