"""bench/run_all.py's targets and the README block it writes: each target judged right, the block replaced and only
it, a README without its two lines refused before any benchmark runs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from support import REPO

_spec = importlib.util.spec_from_file_location("bench_run_all", REPO / "bench" / "run_all.py")
run_all = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = run_all  # dataclasses look their module up there
_spec.loader.exec_module(run_all)


@pytest.mark.parametrize(("goal", "value", "met"), [
    (run_all.Goal(">=", 2), "4.85", True), (run_all.Goal(">=", 2), "1.99", False),
    (run_all.Goal("<=", 0.6), "0.600", True), (run_all.Goal("<=", 0.6), "0.601", False),
    (run_all.Goal("==", 0), "0", True), (run_all.Goal("==", 0), "1e-07", False),
    (run_all.Goal("all"), "10/10", True), (run_all.Goal("all"), "9/10 (DIFF FAILED)", False),
    (run_all.Goal("<=", 3), "FAILED", None), (run_all.Goal("all"), "TIMEOUT", None),
])
def test_goal(goal, value, met):
    assert goal.met(value) is met


def test_every_goal_names_a_ratio_a_script_prints():
    """A target under a name no script prints would never be judged: each name is in some script's source."""
    sources = "".join(p.read_text() for p in (REPO / "bench").glob("*.py") if p.name != "run_all.py")
    assert [name for name in run_all.GOALS if not re.search(rf"\b{name}\b", sources)] == []


def test_every_name_a_bench_script_imports_from_mpitp_exists():
    """A bench script imports mpitp's internals (``bench_coordinator.py`` drives the real dispatcher and writer): a
    name moved or renamed in mpitp fails here, not 600 s into ``run_all.py`` (session 24 moved ``_request_row`` out of
    the runner, and the coordinator bench's rank 0 died on the import while 63 ranks waited at a barrier)."""
    import ast

    missing = []
    for path in sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpitp":
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name) and not (
                                hasattr(module, "__path__")
                                and importlib.util.find_spec(f"{node.module}.{alias.name}") is not None)]
    assert missing == []


def _rows():
    Row = run_all.Row
    return [Row("bcast_64MB", "4.85", "bench_bcast.py", 52.0), Row("gsm8k_tp2", "0.612", "bench_gsm8k.py", 300.4),
            Row("writer_old_vs_new", "222.8", "bench_writer.py", 108.0), Row("sweep", "FAILED", "bench_sweep.py", 3.0),
            Row("kill9", "TIMEOUT", "drill_kill9.py", None)]


def test_a_row_says_its_target_and_verdict():
    rows = _rows()
    assert [r.judged for r in rows] == ["target >= 2: met", "target <= 0.6: MISSED", "", "target <= 0.6: -", ""]


def test_the_block_says_each_verdict():
    block = run_all.readme_block(_rows(), [("gpu_drill", "no GPU on this machine")], "Full run at commit `abc`.")
    lines = block.splitlines()
    assert lines[0] == run_all.BEGIN and lines[-1] == run_all.END
    assert "| `bcast_64MB` | 4.85 | >= 2 | met | `bench_bcast.py` | 52 |" in lines
    assert "| `gsm8k_tp2` | 0.612 | <= 0.6 | **MISSED** | `bench_gsm8k.py` | 300 |" in lines
    assert "| `writer_old_vs_new` | 222.8 | - | - | `bench_writer.py` | 108 |" in lines
    assert "| `sweep` | FAILED | <= 0.6 | - | `bench_sweep.py` | 3 |" in lines
    assert "| `kill9` | TIMEOUT | - | - | `drill_kill9.py` | - |" in lines
    assert "| `gpu_drill` | skipped | | | | no GPU on this machine |" in lines
    assert "Targets met: 1 of 2; missed: gsm8k_tp2." in lines


def test_the_block_is_replaced_and_only_it():
    text = f"# Benchmarks\nbefore\n{run_all.BEGIN}\nold table\n{run_all.END}\nafter\n"
    new = run_all.replace_block(text, f"{run_all.BEGIN}\nnew table\n{run_all.END}")
    assert new == f"# Benchmarks\nbefore\n{run_all.BEGIN}\nnew table\n{run_all.END}\nafter\n"
    assert run_all.replace_block(new, f"{run_all.BEGIN}\nold table\n{run_all.END}") == text
    for bad in ("no lines", f"{run_all.END}\n{run_all.BEGIN}", f"{run_all.BEGIN}\n{run_all.BEGIN}\n{run_all.END}",
                f"{run_all.BEGIN}\nx"):
        with pytest.raises(ValueError):
            run_all.replace_block(bad, "")


def test_the_readme_holds_the_block_once():
    run_all.replace_block(run_all.README.read_text(), f"{run_all.BEGIN}{run_all.END}")


