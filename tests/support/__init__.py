"""Helpers shared by the tests (``from support.mpi import run_mpi``; tests/ is on ``sys.path`` under pytest).

- :mod:`support.mpi`: real ``mpiexec`` launches, the MPI the suite runs under, and the ``mpi`` marker's guard.
- :mod:`support.launch`: a launch watched line by line (fault drills), results-file polling, ``inspect diff``.
- :mod:`support.parity`: request-by-request comparison with single-process lm-eval.
- :mod:`support.tasks`: the offline ``*_local`` tasks materialised on ``../shared/data``.
- :mod:`support.arch`: the architecture matrix (random tiny models per transformers architecture).
- :mod:`support.dropin`, :mod:`support.dropin_corpus`: lm-eval command lines run both ways, outputs compared.

Importing this package puts the suite into offline mode (no network but package registries).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
os.environ.update(OFFLINE_ENV)


def tiny_llama(seed: int = 0):
    """A two-layer random Llama (hidden 32, 4 query and 2 KV heads, vocabulary 97, pad id 0) in eval mode, for
    one-process tests of generation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, and put back after it (tests share one process)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
