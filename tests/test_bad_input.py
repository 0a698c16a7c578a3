"""Bad input under a real ``mpiexec``: one clear line, printed once, exit status 2 on every rank, nothing left behind.

Every row launches ``mpiexec -n N python -m mpitp ...`` (2 ranks unless the row needs 4) in a scratch directory and
checks that the job ends with status 2 within 20 seconds, that the message is on exactly one line of stderr (not once
per rank), that no traceback is shown and that an existing results file is left byte for byte as it was.

``MPITP_BAD_INPUT_TABLE=docs/bad-input.md pytest tests/test_bad_input.py`` rewrites the Markdown table of the actual
messages (linked from the README's Troubleshooting, which quotes a few of its rows).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import REPO, SHARED, STORIES
from support.mpi import explain, run_mpi


@dataclass(frozen=True)
class Row:
    id: str
    input: str  # what is wrong, for the table
    n: int
    args: tuple[str, ...]
    message: str  # the one line printed (a prefix when ``prefix``)
    prefix: bool = False
    keep: tuple[str, ...] = ()  # files that must be byte-identical afterwards
    bound: float = 20.0  # seconds from launch until every rank is gone
    env: tuple[tuple[str, str], ...] = ()  # launcher variables the row sets (shown before the command)


def _click(msg: str) -> str:
    return f"Error: {msg}"


def _err(msg: str) -> str:
    return f"mpitp: error: {msg}"


# Paths are relative to the scratch directory the job runs in (see ``scratch``).
ROWS = [
    Row("missing-model", "model path does not exist", 2, ("eval", "--demo", "--model", "./no-such-model"),
        _err("model path ./no-such-model does not exist")),
    Row("not-a-model", "directory that is not a HF model", 2, ("eval", "--demo", "--model", "./not-a-model"),
        _err("model path ./not-a-model is not a Hugging Face model directory (no config.json)")),
    Row("dcp-no-assets", "torch DCP checkpoint, no `config.json` beside it, no `--hf-assets`", 2,
        ("eval", "--demo", "--model", "./dcp-step"),
        _err("model path ./dcp-step is a torch DCP checkpoint without a config.json beside it: give --hf-assets DIR "
             "(the folder with the model's config.json and tokenizer files)")),
    Row("peft-not-lora", "adapter that is not LoRA (`--peft`)", 2, ("eval", "--demo", "--peft", "./ia3-adapter"),
        _err("--model_args peft=./ia3-adapter: peft_type IA3 is not supported (LoRA adapters only)")),
    Row("tp-world", "`--tp` does not divide the world size", 2, ("eval", "--demo", "--tp", "4"),
        _err("tp=4 does not divide world size 2")),
    Row("tp-heads", "`--tp` does not divide the attention / KV heads", 4,
        ("eval", "--demo", "--model", "./six-heads", "--tp", "4"),
        _err("tp=4 does not divide the model's 6 attention heads")),
    Row("pp-world", "`--tp` x `--pp` does not divide the world size", 2, ("eval", "--demo", "--tp", "2", "--pp", "2"),
        _err("tp=2 x pp=2 = 4 does not divide world size 2")),
    Row("pp-layers", "more pipeline stages than decoder layers", 4, ("eval", "--demo", "--pp", "4"),
        _err("pp=4 exceeds the model's 2 decoder layers (each stage needs at least one)")),
    Row("unknown-task", "unknown task (close matches suggested)", 2, ("eval", "--demo", "--tasks", "mpitp_demo_m"),
        _err("unknown task 'mpitp_demo_m'; did you mean: mpitp_demo_mc"), prefix=True),
    Row("unknown-stock-task", "unknown task, close to a stock lm-eval task", 2,
        ("eval", "--demo", "--tasks", "hellaswagg"), _err("unknown task 'hellaswagg'; did you mean: hellaswag"),
        prefix=True),
    Row("limit-0", "`--limit 0`", 2, ("eval", "--demo", "--limit", "0"),
        _err("--limit: must be > 0, got 0")),
    Row("limit-negative", "`--limit -1`", 2, ("eval", "--demo", "--limit", "-1"),
        _err("--limit: must be > 0, got -1")),
    Row("seed-out-of-range", "`--seed` past NumPy's range", 2, ("eval", "--demo", "--seed", "5000000000"),
        _err("--seed: expected one integer from 0 to 4294967295 or a list of four (None: that generator left "
             "unseeded), got [5000000000, 5000000000, 5000000000, 5000000000]")),
    Row("batch-size-0", "`--batch-size 0`", 2, ("eval", "--demo", "--batch-size", "0"),
        _err("--batch_size: must be >= 1, got 0")),
    Row("unwritable-output", "output cannot be written (its parent is a file)", 2,
        ("eval", "--demo", "--output", "./notes.txt/out.h5"),
        _err("cannot write output ./notes.txt/out.h5: {scratch}/notes.txt is not a directory"),
        keep=("notes.txt",)),
    Row("output-exists", "output exists, neither `--resume` nor `--overwrite`", 2,
        ("eval", "--demo", "--tasks", "mpitp_demo_mc", "--limit", "2", "--output", "results.h5"),
        _err("output results.h5 already exists: pass --resume to continue it or --overwrite to replace it"),
        keep=("results.h5",)),
    Row("resume-other-limit", "`--resume` a file made with other settings (`--limit`)", 2,
        ("eval", "--demo", "--tasks", "mpitp_demo_mc", "--limit", "3", "--output", "results.h5", "--resume"),
        _err("cannot resume results.h5: different settings: limit 2 in the file, 3 now"), keep=("results.h5",)),
    Row("resume-other-model", "`--resume` a file made with another model", 2,
        ("eval", "--demo", "--model", "./six-heads", "--tasks", "mpitp_demo_mc", "--limit", "2",
         "--output", "results.h5", "--resume"),
        _err("cannot resume results.h5: different settings: model {demo_model!r} in the file, './six-heads' now"),
        keep=("results.h5",)),
    Row("resume-corrupt", "`--resume` a file that is not HDF5", 2,
        ("eval", "--demo", "--output", "corrupt.h5", "--resume"),
        _err("cannot resume corrupt.h5: not an mpitp results file ("), prefix=True, keep=("corrupt.h5",)),
    Row("bad-job-file", "malformed job file (`mpitp run`)", 2, ("run", "bad-job.yaml"),
        _err("bad-job.yaml: run 1 ('demo-mpitp_demo_mc'): field 'tp': expected a positive integer, got 'two'")),
    Row("missing-include-path", "`--include-path` does not exist", 2,
        ("eval", "--demo", "--include-path", "./no-such-dir"), _err("--include-path ./no-such-dir: no such directory")),
    Row("missing-tokenizer", "`--tokenizer` path does not exist", 2,
        ("eval", "--demo", "--tokenizer", "./no-such-tokenizer"),
        _err("--tokenizer ./no-such-tokenizer: no such directory")),
    Row("missing-data-dir", "`--data-dir` does not exist", 2, ("eval", "--demo", "--data-dir", "./no-such-dir"),
        _err("--data-dir ./no-such-dir: no such directory")),
    Row("data-dir-task-absent", "`--data-dir` lacks a task's dataset (offline)", 2,
        ("eval", "--model", "./six-heads", "--tasks", "copa", "--data-dir", "./empty-data"),
        _err("--data-dir ./empty-data: task copa reads the Hub dataset aps/super_glue/copa, which is neither in "
             "--data-dir ({scratch}/empty-data/aps/super_glue/copa/validation.jsonl or .parquet) nor in the HF "
             "cache; fetch: mpitp prefetch --tasks copa --data-dir ./empty-data")),
    Row("hub-task-offline", "a task's Hub dataset neither in the HF cache nor in a `--data-dir` (offline)", 2,
        ("eval", "--model", "./six-heads", "--tasks", "copa"),
        _err("task copa reads the Hub dataset aps/super_glue/copa, which is not in the HF cache, and datasets may not "
             "download (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE): on a node with network, mpitp prefetch --tasks copa "
             "--data-dir DATA, then pass --data-dir DATA")),
    Row("other-backend", "another lm-eval backend (`--model vllm`)", 2,
        ("eval", "--model", "vllm", "--model_args", "pretrained=./not-a-model", "--tasks", "mpitp_demo_mc"),
        _err("--model vllm: mpitp runs Hugging Face transformers models only (--model hf --model_args "
             "pretrained=...); 'vllm' is lm-eval's VLLM backend")),
    Row("model-args-parallelize", "an HFLM argument that places the model another way", 2,
        ("eval", "--demo", "--model_args", "parallelize=True"),
        _err("--model_args parallelize: mpitp places the model itself: use --tp/--pp (and more ranks) instead of "
             "parallelize")),
    Row("hub-push", "a Hub push (needs the network)", 2,
        ("eval", "--demo", "--output_path", "out", "--hf_hub_log_args", "push_results_to_hub=True"),
        _err("--hf_hub_log_args push_results_to_hub: pushing to the Hugging Face Hub needs the network; the files "
             "are written under --output_path, push them from a login node")),
    Row("timeout-not-a-number", "`--timeout abc`", 2, ("eval", "--demo", "--timeout", "abc"),
        _err("--timeout: expected a number of seconds, got 'abc'")),
    Row("launcher-more-tasks", "the launcher started more tasks than MPI joined (srun's plugin does not match the MPI)",
        2, ("eval", "--demo"), _err("srun started 4 tasks (SLURM_STEP_NUM_TASKS=4) but MPI sees a world of 2: each "
                                    "process would run the whole evaluation alone; srun's MPI plugin does not match "
                                    "this MPI library ("), prefix=True,
        env=(("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "0"))),
    Row("submit-no-ranks", "`mpitp submit` with neither `--ranks-per-node` nor `--gpus-per-node`", 1,
        ("submit", "demo.yaml", "--scheduler", "slurm", "--nodes", "1", "--time", "00:10:00", "--dry-run"),
        _click("give --ranks-per-node (MPI ranks per node; CPU partitions) or --gpus-per-node (one rank per GPU)")),
    Row("submit-ranks-over-gpus", "`mpitp submit --ranks-per-node` above `--gpus-per-node`", 1,
        ("submit", "demo.yaml", "--scheduler", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--ranks-per-node",
         "4", "--time", "00:10:00", "--dry-run"),
        _click("--ranks-per-node 4 is more than --gpus-per-node 2: ranks would share a GPU")),
    Row("submit-grace", "`mpitp submit --signal-grace` not shorter than `--time`", 1,
        ("submit", "demo.yaml", "--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "4", "--time",
         "00:05:00", "--signal-grace", "600", "--dry-run"),
        _click("--signal-grace 600 s is not shorter than --time 00:05:00 = 300 s: the job would be told to stop "
               "before it starts")),
]

_seen: dict[str, tuple[Row, str]] = {}  # row id -> (row, the actual line), for the table


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory holding every file the rows point at, and a real (complete) results file made by a demo run."""
    d = tmp_path_factory.mktemp("bad_input")
    (d / "not-a-model").mkdir()
    (d / "not-a-model" / "README").write_text("not a model\n")
    six = d / "six-heads"  # config only: the head check runs before any weight is read
    six.mkdir()
    (six / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6, head_dim=8, vocab_size=512,
        max_position_embeddings=256)))
    (d / "ia3-adapter").mkdir()  # the config is refused before the weights are read: a placeholder will do
    (d / "ia3-adapter" / "adapter_config.json").write_text(json.dumps(dict(peft_type="IA3")))
    (d / "ia3-adapter" / "adapter_model.safetensors").write_bytes(b"placeholder")
    (d / "dcp-step").mkdir()  # refused before .metadata is read: placeholders will do
    (d / "dcp-step" / ".metadata").write_bytes(b"placeholder")
    (d / "dcp-step" / "__0_0.distcp").write_bytes(b"placeholder")
    (d / "notes.txt").write_text("a regular file, not a directory\n")
    (d / "empty-data").mkdir()
    (d / "corrupt.h5").write_bytes(b"this is not an HDF5 file\n" * 10)
    (d / "demo.yaml").write_text((REPO / "jobs" / "demo.yaml").read_text())
    (d / "bad-job.yaml").write_text("runs:\n  - model: demo\n    tasks: [mpitp_demo_mc]\n    tp: two\n"
                                    "    output: out.h5\n")
    proc = run_mpi(1, ["eval", "--demo", "--tasks", "mpitp_demo_mc", "--limit", "2", "--bootstrap-iters", "0",
                       "--output", "results.h5"], timeout=300, cwd=str(d))
    assert proc.returncode == 0, explain(proc)
    from mpitp.results.schema import open_h5

    with open_h5(str(d / "results.h5")) as f:
        assert f.attrs["status"] == "complete"
        demo_model = json.loads(f.attrs["config_json"])["model"]
    yield d, demo_model
    table = os.environ.get("MPITP_BAD_INPUT_TABLE")
    if table and len(_seen) == len(ROWS):
        _write_table(Path(table), d)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


