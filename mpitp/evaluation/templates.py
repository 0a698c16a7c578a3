"""lm-eval's prompt templates compiled once per template string instead of once per document.

``lm_eval.utils.apply_template`` calls ``env.from_string(template)`` for every document it renders (``doc_to_text``,
``doc_to_target``, ``doc_to_choice`` of a task YAML), and jinja2 caches only templates from a loader, not from
strings: each call parses and compiles the template to Python bytecode again. On global rank 0 that is twice per
document while building requests and again while computing metrics (a multiple-choice task's ``process_results``
reads ``doc_to_target``); on full hellaswag most of the metrics phase was jinja2 compiling the same two templates
(bench/README.md). Rendering is unchanged: the same environment compiles the same string to the same template, which
is then rendered with the document exactly as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def compiled_once() -> Iterator[None]:
    """Inside this block ``lm_eval.utils.apply_template`` reuses each template string's compiled template."""
    import lm_eval.utils as lm_utils

    from mpitp import compat

    env = lm_utils.env
    compiled: dict = {}

    def apply_template(template: str, doc: dict) -> str:
        tpl = compiled.get(template)
        if tpl is None:
            tpl = compiled[template] = env.from_string(template)
        return tpl.render(**doc)

    with compat.replaced("lm_eval.utils.apply_template", apply_template):
        yield
