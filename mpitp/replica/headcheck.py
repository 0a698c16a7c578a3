"""The head check: before any request is scored, the vocab-parallel head must give the model's own log-probs.

:mod:`mpitp.replica.logits` reads what each model class does around its LM head from its forward; a class that does
something new there (or a head altered after loading) would otherwise give wrong numbers with exit status 0. So
right after loading every replica scores a small fixed probe both ways, the vocab-parallel path and the model's own
``forward(...).logits``, and the run is refused (exit 2, one line) when they differ beyond the parity tolerance.

Without stages, every rank of a replica runs both forwards of the probe (transformers' TP collectives need all of
them; the model's logits arrive gathered). With pipeline stages the model's forward cannot run whole anywhere, so the
probe goes through the stages as a scoring batch would, and the last stage compares its head path against its own
``forward(inputs_embeds=<activations it received>).logits``: the class's forward over the stage's layers, final
norm, head and logit steps, which is exactly what the vocab-parallel path replaces.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from mpitp import testing
from mpitp.errors import UsageError
from mpitp.parallel import comm as mpicomm

if TYPE_CHECKING:
    from mpi4py import MPI

log = logging.getLogger("mpitp")

PROBE_SHAPE = (2, 12)
PARITY_REL = 1e-5  # the project's parity rule in float32


def probe_ids(vocab: int, device: str | torch.device) -> torch.Tensor:
    """The same probe on every rank, without a message: a fixed generator."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, PROBE_SHAPE, generator=g).to(device)


