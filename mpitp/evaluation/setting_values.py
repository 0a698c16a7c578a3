"""The rules a setting's value follows, and the readers that apply them to a job file's YAML and to the command line.

Why a module of its own: :mod:`mpitp.evaluation.settings` declares each setting once and names its reader; the readers
themselves are the same few rules (:func:`limit_value` is lm-eval's reading of ``--limit``, :data:`DTYPES` the
loader's) spelt in each source's style: ``field 'x': expected ...`` for YAML, argparse's ``--flag: must be ...`` on
the command line. Keeping them here leaves the declaration readable and lets :mod:`mpitp.jobs.jobfile` and
:mod:`mpitp.evaluation.lmeval_args` use a rule without the declaration. Like the declaration, this module imports no
heavy library: a job file is checked on a login node in well under a second.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any

from mpitp.replica.loading import DTYPES


class BadValue(ValueError):
    """A setting's value is refused; ``str()`` is the reason (the caller names the file, run and field or flag)."""


class FrozenDict(dict):
    """A read-only mapping that pickles (a job's runs are broadcast to every rank; ``MappingProxyType`` cannot be)."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("a job file's settings are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def thaw(value: Any) -> Any:
    """A frozen job-file value as plain mutable Python (dicts, lists), so the callee may change its copy."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------- shared value rules


def limit_value(v: object) -> int | float:
    """lm-eval's ``--limit``: a number < 1 is a fraction of each task's documents, one >= 1 a count of documents
    (``lm_eval.evaluator_utils.get_sample_size``: ``ceil(n * limit) if limit < 1.0 else int(limit)``), so 1.0 is
    one document. A whole count is kept as an int (the same meaning, and the spelling resume identities use)."""
    given = v
    if isinstance(v, bool):
        raise BadValue(f"expected a number, got {v!r}")
    if not isinstance(v, (int, float)):
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise BadValue(f"expected a number, got {v!r}") from None
    if not v > 0:
        raise BadValue(f"must be > 0, got {given}")
    if v == math.inf:
        raise BadValue(f"must be a finite number, got {given}")
    return int(v) if v >= 1 and v == int(v) else v


SEED_MAX = 2**32 - 1
"""The largest seed every generator lm-eval seeds takes (NumPy's ``np.random.seed``: 0 to 2**32 - 1)."""


def seeds_value(v: object) -> int | list:
    """lm-eval's seeds as ``simple_evaluate`` takes them: one integer for all four slots (python, numpy, torch,
    few-shot) or four values, each an integer or None (that generator left as it is, as ``--seed 0,None,8,52``),
    each integer in NumPy's range. A tuple of three was an IndexError and -1 or 'a' an error from ``np.random.seed``,
    each on rank 0 alone once the run had begun."""
    what = f"one integer from 0 to {SEED_MAX} or a list of four (None: that generator left unseeded)"
    if isinstance(v, (list, tuple)):
        if len(v) == 4 and all(s is None or (_is_int(s) and 0 <= s <= SEED_MAX) for s in v):
            return list(v)
        raise BadValue(f"expected {what}, got {show(v)}")
    if _is_int(v) and 0 <= v <= SEED_MAX:
        return v
    raise BadValue(f"expected {what}, got {show(v)}")


def batch_size_value(value: object) -> int | str:
    """lm-eval's batch size: a positive integer, ``auto`` or ``auto:N`` (N >= 1)."""
    text = str(value).strip()
    if text == "auto":
        return "auto"
    if text.startswith("auto:"):
        n = text[5:]
        if n.isdigit() and int(n) >= 1:
            return f"auto:{int(n)}"
        raise BadValue(f"expected auto:N with N a positive integer, got {value!r}")
    try:
        v = int(text)
    except ValueError:
        raise BadValue(f"expected a positive integer, 'auto' or 'auto:N', got {value!r}") from None
    if v < 1:
        raise BadValue(f"must be >= 1, got {value}")
    return value if isinstance(value, int) else text  # as typed: lm-eval records the string it was given


# ------------------------------------------------------------------------------- reading a job file's YAML value


