"""What a causal LM does between its decoder's last hidden state and the logits it returns, read from its forward.

The vocab-parallel head (:mod:`mpitp.replica.scoring`) recomputes logits from the LM head's weight shard instead of
calling the model's forward, so it must repeat every step the model class takes there: Cohere multiplies by
``logit_scale``, Granite divides by ``logits_scaling`` (and HyperCLOVAX multiplies by a config field of the same
name), Falcon-H1 multiplies by ``lm_head_multiplier``, MiniCPM3 divides the hidden state, Gemma 2/3 soft-cap with
``tanh``. No table of model types could keep up with transformers, so :func:`head_transform` reads the statements of the
class's own ``forward`` (parsed with :mod:`ast`: :func:`mpitp.compat.forward_tree`) between the decoder output and the
loss, evaluates the ``self...`` attributes they name on the live model, and turns each into an elementwise step.
Anything it cannot read is reported as ``unknown`` (the run's head check, :mod:`mpitp.replica.headcheck`, then decides
from numbers whether the head path is still right).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mpitp import compat

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedModel

_LOGITS = frozenset({"logits", "lm_logits"})
_SIGNS = {ast.Mult: "*", ast.Div: "/"}


@dataclass
class HeadTransform:
    """Elementwise steps around ``lm_head``: ``hidden`` before it, ``logits`` after it (in float32, in order).

    Each step is ``("mul", c)``, ``("div", c)``, ``("tanh", None)`` or ``("module", m)``: on the logits an elementwise
    module of the model (e.g. Inkling2's soft-cap, applied to this rank's vocabulary shard), on the hidden state a
    module the head's input passes through first (ModernBERT-decoder's prediction head, ``self.decoder(self.lm_head(
    hidden_states))``: dense, activation, norm, whole on every rank). ``vocab_limit`` cuts the
    vocabulary (Inkling's padded head). ``unknown`` holds the statements that could not be read.
    """

    hidden: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    vocab_limit: int | None = None
    unknown: list[str] = field(default_factory=list)
    source: str = ""

    @property
    def scalar_logit_steps(self) -> bool:
        """Whether every step on the logits is by a scalar (mul, div, tanh): the same on any slice of the vocabulary
        (:mod:`mpitp.replica.scoring` reduces the logits in pieces then)."""
        return all(op in ("mul", "div", "tanh") and (not torch.is_tensor(c) or c.numel() == 1)
                   for op, c in self.logits)

    def apply_hidden(self, h: torch.Tensor) -> torch.Tensor:
        for op, c in self.hidden:
            h = c(h) if op == "module" else h * c if op == "mul" else h / c
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
        def fmt(steps: list) -> str:
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


# ------------------------------------------------------------------------------------ reading the forward's syntax
def _attr_path(e) -> list[str] | None:
    """``self.a.b().c`` as ``["a", "b()", "c"]`` (zero-argument calls allowed along the chain), else None."""
    path = []
    while True:
        call = isinstance(e, ast.Call) and not e.args and not e.keywords
        node = e.func if call else e
        if not isinstance(node, ast.Attribute):
            break
        path.append(node.attr + ("()" if call else ""))
        e = node.value
    return path[::-1] if _is_name(e, "self") and path else None


def _operand(e):
    """A number, a ``self...`` attribute or a local name: ``("num", 1.5)``, ``("attr", path)``, ``("name", id)``."""
    if isinstance(e, ast.Constant) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
        return ("num", e.value)
    path = _attr_path(e)
    if path is not None:
        return ("attr", path)
    if isinstance(e, ast.Name):
        return ("name", e.id)
    return None


def _is_name(e, *names) -> bool:
    return isinstance(e, ast.Name) and e.id in names


def _is_logits(e) -> bool:
    return isinstance(e, ast.Name) and e.id in _LOGITS


def _decoder_out(e) -> bool:
    """``outputs.last_hidden_state``, ``outputs[0]`` (any ``*outputs`` name) or ``hidden_states``."""
    if isinstance(e, ast.Attribute) and e.attr == "last_hidden_state":
        return isinstance(e.value, ast.Name) and e.value.id.endswith("outputs")
    if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant) and e.slice.value == 0:
        return isinstance(e.value, ast.Name) and e.value.id.endswith("outputs")
    return _is_name(e, "hidden_states")


def _calls(e, name: str) -> bool:
    return isinstance(e, ast.Call) and _is_name(e.func, name)


def _tanh(e) -> bool:
    """``torch.tanh(...)`` or ``nn.functional.tanh(...)``."""
    if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "tanh"):
        return False
    owner = e.func.value
    return _is_name(owner, "torch") or isinstance(owner, ast.Attribute) and owner.attr == "functional" and \
        _is_name(owner.value, "nn")


def _binop(e):
    """(left, "*" or "/", right) of a multiplication or division, else None."""
    if isinstance(e, ast.BinOp) and type(e.op) in _SIGNS:
        return e.left, _SIGNS[type(e.op)], e.right
    return None


def _self_call(e):
    """``self.NAME(x)`` (one argument): (NAME, x), else None."""
    if isinstance(e, ast.Call) and len(e.args) == 1 and not e.keywords and isinstance(e.func, ast.Attribute) and \
            _is_name(e.func.value, "self"):
        return e.func.attr, e.args[0]
    return None


def _head_call(e):
    """``self.NAME(hidden_states[...].to(...))`` with optional ``.float()``/``.contiguous()``, or
    ``self.NAME(self.PRE(hidden_states))``: (NAME, PRE or None), else None."""
    if isinstance(e, ast.Call) and not e.args and isinstance(e.func, ast.Attribute) and \
            e.func.attr in ("float", "contiguous"):
        e = e.func.value
    call = _self_call(e)
    if call is None:
        return None
    name, arg = call
    pre = _self_call(arg)
    if pre is not None:
        pre, arg = pre
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "to":
        arg = arg.func.value
    if isinstance(arg, ast.Subscript):
        arg = arg.value
    return (name, pre) if _is_name(arg, "hidden_states") else None


def _if_kind(test):
    """The kind of an ``if`` header (see :func:`_kind`)."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot) and \
            isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
        left, bound = test.left, None
        if isinstance(left, ast.NamedExpr):
            left, bound = left.value, left.target.id
        path = _attr_path(left)
        if path is not None:
            return ("if_set", bound, ("attr", path))
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Subscript) and \
            isinstance(test.left.value, ast.Attribute) and test.left.value.attr == "shape" and \
            _is_name(test.left.value.value, "hidden_states"):
        return ("neutral",)  # if hidden_states.shape[1] == ...: (slicing to the kept positions)
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and \
            all(isinstance(v, ast.Compare) and _is_name(v.left, "unpadded_vocab_size") for v in test.values):
        return ("neutral",)  # if unpadded_vocab_size is not None and unpadded_vocab_size < logits.shape[-1]:
    return None


