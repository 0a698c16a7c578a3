"""Made-up data directories in the generic ``--data-dir`` layout (:mod:`mpitp.tasks.layout`), rows in the schema of
the Hub datasets the stock task YAMLs read (field names from those YAMLs and their ``utils.py``)."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arc_rows(n: int, tag: str) -> list[dict]:
    return [{"id": f"{tag}-{i}", "question": f"Which {tag} thing number {i} is right?",
             "choices": {"text": [f"option {c} of {i}" for c in "abcd"], "label": list("ABCD")},
             "answerKey": "ABCD"[i % 4]} for i in range(n)]


def boolq_rows(n: int) -> list[dict]:
    return [{"question": f"is the sky blue on day {i}", "passage": f"On day {i} the sky was clear and bright.",
             "idx": i, "label": i % 2} for i in range(n)]


def copa_rows(n: int) -> list[dict]:
    return [{"premise": f"The man dropped glass {i}.", "choice1": "It broke.", "choice2": "It sang.",
             "question": ("cause", "effect")[i % 2], "idx": i, "label": i % 2} for i in range(n)]


def mmlu_rows(subject: str, n: int, offset: int = 0) -> list[dict]:
    return [{"question": f"In {subject.replace('_', ' ')}, what is {i + offset} plus one?",
             "subject": subject, "choices": [str(i + offset + d) for d in range(4)], "answer": (i + offset) % 4}
            for i in range(n)]


def small_tasks_dir(root: Path) -> Path:
    """ARC-Challenge (test), BoolQ (train + validation) and COPA (validation) under ``root``."""
    write_jsonl(root / "allenai/ai2_arc/ARC-Challenge/test.jsonl", arc_rows(5, "challenge"))
    write_jsonl(root / "aps/super_glue/boolq/train.jsonl", boolq_rows(3))
    write_jsonl(root / "aps/super_glue/boolq/validation.jsonl", boolq_rows(4))
    write_jsonl(root / "aps/super_glue/copa/validation.jsonl", copa_rows(4))
    return root


def mmlu_subjects() -> list[str]:
    """The ``dataset_name`` of every subtask of the installed lm-eval's ``mmlu`` group (57 in 0.4.13)."""
    from mpitp.tasks.index import merged_index
    from mpitp.tasks.layout import expand

    return sorted(leaf.dataset_name for leaf in expand(["mmlu"], merged_index()))


def mmlu_dir(root: Path, rows: int = 2, fmt: str = "jsonl") -> Path:
    """An MMLU-shaped DATA: every subject with ``rows`` test rows and 1 dev row, as jsonl or parquet."""
    for subject in mmlu_subjects():
        folder = root / "cais/mmlu" / subject
        for split, data in (("test", mmlu_rows(subject, rows)), ("dev", mmlu_rows(subject, 1, offset=100))):
            if fmt == "jsonl":
                write_jsonl(folder / f"{split}.jsonl", data)
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq

                folder.mkdir(parents=True, exist_ok=True)
                pq.write_table(pa.Table.from_pylist(data), folder / f"{split}.parquet")
    return root
