"""Parity: every layout gives lm-eval's own single-process numbers, request by request.

Model: the real pretrained stories260K (TP up to 4). Tasks: stock lm-eval tasks on real data from ../shared, one of
each request type: multiple choice (arc_easy, hellaswag), loglikelihood with greedy checks (lambada_openai), rolling
perplexity over several 512-token windows (wikitext) and greedy generation with stop sequences (gsm8k, 5-shot, the
prompts left-truncated to one length; and 0-shot, a left-padded batch, which mpitp prefills row by row).
"""

from __future__ import annotations

import h5py
import pytest

from support import STORIES
from support.mpi import explain, run_mpi
from support.parity import compare_metrics, compare_requests, mpitp_requests, reference_requests

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # every test here launches mpiexec

TASKS = ["arc_easy_local", "hellaswag_local", "lambada_openai_local", "wikitext_local", "gsm8k_local",
         "gsm8k_zeroshot_local"]
LIMIT = 3
BATCH = 4
GEN_KWARGS = "max_gen_toks=32"


@pytest.fixture(scope="module")
def reference(test_tasks):
    """Single-process ``lm_eval --model hf`` on the same model, tasks and settings."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(2)
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={STORIES},dtype=float32", tasks=TASKS, limit=LIMIT,
        batch_size=BATCH, device="cpu", gen_kwargs=GEN_KWARGS, log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=test_tasks))
    return res


# With stages the rows are cut into chunks of at least this many positions when a batch has fewer rows than twice
# the stages (mpitp.replica.stage_chunks): a small minimum so that the tests' short rows take that path too.
STAGE_CHUNK_ENV = {"MPITP_TEST_STAGE_CHUNK": "16"}


def _run_layout(n, tp, test_tasks, out, pp=1, env=None):
    if pp > 1:
        env = {**STAGE_CHUNK_ENV, **(env or {})}
    return run_mpi(n, ["eval", "--model", str(STORIES), "--tasks", ",".join(TASKS), "--include-path", test_tasks,
                       "--limit", str(LIMIT), "--batch-size", str(BATCH), "--gen-kwargs", GEN_KWARGS,
                       "--bootstrap-iters", "0", "--dtype", "float32", "--tp", str(tp), "--pp", str(pp),
                       "--output", str(out)], env=env)


MAX_GEN = int(GEN_KWARGS.split("=")[1])


def _check_generation_forwards(log, reference, out):
    """The forwards generation ran, from the forward log (``MPITP_TEST_FORWARD_LOG``), per generate call: the 3
    gsm8k questions in one batch (``BATCH`` 4, as lm-eval batches them), one prefill of the prompts left-truncated to
    512 - 32 positions (stories260K's 5-shot prompts are all longer); the 3 zero-shot questions (their own stop list:
    other calls) in batches as the dispatcher's chunks cut them, a left-padded batch's prefill row by row
    (:mod:`mpitp.replica.ragged_prefill`): one forward per prompt length, longest first, of its rows' real tokens
    only. Then one forward per decode step of one position per row still generating (a zero-shot row stops at its
    first ".", and leaves the steps: :mod:`mpitp.replica.finished_rows`), the cache growing by one each; the tokens
    generated are each call's rows times the positions it added."""
    import json

    from transformers import AutoTokenizer

    gen = [json.loads(line) for line in open(log) if '"generate"' in line]
    seq = 512 - MAX_GEN
    tok = AutoTokenizer.from_pretrained(str(STORIES))

    def lengths(task):  # as lm-eval encodes a context: with the tokenizer's BOS; a sample per filter, one per doc
        docs = {s["doc_id"]: s["arguments"][0][0] for s in reference["samples"][task]}
        return [len(tok(ctx)["input_ids"]) for ctx in docs.values()]

    five, zero = lengths("gsm8k_local"), lengths("gsm8k_zeroshot_local")
    assert min(five) > seq and len(set(zero)) > 1 and max(zero) < seq, (five, zero)
    calls = []  # (prefill lines, decode lines) in the log's order
    for g in gen:
        if g["past"] == 0 and (not calls or calls[-1][1]):
            calls.append(([], []))
        calls[-1][0 if g["past"] == 0 else 1].append(g)
    whole = [c for c in calls if [(g["batch"], g["seq"]) for g in c[0]] == [(LIMIT, seq)]]
    assert len(whole) == 1 and len(whole[0][1]) >= 1, calls  # gsm8k: one call, at least one decode step
    rows, generated, shrunk = [], 0, False
    for call in calls:
        prefill, decode = call
        n = sum(g["batch"] for g in prefill)
        seqs = [g["seq"] for g in prefill]
        assert seqs == sorted(set(seqs), reverse=True), prefill  # one forward per prompt length, longest first
        assert [(g["seq"], g["past"]) for g in decode] == [(1, seqs[0] + i) for i in range(len(decode))], decode
        batches = [g["batch"] for g in decode]  # rows that stopped leave the steps (mpitp.replica.finished_rows)
        assert batches == sorted(batches, reverse=True) and all(0 < b <= n for b in batches), decode
        shrunk |= bool(batches) and batches[-1] < n
        assert len(decode) <= MAX_GEN - 1
        generated += n * (len(decode) + 1)
        if call is not whole[0]:
            rows += [g["seq"] for g in prefill for _ in range(g["batch"])]
    assert sorted(rows) == sorted(zero), (rows, zero)  # the zero-shot prompts' real tokens, no padding
    shapes = [([(g["batch"], g["seq"]) for g in c[0]], [g["batch"] for g in c[1]]) for c in calls]
    assert any(len(c[0]) > 1 for c in calls), shapes  # a left-padded batch went row by row
    assert shrunk, shapes  # and rows that met a stop sequence left the decode steps
    with h5py.File(out, "r") as f:
        assert int(f["stats/tokens_generated"][()].sum()) == generated
    return len(gen), LIMIT * seq + sum(zero)