#: CI's Open MPI pass: rows whose verdict is shared between ranks by MPI (world arithmetic, checks on rank 0).
OPENMPI_ROWS = {"missing-model", "tp-world", "tp-heads", "pp-layers", "output-exists", "bad-job-file",
                "launcher-more-tasks"}


@pytest.mark.mpi
@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.openmpi] if r.id in OPENMPI_ROWS else [])
                                 for r in ROWS])
def test_bad_input(row, scratch):
    d, demo_model = scratch
    before = {name: _digest(d / name) for name in row.keep}
    proc = run_mpi(row.n, list(row.args), timeout=120, cwd=str(d), env=dict(row.env))
    message = row.message.format(scratch=d, demo_model=demo_model)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert proc.elapsed < row.bound, f"job took {proc.elapsed:.1f} s\n{explain(proc)}"
    assert "Traceback" not in out, explain(proc)
    lines = [ln for ln in proc.stderr.splitlines() if message in ln]
    assert len(lines) == 1 and out.count(message) == 1, f"message printed {out.count(message)} times\n{explain(proc)}"
    line = lines[0]
    assert line.startswith(message) if row.prefix else line == message, explain(proc)
    for name, digest in before.items():
        assert _digest(d / name) == digest, f"{name} was modified"
    assert not list(d.glob("*.tmp*")), "a temporary results file was left behind"
    _seen[row.id] = (row, line)
    print(f"{row.id}: exit 2 on all {row.n} ranks {proc.elapsed:.1f} s after launch")


