"""Hide what lm-eval and transformers say about mpitp's own integration, not about the user's run.

mpitp hands lm-eval a model it already loaded and sharded, so lm-eval warns that ``pretrained`` is not a string and
that an initialised model was passed; these describe how mpitp calls lm-eval, and a user of ``lm_eval --model hf``
would never see them. Everything else (``--limit`` warnings, few-shot overrides, task messages) stays. With
``--verbosity DEBUG`` nothing is hidden.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

INTEGRATION_MESSAGES = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "Using pre-initialized model",
    "Model parallel was set to False, max memory was not set, and device map was set to",
)
"""Starts of messages that only describe mpitp's use of lm-eval (``lm_eval/models/huggingface.py``,
``lm_eval/evaluator.py``)."""

_LOGGERS = ("lm_eval", "lm-eval", "transformers")


DEMO_METADATA_HINT = "Custom kwargs can be passed to `--metadata`"
"""lm-eval's hint for a task with a ``custom_dataset`` (``lm_eval/api/task.py``, ``download``): the built-in demo's
three tasks read their bundled JSONL through one and take no metadata, so for them the hint (printed once per task)
says nothing to the user. Another task's hint stays."""


class IntegrationFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage().lstrip()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        if text.startswith("mpitp_demo") and DEMO_METADATA_HINT in text:
            return False
        return not text.startswith(INTEGRATION_MESSAGES)


_FILTER = IntegrationFilter()


#: The loggers of lm-eval's modules that say :data:`INTEGRATION_MESSAGES` (``logging.getLogger(__name__)`` there)
_SOURCES = ("lm_eval.models.huggingface", "lm_eval.evaluator")


@contextmanager
def integration_hidden() -> Iterator[None]:
    """The filter on the loggers that say the integration messages, for ``mpitp.evaluate``'s call only: a training
    script's logging is its own (no handler of lm-eval's to filter), so on the loggers themselves, and taken off after.
    Without it every rank printed lm-eval's two warnings about a pre-built model on each call, one of them
    "assuming single-process call to evaluate()" of a multi-process evaluation."""
    added = [logger for logger in map(logging.getLogger, _SOURCES) if _FILTER not in logger.filters]
    for logger in added:
        logger.addFilter(_FILTER)
    try:
        yield
    finally:
        for logger in added:
            logger.removeFilter(_FILTER)


def quiet_integration(verbosity: str | None, is_root: bool) -> None:
    """Install the filter (unless DEBUG) and apply lm-eval's ``--verbosity`` on rank 0, as its CLI does."""
    level = None
    if verbosity:
        level = logging.getLevelName(str(verbosity).upper())
        if not isinstance(level, int):
            from mpitp.errors import UsageError

            raise UsageError(f"--verbosity {verbosity}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL",
                             collective=True)
    if is_root:
        from lm_eval.utils import setup_logging

        setup_logging(level if level is not None else logging.INFO)
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        # Filters on a logger see only records logged to that logger itself; lm-eval logs to lm_eval.<module>.
        for target in [logger, *[h for h in logger.handlers]]:
            if level == logging.DEBUG:
                target.removeFilter(_FILTER)
            else:
                target.addFilter(_FILTER)