LAYOUTS = [(1, 1, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (2, 1, 2), (4, 1, 2), (4, 2, 2)]
LAYOUT_IDS = ["1rank", "dp4", "tp2xdp2", "tp4", "pp2", "pp2xdp2", "pp2xtp2"]
OPENMPI_LAYOUTS = {"tp2xdp2", "tp4", "pp2xtp2"}  # CI's Open MPI pass: TP, the widest TP, and stages with TP


@pytest.fixture(scope="module")
def four_ranks(test_tasks, tmp_path_factory):
    """The 4-rank layouts in one launch: a job file with one run per layout (``mpitp run``: the same world re-laid
    out per run, as a campaign runs), so the suite pays the ranks' start-up once instead of five times (CI's 90
    minutes). ``mpitp eval``'s own command line is the 1- and 2-rank layouts' (``_run_layout``)."""
    import yaml

    tmp = tmp_path_factory.mktemp("parity4")
    runs = [dict(name=i, tp=tp, pp=pp, output=str(tmp / f"{i}.h5"))
            for (n, tp, pp), i in zip(LAYOUTS, LAYOUT_IDS) if n == 4]
    job = tmp / "layouts.yaml"
    job.write_text(yaml.safe_dump(dict(defaults=dict(model=str(STORIES), tasks=TASKS, include_path=test_tasks,
                                                     limit=LIMIT, batch_size=BATCH, gen_kwargs=GEN_KWARGS,
                                                     bootstrap_iters=0, dtype="float32"), runs=runs), sort_keys=False))
    proc = run_mpi(4, ["run", str(job)], timeout=1200, env=STAGE_CHUNK_ENV)
    assert proc.returncode == 0, explain(proc)
    # the probe ran on every replica of every run, its cost shown
    assert proc.stdout.count("head check: passed in") == len(runs), explain(proc)
    # the runs with stages took chunks of positions (their parity below is held through them)
    assert proc.stdout.count("pipeline chunks: on") == sum(1 for r in runs if r["pp"] > 1), explain(proc)
    # and scored their LM head on every stage (mpitp.replica.stage_head): parity below holds through it
    assert proc.stdout.count("pipeline head: spread") == sum(1 for r in runs if r["pp"] > 1), explain(proc)
    return {r["name"]: r["output"] for r in runs}, proc


@pytest.mark.parametrize("n,tp,pp", [pytest.param(*lay, id=i, marks=[pytest.mark.openmpi] if i in OPENMPI_LAYOUTS
                                                   else []) for lay, i in zip(LAYOUTS, LAYOUT_IDS)])
def test_layout_matches_lm_eval(n, tp, pp, reference, test_tasks, tmp_path, request):
    if n == 4:
        outs, proc = request.getfixturevalue("four_ranks")
        out = outs[request.node.callspec.id]
    else:
        out = tmp_path / "out.h5"
        log = tmp_path / "forwards.jsonl"  # one rank: generate's forwards counted (_check_generation_forwards)
        env = {"MPITP_TESTING": "1", "MPITP_TEST_FORWARD_LOG": str(log)} if n == 1 else None
        proc = _run_layout(n, tp, test_tasks, out, pp, env=env)
        assert proc.returncode == 0, explain(proc)
        assert "head check: passed in" in proc.stdout, explain(proc)  # the probe ran, its cost shown
        assert ("pipeline chunks: on" in proc.stdout) == (pp > 1), explain(proc)
        assert ("pipeline head: spread" in proc.stdout) == (pp > 1), explain(proc)
        if n == 1:
            assert "generation prefill: row by row" in proc.stdout, explain(proc)  # the summary says so
            forwards, prefill_tokens = _check_generation_forwards(log, reference, out)
            print(f"gsm8k generation: {forwards} forwards, {prefill_tokens} prefill tokens")
    ref = reference_requests(reference["samples"])
    got = mpitp_requests(str(out), TASKS)
    worst, problems = compare_requests(ref, got)
    assert not problems, "\n".join(problems[:20])
    assert len(got) >= 5 * LIMIT  # every task contributed rows
    gens = [v[2] for k, v in got.items() if k[0] == "gsm8k_local"]
    assert len(gens) == LIMIT and all(len(g) > 20 for g in gens), gens  # real greedy text was compared
    assert sum(1 for k in got if k[0] == "gsm8k_zeroshot_local") == LIMIT  # and from the padded batch
    problems = compare_metrics(reference["results"], str(out), TASKS)
    assert not problems, "\n".join(problems)
    print(f"layout n={n} tp={tp} pp={pp}: {len(got)} requests, max relative |d ll| = {worst:.2e}, "
          f"wall {proc.elapsed:.1f} s")


def test_limit_one_on_four_groups(test_tasks, tmp_path):
    """dp=4 with a single request per task: no group may hang for want of work, and the one wikitext document is
    not one indivisible item: its rolling windows are spread over the groups (each counts a share of the request)."""
    out = tmp_path / "one.h5"
    proc = run_mpi(4, ["eval", "--model", str(STORIES), "--tasks", "arc_easy_local,wikitext_local",
                       "--include-path", test_tasks, "--limit", "1", "--bootstrap-iters", "0", "--output", str(out),
                       "--timeout", "120"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    got = mpitp_requests(str(out), ["arc_easy_local", "wikitext_local"])
    assert len([k for k in got if k[0] == "wikitext_local"]) == 1
    assert len([k for k in got if k[0] == "arc_easy_local"]) == 4  # one question, four choices
    with h5py.File(out, "r") as f:
        shares, tokens = f["stats/requests"][()], f["stats/tokens_scored"][()]
    assert round(shares.sum(), 9) == 5, shares
    assert sum(1 for x in shares if abs(x - round(x)) > 1e-9) >= 2, shares  # the document was split between groups
    print(f"--limit 1 on dp=4: requests per group {[round(float(x), 3) for x in shares]}, "
          f"tokens scored {tokens.tolist()}")


DEMO_TASKS = ["mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen"]


def test_odd_vocabulary_tp4_matches_lm_eval(tmp_path):
    """The demo model's vocabulary (509) does not divide by 4: uneven vocabulary shards, same numbers."""
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    from mpitp.tasks.demo import demo_tasks_dir, prepare_demo

    model_dir, include, _ = prepare_demo(str(tmp_path / "cache"))
    torch.set_num_threads(2)
    ref = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32,max_length=64",
                                  tasks=DEMO_TASKS, limit=6, batch_size=2, device="cpu", log_samples=True,
                                  bootstrap_iters=0, task_manager=TaskManager(include_path=demo_tasks_dir()))
    out = tmp_path / "demo.h5"
    proc = run_mpi(4, ["eval", "--model", model_dir, "--tasks", ",".join(DEMO_TASKS), "--include-path", include,
                       "--limit", "6", "--batch-size", "2", "--max-length", "64", "--bootstrap-iters", "0",
                       "--tp", "4", "--output", str(out)])
    assert proc.returncode == 0, explain(proc)
    worst, problems = compare_requests(reference_requests(ref["samples"]), mpitp_requests(str(out), DEMO_TASKS))
    assert not problems, "\n".join(problems[:20])
    assert not compare_metrics(ref["results"], str(out), DEMO_TASKS)
