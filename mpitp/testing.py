"""The one seam through which production code reaches test-only behaviour (``MPITP_TEST_*`` environment variables).

The test suite and the fault drills launch real ``mpiexec`` jobs and steer them from outside through these variables:
a stall at a named point, random chunk sizes, a simulated out-of-memory error, an exception on a worker or inside a
forward, an altered LM head. Production code calls the functions below at those points; each is a cheap no-op when
its variable is unset. The environment is read once per process (:func:`hooks`).

===============================================  ==================================================================
``MPITP_TEST_STALL=<where>:<seconds>``           :func:`stall` sleeps at ``where`` (``between_chunks``,
                                                 ``post_processing``, ``metrics``; on every rank ``before_load``,
                                                 ``before_finalize``, ``before_finalize_rank<N>``): drills' instants
``MPITP_TEST_CHUNK_SEED=<seed>``                 :func:`chunks_per_group`: random chunk sizes (stress tests)
``MPITP_TEST_OOM_ABOVE=<rows>``                  :func:`check_oom`: a batch of more rows fails as out of memory
``MPITP_TEST_RAISE=<rank>:<forwards>``           :func:`check_raise`: that TP worker raises at a message boundary
``MPITP_TEST_RAISE_IN_FORWARD=<rank>:<n>[:oom]`` :func:`install_forward_fault`: that rank raises *inside* a forward
``MPITP_TEST_ALTER_HEAD=<factor>|nan``           :func:`alter_head`: the head's weights scaled after loading
``MPITP_TEST_IO_REPORT=1``                       :func:`report_io`: each rank prints its ``/proc/self/io`` counters
                                                 when the model is loaded (bench/README: bytes read per node)
``MPITP_TEST_FINALIZE_WAIT=<seconds>``           the bound on ``MPI_Finalize`` (``errors.FINALIZE_WAIT_S``)
``MPITP_TEST_FORWARD_LOG=<path>``                :func:`log_forward`, :func:`install_generate_log`: each DP leader
                                                 appends one JSON line per forward of its replica (the shape it
                                                 fed) to ``path``: bench/bench_forward_limit.py replays them
``MPITP_TEST_STAGE_CHUNK=<positions>``           :func:`stage_chunk`: pipeline stages cut few-row batches into
                                                 chunks of at least that many positions (0: never), so that short
                                                 test rows take the path long ones take
===============================================  ==================================================================

The hooks are live only when ``MPITP_TESTING=1`` is set too (the test suite sets it in ``tests/conftest.py``):
production never sets it, so an environment that happens to carry an ``MPITP_TEST_*`` variable (a copied job
script, a shared module file) cannot alter a run; such variables are then ignored with one warning line. A run with
hooks live records them in its results file (root attribute ``test_hooks``, shown by ``mpitp inspect``). A malformed
value is a usage error (one line, exit status 2), not a traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import torch
    from transformers import PreTrainedModel

log = logging.getLogger("mpitp")


@dataclass(frozen=True)
class Hooks:
    """The test hooks this process was started with (None: off)."""

    stall: tuple[str, float] | None = None
    chunk_seed: str | None = None
    oom_above: int | None = None
    raise_at: tuple[int, int] | None = None
    raise_in_forward: tuple[int, int, bool] | None = None
    alter_head: float | None = None
    io_report: bool = False
    finalize_wait: float | None = None
    forward_log: str | None = None
    stage_chunk: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Hooks:
        """The hooks ``env`` sets, when it opts in with ``MPITP_TESTING=1``; else none (a warning names what was
        ignored). A value that does not parse is a :class:`~mpitp.errors.UsageError` naming the variable."""
        env = os.environ if env is None else env
        given = [k for k in HOOK_VARS if env.get(k)]
        if not given:
            return cls()
        if env.get("MPITP_TESTING") != "1":
            log.warning("ignoring %s: test hooks are live only with MPITP_TESTING=1", ", ".join(given))
            return cls()
        try:
            return cls._parse(env)
        except (ValueError, IndexError):
            from mpitp.errors import UsageError

            shown = "; ".join(f"{k}={env[k]!r}" for k in given)
            raise UsageError(f"malformed test hook ({shown}): see mpitp/testing.py for the forms",
                             collective=True) from None  # every rank reads the same environment at the same point

    @classmethod
    def _parse(cls, env) -> Hooks:
        stall = env.get("MPITP_TEST_STALL")
        raise_at = env.get("MPITP_TEST_RAISE")
        in_forward = env.get("MPITP_TEST_RAISE_IN_FORWARD")
        oom = env.get("MPITP_TEST_OOM_ABOVE")
        alter = env.get("MPITP_TEST_ALTER_HEAD")  # "nan" makes every logit NaN (an fp16 overflow)
        forward = None
        if in_forward:
            parts = in_forward.split(":")
            forward = (int(parts[0]), int(parts[1]), parts[2:] == ["oom"])
        where, _, seconds = (stall or "").partition(":")
        if raise_at and len(raise_at.split(":")) != 2:
            raise ValueError(raise_at)
        return cls(stall=(where, float(seconds)) if stall else None,
                   chunk_seed=env.get("MPITP_TEST_CHUNK_SEED") or None,
                   oom_above=int(oom) if oom else None,
                   raise_at=tuple(int(x) for x in raise_at.split(":")) if raise_at else None,
                   raise_in_forward=forward,
                   alter_head=float(alter) if alter else None,
                   io_report=env.get("MPITP_TEST_IO_REPORT", "") not in ("", "0"),
                   finalize_wait=float(env["MPITP_TEST_FINALIZE_WAIT"]) if env.get("MPITP_TEST_FINALIZE_WAIT")
                   else None,
                   forward_log=env.get("MPITP_TEST_FORWARD_LOG") or None,
                   stage_chunk=int(env["MPITP_TEST_STAGE_CHUNK"]) if env.get("MPITP_TEST_STAGE_CHUNK") else None)


HOOK_VARS = ("MPITP_TEST_STALL", "MPITP_TEST_CHUNK_SEED", "MPITP_TEST_OOM_ABOVE", "MPITP_TEST_RAISE",
             "MPITP_TEST_RAISE_IN_FORWARD", "MPITP_TEST_ALTER_HEAD", "MPITP_TEST_IO_REPORT",
             "MPITP_TEST_FINALIZE_WAIT", "MPITP_TEST_FORWARD_LOG", "MPITP_TEST_STAGE_CHUNK")


def active() -> list[str]:
    """``NAME=value`` of each hook live in this process (what a results file records as ``test_hooks``)."""
    if hooks() == Hooks():
        return []
    return [f"{k}={os.environ[k]}" for k in HOOK_VARS if os.environ.get(k)]


@functools.cache
def hooks() -> Hooks:
    """This process's hooks, read from the environment on first use (``hooks.cache_clear()`` reads it again)."""
    return Hooks.from_env()


