"""Classify pointwise graph nodes into the epilogue language (:mod:`fxfuse.epilogue`).

Every spelling of an elementwise op (``nn.ReLU``, ``F.relu``, ``x.relu()``, ``torch.relu``, ``x.relu_()``;
``operator.mul``, ``torch.mul``, ``x.mul(y)``; ``nn.ReLU6`` → two clamps ...) is mapped to a small
:class:`PointwiseOp`: an epilogue expression whose operands ``v0, v1, ...`` stand for the node's tensor
inputs ``inputs[0], inputs[1], ...``; python numbers become constants. The cluster builder later
substitutes these expressions into each other to get the epilogue of a whole pointwise cluster.

Example:
    >>> import operator, torch
    >>> g = torch.fx.Graph(); x = g.placeholder("x")
    >>> n = g.call_function(operator.pow, (g.call_function(torch.relu, (x,)), 2))
    >>> str(classify(None, n).expr)
    'pow(v0,2.0)'
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import epilogue as ep
from .module_state import runs_own_code

__all__ = ["PointwiseOp", "Unsupported", "classify", "describe", "inplace_input", "is_identity_module",
           "is_known_activation", "INPLACE_UNSAFE"]

INPLACE_UNSAFE = "in-place op on a value that is used elsewhere"


@dataclass(frozen=True)
class PointwiseOp:
    """``expr`` over ``Operand(i)`` = ``inputs[i]`` (a graph node); what one pointwise node computes."""

    expr: ep.Expr
    inputs: tuple[fx.Node, ...]


@dataclass(frozen=True)
class Unsupported:
    """A node that looks pointwise but must not be fused, and why."""

    reason: str


_EXPR_TYPES = (ep.Acc, ep.Operand, ep.Const, ep.Call)


class _Builder:
    """Turns node arguments into epilogue leaves, numbering node inputs as operands."""

    def __init__(self):
        self.inputs: list[fx.Node] = []

    def leaf(self, arg: Any) -> ep.Expr:
        if isinstance(arg, fx.Node):
            if arg not in self.inputs:
                self.inputs.append(arg)
            return ep.Operand(self.inputs.index(arg))
        if isinstance(arg, (bool, int, float)):
            return ep.Const(float(arg))
        raise TypeError(f"unsupported argument {arg!r}")

    def call(self, op: str, *args: Any) -> ep.Expr:
        return ep.Call(op, tuple(a if isinstance(a, _EXPR_TYPES) else self.leaf(a) for a in args))


_Rule = Callable[[_Builder, Callable[[int, str, Any], Any]], ep.Expr]


def _unary(op: str) -> _Rule:
    return lambda b, arg: b.call(op, arg(0, "input", None))


def _binary(op: str, first: str = "input", second: str = "other") -> _Rule:
    def rule(b, arg):
        if arg(2, "alpha", 1) != 1 or arg(2, "rounding_mode", None) is not None:
            raise TypeError("alpha / rounding_mode")
        return b.call(op, arg(0, first, None), arg(1, second, None))
    return rule


def _gelu(b, arg):
    approx = arg(1, "approximate", "none")
    return b.call({"none": "gelu", "tanh": "gelu_tanh"}[approx], arg(0, "input", None))


def _clamp(lo: Any, hi: Any, x: Any, b: _Builder, expr: Optional[ep.Expr] = None) -> ep.Expr:
    e = expr if expr is not None else b.leaf(x)
    if lo is not None:
        e = b.call("clamp_min", e, lo)
    if hi is not None:
        e = b.call("clamp_max", e, hi)
    if lo is None and hi is None:
        raise TypeError("clamp without bounds")
    return e


def _hardtanh(lo: Any, hi: Any, x: Any, b: _Builder) -> ep.Expr:
    """``F.hardtanh`` (ReLU6's too): one op with numeric bounds (its gradient is 0 at them, clamp's is not)."""
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in (lo, hi)):  # (numpy's floats too)
        return b.call("hardtanh", x, float(lo), float(hi))
    return _clamp(lo, hi, x, b)


_UNARY = ["relu", "sigmoid", "tanh", "neg", "exp", "log", "abs", "sqrt", "rsqrt", "silu", "erf", "sin", "cos"]

# (name of the op as spelled by torch / Tensor methods) -> rule over (builder, arg getter)
_RULES: dict[str, _Rule] = {name: _unary(name) for name in _UNARY}
_RULES.update({
    "negative": _unary("neg"),
    "gelu": _gelu,
    "leaky_relu": lambda b, arg: b.call("leaky_relu", arg(0, "input", None), arg(1, "negative_slope", 0.01)),
    "relu6": lambda b, arg: _hardtanh(0.0, 6.0, arg(0, "input", None), b),
    "hardtanh": lambda b, arg: _hardtanh(arg(1, "min_val", -1.0), arg(2, "max_val", 1.0), arg(0, "input", None), b),
    "clamp": lambda b, arg: _clamp(arg(1, "min", None), arg(2, "max", None), arg(0, "input", None), b),
    "clamp_min": lambda b, arg: b.call("clamp_min", arg(0, "input", None), arg(1, "min", None)),
    "clamp_max": lambda b, arg: b.call("clamp_max", arg(0, "input", None), arg(1, "max", None)),
    "square": lambda b, arg: b.call("pow", arg(0, "input", None), 2.0),
    "add": _binary("add"),
    "sub": _binary("sub"),
    "subtract": _binary("sub"),
    "rsub": lambda b, arg: _binary("sub", "other", "input")(b, lambda i, k, d: arg(1 - i if i < 2 else i, k, d)),
    "mul": _binary("mul"),
    "multiply": _binary("mul"),
    "div": _binary("div"),
    "divide": _binary("div"),
    "true_divide": _binary("div"),
    "maximum": _binary("maximum"),
    "minimum": _binary("minimum"),
    "pow": _binary("pow", "input", "exponent"),
})
_RULES["clip"] = _RULES["clamp"]

# Functional / torch / operator spellings -> rule name. ``torch._C._nn.gelu`` is ``F.gelu``.
_FUNCTIONS: dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.pow: "pow", operator.abs: "abs",
    F.relu: "relu", F.gelu: "gelu", F.silu: "silu", F.leaky_relu: "leaky_relu", F.relu6: "relu6",
    F.hardtanh: "hardtanh", F.sigmoid: "sigmoid", F.tanh: "tanh", torch._C._nn.leaky_relu: "leaky_relu",
    torch._C._nn.hardtanh: "hardtanh", torch._C._nn.silu: "silu",
}
for _name in ["relu", "sigmoid", "tanh", "neg", "negative", "exp", "log", "abs", "sqrt", "rsqrt", "erf", "sin", "cos",
              "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide", "maximum", "minimum",
              "pow", "clamp", "clip", "clamp_min", "clamp_max", "square"]:
    _FUNCTIONS[getattr(torch, _name)] = _name
_INPLACE_FUNCTIONS: dict[Any, str] = {torch.relu_: "relu", F.relu_: "relu", torch.sigmoid_: "sigmoid",
                                      torch.tanh_: "tanh", F.leaky_relu_: "leaky_relu", F.hardtanh_: "hardtanh",
                                      torch.sin_: "sin", torch.cos_: "cos",
                                      operator.iadd: "add", operator.isub: "sub", operator.imul: "mul",
                                      operator.itruediv: "div"}  # (x += y: how Dynamo and fxfuse's tracer record it)

_AUGMENTED = {operator.iadd, operator.isub, operator.imul, operator.itruediv}

_GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}  # nn.GELU.approximate: any other value raises in eager

_MODULES: dict[type, Callable[[nn.Module, Any, _Builder], ep.Expr]] = {
    nn.ReLU: lambda m, x, b: b.call("relu", x),
    nn.GELU: lambda m, x, b: b.call(_GELU_FORMS[m.approximate], x),  # (KeyError: eager raises, nothing fused)
    nn.SiLU: lambda m, x, b: b.call("silu", x),
    nn.Sigmoid: lambda m, x, b: b.call("sigmoid", x),
    nn.Tanh: lambda m, x, b: b.call("tanh", x),
    nn.LeakyReLU: lambda m, x, b: b.call("leaky_relu", x, float(m.negative_slope)),
    nn.ReLU6: lambda m, x, b: _hardtanh(float(m.min_val), float(m.max_val), x, b),  # (Hardtanh's: bounds settable)
    nn.Hardtanh: lambda m, x, b: _hardtanh(float(m.min_val), float(m.max_val), x, b),
}

# Activation modules of other libraries, by class (``module.qualname``): they are kept as leaves when
# tracing and classified by what they compute. ``transformers.activations`` (the ``ACT2FN`` classes):
# the tanh-GELU variants (NewGELU, FastGELU, AccurateGELU, GELUTanh) all compute
# 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), which is ``gelu_tanh``.
_HF = "transformers.activations."
_NAMED_MODULES: dict[str, Callable[[nn.Module, Any, _Builder], ep.Expr]] = {
    _HF + "GELUActivation": lambda m, x, b: b.call("gelu", x),
    _HF + "GELUTanh": lambda m, x, b: b.call("gelu_tanh", x),
    _HF + "PytorchGELUTanh": lambda m, x, b: b.call("gelu_tanh", x),
    _HF + "NewGELUActivation": lambda m, x, b: b.call("gelu_tanh", x),
    _HF + "FastGELUActivation": lambda m, x, b: b.call("gelu_tanh", x),
    _HF + "AccurateGELUActivation": lambda m, x, b: b.call("gelu_tanh", x),
    _HF + "SiLUActivation": lambda m, x, b: b.call("silu", x),
    _HF + "QuickGELUActivation": lambda m, x, b: b.call("mul", b.leaf(x), b.call("sigmoid", b.call("mul", 1.702, x))),
    _HF + "ReLUSquaredActivation": lambda m, x, b: b.call("pow", b.call("relu", x), 2.0),
    _HF + "ClippedGELUActivation": lambda m, x, b: _clamp(float(m.min), float(m.max), None, b, b.call("gelu", x)),
}
# Modules that return their input unchanged.
_IDENTITY_MODULES = {_HF + "LinearActivation"}


def _class_key(mod: Any) -> str:
    cls = type(mod)
    return f"{cls.__module__}.{cls.__qualname__}"


def _module_rule(mod: Any):
    rule = _MODULES.get(type(mod))
    return rule if rule is not None else _NAMED_MODULES.get(_class_key(mod))


def is_known_activation(mod: Any) -> bool:
    """A module fxfuse classifies by its class (kept as a leaf when tracing)."""
    return _module_rule(mod) is not None or _class_key(mod) in _IDENTITY_MODULES


def is_identity_module(mod: Any) -> bool:
    """``nn.Identity`` and the like: a call returns its argument."""
    return isinstance(mod, nn.Identity) or _class_key(mod) in _IDENTITY_MODULES


_CASTS = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "int", "long", "bool"}


def describe(node: fx.Node, root: Optional[nn.Module] = None) -> str:
    """A short human name for what ``node`` calls: ``torch.erfinv``, ``Tensor.float``, ``nn.LayerNorm``."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        mod = root.get_submodule(node.target) if root is not None else None
        return f"nn.{type(mod).__name__}" if mod is not None else f"module {node.target}"
    if node.op == "call_function":
        target = node.target
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", str(target))
        if module.startswith("torch._C._nn") or module == "torch.nn.functional":
            return f"F.{name}"
        if module.startswith("torch") or isinstance(target, torch._ops.OpOverload):
            return f"torch.{name}" if not isinstance(target, torch._ops.OpOverload) else str(target)
        return f"{module}.{name}" if module else name
    return node.op