def _write_table(path: Path, scratch: Path) -> None:
    home = str(Path.home())

    def clean(s: str) -> str:
        return s.replace(str(scratch), "$PWD").replace(home, "~").replace("|", "\\|")

    lines = ["| input | command | message |", "|---|---|---|"]
    for row in ROWS:
        _, line = _seen[row.id]
        cmd = "".join(f"{k}={v} " for k, v in row.env) + f"mpiexec -n {row.n} mpitp {' '.join(row.args)}"
        lines.append(f"| {clean(row.input)} | `{clean(cmd)}` | `{clean(line)}` |")
    text = ("# Bad input\n\n"
            "What `mpitp` prints for common mistakes, measured by `tests/test_bad_input.py` under a real `mpiexec`. "
            "Each is one line, printed once (by rank 0, not once per rank); every rank exits with status 2 within "
            "seconds, before any model weights are loaded, and an existing results file is left untouched. `mpitp "
            "eval` parses lm-eval's command line (its own parser, see `mpitp eval --help`) on rank 0 and reports an "
            "option error as one `mpitp: error:` line too.\n\n"
            + "\n".join(lines) + "\n")
    path = path if path.is_absolute() else REPO / path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_readme_shows_the_measured_table():
    """docs/bad-input.md holds one measured row per case (regenerate it with MPITP_BAD_INPUT_TABLE); the README's
    Troubleshooting links it and shows only rows of it, so a message the README quotes is one a test measured."""
    table = [ln for ln in (REPO / "docs" / "bad-input.md").read_text().splitlines() if ln.startswith("| ")]
    readme = (REPO / "README.md").read_text()
    assert len(table) == len(ROWS) + 1
    assert "(docs/bad-input.md)" in readme
    start = readme.index(table[0])
    shown = readme[start:].split("\n\n", 1)[0].splitlines()
    assert shown[:2] == [table[0], "|---|---|---|"] and len(shown) > 2
    assert set(shown[2:]) <= set(table[1:]), set(shown[2:]) - set(table[1:])


