"""Dataset loader for the mpitp demo tasks.

lm-eval imports this module by file path (``custom_dataset: !function
demo_data.load_jsonl``) and calls the loader with the task's ``metadata`` and
``dataset_kwargs`` as keyword arguments.  The JSONL file is resolved relative to
this file, so the tasks work from any working directory and from an installed
wheel, and nothing is written to (or read from) the HF datasets cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

HERE = Path(__file__).resolve().parent


def read_jsonl(data_file: str) -> list[dict[str, Any]]:
    path = Path(data_file)
    if not path.is_absolute():
        path = HERE / path
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_jsonl(data_file: str, split: str = "test", **_ignored: Any) -> datasets.DatasetDict:
    """Return a ``datasets.DatasetDict`` with one split built in memory.

    Extra keyword arguments (task metadata such as ``version`` or the model
    arguments lm-eval forwards) are ignored.
    """
    import datasets

    rows = read_jsonl(data_file)
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
