"""``mpitp report``: the HTML page, opened from disk in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium).

Why a browser: the page's promises are about what a browser does with it (no request to any host, no console error,
numbers shown equal to ``mpitp inspect``'s, filters that change the rows shown, text from files shown as text and
never run). Files are synthetic, written through the real :class:`mpitp.results.store.ResultWriter` (fast, every
value known), and one real `mpiexec` run shared with test_inspect.py (tests/conftest.py's ``demo_file``). One
Chromium serves the module (start-ups are seconds on CI's 2 cores). Screenshots of each view land in the test's tmp
folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from click.testing import CliRunner

from mpitp.cli.inspect import inspect_command
from mpitp.cli.report import report_command
from mpitp.results.report import script_json
from mpitp.results.store import ResultWriter

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
HOSTILE = "</script><script>window.pwned=1</script><img src=http://example.invalid/x.png>"


def make_run(path, model: str, correct: list[int], group: dict | None = None, revision: str | None = None) -> str:
    """One finished run of one multiple-choice task; ``correct[d]`` is document d's acc. Document 0's text and the
    model name carry markup that must show as text. ``revision``: the run's --revision (in ``config_json``)."""
    n = len(correct)
    w = ResultWriter(str(path), dict(mpitp_version="0.1.0", model=model, tokenizer=model, dtype="float32",
                                     world_size=2, tp=2, dp=1, lm_eval_version="0.4.13", created="2026-12-02T09:00:00",
                                     fingerprint_json=json.dumps({"model": model}),
                                     config_json=json.dumps({"model": model, "revision": revision})))
    w.append("syn_mc", [dict(doc_id=d, idx=i, kind="loglikelihood", loglikelihood=-1.0 - d % 7 - 0.5 * i,
                             is_greedy=i == 0, generation="", n_tokens=3, args_hash=f"{d}-{i}")
                        for d in range(n) for i in range(2)])
    acc = sum(correct) / n
    metrics = {"name": "syn_mc", "sample_len": n, "acc,none": acc, "acc_stderr,none": 0.125,
               "acc_norm,none": 1 - acc, "acc_norm_stderr,none": 0.0625}
    samples = [{"doc_id": d, "doc": {"id": d}, "arguments": [[HOSTILE if d == 0 else f"question {d}", " yes"],
                                                              [HOSTILE if d == 0 else f"question {d}", " no"]],
                "target": f"answer {d % 3}", "filtered_resps": [[-1.0, True], [-2.0, False]][::1 if c else -1],
                "metrics": ["acc"], "filter": "none", "acc": float(c)} for d, c in enumerate(correct)]
    w.write_task("syn_mc", dict(output_type="multiple_choice", num_fewshot=0, n_docs=n), metrics, samples=samples)
    results = {"syn_mc": {"alias": "syn_mc", **metrics}}
    if group:  # lm-eval's shape: the group's aggregate beside its subtasks, and group_subtasks
        results.update(group["results"])
    w.finish({"results": results, "higher_is_better": {"syn_mc": {"acc": True}},
              "n-samples": {"syn_mc": {"original": n, "effective": n}},
              "group_subtasks": group["group_subtasks"] if group else {}}, wall_time_s=1.0)
    w.close()
    return str(path)


def sweep_summary(path, values: list[float]) -> None:
    rows = [dict(model=f"m/step-{i}", name=f"step-{i}", output=f"step-{i}.h5", status="complete",
                 metrics={"syn_mc": {"acc,none": v, "acc_stderr,none": 0.05}}) for i, v in enumerate(values)]
    tests = [dict(a="step-0", b="step-1", task="syn_mc", metric="acc,none", diff=0.25, ci=[0.1, 0.4], p_value=0.01,
                  test="paired bootstrap", sentence="syn_mc acc: B is better than A by +0.25"),
             dict(a="step-1", b="step-2", error="<b>unreadable</b>")]
    path.write_text(json.dumps({"wall_time_s": 1.0, "checkpoints": rows, "comparisons": tests}))


def render_cli(*inputs, out, iters: int = 10000) -> str:
    res = CliRunner().invoke(report_command, [*map(str, inputs), "-o", str(out), "--bootstrap-iters", str(iters)])
    assert res.exit_code == 0, res.output
    return out.read_text()


