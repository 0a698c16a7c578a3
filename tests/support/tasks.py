"""Turn the hand-written task templates in ``tests/tasks/`` into YAMLs lm-eval can read from anywhere.

The templates cannot be passed to lm-eval as they are, for two reasons found with lm-eval 0.4.13 / datasets 5.x:

- ``datasets`` resolves relative ``data_files`` against the current directory, not the YAML's, so
  ``../../../shared/data/...`` would only work from one cwd.
- ``include`` is resolved against the including YAML's directory, and the stock YAML lives inside whatever
  environment lm-eval is installed in, so its path cannot be written down in the repository.

So in a template ``include`` is relative to the installed ``lm_eval/tasks`` directory and ``data_files`` are relative to
the template; :func:`materialize_test_tasks` writes copies with both made absolute.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from . import REPO

TEMPLATES = REPO / "tests" / "tasks"
LOCAL_TASKS = (
    "arc_easy_local",
    "hellaswag_local",
    "piqa_local",
    "lambada_openai_local",
    "wikitext_local",
    "gsm8k_local",
    "gsm8k_zeroshot_local",
)


def stock_tasks_dir() -> Path:
    """The installed ``lm_eval/tasks`` directory."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def materialize_test_tasks(tmp_dir: str | Path) -> str:
    """Write every ``tests/tasks/*.yaml`` template into ``tmp_dir`` with absolute paths; return ``tmp_dir``.

    Pass the result as lm-eval's include path: ``TaskManager(include_path=materialize_test_tasks(tmp))``.
    Raises FileNotFoundError naming the first missing stock YAML or data file (e.g. no ``../shared``).
    """
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    stock_dir = stock_tasks_dir()
    for template in sorted(TEMPLATES.glob("*.yaml")):
        cfg = yaml.safe_load(template.read_text())
        include = stock_dir / cfg["include"]
        if not include.is_file():
            raise FileNotFoundError(f"{template.name}: stock task YAML {include} not found")
        cfg["include"] = str(include)
        files = cfg["dataset_kwargs"]["data_files"]
        for split, rel in files.items():
            path = (template.parent / rel).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"{template.name}: data file {path} not found")
            files[split] = str(path)
        (out / template.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(out)