def stage_chunk() -> int | None:
    """The least positions of a pipeline chunk the tests ask for (:mod:`mpitp.replica.stage_chunks`; 0: no chunks),
    or None: mpitp's own."""
    return hooks().stage_chunk


def stall(where: str) -> None:
    """Sleep on this rank at ``where`` when ``MPITP_TEST_STALL`` names it (rank 0's points: fault drills)."""
    spec = hooks().stall
    if spec is not None and spec[0] == where:
        log.warning("test hook: stalling %g s at %s", spec[1], where)
        time.sleep(spec[1])


def chunks_per_group(kind: str, n_items: int, default: int) -> int:
    """The dispatcher's chunks per DP group: random per run kind and size under ``MPITP_TEST_CHUNK_SEED``."""
    seed = hooks().chunk_seed
    if seed is None:
        return default
    import random

    return random.Random(f"{seed}:{kind}:{n_items}").randint(1, 16)


def check_oom(rows: int) -> None:
    """Fail a batch of more than ``MPITP_TEST_OOM_ABOVE`` rows as out of memory (the leader's retry path)."""
    limit = hooks().oom_above
    if limit is not None and rows > limit:
        import torch

        raise torch.OutOfMemoryError(f"test hook: simulated out of memory for {rows} rows")


def check_raise(rank: int, forwards: int) -> None:
    """Raise on the TP worker of global rank ``rank`` once it has run the forwards ``MPITP_TEST_RAISE`` names."""
    spec = hooks().raise_at
    if spec is not None and rank == spec[0] and forwards >= spec[1]:
        raise RuntimeError(f"test hook: injected failure on rank {rank} after {forwards} forwards")


def install_forward_fault(layers: torch.nn.ModuleList | None, rank: int, forwards: Callable[[], int]) -> None:
    """Under ``MPITP_TEST_RAISE_IN_FORWARD=<rank>:<n>[:oom]`` raise inside the forward of that rank's last decoder
    layer once it has run ``n`` forwards (``forwards()`` counts them): its TP peers are then inside a torch collective
    of the same forward (or, with stages, waiting for its activations), not at a message boundary."""
    spec = hooks().raise_in_forward
    if spec is None or spec[0] != rank or not layers:
        return
    after, oom = spec[1], spec[2]

    def hook(module: torch.nn.Module, args: tuple) -> None:
        done = forwards()
        if done > after:
            where = f"inside a forward on rank {rank} after {done - 1} forwards"
            if oom:
                import torch

                raise torch.OutOfMemoryError(f"test hook: simulated out of memory {where}")
            raise RuntimeError(f"test hook: injected failure {where}")

    layers[-1].register_forward_pre_hook(hook)


