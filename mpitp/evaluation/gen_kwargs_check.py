"""``--gen_kwargs``, checked on rank 0 before any model loads: what lm-eval's ``HFLM.generate_until`` would hand to
transformers' ``generate``, so that a bad value is refused as one line naming it (``--gen_kwargs temperature=abc:
temperature must be a number``) instead of a ValueError on every rank after the load.

Two steps. :func:`parse_gen_kwargs` (no torch) reads the value as lm-eval does and checks what lm-eval itself reads
(``normalize_gen_kwargs``: the first of ``max_gen_toks``/``max_new_tokens``/... as a positive integer, ``until``,
``temperature`` as a number) and each value's type against transformers' own defaults (``temperature`` a number,
``top_k`` an integer, ``do_sample`` a boolean). :func:`check_generation` (imports torch: run it after the cheap checks)
builds transformers' ``GenerationConfig`` from them as ``generate`` does (its defaults, then the kwargs, which
validates them) and the logits processors ``generate`` would build from it, each of which checks its own value
(``temperature`` > 0 when sampling, ``top_k`` > 0, ``top_p`` in (0, 1], ...).

Only what the user's keys decide is checked: lm-eval merges ``--gen_kwargs`` into each task's own
``generation_kwargs`` (whose ``do_sample``/``temperature`` may decide the mode), so the sampling warpers are built only
when ``do_sample=True`` is given (otherwise transformers' greedy defaults), so that what ``lm_eval --model hf`` runs
is not refused.
"""

from __future__ import annotations

import logging
from typing import Any

from mpitp.errors import UsageError

log = logging.getLogger("mpitp")

_DEFAULTS = "transformers.generation.configuration_utils.GenerationConfig._get_default_generation_params"
_PROCESSORS = "transformers.generation.utils.GenerationMixin._get_logits_processor"

#: lm-eval's names for the number of tokens to generate, the first given wins (``normalize_gen_kwargs``)
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