# --gen_kwargs: each value checked on rank 0 (lm-eval's reading, then transformers' GenerationConfig and logits
# processors) before the model loads, in every layout. In-process: the values as lm-eval's command line reads them.
GEN_KWARGS_REFUSED = [
    ("temperature=abc", 1, "--gen_kwargs temperature=abc: temperature must be a number"),
    ("max_gen_toks=abc", 1, "--gen_kwargs max_gen_toks=abc: max_gen_toks must be a positive integer (tokens to "
                            "generate)"),
    ("max_gen_toks=-5", 1, "--gen_kwargs max_gen_toks=-5: max_gen_toks must be a positive integer (tokens to "
                           "generate)"),
    ("do_sample=True,temperature=0", 2, "--gen_kwargs do_sample=True,temperature=0: `temperature` (=0) has to be a "
                                        "strictly positive float"),
    ("top_k=-1,do_sample=True", 1, "--gen_kwargs top_k=-1,do_sample=True: `top_k` has to be a strictly positive "
                                   "integer"),
    ("until=5", 1, "--gen_kwargs until=5: until must be a stop string or a list of them"),
    ("do_sample=maybe", 1, "--gen_kwargs do_sample=maybe: do_sample must be true or false"),
    ("repetition_penalty=0", 1, "--gen_kwargs repetition_penalty=0: `penalty` has to be a strictly positive float"),
]
#: run by ``lm_eval --model hf`` as they are (temperature=0 is greedy, sampling flags without do_sample are ignored)
GEN_KWARGS_ACCEPTED = ["temperature=0", "do_sample=False", "do_sample=False,temperature=0.7", "temperature=0.7",
                       "top_p=0.9", "do_sample=True,temperature=0.7,top_p=0.9,top_k=40", "max_gen_toks=12,until=Q:"]


