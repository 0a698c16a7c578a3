"""``--batch_size auto``: a batch size per request-length bucket, from a memory budget the whole replica agrees on.

lm-eval's ``auto`` runs trial forwards until one does not run out of CUDA memory, on the longest request of the first
task it meets, and keeps that size (``auto:N`` re-detects N times): short tasks after a long one stay at the long one's
size (lm-eval #3654), on CPU there is no OOM to find a limit by, and a trial forward on one rank of a TP group would
desynchronise the group's collectives. Here instead:

- every rank of a replica (all its TP ranks and pipeline stages) measures the memory it may use (free device memory,
  or its share of the node's available RAM on CPU) and the replica takes the minimum (:func:`agreed_budget`, one
  MPI all-reduce before the roles split), so the leader's choice fits every rank and workers just follow its batches;
- rows are batched longest first, each batch as large as its longest row allows by an estimate of a forward's
  transient memory per row at that length (:func:`row_bytes`: hidden states, the TP shard of the
  attention and MLP activations, attention scores, and for generation the KV-cache shard), capped by
  ``max_batch_size``;
- so each task, and each length range within a task, gets its own size; ``auto:N`` is accepted and means the same.

An out-of-memory error in a batch anyway is the replica leader's retry path (a smaller batch for the whole group).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI
    from transformers import PreTrainedConfig

log = logging.getLogger("mpitp")

DEFAULT_MAX_BATCH_SIZE = 64  # lm-eval's HFLM default
SAFETY = 2.0  # estimate x SAFETY must fit: allocator slack, temporaries the estimate leaves out
CPU_SHARE = 0.5  # of a rank's share of the node's available memory (the page cache and peers need the rest)
GPU_SHARE = 0.85  # of the free device memory after loading
SIZE_STEP = 64  # sizes are computed for row lengths rounded up to this many tokens (one size per step)


def is_auto(batch_size: int | str) -> bool:
    return str(batch_size).startswith("auto")


def local_budget(device: str, local_size: int) -> int:
    """Bytes this rank may spend on activations now (the model is loaded)."""
    if str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * GPU_SHARE)
    return int(_mem_available() / max(1, local_size) * CPU_SHARE)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def agreed_budget(comm: MPI.Comm, device: str, local_size: int) -> int:
    """The smallest budget over ``comm`` (a replica's ranks): collective, every rank of ``comm`` calls it."""
    from mpi4py import MPI

    return int(comm.allreduce(local_budget(device, local_size), op=MPI.MIN))


def row_bytes(config: PreTrainedConfig, tp: int, pp: int, dtype_bytes: int, tokens: int, new_tokens: int = 0) -> int:
    """Transient memory of one row of ``tokens`` tokens in a forward on one rank (plus its KV cache shard when
    generating ``new_tokens``): the estimate the batch size is cut from."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    layers = int(getattr(text, "num_hidden_layers", 1) or 1)
    head_dim = int(getattr(text, "head_dim", 0) or hidden // max(1, heads))
    n = tokens + new_tokens
    per_token = (4 * hidden + 3 * heads * head_dim // tp + 3 * inter // tp) * dtype_bytes
    scores = heads // tp * n * 4  # attention scores of one layer, float32 (eager / math kernels materialise them)
    kv = 2 * (-(-layers // pp)) * (kv_heads // tp) * head_dim * dtype_bytes if new_tokens else 0
    return n * (per_token + scores + kv)


class AutoBatch:
    """Batch sizes per length bucket for one model replica; built on a DP leader from its replica's agreed budget."""

    def __init__(self, budget: int, config: PreTrainedConfig, tp: int, pp: int, dtype_bytes: int,
                 max_batch_size: int | None = None):
        self.budget, self.config, self.tp, self.pp, self.dtype_bytes = budget, config, tp, pp, dtype_bytes
        self.max_batch_size = max_batch_size or DEFAULT_MAX_BATCH_SIZE
        self.chosen: dict[tuple[int, int], int] = {}

    def size(self, tokens: int, new_tokens: int = 0) -> int:
        """Rows for a batch whose longest row has ``tokens`` tokens (rounded up to a multiple of 64)."""
        key = (-(-int(tokens) // SIZE_STEP) * SIZE_STEP, new_tokens)
        if key not in self.chosen:
            need = row_bytes(self.config, self.tp, self.pp, self.dtype_bytes, key[0], new_tokens) * SAFETY
            self.chosen[key] = max(1, min(self.max_batch_size, int(self.budget // max(1.0, need))))
            log.debug("batch size auto: %d rows for %d-token rows (+%d new)", self.chosen[key], key[0], new_tokens)
        return self.chosen[key]

    def groups(self, lengths: list[int]) -> list[tuple[int, list[int]]]:
        """Batches ``(batch size, indices)``, longest rows first, each as large as its longest (first) row allows:
        as few forwards as the memory budget permits, and padding as in fixed-size batching (rows sorted by length)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out, start = [], 0
        while start < len(order):
            size = self.size(lengths[order[start]])
            out.append((size, order[start : start + size]))
            start += size
        return out
