"""Built-in offline demo for ``mpitp eval --demo``.

Everything here works without network access: a tiny random-weight Llama
model is built locally (:func:`build_demo_model`) and three small lm-eval tasks
ship with the package (``mpitp/tasks/demo/tasks``):

* ``mpitp_demo_mc``  - multiple_choice, metrics ``acc`` / ``acc_norm``
* ``mpitp_demo_ppl`` - loglikelihood_rolling, metrics ``word_perplexity`` /
  ``byte_perplexity`` / ``bits_per_byte``
* ``mpitp_demo_gen`` - generate_until, metric ``exact_match`` (filter
  ``remove_whitespace``)

All three carry the tag ``mpitp_demo``.  The task YAMLs load their JSONL data
through ``custom_dataset`` (``tasks/demo_data.py``), which resolves the file
relative to the YAML, so :func:`demo_tasks_dir` can be passed directly as an
lm-eval ``include_path`` from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from mpitp.tasks.demo.model import DEMO_VOCAB_SIZE, build_demo_model, is_complete, recipe_hash

DEMO_TASKS = ["mpitp_demo_mc", "mpitp_demo_ppl", "mpitp_demo_gen"]
DEMO_TAG = "mpitp_demo"
DEMO_MODEL_SUBDIR = "mpitp-demo-llama"

__all__ = [
    "DEMO_MODEL_SUBDIR",
    "DEMO_TAG",
    "DEMO_TASKS",
    "DEMO_VOCAB_SIZE",
    "build_demo_model",
    "default_cache_dir",
    "demo_tasks_dir",
    "is_complete",
    "prepare_demo",
    "recipe_hash",
]


def demo_tasks_dir() -> str:
    """Absolute path of the directory holding the demo task YAMLs (an lm-eval include_path)."""
    return str(Path(__file__).resolve().parent / "tasks")


def default_cache_dir() -> str:
    """``$MPITP_CACHE`` or ``$XDG_CACHE_HOME/mpitp`` (default ``~/.cache/mpitp``)."""
    env = os.environ.get("MPITP_CACHE")
    if env:
        return str(Path(env).expanduser())
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base).expanduser() / "mpitp")


def cache_folder(variable: str, name: str) -> Path | None:
    """One of mpitp's caches: the folder ``$VARIABLE`` names, None when it says ``0``/``off``/``false`` (the cache is
    off), else ``<default_cache_dir()>/name``."""
    v = os.environ.get(variable, "")
    if v in ("0", "off", "false", "False"):
        return None
    return Path(v).expanduser() if v else Path(default_cache_dir()) / name


def prepare_demo(
    cache_dir: str | os.PathLike | None = None, seed: int = 0
) -> tuple[str, str, list[str]]:
    """Build (or reuse) the demo model under ``cache_dir``.

    Returns ``(model_dir, include_path, tasks)``: the model directory to use as
    ``pretrained=``, the lm-eval include path with the demo tasks, and the list
    of demo task names.
    """
    root = Path(cache_dir) if cache_dir is not None else Path(default_cache_dir())
    model_dir = build_demo_model(root / DEMO_MODEL_SUBDIR, seed=seed)
    return model_dir, demo_tasks_dir(), list(DEMO_TASKS)