def alter_head(head) -> None:
    """Scale the vocab-parallel head's weight shard by ``MPITP_TEST_ALTER_HEAD``, as a model class with a logit step
    mpitp does not know would (a Cohere ``logit_scale`` that is not applied); ``nan`` makes every logit NaN."""
    factor = hooks().alter_head
    if factor is not None and head is not None:
        head.weight = head.weight * factor


def report_io(phase: str, world) -> None:
    """Under ``MPITP_TEST_IO_REPORT`` print this rank's I/O counters (``rchar``: bytes through read()/pread(), page
    cache hits included, memory-mapped reads not; ``read_bytes``: bytes this process had fetched from storage) as one
    ``io:`` line on stderr, whatever the log level: what bench/README's per-node table sums."""
    if not hooks().io_report:
        return
    import sys

    import transformers.modeling_utils  # noqa: F401 - ~120 MB of rchar: imported first, so the counts are the model's

    try:
        with open("/proc/self/io") as f:
            counters = dict(line.split(": ") for line in f.read().split("\n") if ": " in line)
    except OSError:
        counters = {}
    fields = " ".join(f"{k}={counters.get(k, '?').strip()}" for k in ("rchar", "read_bytes"))
    # One write, newline included (print writes the newline separately, and the launcher interleaves the ranks'
    # writes: another rank's line could land between the two).
    sys.stderr.write(f"io: {phase}: rank={world.rank} node={world.node_name} local_rank={world.local_rank} {fields}\n")
    sys.stderr.flush()


def log_forward(layout, kind: str, **shape: int) -> None:
    """Under ``MPITP_TEST_FORWARD_LOG`` append ``{"kind": kind, "dp": <DP rank>, **shape}`` as one JSON line, on a
    DP leader only (its workers run the same forward): the shapes a replica really fed, so that a benchmark can time
    the same forwards alone and say how far mpitp's busy time is from pure compute. One ``write`` per line on an
    ``O_APPEND`` descriptor, so the lines of several DP leaders sharing the file never interleave."""
    path = hooks().forward_log
    if path is None or not layout.is_leader:
        return
    line = json.dumps({"kind": kind, "dp": int(layout.dp_rank), **{k: int(v) for k, v in shape.items()}},
                      separators=(",", ":"))
    os.write(_log_fd(path), (line + "\n").encode())


#: The attribute set on a generate forward's output that did not run the whole batch as given: ``[(rows, length,
#: pad)]``, the forwards it ran instead (mpitp.replica.ragged_prefill: a prefill row by row; mpitp.replica.generation
#: with finished_rows: a decode step over the rows still generating).
RAGGED_ROWS = "mpitp_ragged_rows"


@functools.cache
def _log_fd(path: str) -> int:
    """The log's descriptor, opened once per process (a forward should not pay an ``open``)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)


def install_generate_log(model: PreTrainedModel, layout) -> None:
    """Under ``MPITP_TEST_FORWARD_LOG`` log every ``generate`` forward of the DP leader's ``model`` (the
    top-level module HF ``generate`` calls, whatever mpitp puts behind it: its own forward, the mirrored one, the
    stages' step) as a ``generate`` line: ``batch``, ``seq`` (input positions of this step: the prompt at prefill,
    1 per decode step), ``past`` (positions already in the KV cache) and ``tokens`` (``batch * seq``).

    Only forwards that carry a transformers ``Cache`` are generation steps: the head check calls the same module
    without one (``use_cache=False``). Generation without a KV cache is therefore not logged. A padded prefill that
    went row by row (:mod:`mpitp.replica.ragged_prefill`) is logged as the forwards of its rows, logged after it ran."""
    if hooks().forward_log is None or not layout.is_leader:
        return

    seen: list[tuple[int, int, int]] = []  # the forward under way: (batch, seq, past), taken before it runs

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        from transformers.cache_utils import Cache

        seen.clear()
        cache = next((v for v in kwargs.values() if isinstance(v, Cache)), None)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if cache is not None and ids is not None:
            seen.append((int(ids.shape[0]), int(ids.shape[1]), int(cache.get_seq_length())))

    def after(module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
        if not seen:
            return
        rows = getattr(output, RAGGED_ROWS, None)  # a padded prefill computed row by row: the rows' own forwards
        batch, seq, past = seen.pop()
        for b, s in ((n, length) for n, length, _ in rows) if rows else [(batch, seq)]:
            log_forward(layout, "generate", batch=b, seq=s, past=past, tokens=b * s)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