def _arg_getter(node: fx.Node) -> Callable[[int, str, Any], Any]:
    args, kwargs = node.args, node.kwargs

    def get(index: int, name: str, default: Any) -> Any:
        if index < len(args):
            return args[index]
        return kwargs.get(name, default)

    return get


def _inplace_safe(node: fx.Node) -> bool:
    """An in-place op may be treated as out-of-place when nobody else can see the mutated tensor: its other readers
    are elementwise ops that ran before the write (``h.mul_(h.sigmoid())``), which read the value it replaces."""
    target = node.args[0] if node.args else None
    if not (isinstance(target, fx.Node) and target.op in ("call_function", "call_method", "call_module")):
        return False
    others = {u for u in target.users if u is not node}
    if not others:
        return True
    before: set[fx.Node] = set()
    n = target.next
    while n is not node and n.op != "root":
        before.add(n)
        n = n.next
    return n is node and all(u in before and "fxfuse_pointwise" in u.meta for u in others)


_INPLACE_FLAG_AT = {"relu": 1, "silu": 1, "relu6": 1, "hardtanh": 3, "leaky_relu": 2}  # F.relu(x, inplace=...)'s place


def _inplace_flag(node: fx.Node, name: str) -> bool:
    """``F.relu(x, inplace=True)`` and the like: the flag, the last positional argument or a keyword."""
    flag = _arg_getter(node)(_INPLACE_FLAG_AT[name], "inplace", False)
    return isinstance(flag, bool) and flag