def tolerance(ref_lp: torch.Tensor, ref_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Allowed |d log p| per entry: the parity rule ``1e-5 * max(1, |log p|)``, plus what two correct float
    computations of the same log-softmax may differ by.

    - The logits: in bf16/fp16 the model rounds its logits to the dtype after every step it takes past the head
      (Cohere's scale, Granite's division) while the vocab-parallel path takes those steps in float32, so each logit
      may differ by half an ulp of the dtype, ``eps / 2 * |logit|``, and a log-softmax entry by twice the largest of
      those in its row. We allow twice that, ``2 * eps(dtype) * max(1, max |logit| of the row)``.
    - The normaliser: both sides sum the row's V exponentials in float32, in different orders (shards, blocks,
      threads), so its log differs by about ``sqrt(V)`` float32 ulps (a random walk of rounding errors). We allow
      ``2 * sqrt(V) * eps(float32)``: 5.3e-5 for GPT-2's 50,257 entries, 2.4e-6 for a vocabulary of 100. Found on
      the registry-wide matrix at one thread per rank: entries near ``log p = -0.43`` off by 1.5-2.1e-5 with the
      logits bit-identical (1.06-1.47x the parity rule alone).

    A head that is really different (a step missed) is off by orders of magnitude more (ModernBERT's decoder before
    its prediction head was read as a step: 10.2).
    """
    tol = PARITY_REL * ref_lp.abs().clamp(min=1.0)
    eps = torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else torch.finfo(torch.float32).eps
    row = ref_logits.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
    normaliser = 2 * ref_lp.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps
    return tol + 2 * eps * row + normaliser


def hidden_mismatch(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    """How far two computations of the same hidden states are apart when that is more than rounding ("by up to d
    (of m)", m their largest magnitude), else None. For the start-up probes that compare one model's layers computed
    two ways (prefix sharing's trees, pipeline chunks): 8 units of the dtype's rounding (float32: of the parity rule)
    relative to the largest entry; a way that really differs (a position restarted, a key not attended) is off by
    order one."""
    got, ref = got.float(), ref.float()
    d, scale = float((got - ref).abs().max()), max(1.0, float(ref.abs().max()))
    eps = torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else PARITY_REL
    return None if d <= 8 * eps * scale else f"by up to {d:.3g} (of {scale:.3g})"  # NaN is a mismatch too


def _compare(head, h: torch.Tensor, ref_logits: torch.Tensor, dtype) -> tuple[float, float, str]:
    """(largest |d log p|, largest |d| / tolerance) between the head path and the model's logits, over this rank's
    columns of the log-softmax rows (every TP rank checks its own: the verdict takes the worst rank; nothing is
    gathered) and the scoring reductions (:meth:`VocabParallelHead.score`)."""
    ref_logits = ref_logits.float().reshape(-1, ref_logits.shape[-1])[:, : head.vocab_size]
    ref_lp = torch.log_softmax(ref_logits, dim=-1)
    ours = head.local_log_softmax(h)
    g = torch.Generator().manual_seed(4321)
    targets = torch.randint(0, head.vocab_size, (h.shape[0],), generator=g).to(h.device)
    lp, _ = head.score(h, targets)
    tol = tolerance(ref_lp, ref_logits, dtype)
    cols = slice(head.offset, head.offset + ours.shape[1])
    d_rows = (ours - ref_lp[:, cols]).abs()
    ref_t = ref_lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    d_score = (lp - ref_t).abs()
    tol_t = tol.gather(1, targets.unsqueeze(1)).squeeze(1)
    tol = torch.where(torch.isfinite(tol), tol, 1.0)[:, cols]
    tol_t = torch.where(torch.isfinite(tol_t), tol_t, 1.0)
    # Where the model's own logits are NaN/inf (a float16 overflow) nothing can be compared: the head path must be
    # non-finite there too, and the scoring's own NaN check names the request that meets it.
    d_rows = torch.where(torch.isfinite(ref_lp[:, cols]), d_rows, torch.where(torch.isfinite(ours), float("inf"), 0.0))
    d_score = torch.where(torch.isfinite(ref_t), d_score, torch.where(torch.isfinite(lp), float("inf"), 0.0))
    worst = max(float(d_rows.max()), float(d_score.max()))
    ratio = max(float((d_rows / tol).max()), float((d_score / tol_t).max()))
    return worst, ratio, head.transform.describe()


@torch.no_grad()
def _local_check(shard) -> tuple[float, float, str] | None:
    """This rank's (worst |d|, worst |d| / tolerance, head steps), or None where this rank compares nothing."""
    model, lay, head = shard.model, shard.layout, shard.head
    text = model.config.get_text_config()
    vocab = int(head.vocab_size if head is not None else text.vocab_size)
    ids = probe_ids(min(vocab, int(text.vocab_size)), shard.device)
    dtype = next(model.parameters()).dtype
    if not shard.pipeline:
        ref = model(input_ids=ids, use_cache=False).logits
        h = shard.base(input_ids=ids, use_cache=False).last_hidden_state
        return _compare(head, h.reshape(-1, h.shape[-1]), ref, dtype)
    link, base = shard.link, shard.base
    if lay.first_stage:
        x = None
        h = base(input_ids=ids, use_cache=False).last_hidden_state
    else:
        x = link.recv_activation(shard.device)
        h = base(inputs_embeds=x, use_cache=False).last_hidden_state
    if not lay.last_stage:
        link.send_activation(h)
        link.flush()
        return None
    ref = model(inputs_embeds=x, use_cache=False).logits
    return _compare(head, h.reshape(-1, h.shape[-1]), ref, dtype)


def check_head(shard, world_comm: MPI.Comm, timeout: float, skip: bool = False,
               passed: float | None = None) -> float | None:
    """Run the probe on every replica and refuse the run when any head path differs. Collective over the world.

    Returns the seconds it took (the extra forwards), or None when skipped. ``passed``: the seconds of a check this
    very model's head already passed, with none of the head's parameters changed since (an adapter sweep): returned
    without probing again (every rank passes the same).
    """
    model_type = getattr(shard.model.config, "model_type", type(shard.model).__name__)
    testing.alter_head(shard.head)
    if skip:
        if world_comm.Get_rank() == 0:
            log.warning("--skip-head-check: the vocab-parallel head is not compared with %s's own logits; a logit "
                        "step mpitp does not apply would give wrong log-likelihoods without an error", model_type)
        return None
    if passed is not None:
        return passed
    t0 = time.perf_counter()
    with shard.stats.uncounted():
        local = _local_check(shard)
    parts = mpicomm.gather_obj(local, world_comm, root=0, timeout=timeout, phase="head check")
    verdict = None
    if parts is not None:
        done = [p for p in parts if p is not None]
        verdict = max(done, key=lambda p: p[1] if p[1] == p[1] else float("inf"))
    worst_d, ratio, steps = mpicomm.bcast_obj(verdict, world_comm, root=0, timeout=timeout, phase="head check")
    if not ratio <= 1.0:  # NaN fails too
        raise UsageError(f"head check failed for model type '{model_type}': the vocab-parallel head differs from "
                         f"the model's own logits by up to {worst_d:.3g} in log-probability ({ratio:.3g}x the "
                         f"tolerance; head steps applied: {steps}); refusing to produce wrong numbers "
                         f"(--skip-head-check runs anyway)", collective=True)
    return time.perf_counter() - t0