def test_script_json_cannot_end_its_script():
    text = script_json({"a": "</script><!-- & >"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"a": "</script><!-- & >"}


def test_prompt_and_answer_from_lm_eval_sample_shapes():
    """lm-eval logs arguments as a list of tuples or as gen_args_i dicts, answers as generations or (ll, greedy)."""
    from mpitp.results.report_samples import _answer, _prompt

    assert _prompt({"arguments": [["ctx", " a"], ["ctx", " b"]]}) == "ctx"
    assert _prompt({"arguments": {"gen_args_0": {"arg_0": "What?", "arg_1": {}}}}) == "What?"
    assert _prompt({"arguments": [], "doc": {"q": 1}}) == '{"q": 1}'
    assert _answer({"filtered_resps": [[-3.0, False], [-1.5, True], [-2.0, False]]}) == "choice 1"
    assert _answer({"filtered_resps": [["4"]]}) == "4" and _answer({"filtered_resps": ["x y"]}) == "x y"
    assert _answer({"filtered_resps": "not a list"}) == "" and _answer({}) == ""


def test_answers_of_a_run_without_logged_samples_come_from_its_rows(tmp_path):
    """A run without --log-samples keeps its answers in its request rows: the Samples view showed its scores beside
    blank answers (a demo run's 30 generations, stored, shown as '')."""
    from mpitp.results.reader import load
    from mpitp.results.report_samples import read_task

    w = ResultWriter(str(tmp_path / "r.h5"), dict(mpitp_version="0.1.0", model="m", tokenizer="m", dtype="float32",
                                                  world_size=1, tp=1, dp=1, lm_eval_version="0.4.13"))
    w.append("gen", [dict(doc_id=d, idx=0, kind="generate_until", loglikelihood=float("nan"), is_greedy=False,
                          generation=f" answer {d}", n_tokens=2, args_hash=f"g{d}") for d in (1, 0)])
    w.append("mc", [dict(doc_id=d, idx=i, kind="loglikelihood", loglikelihood=-abs(i - d) - 1.0, is_greedy=False,
                         generation="", n_tokens=1, args_hash=f"m{d}{i}") for d in range(3) for i in range(3)][::-1])
    for task, kind in (("gen", "generate_until"), ("mc", "multiple_choice")):
        w.write_task(task, dict(output_type=kind, num_fewshot=0, n_docs=3), {"name": task})
    w.finish({"results": {"gen": {}, "mc": {}}}, wall_time_s=1.0)
    w.close()
    run = load(str(tmp_path / "r.h5"))
    assert read_task(run, "gen").answers == {0: " answer 0", 1: " answer 1"}
    assert read_task(run, "mc").answers == {0: "choice 0", 1: "choice 1", 2: "choice 2"}
    assert read_task(run, "mc").lls == {0: -1.0, 1: -2.0, 2: -3.0}  # each document's first request (idx 0)


def test_bad_input_is_one_line_exit_2(tmp_path):
    (tmp_path / "x.h5").write_text("not hdf5")
    res = CliRunner().invoke(report_command, [str(tmp_path / "x.h5"), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "not an mpitp results file" in res.output and not (tmp_path / "r.html").exists()
    (tmp_path / "sweep-summary.json").write_text("[1, 2")
    res = CliRunner().invoke(report_command, [str(tmp_path / "sweep-summary.json"), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "sweep-summary.json: not a sweep summary" in res.output
    res = CliRunner().invoke(report_command, [str(tmp_path / "empty"), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "no such file" in res.output, res.output


@pytest.mark.parametrize("where", ["missing-folder", "a-folder", "a-fifo"])
def test_an_output_that_cannot_be_written_is_one_line_before_the_work(where, tmp_path):
    """``-o`` in a folder that does not exist, naming a folder, or naming a FIFO (a device as root: ``-o /dev/stdout``
    replaced the system's with a regular file): a traceback after the page was built, or a replaced special file."""
    run = make_run(tmp_path / "a.h5", "m", [1, 0, 1])
    out = {"missing-folder": tmp_path / "no" / "r.html", "a-folder": tmp_path, "a-fifo": tmp_path / "r.html"}[where]
    if where == "a-fifo":
        os.mkfifo(out)
    res = CliRunner().invoke(report_command, [run, "-o", str(out)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert res.output.startswith(f"mpitp: error: -o {out}: ") and "Traceback" not in res.output, res.output
    assert not (tmp_path / "no").exists() and (where != "a-fifo" or not out.is_file())
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_size_bounds_are_stated_on_the_page(tmp_path):
    """Past the row cap a task's samples are left out, past the text budget its texts: the page says which."""
    from mpitp.results.report import build, render

    a = make_run(tmp_path / "a.h5", "model/a", [1, 0, 1])
    page = render(build([a], cap=2))
    assert "syn_mc: 3 documents left out (the report embeds at most 2 sample rows)" in page
    page = render(build([a], text_budget=10))
    assert "syn_mc: document texts left out (" in page and "question 1" not in page
    assert "question 1" in render(build([a]))
    # how fast it ran (mpitp.results.speed): 2 ranks x the 1.0 s wall; no /stats, so no tokens/s (not a zero)
    assert build([a]).runs[0].speed == "2.0 device-s"


def test_unfinished_run_is_marked(tmp_path):
    """A run still writing (rows only in its journal, no metrics) is listed as such, its samples still shown."""
    from mpitp.results.report import build, render

    w = ResultWriter(str(tmp_path / "running.h5"), dict(mpitp_version="0.1.0", model="model/r", world_size=1, tp=1,
                                                         dp=1))
    w.append("syn_mc", [dict(doc_id=d, idx=0, kind="loglikelihood", loglikelihood=-1.5, is_greedy=True,
                             generation="", n_tokens=3, args_hash=str(d)) for d in range(4)])
    w.close()
    report = build([str(tmp_path / "running.h5")])
    assert report.runs[0].status == "running" and report.runs[0].wall_time == ""
    assert [row[0] for row in report.samples["syn_mc"]["rows"]] == [0, 1, 2, 3]
    assert "running (incomplete)" in " ".join(render(report).split())


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module (a start-up costs seconds on CI's 2 cores); each test drains its logs."""
    if not (CHROMIUM and DRIVER):
        why = "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; .ci/run installs them")
        pytest.skip(f"headless browser test: {why}")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[dev])")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    yield driver
    driver.quit()


@pytest.fixture
def browser(chromium):
    """The module's browser on a blank page, the console and network logs of earlier tests read away (each call of
    ``get_log`` returns what came since the last)."""
    chromium.get("about:blank")
    chromium.get_log("browser")
    chromium.get_log("performance")
    return chromium


def _requests(driver) -> list[str]:
    """Every URL the page asked for (Chromium's DevTools Network events)."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def _inspect_values(path) -> dict[str, tuple[str, str]]:
    """metric -> (value, stderr) as ``mpitp inspect`` prints them."""
    res = CliRunner().invoke(inspect_command, [str(path)])
    assert res.exit_code == 0, res.output
    found = {}
    for line in res.output.splitlines():
        m = re.match(r"\s*syn_mc\s+(\S+)\s+\S+\s+([-\d.]+)\s+±\s+([-\d.]+)", line)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    assert found, res.output
    return found


@pytest.mark.slow  # ~28 s on CI's 2 cores (every view, filters, screenshots)
def test_report_in_browser(tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    runs = tmp_path / "runs"
    runs.mkdir()
    a = make_run(runs / "a.h5", HOSTILE, [1, 1, 0, 1, 0, 1, 1, 0] * 30)  # 240 documents: three pages of 100
    b = make_run(runs / "b.h5", "model/b", [1, 0, 0, 1, 1, 1, 1, 1] * 30)  # disagrees with a on 3 of every 8
    sweep_summary(runs / "sweep-summary.json", [0.25, 0.5, 0.625])
    html = render_cli(runs, out=tmp_path / "report.html")
    assert "window.pwned=1</script>" not in html  # neither in markup nor in the JSON block

    browser.get((tmp_path / "report.html").as_uri())
    shot = tmp_path / "screens"
    shot.mkdir()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
    urls = _requests(browser)
    assert urls and all(u.startswith("file://") for u in urls), urls
    assert browser.execute_script("return window.pwned === undefined")
    def screenshot(anchor: str, name: str) -> None:
        browser.execute_script(f"document.getElementById('{anchor}').scrollIntoView()")
        browser.save_screenshot(str(shot / name))

    screenshot("runs", "runs.png")
    screenshot("leaderboard", "leaderboard.png")
    runs_text = browser.find_element(By.ID, "runs-table").text
    assert HOSTILE in runs_text and "complete" in runs_text

    # The leaderboard shows what `mpitp inspect` prints, the best value of the row marked.
    printed = [_inspect_values(a), _inspect_values(b)]
    best = {"acc": [False, True], "acc_norm": [True, False]}  # acc 0.625 < 0.75, acc_norm 0.375 > 0.25

    def board() -> list[tuple[str, list]]:
        rows = []
        for tr in browser.find_elements(By.CSS_SELECTOR, "#leaderboard-table tbody tr"):
            cells = tr.find_elements(By.CSS_SELECTOR, "td.num")
            rows.append((tr.find_elements(By.TAG_NAME, "td")[1].text, cells))
        return rows

    assert [metric for metric, _ in board()] == ["acc", "acc_norm"]
    for metric, cells in board():
        for cell, values in zip(cells, printed):
            assert cell.find_element(By.CLASS_NAME, "value").text == values[metric][0]
            assert cell.find_element(By.CLASS_NAME, "err").text == f"± {values[metric][1]}"
        assert [("best" in c.get_attribute("class")) for c in cells] == best[metric], metric
    header = browser.find_elements(By.CSS_SELECTOR, "#leaderboard-table th.sortable")
    assert [h.text for h in header] == ["task", "metric", "filter", "R1", "R2"]
    header[3].click()  # by R1, ascending: acc_norm (0.375) first
    assert [metric for metric, _ in board()] == ["acc_norm", "acc"]
    header[3].click()
    assert [metric for metric, _ in board()] == ["acc", "acc_norm"]

    # The paired tests are those `mpitp inspect diff a b` prints.
    res = CliRunner().invoke(inspect_command, ["diff", a, b])
    shown_diff = browser.find_element(By.CSS_SELECTOR, "pre.diff").text
    assert res.exit_code == 1 and "McNemar" in shown_diff and shown_diff in res.output, (shown_diff, res.output)
    screenshot("diff", "diff.png")

    # A sweep plot has one point per checkpoint.
    assert len(browser.find_elements(By.CSS_SELECTOR, "figure.sweep circle.point")) == 3
    assert [li.text for li in browser.find_elements(By.CSS_SELECTOR, "ul.sweep-tests li")] == [
        "step-1 vs step-0: syn_mc acc: B is better than A by +0.25",
        "step-2 vs step-1: step-2 against step-1: <b>unreadable</b>"]
    screenshot("sweeps", "sweep.png")

    # Samples: paged, filtered by disagreement and by text, markup shown as text.
    def shown():
        return browser.find_elements(By.CSS_SELECTOR, "#samples-table tr.sample")

    assert len(shown()) == 100 and browser.find_element(By.ID, "count").text == "240 of 240 documents"
    browser.find_element(By.ID, "disagree").click()
    assert len(shown()) == 90 and browser.find_element(By.ID, "count").text == "90 of 240 documents"
    first = shown()[0].find_elements(By.TAG_NAME, "td")
    assert [first[i].text for i in (0, 3, 4, 6, 7)] == ["1", "choice 0", "1", "choice 1", "0"]  # a right, b wrong
    screenshot("samples", "samples-disagree.png")
    browser.find_element(By.ID, "disagree").click()
    Select(browser.find_element(By.ID, "wrong-only")).select_by_visible_text("R2")  # wrong in b, right in a: 1 of 8
    assert len(shown()) == 30 and all(r.find_element(By.TAG_NAME, "td").text in {str(8 * k + 1) for k in range(30)}
                                      for r in shown())
    Select(browser.find_element(By.ID, "wrong-only")).select_by_visible_text("any run")
    assert len(shown()) == 100
    browser.find_element(By.ID, "search").send_keys("window.pwned")
    rows = shown()
    assert len(rows) == 1 and rows[0].find_elements(By.TAG_NAME, "td")[1].text == HOSTILE
    screenshot("samples", "samples-search.png")
    assert browser.execute_script("return window.pwned === undefined")
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    assert all(u.startswith("file://") for u in _requests(browser))


def test_groups_fold_in_browser(tmp_path, browser):
    """A group's subtasks are folded under its row; unfolding shows them, sorting keeps them under their group."""
    from selenium.webdriver.common.by import By

    nested = {"results": {"outer": {"alias": "outer", "acc,none": 0.5, "acc_stderr,none": 0.1},
                          "inner": {"alias": " - inner", "acc,none": 0.25, "acc_stderr,none": 0.1},
                          "solo": {"alias": "solo", "acc,none": 0.9, "acc_stderr,none": 0.1}},
              "group_subtasks": {"outer": ["inner"], "inner": ["syn_mc"], "solo": []}}
    a = make_run(tmp_path / "a.h5", "model/a", [1, 0, 1, 1], group=nested)
    render_cli(a, out=tmp_path / "r.html")
    browser.get((tmp_path / "r.html").as_uri())

    def visible():
        return [(tr.get_attribute("data-task"), tr.find_elements(By.TAG_NAME, "td")[1].text)
                for tr in browser.find_elements(By.CSS_SELECTOR, "#leaderboard-table tbody tr") if tr.is_displayed()]

    assert visible() == [("outer", "acc"), ("solo", "acc")]
    browser.find_element(By.CSS_SELECTOR, "tr[data-task=outer] button.fold").click()
    assert visible() == [("outer", "acc"), ("inner", "acc"), ("solo", "acc")]
    browser.find_element(By.CSS_SELECTOR, "tr[data-task=inner] button.fold").click()
    assert visible() == [("outer", "acc"), ("inner", "acc"), ("syn_mc", "acc"), ("syn_mc", "acc_norm"),
                         ("solo", "acc")]
    browser.find_elements(By.CSS_SELECTOR, "#leaderboard-table th.sortable")[3].click()  # by R1: solo 0.9 last
    browser.find_elements(By.CSS_SELECTOR, "#leaderboard-table th.sortable")[3].click()  # descending: solo first
    assert visible() == [("solo", "acc"), ("outer", "acc"), ("inner", "acc"), ("syn_mc", "acc"),
                         ("syn_mc", "acc_norm")]
    browser.find_element(By.CSS_SELECTOR, "tr[data-task=outer] button.fold").click()  # folds inner's rows too
    assert visible() == [("solo", "acc"), ("outer", "acc")]
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    browser.save_screenshot(str(tmp_path / "groups.png"))


@pytest.mark.parametrize("n", [10**3, pytest.param(10**5, marks=pytest.mark.slow)])
def test_report_of_many_samples_opens_fast(tmp_path, browser, n):
    """10^3 and 10^5 documents: the file's size, the time until the first page of samples shows and the time a
    filter over all of them takes (printed; bounds loose, the CI machine is shared)."""
    make_run(tmp_path / "a.h5", "model/a", [d % 2 for d in range(n)])
    make_run(tmp_path / "b.h5", "model/b", [d % 3 == 0 for d in range(n)])
    out = tmp_path / "big.html"
    render_cli(tmp_path / "a.h5", tmp_path / "b.h5", out=out, iters=100)  # the paired tests are not timed here
    start = time.monotonic()
    browser.get(out.as_uri())
    rows = browser.find_elements("css selector", "#samples-table tr.sample")
    opened = time.monotonic() - start
    start = time.monotonic()
    browser.find_element("id", "disagree").click()
    count = browser.find_element("id", "count").text
    filtered = time.monotonic() - start
    print(f"report of {n} samples x 2 runs: {os.path.getsize(out) / 1e6:.2f} MB, opened in {opened:.2f} s, "
          f"'runs disagree' filter in {filtered:.2f} s")
    disagree = sum((d % 2) != (d % 3 == 0) for d in range(n))
    assert len(rows) == 100 and count == f"{disagree} of {n} documents"
    assert opened < 20 and filtered < 10, (opened, filtered)


def _profiled_build(files: list[str], iters: int) -> dict[tuple[str, str], int]:
    """Calls per (last two parts of the file, function) while the page of ``files`` is built and rendered (cProfile
    counts calls exactly; timings on a shared machine would say little)."""
    import cProfile
    import pstats

    from mpitp.results.report import build, render

    prof = cProfile.Profile()
    prof.enable()
    render(build(files, diff_iters=iters))
    prof.disable()
    calls: dict[tuple[str, str], int] = {}
    for (filename, _, name), (_, ncalls, *_) in pstats.Stats(prof).stats.items():
        key = ("/".join(filename.replace(os.sep, "/").split("/")[-2:]), name)
        calls[key] = calls.get(key, 0) + ncalls
    return calls


def test_report_writing_is_linear_and_reads_each_file_once(tmp_path):
    """Each logged sample's JSON is parsed once and each task's per-document scores are read once per file, however
    many pairs the Diff view compares (3 runs: 3 pairs); one paired bootstrap per pair and metric, none per sample.
    Counted twice, at n and 2n documents: the JSON parses grow by exactly 3n (one per sample of each run)."""
    def files(n: int) -> list[str]:
        d = tmp_path / str(n)
        d.mkdir()
        return [make_run(d / f"{k}.h5", f"model/{k}", [int((doc * (k + 2)) % 5 < 3) for doc in range(n)])
                for k in range(3)]

    n = 1000
    small, large = _profiled_build(files(n), 50), _profiled_build(files(2 * n), 50)
    for calls in (small, large):
        assert calls[("results/docscores.py", "read")] == 3, calls[("results/docscores.py", "read")]
        assert calls[("results/docscores.py", "parse_samples")] == 3
        assert calls[("results/reader.py", "load_samples")] == 3
        # the samples carry one metric (acc): 3 pairs x 1 metric, McNemar beside each bootstrap
        assert calls[("results/stats.py", "paired_bootstrap")] == 3
        assert calls[("results/stats.py", "mcnemar")] == 3
    loads = ("json/__init__.py", "loads")
    assert large[loads] - small[loads] == 3 * n, (small[loads], large[loads])
    assert large[("results/report_samples.py", "_prompt")] == 3 * 2 * n


def test_files_of_one_model_family_are_a_sweep(tmp_path):
    """Checkpoint-like last path parts (step-30, step-200, step-1000) or revisions of one model make a sweep, ordered
    naturally; other runs stay where they were. The neighbours' paired tests are those `inspect diff` prints."""
    from mpitp.results.report import PAIR_BOUND, build, family, pairs

    given = [("ckpts/run/step-200", None), ("ckpts/run/step-30", None), ("other/model", None),
             ("ckpts/run/step-1000", None), ("org/m", "v10"), ("org/m", "v2")]
    paths = [make_run(tmp_path / f"{i}.h5", model, [int((d * (i + 2)) % 5 < 2) for d in range(16)], revision=rev)
             for i, (model, rev) in enumerate(given)]
    report = build(paths, diff_iters=200)
    assert [(r.model, os.path.basename(r.path)) for r in report.runs] == [
        ("ckpts/run/step-30", "1.h5"), ("ckpts/run/step-200", "0.h5"), ("ckpts/run/step-1000", "3.h5"),
        ("other/model", "2.h5"), ("org/m", "5.h5"), ("org/m", "4.h5")]
    assert [(p.title, [name for name, _, _ in p.points]) for p in report.sweeps] == [
        ("ckpts/run: syn_mc: acc,none", ["step-30", "step-200", "step-1000"]),
        ("ckpts/run: syn_mc: acc_norm,none", ["step-30", "step-200", "step-1000"]),
        ("org/m: syn_mc: acc,none", ["v2", "v10"]), ("org/m: syn_mc: acc_norm,none", ["v2", "v10"])]
    assert len(report.diffs) == 15  # every pair of 6 runs
    expected = []
    for a, b, name_a, name_b in ((1, 0, "step-30", "step-200"), (0, 3, "step-200", "step-1000"), (5, 4, "v2", "v10")):
        res = CliRunner().invoke(inspect_command, ["diff", paths[a], paths[b], "--bootstrap-iters", "200"])
        sentence = next(line.strip() for line in res.output.splitlines() if "[McNemar" in line)
        expected.append(f"{name_b} vs {name_a}: {sentence}")
    assert report.sweep_tests == expected
    from mpitp.results.reader import load

    assert family(load(paths[2])) is None  # "model" is no checkpoint name, and no revision
    assert len(pairs(PAIR_BOUND)) == PAIR_BOUND * (PAIR_BOUND - 1) // 2 and len(pairs(PAIR_BOUND + 1)) == PAIR_BOUND


def _statistics(a: str, b: str) -> str:
    res = CliRunner().invoke(inspect_command, ["diff", a, b, "--bootstrap-iters", "1000"])
    assert res.exit_code in (0, 1) and "paired tests" in res.output, res.output
    return res.output


def test_diff_of_any_two_runs_and_family_sweep_in_browser(tmp_path, browser):
    """Diff: any two runs picked show what `inspect diff A B` prints and the documents scored differently; the
    family's sweep plot has one point per checkpoint in checkpoint order, bars of 95% CIs (value ± 1.96 stderr)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    n = 200  # 125 documents change between R1 and R3: past the 100 the page lists
    correct = {"step-200": [int(d % 4 != 0) for d in range(n)], "step-30": [int(d % 2 == 0) for d in range(n)],
               "step-1000": [int(d % 8 != 0) for d in range(n)]}
    paths = {name: make_run(tmp_path / f"{name}.h5", f"ckpts/run/{name}", c) for name, c in correct.items()}
    render_cli(*paths.values(), out=tmp_path / "family.html", iters=1000)
    browser.get((tmp_path / "family.html").as_uri())
    order = ["step-30", "step-200", "step-1000"]  # R1, R2, R3
    assert [tr.find_elements(By.TAG_NAME, "td")[1].text for tr in
            browser.find_elements(By.CSS_SELECTOR, "#runs-table tr")[1:]] == [f"ckpts/run/{o}" for o in order]

    def pick(a: str, b: str) -> tuple[str, str, str, list[str]]:
        Select(browser.find_element(By.ID, "diff-a")).select_by_visible_text(a)
        Select(browser.find_element(By.ID, "diff-b")).select_by_visible_text(b)
        return (browser.find_element(By.ID, "diff-text").text, browser.find_element(By.ID, "diff-note").text,
                browser.find_element(By.ID, "diff-count").text,
                [tr.find_elements(By.TAG_NAME, "td")[1].text for tr in
                 browser.find_elements(By.CSS_SELECTOR, "#diff-docs tr.changed")])

    assert browser.find_element(By.ID, "diff-text").text in _statistics(paths["step-30"], paths["step-200"])
    text, note, count, docs = pick("R1", "R3")
    changed = [str(d) for d in range(n) if correct["step-30"][d] != correct["step-1000"][d]]
    assert text and text in _statistics(paths["step-30"], paths["step-1000"]) and note == ""
    assert count == f"{len(changed)} documents scored differently by R1 and R3 (the first 100 shown; the Samples " \
                    "view's filters show all)" and docs == changed[:100], (count, docs[:5])
    browser.execute_script("document.getElementById('diff').scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "diff.png"))
    swapped = pick("R3", "R1")
    assert swapped[0] == text and swapped[1].startswith("R1 against R3 is shown") and swapped[3] == changed[:100]
    assert pick("R2", "R2") == ("", "Pick two different runs.", "", [])

    figures = browser.find_elements(By.CSS_SELECTOR, "figure.sweep")
    assert [f.find_element(By.TAG_NAME, "figcaption").text for f in figures] == [
        "ckpts/run: syn_mc: acc,none", "ckpts/run: syn_mc: acc_norm,none"]
    assert [t.text for t in figures[0].find_elements(By.CSS_SELECTOR, "text.checkpoint")] == order
    acc = sum(correct["step-30"]) / n
    first = figures[0].find_element(By.CSS_SELECTOR, "circle.point title").get_attribute("textContent")
    assert first == f"step-30: {acc:.4f}, 95% CI [{acc - 0.245:.4f}, {acc + 0.245:.4f}]"  # 1.96 x stderr 0.125
    assert "95% confidence interval, value ± 1.96 · stderr" in browser.find_element(By.CSS_SELECTOR, "p.legend").text
    tests = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "ul.sweep-tests li")]
    assert [t.split(": ")[0] for t in tests] == ["step-200 vs step-30", "step-1000 vs step-200"]
    assert tests[0].partition(": ")[2] in _statistics(paths["step-30"], paths["step-200"])
    browser.execute_script("document.getElementById('sweeps').scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "sweep.png"))
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


@pytest.mark.mpi
def test_report_of_a_real_mpiexec_run_in_browser(demo_file, tmp_path, browser):
    """The session's real `mpiexec -n 2 mpitp eval --demo` file (tests/conftest.py): the leaderboard shows exactly
    the rows `mpitp inspect` prints, every task's samples are there, no console error, no request."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    printed = {}
    res = CliRunner().invoke(inspect_command, [demo_file])
    for line in res.output.split("speed per task")[0].splitlines():  # the metrics table, not the speed table below
        t = line.split()
        if t and t[0].startswith("mpitp_demo_"):
            printed[tuple(t[:3])] = (t[3], t[5] if len(t) > 5 and t[4] == "±" else "", t[-1])
    assert len(printed) >= 3, res.output
    render_cli(demo_file, out=tmp_path / "real.html")
    browser.get((tmp_path / "real.html").as_uri())
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    assert all(u.startswith("file://") for u in _requests(browser))
    shown = {}
    for tr in browser.find_elements(By.CSS_SELECTOR, "#leaderboard-table tbody tr"):
        tds = tr.find_elements(By.TAG_NAME, "td")
        errs = tds[3].find_elements(By.CLASS_NAME, "err")
        shown[(tds[0].text, tds[1].text, tds[2].text)] = (
            tds[3].find_element(By.CLASS_NAME, "value").text, errs[0].text.removeprefix("± ") if errs else "")
    assert shown == {k: v[:2] for k, v in printed.items()}, (shown, printed)
    tasks = sorted({k[0] for k in printed})
    for task in tasks:
        Select(browser.find_element(By.ID, "task")).select_by_visible_text(task)
        n = next(v[2] for k, v in printed.items() if k[0] == task)
        assert browser.find_element(By.ID, "count").text == f"{n} of {n} documents", task
    browser.save_screenshot(str(tmp_path / "real-samples.png"))
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_a_directorys_files_come_in_a_sweeps_order(tmp_path):
    """A sweep's folder lists its files step-1, step-10, step-2 by name; the report's Runs table took that order
    (R2 step-10, R3 step-2) while its sweep chart beside it went step-1, step-2, step-10."""
    from mpitp.results.report import expand

    for n in (1, 10, 2):
        (tmp_path / f"step-{n}.h5").write_bytes(b"")
    files, _ = expand([str(tmp_path)])
    assert [os.path.basename(f) for f in files] == ["step-1.h5", "step-2.h5", "step-10.h5"]


def test_a_directory_with_no_results_is_said_not_dropped(tmp_path):
    """``mpitp report out/ run.h5`` where ``--output_path out/`` put the file in ``out/<model>/``: the page was made
    from run.h5 alone, out/ dropped without a word (alone it was refused: 'no results files in out')."""
    from mpitp.results.report import expand

    (tmp_path / "out" / "model").mkdir(parents=True)
    (tmp_path / "out" / "model" / "results.h5").write_bytes(b"")
    (tmp_path / "run.h5").write_bytes(b"")
    said = []
    files, _ = expand([str(tmp_path / "out"), str(tmp_path / "run.h5")], said.append)
    assert files == [str(tmp_path / "run.h5")]
    assert said == [f"skipped {tmp_path / 'out'}: no *.h5 or sweep-summary*.json in it (its subfolders are not read)"]


def test_several_sweep_summaries_each_name_their_charts_and_tests(tmp_path):
    """A job's checkpoint sweep and adapter sweep (each step-0, step-1, ...) in one report: their charts were both
    titled "syn_mc: acc,none" and their test lines both "step-1 vs step-0: ...", which sweep each was not said (only
    the speed tables named their summary). Each now starts with its summary's name; one summary alone, as before."""
    from mpitp.results.report import build

    folders = [tmp_path / "ckpt", tmp_path / "ad"]
    for folder, values in zip(folders, ([0.25, 0.5], [0.75, 0.5])):
        folder.mkdir()
        make_run(folder / "step-0.h5", f"{folder.name}/step-0", [1, 0, 0, 0])
        sweep_summary(folder / "sweep-summary.json", values)
    report = build([str(f) for f in folders], diff_iters=0)
    names = [f"{f / 'sweep-summary.json'}: " for f in folders]
    assert [p.title for p in report.sweeps] == [f"{n}syn_mc: acc,none" for n in names]
    assert [p.points[1][1] for p in report.sweeps] == [0.5, 0.5] and report.sweeps[0].points[0][1] == 0.25
    assert [t.split("step-1 vs step-0")[0] for t in report.sweep_tests[::2]] == names
    alone = build([str(folders[0])], diff_iters=0)
    assert [p.title for p in alone.sweeps] == ["syn_mc: acc,none"]
    assert alone.sweep_tests[0].startswith("step-1 vs step-0: ")


def test_output_never_replaces_an_input_or_a_results_file(tmp_path):
    """``mpitp report run.h5 -o run.h5`` wrote the page over the results file (its rows and scores gone, exit 0);
    so did -o naming another run's file, a sweep summary read from a folder, or a run's journal. Each is one line,
    exit 2, and the file keeps its bytes."""
    (tmp_path / "sw").mkdir()
    run = make_run(tmp_path / "sw" / "step-1.h5", "m/step-1", [1, 0, 1])
    other = make_run(tmp_path / "other.h5", "m/other", [1, 1, 0])
    sweep_summary(tmp_path / "sw" / "sweep-summary.json", [0.5, 0.75])
    journal = tmp_path / "running.h5.journal"
    journal.write_bytes(b"MPITPJ1\n" + b"\0" * 40)
    for inputs, out, why in (
            ([run], run, "is an HDF5 file (a results file?), not a page to replace"),
            ([run], other, "is an HDF5 file (a results file?), not a page to replace"),
            ([tmp_path / "sw"], tmp_path / "sw" / "sweep-summary.json",
             f"is {tmp_path / 'sw' / 'sweep-summary.json'}, one of the report's inputs"),
            ([run], journal, "is a run's journal (the rows of a run not finished), not a page to replace")):
        before = open(out, "rb").read()
        res = CliRunner().invoke(report_command, [*map(str, inputs), "-o", str(out)])
        assert res.exit_code == 2 and res.output == f"mpitp: error: -o {out}: {why}\n", res.output
        assert open(out, "rb").read() == before
    render_cli(run, out=tmp_path / "r.html")
    assert "<html" in render_cli(run, out=tmp_path / "r.html", iters=0)  # a page replaces a page
