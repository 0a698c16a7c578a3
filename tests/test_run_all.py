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
