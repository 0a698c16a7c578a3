"""What a causal LM does between its decoder's last hidden state and the logits it returns, read from its forward.

The vocab-parallel head (:mod:`mpitp.replica.scoring`) recomputes logits from the LM head's weight shard instead of
calling the model's forward, so it must repeat every step the model class takes there: Cohere multiplies by
``logit_scale``, Granite divides by ``logits_scaling`` (and HyperCLOVAX multiplies by a config field of the same
name), Falcon-H1 multiplies by ``lm_head_multiplier``, MiniCPM3 divides the hidden state, Gemma 2/3 soft-cap with
``tanh``. No table of model types could keep up with transformers, so :func:`head_transform` reads the statements of
the class's own ``forward`` between the decoder output and the loss, evaluates the ``self...`` attributes they name on
the live model, and turns each into an elementwise step. Anything it cannot read is reported as ``unknown`` (the
run's head check, :mod:`mpitp.replica.headcheck`, then decides from numbers whether the head path is still right).
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import dataclass, field

import torch

_NUM = r"[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?"
_ATTR = r"self(?:\.[A-Za-z_][A-Za-z_0-9]*(?:\(\))?)+"
_NAME = r"[A-Za-z_][A-Za-z_0-9]*"
_OPERAND = rf"(?:{_ATTR}|{_NUM}|{_NAME})"
_DECODER_OUT = r"(?:[a-z_0-9]*outputs\.last_hidden_state|[a-z_0-9]*outputs\[0\]|hidden_states)"
_LOGITS = r"(?:lm_)?logits"

# Statements that change nothing for the vocab-parallel head (it computes the scored positions only, in float32).
_NEUTRAL = [
    re.compile(rf"hidden_states = {_DECODER_OUT}$"),
    re.compile(r"hidden_states = slice_logits_to_keep\(.*\)$"),
    re.compile(r"slice_indices = .*logits_to_keep.*$"),
    re.compile(r"if hidden_states\.shape\[1\] == .*:$"),
    re.compile(r"unpadded_vocab_size = self\.config\.unpadded_vocab_size$"),
    re.compile(r"if unpadded_vocab_size is not None and unpadded_vocab_size < logits\.shape\[-1\]:$"),
]
_HIDDEN_OP = re.compile(rf"hidden_states = (?:{_DECODER_OUT}) ([*/]) ({_OPERAND})$")
_HIDDEN_SLICED_OP = re.compile(rf"hidden_states = slice_logits_to_keep\((?:{_DECODER_OUT}), logits_to_keep\) ([*/]) "
                               rf"({_OPERAND})$")
_HEAD = re.compile(rf"{_LOGITS} = self\.({_NAME})\(hidden_states(?:\[[^\]]*\])?(?:\.to\([^)]*\))?\)"
                   rf"(?:\.float\(\)|\.contiguous\(\))?(?: ([*/]) ({_OPERAND}))?$")
_LOGIT_OP = re.compile(rf"{_LOGITS} = {_LOGITS}(?:\.float\(\))? ([*/]) ({_OPERAND})$")
_TANH = re.compile(rf"{_LOGITS} = (?:torch|nn\.functional)\.tanh\({_LOGITS}\)$")
_SOFTCAP = re.compile(rf"{_LOGITS} = (?:torch|nn\.functional)\.tanh\({_LOGITS} / ({_OPERAND})\) \* ({_OPERAND})$")
_MODULE = re.compile(rf"{_LOGITS} = ({_ATTR})\({_LOGITS}\)$")
_VOCAB_CUT = re.compile(rf"{_LOGITS} = {_LOGITS}\[\.\.\., :unpadded_vocab_size\]$")
_IF_SET = re.compile(rf"if \(?(?:({_NAME}) := )?({_ATTR})\)? is not None:$")
_LOCAL = re.compile(rf"({_NAME}) = ({_ATTR})$")
_END = re.compile(r"^(loss\b|if labels\b|return\b|output = |if not return_dict)")


@dataclass
class HeadTransform:
    """Elementwise steps around ``lm_head``: ``hidden`` before it, ``logits`` after it (in float32, in order).

    Each step is ``("mul", c)``, ``("div", c)``, ``("tanh", None)`` or ``("module", m)`` (an elementwise module of
    the model, e.g. Inkling2's soft-cap, applied to this rank's vocabulary shard). ``vocab_limit`` cuts the
    vocabulary (Inkling's padded head). ``unknown`` holds the statements that could not be read.
    """

    hidden: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    vocab_limit: int | None = None
    unknown: list[str] = field(default_factory=list)
    source: str = ""

    def apply_hidden(self, h: torch.Tensor) -> torch.Tensor:
        for op, c in self.hidden:
            h = h * c if op == "mul" else h / c
        return h

    def apply_logits(self, logits: torch.Tensor) -> torch.Tensor:
        for op, c in self.logits:
            if op == "mul":
                logits = logits * c
            elif op == "div":
                logits = logits / c
            elif op == "tanh":
                logits = torch.tanh(logits)
            else:
                logits = c(logits).float()
        return logits

    def describe(self) -> str:
        def fmt(steps):
            return " ".join(f"{op}{'' if c is None else ' ' + (repr(c) if not callable(c) else type(c).__name__)}"
                            for op, c in steps)

        parts = []
        if self.hidden:
            parts.append(f"hidden: {fmt(self.hidden)}")
        if self.logits:
            parts.append(f"logits: {fmt(self.logits)}")
        if self.vocab_limit is not None:
            parts.append(f"vocabulary cut at {self.vocab_limit}")
        return "; ".join(parts) or "none"


def _value(model, expr: str, local: dict | None = None):
    """``self.a.b`` (``get_text_config()`` calls allowed) on the live model, a local bound earlier, or a number."""
    if not expr.startswith("self."):
        if local and expr in local:
            return local[expr]
        return float(expr)
    obj = model
    for name in expr.split(".")[1:]:
        obj = getattr(obj, name.removesuffix("()"))
        if name.endswith("()"):
            obj = obj()
    if torch.is_tensor(obj):
        return obj.detach().float() if obj.numel() > 1 else float(obj)
    return obj


def _statements(forward) -> list[tuple[int, str]]:
    """``(indent, text)`` of the head part of a CausalLM forward: after the decoder runs, before the loss."""
    src = textwrap.dedent(inspect.getsource(forward))
    body = src.split('"""', 2)[-1] if src.count('"""') >= 2 else src
    lines = [(len(raw) - len(raw.lstrip()), raw.split("#")[0].strip()) for raw in body.splitlines()]
    lines = [(ind, text) for ind, text in lines if text]
    start = next((i for i, (_, t) in enumerate(lines)
                  if re.search(r"outputs\.last_hidden_state|outputs\[0\]", t) and "=" in t), None)
    if start is None:
        return []
    out = []
    for ind, text in lines[start:]:
        if _END.search(text):
            break
        out.append((ind, text))
    return out


def head_transform(model) -> HeadTransform:
    """The steps ``type(model).forward`` applies around its LM head, with this model's values filled in."""
    t = HeadTransform()
    try:
        stmts = _statements(type(model).forward)
    except (OSError, TypeError) as exc:  # no source (compiled, or built at runtime)
        t.unknown.append(f"forward source unavailable ({exc})")
        return t
    t.source = "\n".join(s for _, s in stmts)
    if not any(_HEAD.match(s) for _, s in stmts):
        t.unknown.append("no `logits = self.<head>(hidden_states)` statement in the forward")
    skip_deeper, local = None, {}
    head = model.get_output_embeddings()

    def step(sign, expr):
        return ("mul" if sign == "*" else "div", _value(model, expr, local))

    for ind, s in stmts:
        if skip_deeper is not None:
            if ind > skip_deeper:
                continue
            skip_deeper = None
        try:
            if m := _IF_SET.match(s):
                value = _value(model, m.group(2))
                if m.group(1):
                    local[m.group(1)] = value
                if value is None:
                    skip_deeper = ind
                continue
            if any(p.match(s) for p in _NEUTRAL):
                continue
            if m := _LOCAL.match(s):
                local[m.group(1)] = _value(model, m.group(2))
            elif m := (_HIDDEN_OP.match(s) or _HIDDEN_SLICED_OP.match(s)):
                t.hidden.append(step(m.group(1), m.group(2)))
            elif (m := _HEAD.match(s)) and getattr(model, m.group(1), None) is head:
                if m.group(2):
                    t.logits.append(step(m.group(2), m.group(3)))
            elif m := _LOGIT_OP.match(s):
                t.logits.append(step(m.group(1), m.group(2)))
            elif _TANH.match(s):
                t.logits.append(("tanh", None))
            elif m := _SOFTCAP.match(s):
                t.logits += [step("/", m.group(1)), ("tanh", None), step("*", m.group(2))]
            elif m := _MODULE.match(s):
                t.logits.append(("module", _value(model, m.group(1))))
            elif _VOCAB_CUT.match(s):
                limit = getattr(model.config.get_text_config(), "unpadded_vocab_size", None)
                t.vocab_limit = int(limit) if limit is not None else None
            else:
                t.unknown.append(s)
        except (AttributeError, ValueError) as exc:
            t.unknown.append(f"{s} ({exc})")
    return t