def test_readme_is_refused_with_part_of_the_run():
    """``--readme`` writes the figures of a whole run; a part of one is refused before anything runs."""
    for extra in (["--quick"], ["--only", "bcast"], ["--skip", "kill9"]):
        p = subprocess.run([sys.executable, str(REPO / "bench" / "run_all.py"), "--readme", *extra],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "not with --quick, --only or --skip" in p.stderr and "RATIO" not in p.stdout


def test_paired_table_gives_both_trees_medians_and_the_verdict_of_this_one(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # run_all takes common.median from bench/common.py
    Row = run_all.Row
    rows = [Row("launch_alone_s", "4.1", "bench_launch.py", 40, "before"),
            Row("launch_alone_s", "3.4", "bench_launch.py", 40, "after"),
            Row("launch_alone_s", "3.6", "bench_launch.py", 40, "after"),
            Row("launch_alone_s", "4.5", "bench_launch.py", 40, "before"),
            Row("gsm8k_tp2", "0.80", "bench_gsm8k.py", 90, "before"),
            Row("gsm8k_tp2", "FAILED", "bench_gsm8k.py", 9, "after"),
            Row("writer_old_vs_new", "200 (x)", "bench_writer.py", 9, "after")]
    assert run_all.paired_table(rows) == [
        ("launch_alone_s", "4.3", "3.5", "target <= 3: MISSED"),
        ("gsm8k_tp2", "0.8", "FAILED", "target <= 0.6: -"),
        ("writer_old_vs_new", "-", "200", ""),
    ]


def test_before_runs_each_script_on_both_trees_in_turn(monkeypatch, tmp_path, capsys):
    """``--before``: per script and pair one run per tree, the earlier tree through ``--tree``, the order swapped
    from one pair to the next (so neither tree always goes first)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    calls = []

    def fake_run(b, args, timeout, rev, tree=""):
        calls.append((b.name, tree, args))
        return [run_all.Row(f"{b.name}_ratio", "1.0" if tree == "after" else "2.0", b.script, 1.0, tree)]

    monkeypatch.setattr(run_all, "run", fake_run)
    a, b = (run_all.Bench(n, f"bench_{n}.py", paired=["--reps", "1"]) for n in ("a", "b"))
    args = type("Args", (), {"before": str(tmp_path), "pairs": 2})
    assert run_all.report_pairs([(a, a.paired), (b, b.paired)], args, 60, "abc1234", [], 0.0) == 0
    tree = ["--reps", "1", "--tree", str(tmp_path.resolve())]
    assert calls == [("a", "before", tree), ("a", "after", ["--reps", "1"]),
                     ("a", "after", ["--reps", "1"]), ("a", "before", tree),
                     ("b", "before", tree), ("b", "after", ["--reps", "1"]),
                     ("b", "after", ["--reps", "1"]), ("b", "before", tree)]
    out = capsys.readouterr().out
    assert re.search(r"a_ratio +2 +1\b", out) and re.search(r"b_ratio +2 +1\b", out)


def test_before_is_refused_without_a_tree_or_with_the_readme(tmp_path):
    script = str(REPO / "bench" / "run_all.py")
    (tmp_path / "mpitp").mkdir()
    (tmp_path / "mpitp" / "__init__.py").write_text("")
    for argv, says in ((["--before", str(tmp_path / "none")], "no mpitp/ package in it"),
                       (["--before", str(tmp_path), "--readme"], "not with --readme or --quick"),
                       (["--before", str(tmp_path), "--pairs", "0"], "--pairs must be >= 1")):
        p = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and says in p.stderr and "RATIO" not in p.stdout, p.stderr
    listed = subprocess.run([sys.executable, script, "--before", str(tmp_path), "--list"], capture_output=True,
                            text=True, timeout=60).stdout
    ran = [line.split()[0] for line in listed.splitlines() if "skipped" not in line]
    assert ran == [b.name for b in run_all.BENCHES if b.paired is not None] and "launch" in ran


def test_a_scripts_whole_output_is_kept(tmp_path, monkeypatch, capsys):
    """Beside its RATIO lines, a script's other lines (phases, per-group busy) land in a log whose path is printed."""
    script = tmp_path / "bench_tiny.py"
    script.write_text("import sys\nprint('group 0 busy 1.5 s')\nprint('RATIO tiny 0.5')\n"
                      "print('warn', file=sys.stderr)\n")
    monkeypatch.setattr(run_all, "LOGS", tmp_path / "logs")
    rows = run_all.run(run_all.Bench("tiny", str(script)), [], 60, "abc1234", "after")
    assert [(r.name, r.value, r.tree) for r in rows] == [("tiny", "0.5", "after")]
    logs = list((tmp_path / "logs").glob("tiny-after-*.log"))
    assert len(logs) == 1 and str(logs[0]) in capsys.readouterr().out
    assert logs[0].read_text().splitlines() == ["group 0 busy 1.5 s", "RATIO tiny 0.5", "", "--- stderr ---", "warn"]