def _check_gen_kwargs(gen_kwargs, tp: int) -> None:
    """What ``check_all`` does with ``--gen_kwargs`` (no model: these checks need none)."""
    from mpitp.evaluation import checks
    from mpitp.evaluation.gen_kwargs_check import check_generation
    from mpitp.evaluation.lmeval_args import parse_eval_args

    if isinstance(gen_kwargs, str):
        gen_kwargs = parse_eval_args(["--model", "hf", "--model_args", "pretrained=m", "--tasks", "t",
                                      "--gen_kwargs", gen_kwargs]).cfg.gen_kwargs
    check_generation(checks.check_gen_kwargs(gen_kwargs, tp, 1))


@pytest.mark.parametrize("text,tp,message", GEN_KWARGS_REFUSED, ids=[t for t, _, _ in GEN_KWARGS_REFUSED])
def test_bad_gen_kwargs_refused_before_the_model_loads(text, tp, message):
    from mpitp.errors import UsageError

    with pytest.raises(UsageError) as err:
        _check_gen_kwargs(text, tp)
    line = str(err.value)
    assert line.startswith(message) and "\n" not in line, line


@pytest.mark.parametrize("gen_kwargs", [*GEN_KWARGS_ACCEPTED, {"until": ["\n\n", "Question:"], "max_gen_toks": 5,
                                                               "do_sample": False}])
def test_gen_kwargs_lm_eval_runs_are_accepted(gen_kwargs):
    for tp in (1, 2):
        _check_gen_kwargs(gen_kwargs, tp)