def show(value: Any) -> str:
    if value is None:
        return "an empty value"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def suggest(word: Any, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def yaml_string(v: Any) -> str:
    if isinstance(v, str) and v.strip():
        return v.strip()
    hint = " (quote it in YAML)" if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
    raise BadValue(f"expected a non-empty string, got {show(v)}{hint}")


def yaml_string_list(v: Any) -> str:
    """One string, or a list of them joined with commas: ``peft: [a, b]`` is the job file's ``--peft a,b`` (an
    adapter sweep)."""
    if not isinstance(v, list):
        return yaml_string(v)
    if v and all(isinstance(p, str) and p.strip() and "," not in p for p in v):
        return ",".join(p.strip() for p in v)
    raise BadValue(f"expected a string or a non-empty list of paths or globs (without commas), got {show(v)}")


def yaml_int_at_least(lo: int, what: str) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if _is_int(v) and v >= lo:
            return v
        raise BadValue(f"expected {what}, got {show(v)}")
    return check


def yaml_seed(v: Any) -> int | tuple[int | None, ...]:
    """lm-eval's ``--seed``: one integer for its four generators (python, numpy, torch, few-shot), or four values,
    ``null`` leaving that one unseeded (``--seed 0,None,8,52``). The job file took only the one integer, so
    ``seed: [1, 2, 3, 4]`` (the settings' own description) was refused."""
    if _is_int(v) and v >= 0:
        return v
    if isinstance(v, list) and len(v) == 4 and all(x is None or (_is_int(x) and x >= 0) for x in v):
        return tuple(v)
    raise BadValue(f"expected a non-negative integer or a list of four (python, numpy, torch, few-shot; null: "
                   f"unseeded), got {show(v)}")


def yaml_dtype(v: Any) -> str:
    if v in DTYPES:
        return v
    choices = ", ".join(repr(d) for d in DTYPES)
    raise BadValue(f"expected one of {choices}, got {show(v)}{suggest(v, DTYPES)}")


def yaml_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise BadValue(f"expected true or false, got {show(v)}")


def flag_value(v: Any) -> bool:
    """A flag given from Python: True or False (a truthy string such as "no" is the slip it most likely is)."""
    if isinstance(v, bool):
        return v
    raise BadValue(f"expected True or False, got {show(v)}")


def string_value(v: Any) -> str:
    """A text setting given from Python: a non-empty string."""
    if isinstance(v, str) and v.strip():
        return v
    raise BadValue(f"expected a non-empty string, got {show(v)}")


def paths_value(v: Any) -> str | list:
    """``include_path`` given from Python: one folder or a list of them (maybe empty), each a non-empty string."""
    if isinstance(v, (list, tuple)) and all(isinstance(p, str) and p.strip() for p in v):
        return list(v)
    if isinstance(v, str) and v.strip():
        return v
    raise BadValue(f"expected a folder or a list of folders, got {show(v)}")


def bool_or_name(v: Any) -> bool | str:
    """``apply_chat_template``: True, False or the name of one of the tokenizer's chat templates."""
    if isinstance(v, bool) or (isinstance(v, str) and v.strip()):
        return v
    raise BadValue(f"expected True, False or a chat template's name, got {show(v)}")


def yaml_limit(v: Any) -> int | float:
    """:func:`limit_value`'s rule; YAML is typed, so a quoted number or a count with a fraction (1.5) is refused as
    the slip it most likely is."""
    ok = (_is_int(v) or isinstance(v, float)) and not isinstance(v, bool) and 0 < v < math.inf
    if not ok or (v > 1 and v != int(v)):
        raise BadValue(f"expected a positive integer (examples per task) or a fraction in (0, 1), got {show(v)}")
    return limit_value(v)


def yaml_timeout(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf:
        return float(v)
    raise BadValue(f"expected a positive number of seconds, got {show(v)}")


def yaml_tasks(v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise BadValue(f"expected a list of task names or a comma-separated string, got {show(v)}")
    tasks: list[str] = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, str):
            raise BadValue(f"item {i}: expected a task name, got {show(item)}")
        for task in (t.strip() for t in item.split(",")):
            if not task:
                raise BadValue(f"empty task name in {show(item)}")
            if task in tasks:
                raise BadValue(f"task {task!r} is listed twice")
            tasks.append(task)
    if not tasks:
        raise BadValue("expected at least one task")
    return tuple(tasks)


def yaml_gen_kwargs(v: Any) -> str | FrozenDict:
    """A string (``temperature=0,top_p=1``, read by lm-eval) or a mapping, which reaches lm-eval as the dict it is:
    ``until: ["\\n\\n"]`` stays a list of stop strings."""
    if isinstance(v, str):
        return v.strip()
    if not isinstance(v, dict):
        raise BadValue(f"expected a string like 'temperature=0,top_p=1' or a mapping, got {show(v)}")
    out: dict[str, Any] = {}
    for key, val in v.items():
        if not isinstance(key, str):
            raise BadValue(f"key {show(key)}: expected a string key")
        scalar = (str, int, float, bool)
        if isinstance(val, list) and all(isinstance(x, scalar) for x in val):
            val = tuple(val)
        elif not isinstance(val, scalar):
            raise BadValue(f"key {key!r}: expected a number, string, boolean or list of them, got {show(val)}")
        out[key] = val
    return FrozenDict(out)


def yaml_output(v: Any) -> str:
    v = yaml_string(v)
    if not v.endswith((".h5", ".hdf5")):
        raise BadValue(f"expected a path ending in .h5, got {show(v)}")
    return v


def yaml_batch_size(v: Any) -> int | str:
    """lm-eval's batch size: a positive integer, ``auto`` or ``auto:N``."""
    if _is_int(v) and v >= 1:
        return v
    if isinstance(v, str) and (v == "auto" or (v.startswith("auto:") and v[5:].isdigit() and int(v[5:]) >= 1)):
        return v
    raise BadValue(f"expected a positive integer, 'auto' or 'auto:N', got {show(v)}")


def yaml_mapping(v: Any) -> str | FrozenDict:
    """An lm-eval dict setting (model_args, metadata, wandb_args ...): a mapping, or lm-eval's ``k=v,k2=v2``."""
    if isinstance(v, str):
        return v.strip()
    if isinstance(v, dict):
        return FrozenDict({k: (FrozenDict(x) if isinstance(x, dict) else x) for k, x in v.items()})
    raise BadValue(f"expected a mapping or a string like 'key=value,key2=value2', got {show(v)}")


VERBOSITIES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""lm-eval's ``--verbosity`` levels (any case, as its logging reads them)."""


def yaml_verbosity(v: Any) -> str:
    """A log level of :data:`VERBOSITIES`: refused while reading the job file, where the run's turn refused it before
    (the run recorded as failed, the job file's field unnamed)."""
    if isinstance(v, str) and v.strip().upper() in VERBOSITIES:
        return v.strip()
    raise BadValue(f"expected one of {', '.join(VERBOSITIES)}, got {show(v)}")


def yaml_device(v: Any) -> str:
    """A device kind as ``--device`` takes it (:func:`mpitp.parallel.device.plan_device`): cpu, cuda, cuda:<index> or
    auto; whether the node has it is the run's to find out."""
    text = v.strip().lower() if isinstance(v, str) else None
    if text in ("cpu", "cuda", "auto") or (text and text.startswith("cuda:") and text[5:].isdigit()):
        return v.strip()
    raise BadValue(f"expected cpu, cuda, cuda:<index> or auto, got {show(v)}")


CACHE_REQUESTS = ("true", "refresh", "delete")
"""lm-eval's ``--cache_requests`` values (``lm_eval._cli.utils.request_caching_arg_to_dict``)."""


def yaml_cache_requests(v: Any) -> str | None:
    """lm-eval's ``--cache_requests true|refresh|delete`` as a job file writes it: ``true`` (a YAML boolean, or the
    flag's word), ``refresh`` or ``delete``; ``false`` leaves it off. Its declared type is the mapping lm-eval parses
    the flag into, so the mapping reader refused ``true`` and passed ``maybe`` on to lm-eval's parser, whose
    ArgumentTypeError was a traceback and MPI_Abort once the run began."""
    if v is True or v is False:
        return "true" if v else None
    if isinstance(v, str) and v.strip().lower() in CACHE_REQUESTS:
        return v.strip().lower()
    raise BadValue(f"expected true, 'refresh' or 'delete' (lm-eval's --cache_requests), got {show(v)}")


# -------------------------------------------------------------------------------- reading a command-line value


def _cli(parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    """A shared rule as an argparse ``type``: its refusal becomes ``--flag: reason``."""
    def check(value: str) -> Any:
        try:
            return parse(value)
        except BadValue as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    check.__name__ = getattr(parse, "__name__", "value")
    return check


def cli_int_at_least(lo: int) -> Callable[[str], int]:
    def check(value: str) -> int:
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return v
    return check


def cli_positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    if math.isinf(v):  # a deadline that never comes: the wait it bounds could hang for ever
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {value!r}")
    return v


cli_limit = _cli(limit_value)
cli_batch_size = _cli(batch_size_value)