def _assign_kind(target: str, v):
    """The kind of ``target = v`` (see :func:`_kind`)."""
    if target == "hidden_states":
        if _decoder_out(v) or _calls(v, "slice_logits_to_keep"):
            return ("neutral",)
        op = _binop(v)
        if op and (_decoder_out(op[0]) or _calls(op[0], "slice_logits_to_keep") and len(op[0].args) == 2
                   and _decoder_out(op[0].args[0]) and _is_name(op[0].args[1], "logits_to_keep")):
            ref = _operand(op[2])
            return ("hidden", op[1], ref) if ref else None
        return None
    if target == "slice_indices":
        return ("neutral",) if any(_is_name(n, "logits_to_keep") for n in ast.walk(v)) else None
    if target == "unpadded_vocab_size" and _attr_path(v) == ["config", "unpadded_vocab_size"]:
        return ("neutral",)
    if target in _LOGITS:
        return _logits_kind(v)
    path = _attr_path(v)
    return ("local", target, ("attr", path)) if path is not None else None


def _logits_kind(v):
    op = _binop(v)
    if (call := _head_call(v)) is not None:
        return ("head", *call, None, None)
    if op and (call := _head_call(op[0])) is not None:
        ref = _operand(op[2])
        return ("head", *call, op[1], ref) if ref else None
    if op:
        left = op[0]
        if isinstance(left, ast.Call) and not left.args and isinstance(left.func, ast.Attribute) and \
                left.func.attr == "float":
            left = left.func.value
        if _is_logits(left) and (ref := _operand(op[2])):
            return ("logit", op[1], ref)
        inner = _binop(left.args[0]) if _tanh(left) and len(left.args) == 1 else None
        if op[1] == "*" and inner and inner[1] == "/" and _is_logits(inner[0]):
            a, b = _operand(inner[2]), _operand(op[2])
            return ("softcap", a, b) if a and b else None
        return None
    if _tanh(v) and len(v.args) == 1 and _is_logits(v.args[0]):
        return ("tanh",)
    if isinstance(v, ast.Call) and len(v.args) == 1 and not v.keywords and _is_logits(v.args[0]):
        path = _attr_path(v.func)
        return ("module", ("attr", path)) if path is not None else None
    if isinstance(v, ast.Subscript) and _is_logits(v.value) and isinstance(v.slice, ast.Tuple) and \
            len(v.slice.elts) == 2 and isinstance(v.slice.elts[0], ast.Constant) and \
            v.slice.elts[0].value is Ellipsis and isinstance(v.slice.elts[1], ast.Slice) and \
            _is_name(v.slice.elts[1].upper, "unpadded_vocab_size") and v.slice.elts[1].lower is None:
        return ("vocab_cut",)
    return None


def _kind(node):
    """What one statement does around the head: ``("neutral",)`` (nothing for the vocab-parallel head), ``("if_set",
    bound name, ref)``, ``("local", name, ref)``, ``("hidden", sign, ref)``, ``("head", attribute, pre-head
    attribute, sign, ref)``, ``("logit", sign, ref)``, ``("tanh",)``, ``("softcap", divisor, factor)``, ``("module",
    ref)``, ``("vocab_cut",)``; None when it cannot be read."""
    if isinstance(node, ast.If):
        return _if_kind(node.test)
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return _assign_kind(node.targets[0].id, node.value)
    return None