@pytest.mark.mpi
def test_bad_gen_kwargs_under_mpiexec(tmp_path):
    """End to end, tp=1: one line from rank 0, exit status 2 on every rank, no traceback, no results file."""
    proc = run_mpi(2, ["eval", "--demo", "--tasks", "mpitp_demo_gen", "--limit", "2", "--output", "out.h5",
                       "--gen_kwargs", "temperature=abc"], timeout=120, cwd=str(tmp_path))
    message = _err("--gen_kwargs temperature=abc: temperature must be a number")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in out and out.count(message) == 1, explain(proc)
    assert message in proc.stderr.splitlines(), explain(proc)
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("args,message", [
    (("--demo", "--tasks", "mpitp_demo_gen", "--max-length", "16", "--gen_kwargs", "max_gen_toks=16"),
     "max_gen_toks 16 leaves no room for the prompt in the model's max_length 16 (lm-eval refuses it too)"),
    (("--model", str(STORIES), "--tasks", "arc_easy", "--data-dir", str(SHARED / "data"), "--max-length", "2"),
     "which lm-eval cannot score with the model's max_length 2 (it must be 1 to max_length tokens)"),
    (("--model", str(STORIES), "--tasks", "arc_easy", "--data-dir", str(SHARED / "data"), "--apply_chat_template"),
     "--apply_chat_template: the tokenizer cannot apply a chat template: "),
], ids=["max-gen-toks", "long-continuation", "no-chat-template"])
def test_requests_lm_eval_cannot_score_are_one_line(args, message, tmp_path):
    """What lm-eval refuses by an assertion once its requests are built (a traceback from whichever rank met it): one
    line and exit 2. A continuation too long is met by the DP leader that tokenises a chunk, once the run is under
    way: the file is left 'running', for a --resume with a larger --max-length. max_gen_toks leaving no room is met
    before any request is served, so before the file is made, and a tokenizer without a chat template by the checks,
    before the load: the fixed rerun needs no --overwrite (a 'running' file of no rows was left, which --resume
    refused over its other settings)."""
    proc = run_mpi(2, ["eval", *args, "--tp", "2", "--limit", "2", "--output", "out.h5"], timeout=120,
                   cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in out and out.count(message) == 1, explain(proc)
    assert any(ln.startswith("mpitp: error: ") and message in ln for ln in proc.stderr.splitlines()), explain(proc)
    assert (tmp_path / "out.h5").exists() == ("cannot score with" in message), explain(proc)


@pytest.mark.mpi
def test_commands_that_use_no_mpi_run_once_under_mpiexec(tmp_path):
    """``mpiexec -n 2 mpitp check`` printed its verdict twice, ``submit`` submitted once per rank (two scripts
    rendered, two jobs), ``prefetch`` downloaded into one folder from each: rank 0 alone runs such a command, the
    other ranks leave at once, and rank 0's status is the launch's."""
    demo = str(REPO / "jobs" / "demo.yaml")
    proc = run_mpi(2, ["submit", demo, "--scheduler", "slurm", "--nodes", "1", "--ranks-per-node", "2", "--time",
                       "00:10:00", "--dry-run"], timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.count("#SBATCH --nodes") == 1, explain(proc)
    proc = run_mpi(2, ["check", demo], timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.count("mpitp check: ready offline") == 1, explain(proc)
    proc = run_mpi(2, ["inspect", "missing.h5"], timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("missing.h5: no such file") == 1, explain(proc)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tokenizer="./no-such-tokenizer"), "--tokenizer ./no-such-tokenizer: no such directory"),
    (dict(tokenizer="no-such-org/no-such-tokenizer"), "--tokenizer no-such-org/no-such-tokenizer cannot be loaded: "),
    (dict(apply_chat_template=True), "--apply_chat_template: the tokenizer cannot apply a chat template: "),
], ids=["path", "hub-id", "no-chat-template"])
def test_tokenizer_refused_before_the_load(kwargs, message, monkeypatch):
    """The checks load the tokenizer lm-eval will load when one is named or a chat template asked for: a missing one
    was an OSError traceback on every rank after the model load, one without a template a refusal on rank 0 alone
    (a job file's later runs never started)."""
    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import check_tokenizer
    from mpitp.evaluation.settings import EvalConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_tokenizer(EvalConfig(model=str(STORIES)))  # neither: the model's own, left to mpitp check
    check_tokenizer(EvalConfig(model=str(STORIES), tokenizer=str(STORIES)))
    with pytest.raises(UsageError) as info:
        check_tokenizer(EvalConfig(model=str(STORIES), **kwargs))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_tokenizer_larger_than_the_embedding_refused():
    """GPT-2's tokenizer (50257 ids) for stories260K (512 embedded): an IndexError traceback on every rank at the
    first forward; now refused by the checks, the arithmetic spelt out."""
    from transformers import AutoConfig

    from mpitp.errors import UsageError
    from mpitp.evaluation.checks import check_tokenizer
    from mpitp.evaluation.settings import EvalConfig

    gpt2, config = SHARED / "tokenizers" / "gpt2", AutoConfig.from_pretrained(str(STORIES))
    check_tokenizer(EvalConfig(model=str(STORIES), tokenizer=str(STORIES)), config)
    with pytest.raises(UsageError) as info:
        check_tokenizer(EvalConfig(model=str(STORIES), tokenizer=str(gpt2)), config)
    assert str(info.value) == (f"--tokenizer {gpt2} has 50257 token ids, the model {STORIES} embeds 512 (config "
                               "vocab_size): ids 512 to 50256 have no embedding; give the model's own tokenizer")


def test_gen_kwargs_key_generate_would_refuse():
    """A --gen_kwargs key that is no generation setting nor an input of the model (a typo) was generate's ValueError
    ('The following model_kwargs are not used by the model: ['tempreature']') on every DP leader after the load;
    the checks refuse it with the closest setting. Model inputs and transformers' own keywords pass, as generate
    takes them."""
    from transformers import AutoConfig

    from mpitp.errors import UsageError
    from mpitp.evaluation.gen_kwargs_check import check_model_kwargs, parse_gen_kwargs

    config = AutoConfig.from_pretrained(str(STORIES))
    for ok in ("temperature=0,max_gen_toks=4,until=Q:", "output_hidden_states=False", "do_sample=False,top_k=5"):
        check_model_kwargs(parse_gen_kwargs(ok), config)
    with pytest.raises(UsageError) as info:
        check_model_kwargs(parse_gen_kwargs("temperature=0,tempreature=0"), config)
    assert str(info.value) == ("--gen_kwargs tempreature=0: tempreature is no generation setting (transformers' "
                               "GenerationConfig) nor an input of LlamaForCausalLM: generate would refuse it (did you "
                               "mean temperature?)")
