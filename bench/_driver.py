"""One process of a benchmark run: times the evaluation inside the process and reports peak RSS.

    mpiexec -n N python bench/_driver.py mpitp [--no-cache] -- eval --model M --tasks T ...   (mpitp's own CLI)
    [torchrun --nproc-per-node N] python bench/_driver.py lmeval '<json spec>'                (lm-eval's HFLM)

Both modes import the heavy libraries (torch, transformers with its model-loading code ``transformers.modeling_utils``,
lm_eval and its HF model, and mpi4py/mpitp for mpitp)
*before* the clock starts, then time exactly one call: ``mpitp.cli.main(argv)`` (checks, TP world, sharded model
load, lm-eval on rank 0 with dispatch, HDF5 file) or ``TaskManager(...)`` + ``lm_eval.simple_evaluate(model="hf",
...)`` (model load, the same tasks, lm-eval's own batching). Each rank then prints one line::

    BENCHRESULT {"rank": r, "time_s": ..., "cpu_s": ..., "maxrss_kb": ..., ...}

``time_s`` is wall-clock time of that call, ``cpu_s`` the process's user + system CPU time over it (less sensitive
to other load on a shared machine), ``maxrss_kb`` the process's peak resident set over its whole life and
``base_rss_kb`` its peak after the imports, just before the timed call (the libraries' share); ``end_rss_mb`` the
current RSS at the end split into ``RssAnon`` (private memory) and ``RssFile`` (file-backed pages: shared libraries
and the memory-mapped safetensors checkpoint, shared with the page cache and other ranks).

``--no-cache`` / ``"no_cache": true`` makes every ``generate`` call of lm-eval's ``HFLM._model_generate`` run with
``use_cache=False`` (lm-eval hard-codes ``use_cache=True`` there, so ``--gen-kwargs use_cache=False`` cannot work:
it raises "got multiple values for keyword argument 'use_cache'"). mpitp's ``MPITPLM._model_generate`` calls that
same method, so the patch reaches both, and it leaves the kwargs mpitp inspects (``plain_greedy``) untouched.

Generation is also timed per call: ``gen_s`` (wall time inside ``_model_generate``, i.e. HF ``generate`` including,
for mpitp, the mirroring of every forward to the TP workers) and ``gen_tokens`` (batch x new positions), on the
rank that drives ``generate`` (mpitp: the DP leader; lm-eval TP: every rank runs it, rank 0 reports).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time


def _maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: kB


def _status_mb() -> dict:
    """Current RSS split from /proc/self/status: anonymous (private) vs file-backed (mmapped checkpoint, libraries)."""
    out = {}
    try:
        for line in open("/proc/self/status"):
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _patch_no_cache() -> None:
    from lm_eval.models.huggingface import HFLM

    original = HFLM._model_generate

    def no_cache_model_generate(self, context, max_length, stop, **generation_kwargs):
        model = self.model
        generate = model.generate
        own = vars(model).get("generate")  # mpitp's own per-row stops may have set one on the instance already

        def generate_without_cache(*args, **kwargs):
            kwargs["use_cache"] = False
            return generate(*args, **kwargs)

        model.generate = generate_without_cache
        try:
            return original(self, context, max_length, stop, **generation_kwargs)
        finally:  # what was there before, not nothing: mpitp's block puts its own back after this
            if own is None:
                del model.generate
            else:
                model.generate = own

    HFLM._model_generate = no_cache_model_generate


GEN = {"gen_s": 0.0, "gen_tokens": 0, "gen_calls": 0}


def _time_generate(cls) -> None:
    """Accumulate wall time and new tokens (batch x new positions) of every ``cls._model_generate`` call."""
    original = cls._model_generate

    def timed_model_generate(self, context, max_length, stop, **generation_kwargs):
        t0 = time.perf_counter()
        out = original(self, context, max_length, stop, **generation_kwargs)
        GEN["gen_s"] += time.perf_counter() - t0
        GEN["gen_tokens"] += int((out.shape[1] - context.shape[1]) * out.shape[0])
        GEN["gen_calls"] += 1
        return out

    cls._model_generate = timed_model_generate


def _emit(payload: dict) -> None:
    if GEN["gen_calls"]:
        payload.update(GEN)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        payload["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20  # this process, its current device
    payload["maxrss_kb"] = _maxrss_kb()
    payload["end_rss_mb"] = _status_mb()
    sys.stdout.write("BENCHRESULT " + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def run_mpitp(argv: list[str]) -> None:
    no_cache = False
    while argv and argv[0] != "--":
        if argv[0] == "--no-cache":
            no_cache = True
        argv = argv[1:]
    argv = argv[1:]
    policy, imports = _policy("gcpolicy"), _policy("importpolicy")
    if policy is not None:
        policy.start_up()
    if imports is not None:
        imports.start_up()
    import lm_eval  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    import lm_eval.models.huggingface  # noqa: F401
    import lm_eval.tasks  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401 - 1.7-2.2 s; both modes need it to load a model
    from mpi4py import MPI

    import mpitp.cli
    import mpitp.evaluation.finish
    import mpitp.evaluation.lm

    if no_cache:
        _patch_no_cache()
    _time_generate(mpitp.evaluation.lm.MPITPLM)  # outermost: includes mpitp's TP mirroring of every decode step
    captured: dict = {}
    finish = mpitp.evaluation.finish.finish_root

    def finish_root(state, all_stats, wall, *args, **kwargs):
        captured["stats"] = [dataclasses.asdict(s) for s in all_stats]  # mpitp.replica.stats.GroupStats
        captured["mpitp_wall_s"] = wall
        return finish(state, all_stats, wall, *args, **kwargs)

    mpitp.evaluation.finish.finish_root = finish_root
    base = _maxrss_kb()
    c0, t0 = _cpu_s(), time.perf_counter()
    mpitp.cli.main(argv)
    dt, dc = time.perf_counter() - t0, _cpu_s() - c0
    _emit(dict(rank=MPI.COMM_WORLD.Get_rank(), time_s=dt, cpu_s=dc, base_rss_kb=base, **captured))
    if policy is not None:
        policy.leaving()


def _policy(name: str):
    """``mpitp.<name>`` (``gcpolicy``, ``importpolicy``) where the tree under test has it: the process as the
    ``mpitp`` console script sets it up (``main(argv)`` leaves a caller's process alone), so launch to exit is a
    user's; None for an older tree."""
    import importlib

    import mpitp

    try:
        policy = importlib.import_module(f"mpitp.{name}")
    except ImportError:
        return None
    # an editable install's finder serves a module the tree under test lacks from the installed checkout: not it
    return policy if os.path.dirname(policy.__file__) == os.path.dirname(mpitp.__file__) else None


def run_lmeval(spec: dict) -> None:
    import lm_eval
    import lm_eval.evaluator  # noqa: F401
    import lm_eval.models.huggingface  # noqa: F401
    import torch
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401 - as in run_mpitp
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(int(spec.get("threads", 1)))
    if spec.get("no_cache"):
        _patch_no_cache()
    _time_generate(lm_eval.models.huggingface.HFLM)
    rank = int(os.environ.get("RANK", "0"))
    base = _maxrss_kb()
    c0, t0 = _cpu_s(), time.perf_counter()
    tm = TaskManager(include_path=spec["include_path"], include_defaults=False, verbosity="ERROR")
    res = lm_eval.simple_evaluate(model="hf", model_args=spec["model_args"], tasks=spec["tasks"],
                                  batch_size=spec["batch_size"], limit=spec["limit"], gen_kwargs=spec["gen_kwargs"],
                                  task_manager=tm, log_samples=spec.get("log_samples", False))
    dt, dc = time.perf_counter() - t0, _cpu_s() - c0
    out = dict(rank=rank, time_s=dt, cpu_s=dc, base_rss_kb=base)
    if res:
        out["results"] = res.get("results")
        if spec.get("samples_out"):  # every request's response, for request-by-request parity (gpu_drill.py)
            with open(spec["samples_out"], "w") as f:
                json.dump({task: [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in rows]
                           for task, rows in res.get("samples", {}).items()}, f, default=str)
        if spec.get("log_samples"):
            gens = []
            for samples in res.get("samples", {}).values():
                for s in samples:
                    for r in s.get("resps", []):
                        if r and isinstance(r[0], str):
                            gens.append(r[0])
            out["generations"] = gens
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    _emit(out)


def main() -> None:
    mode = sys.argv[1]
    if mode == "mpitp":
        run_mpitp(sys.argv[2:])
    elif mode == "lmeval":
        run_lmeval(json.loads(sys.argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