@dataclass
class Statement:
    """One statement of the head part of a forward: its nesting depth, syntax node (None for an ``else:``), text
    (a compound statement's header only) and :func:`_kind`."""

    depth: int
    node: ast.stmt | None
    text: str
    kind: tuple | None


def _header(node) -> str:
    if isinstance(node, ast.If):
        return f"if {ast.unparse(node.test)}:"
    return ast.unparse(node).splitlines()[0]


def _flat(body: list, depth: int = 0):
    """Statements in source order, each compound statement's header followed by its body one level deeper."""
    for node in body:
        yield depth, node
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            yield from _flat(node.body, depth + 1)
            if getattr(node, "orelse", None):
                yield depth, None  # else:
                yield from _flat(node.orelse, depth + 1)


def _decoder_assignment(node) -> bool:
    """An assignment that reads the decoder's output (``outputs.last_hidden_state``, ``outputs[0]``)."""
    return isinstance(node, ast.Assign) and any(
        _decoder_out(n) and not _is_name(n, "hidden_states") for n in ast.walk(node.value))


def _ends_head(node) -> bool:
    """The loss, the returned output or ``return_dict`` handling: the head part is over."""
    if isinstance(node, ast.Return):
        return True
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_name(node.targets[0], "loss", "output"):
        return True
    if isinstance(node, ast.If):
        t = node.test
        return isinstance(t, ast.Compare) and _is_name(t.left, "labels") or \
            isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and _is_name(t.operand, "return_dict")
    return False


def statements(forward: Callable) -> list[Statement]:
    """The head part of a CausalLM forward: from the statement that takes the decoder's output to the loss."""
    tree = compat.forward_tree(forward)
    fn = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    flat = list(_flat(fn.body))
    start = next((i for i, (_, n) in enumerate(flat) if n is not None and _decoder_assignment(n)), None)
    if start is None:
        return []
    out = []
    for depth, node in flat[start:]:
        if node is not None and _ends_head(node):
            break
        out.append(Statement(depth, node, "else:" if node is None else _header(node),
                             None if node is None else _kind(node)))
    return out


# ------------------------------------------------------------------------------------------- the live model's values
def _value(model, ref, local: dict | None = None):
    """A :func:`_operand` on the live model: ``self.a.b`` (``get_text_config()`` calls allowed), a local bound
    earlier, or a number."""
    what, v = ref
    if what == "num":
        return float(v)
    if what == "name":
        if local and v in local:
            return local[v]
        raise ValueError(f"{v!r} is not a value read earlier")
    obj = model
    for name in v:
        obj = getattr(obj, name.removesuffix("()"))
        if name.endswith("()"):
            obj = obj()
    if torch.is_tensor(obj):
        return obj.detach().float() if obj.numel() > 1 else float(obj)
    return obj


def head_transform(model: PreTrainedModel) -> HeadTransform:
    """The steps ``type(model).forward`` applies around its LM head, with this model's values filled in."""
    t = HeadTransform()
    try:
        stmts = statements(type(model).forward)
    except (OSError, TypeError, SyntaxError) as exc:  # no source (compiled, or built at runtime)
        t.unknown.append(f"forward source unavailable ({exc})")
        return t
    t.source = "\n".join(s.text for s in stmts)
    if not any(s.kind and s.kind[0] == "head" for s in stmts):
        t.unknown.append("no `logits = self.<head>(hidden_states)` statement in the forward")
    skip_deeper, local = None, {}
    head = model.get_output_embeddings()

    def step(sign: str, ref: tuple[str, object]) -> tuple[str, object]:
        return ("mul" if sign == "*" else "div", _value(model, ref, local))

    for s in stmts:
        if skip_deeper is not None:
            if s.depth > skip_deeper:
                continue
            skip_deeper = None
        k = s.kind or ("unknown",)
        try:
            if k[0] == "if_set":
                value = _value(model, k[2])
                if k[1]:
                    local[k[1]] = value
                if value is None:
                    skip_deeper = s.depth
            elif k[0] == "neutral":
                continue
            elif k[0] == "local":
                local[k[1]] = _value(model, k[2])
            elif k[0] == "hidden":
                t.hidden.append(step(k[1], k[2]))
            elif k[0] == "head" and getattr(model, k[1], None) is head:
                if k[2]:
                    t.hidden.append(("module", getattr(model, k[2])))
                if k[3]:
                    t.logits.append(step(k[3], k[4]))
            elif k[0] == "logit":
                t.logits.append(step(k[1], k[2]))
            elif k[0] == "tanh":
                t.logits.append(("tanh", None))
            elif k[0] == "softcap":
                t.logits += [step("/", k[1]), ("tanh", None), step("*", k[2])]
            elif k[0] == "module":
                t.logits.append(("module", _value(model, k[1])))
            elif k[0] == "vocab_cut":
                limit = getattr(model.config.get_text_config(), "unpadded_vocab_size", None)
                t.vocab_limit = int(limit) if limit is not None else None
            else:
                t.unknown.append(s.text)
        except (AttributeError, ValueError) as exc:
            t.unknown.append(f"{s.text} ({exc})")
    return t