def inplace_input(root: Optional[nn.Module], node: fx.Node) -> Optional[fx.Node]:
    """The tensor an in-place elementwise op writes and returns (``h.relu_()``, ``F.relu(h, inplace=True)``,
    ``nn.ReLU(inplace=True)(h)``, ``h += 1``); None for any other node.

    Example:
        >>> gm = fx.symbolic_trace(lambda h: h.relu_())
        >>> relu_ = next(n for n in gm.graph.nodes if n.op == "call_method")
        >>> inplace_input(gm, relu_).name
        'h'
    """
    target = node.args[0] if node.args else None
    if not isinstance(target, fx.Node):
        return None
    if node.op == "call_method":
        name = str(node.target)
        return target if name.endswith("_") and name[:-1] in _RULES else None
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS:  # (not ``x += y``: on a number it makes a new one)
            return target if node.target not in _AUGMENTED else None
        name = _FUNCTIONS.get(node.target)
        return target if name in _INPLACE_FLAG_AT and _inplace_flag(node, name) else None
    if node.op == "call_module" and root is not None and len(node.args) == 1 and not node.kwargs:
        mod = root.get_submodule(node.target)
        # (a call that runs hooks or an instance forward may return, or write, another tensor)
        return target if type(mod) in _MODULES and getattr(mod, "inplace", False) is True \
            and not runs_own_code(mod) else None
    return None