def _text(v: Any) -> str:
    """A value as the user would write it in ``k=v`` (a string lm-eval would not read back as itself: quoted)."""
    if isinstance(v, str):
        from lm_eval.utils import handle_arg_string

        return v if v and handle_arg_string(v) == v else repr(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:  # lm-eval's command line reads -5 as -5.0
        return str(int(v))
    return str(v)


def shown_kwargs(parsed: dict) -> str:
    return ",".join(f"{k}={_text(v)}" for k, v in parsed.items())


def _refuse(key: str, value: Any, why: str) -> UsageError:
    return UsageError(f"--gen_kwargs {key}={_text(value)}: {why}")


def parse_gen_kwargs(gen_kwargs: str | dict) -> dict:
    """``gen_kwargs`` as lm-eval reads it (a ``k=v,...`` string through its own parser, a mapping as the dict it is),
    each value checked as lm-eval and transformers will read it; refused with a :class:`UsageError` naming it."""
    if isinstance(gen_kwargs, str):
        from lm_eval.utils import simple_parse_args_string

        try:
            parsed = simple_parse_args_string(gen_kwargs)
        except Exception as exc:  # noqa: BLE001 - lm-eval's parser raises plain errors on bad syntax
            raise UsageError(f"--gen-kwargs {gen_kwargs!r}: {exc}") from None
    else:
        parsed = {k: list(v) if isinstance(v, tuple) else v for k, v in dict(gen_kwargs).items()}
    _check_values(parsed)
    return parsed


def _check_values(parsed: dict) -> None:
    until = parsed.get("until")
    if until is not None and not (isinstance(until, str) or (
            isinstance(until, list) and all(isinstance(s, str) for s in until))):
        raise _refuse("until", until, "until must be a stop string or a list of them")
    given = [k for k in MAX_TOKEN_KEYS if parsed.get(k) is not None]
    if given:  # lm-eval reads the first with int() and ignores the others
        key, value = given[0], parsed[given[0]]
        try:
            ok = not isinstance(value, bool) and int(value) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise _refuse(key, value, f"{key} must be a positive integer (tokens to generate)")
    if "temperature" in parsed and not _is_number(parsed["temperature"]):  # lm-eval reads it with float()
        raise _refuse("temperature", parsed["temperature"], "temperature must be a number")
    from mpitp import compat

    for key, default in compat.attribute(_DEFAULTS)().items():
        value = parsed.get(key)
        if value is None or default is None:
            continue
        if isinstance(default, bool):
            if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
                raise _refuse(key, value, f"{key} must be true or false")
        elif isinstance(default, (int, float)) and not _is_number(value):  # its range: transformers' own check
            raise _refuse(key, value, f"{key} must be an integer" if isinstance(default, int) else
                          f"{key} must be a number")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def generate_kwargs(parsed: dict) -> dict:
    """The keyword arguments lm-eval's ``HFLM`` passes on to ``generate`` for ``parsed``, as far as its keys decide
    them: ``until`` and the token count go to lm-eval's own stopping criteria and ``max_length``; greedy decoding
    (``do_sample=False``, or ``temperature=0`` without ``do_sample``) drops the temperature (``_model_generate``)."""
    kw = {k: v for k, v in parsed.items() if k != "until" and k not in MAX_TOKEN_KEYS}
    do_sample = kw.get("do_sample")
    if do_sample is False or (do_sample is None and "temperature" in kw and float(kw["temperature"]) == 0.0):
        kw.pop("temperature", None)
        kw["do_sample"] = False
    return kw


def check_generation(parsed: dict) -> None:
    """Build what ``generate`` builds from ``parsed`` (lm-eval's :func:`generate_kwargs`): transformers'
    ``GenerationConfig`` (its defaults, then the kwargs, which validates them) and its logits processors; the first
    error is refused as one line. Imports torch (transformers' generation code)."""
    if parsed:
        _build_generation(generate_kwargs(parsed), f"--gen_kwargs {shown_kwargs(parsed)}")


def check_model_kwargs(parsed: dict, config) -> None:
    """Keys of ``parsed`` that neither lm-eval, transformers' ``GenerationConfig`` nor the model ``config`` names
    takes as an input: ``generate`` hands them to the model and refuses them (``The following model_kwargs are not
    used by the model: ['tempreature']``), a ValueError traceback on every DP leader after the load; refused here as
    one line with the closest generation setting. The inputs are ``generate``'s own test
    (``GenerationMixin._validate_model_kwargs``, decoder-only): ``prepare_inputs_for_generation``'s parameters, the
    forward's where that takes ``**kwargs``, and transformers' model-agnostic keywords."""
    import difflib
    import inspect

    from transformers import GenerationConfig
    from transformers.utils.generic import TransformersKwargs

    from mpitp.replica.tp_plans import causal_lm_class

    unused = GenerationConfig().update(**generate_kwargs(parsed)) if parsed else {}
    unused = {k: v for k, v in unused.items() if v is not None}
    if not unused:
        return
    try:
        model = causal_lm_class(config)
    except (KeyError, AttributeError):  # no causal-LM class: refused by the checks with its reason
        return
    inputs = set(inspect.signature(model.prepare_inputs_for_generation).parameters)
    if inputs & {"kwargs", "model_kwargs"}:
        inputs |= set(inspect.signature(model.forward).parameters)
    inputs |= set(TransformersKwargs.__optional_keys__)
    for key, value in unused.items():
        if key not in inputs:
            close = difflib.get_close_matches(key, list(GenerationConfig().to_dict()), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise _refuse(key, value, f"{key} is no generation setting (transformers' GenerationConfig) nor an input "
                                      f"of {model.__name__}: generate would refuse it{hint}")


def check_request_generation(kwargs: dict, default_max_gen_toks: int, task: str) -> None:
    """One request's generation kwargs as lm-eval hands them to its model (the task's ``generation_kwargs`` with
    ``--gen_kwargs`` merged in) checked as ``HFLM`` passes them to ``generate``: its ``normalize_gen_kwargs`` decides
    the mode first (no ``do_sample`` and a temperature above 0: sampling, whatever the model's generation config), so
    a sampling setting :func:`check_generation` could not judge before the tasks were built (``temperature=0.9,
    top_k=-1`` on a task without ``do_sample``) is one line naming the task, not a traceback from the DP leader."""
    from lm_eval.models.utils import normalize_gen_kwargs

    kw = dict(normalize_gen_kwargs(kwargs, default_max_gen_toks))
    for k in ("until", "max_gen_toks"):  # lm-eval's stopping criteria and max_length, not generate's kwargs
        kw.pop(k, None)
    if kw.get("do_sample") is False:  # HFLM._model_generate drops the temperature for greedy decoding
        kw.pop("temperature", None)
    _build_generation(kw, f"task {task}'s generation kwargs (with --gen_kwargs merged) {shown_kwargs(kwargs)}")


def _build_generation(kw: dict, what: str) -> None:
    """transformers' ``GenerationConfig`` (its defaults, then ``kw``) and the logits processors ``generate`` would
    build from it; the first error refused as one line starting with ``what``."""
    import warnings

    from transformers import GenerationConfig

    from mpitp import compat

    quiet = logging.getLogger("mpitp.gen_kwargs_check")  # generate warns itself (its own warning_once, per rank)
    quiet.disabled = True
    config = GenerationConfig()
    try:
        with warnings.catch_warnings(), compat.replaced("transformers.generation.configuration_utils.logger", quiet):
            warnings.simplefilter("ignore")
            config.update(**compat.attribute(_DEFAULTS)(), defaults_only=True)
            config.update(**kw)
            compat.attribute(_PROCESSORS)(_ModelStandIn(), config, input_ids_seq_length=1, device="cpu")
    except (ValueError, TypeError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(f"{what}: {why}") from None
    except Exception as exc:  # noqa: BLE001 - the stand-in lacks what a processor wanted: generate decides
        log.debug("%s: not checked past %s: %s", what, type(exc).__name__, exc)


class _ModelStandIn:
    """What ``GenerationMixin._get_logits_processor`` reads of the model (before it loads): a decoder-only config."""

    class config:  # noqa: N801 - the attribute's name
        is_encoder_decoder = False

    @staticmethod
    def _merge_criteria_processor_list(default_list, custom_list):
        return default_list
