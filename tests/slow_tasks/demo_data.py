"""The demo tasks' loader for the test tasks in this folder: lm-eval imports a ``!function`` module from the YAML's
own folder, so this names the package's loader (which reads the demo's JSONL files beside it)."""

from mpitp.tasks.demo.tasks.demo_data import load_jsonl  # noqa: F401