def classify(root: Optional[nn.Module], node: fx.Node) -> Union[PointwiseOp, Unsupported, None]:
    """Classify ``node``: a :class:`PointwiseOp`, an :class:`Unsupported` reason, or ``None`` (not pointwise).

    ``root`` is the graph's module (needed for ``call_module`` nodes).
    """
    if "out" in node.kwargs:
        return None
    value = node.meta.get("val", node.meta.get("example_value"))
    if value is not None and not isinstance(value, torch.Tensor):
        return None  # SymInt arithmetic on sizes, not a tensor op
    b = _Builder()
    inplace = False
    try:
        if node.op == "call_module":
            mod = root.get_submodule(node.target) if root is not None else None
            rule = _module_rule(mod)
            if rule is None or len(node.args) != 1 or node.kwargs:
                return None
            inplace = bool(getattr(mod, "inplace", False))
            expr = rule(mod, node.args[0], b)
        elif node.op == "call_function":
            name = _FUNCTIONS.get(node.target)
            if name is None:
                name = _INPLACE_FUNCTIONS.get(node.target)
                inplace = name is not None
            if name is None:
                return None
            get = _arg_getter(node)
            if name in _INPLACE_FLAG_AT and node.target in _FUNCTIONS:
                # F.relu(x, inplace=True) etc.: the flag is the last positional or a keyword
                n_pos = _INPLACE_FLAG_AT[name]
                inplace = _inplace_flag(node, name)
                node_args = node.args[:n_pos]
                get = lambda i, k, d: node_args[i] if i < len(node_args) else (  # noqa: E731
                    node.kwargs.get(k, d) if k != "inplace" else d)
            expr = _RULES[name](b, get)
        elif node.op == "call_method":
            target = str(node.target)
            if target in _CASTS:
                return Unsupported(f"cast (Tensor.{target}) in the middle")
            if target.endswith("_") and target[:-1] in _RULES:
                inplace, target = True, target[:-1]
            rule = _RULES.get(target)
            if rule is None:
                return None
            expr = rule(b, _arg_getter(node))
        else:
            return None
    except (TypeError, ValueError, KeyError, IndexError):
        return Unsupported(f"unsupported arguments of {describe(node, root)} in the middle")
    if not isinstance(expr, ep.Call) or not b.inputs:
        return None
    if inplace and not _inplace_safe(node):
        return Unsupported(INPLACE_UNSAFE)
    return PointwiseOp(expr, tuple(b.inputs))
