"""The derivative of a one-accumulator epilogue, written in the epilogue language.

The fused chain backward (:mod:`fxfuse.kernels.chain_backward_template`) multiplies each layer's incoming
gradient by act'(a). Its table (``DERIVATIVES``) holds hand-written forms of the common activations, each
matched to the tensor eager saves (ReLU's output, GELU's input). Any other epilogue over one accumulator built
from smooth ops (SIREN's ``sin(mul(a0,30.0))``, QuickGELU's ``mul(a0,sigmoid(mul(1.702,a0)))``) gets its
derivative here, by the chain rule, as an expression of the pre-activation ``a0``: the kernels evaluate it on
fp32 values like the forward epilogue.

Ops with a kink (relu, abs, the clamps, hardtanh, leaky_relu, maximum, minimum) have no derivative here:
eager picks a side at the kink op by op, which a formula would not reproduce. Epilogues with operands have none
either (the chain backward takes none).

Example:
    >>> str(derivative(ep.parse("sin(mul(a0,30.0))")))
    'mul(cos(mul(a0,30.0)),30.0)'
    >>> derivative(ep.parse("relu(a0)")) is None
    True
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import epilogue as ep

__all__ = ["derivative", "derivative_text"]

_ONE, _ZERO = ep.Const(1.0), ep.Const(0.0)
_KINKED = frozenset({"relu", "abs", "leaky_relu", "hardtanh", "clamp_min", "clamp_max", "maximum", "minimum"})
_GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)


def _call(op: str, *args: ep.Expr) -> ep.Expr:
    """``op(*args)``, folded where the arguments make it trivial (the language refuses ops on two constants)."""
    if all(isinstance(a, ep.Const) for a in args):
        return ep.Const(float(ep.OPS[op].torch(*[torch.tensor(a.value, dtype=torch.float64) for a in args])))
    if op == "mul":
        a, b = args
        if _ZERO in (a, b):
            return _ZERO
        if a == _ONE:
            return b
        if b == _ONE:
            return a
    if op == "add":
        a, b = args
        if a == _ZERO:
            return b
        if b == _ZERO:
            return a
    if op == "sub" and args[1] == _ZERO:
        return args[0]
    if op == "div" and args[1] == _ONE:
        return args[0]
    return ep.Call(op, tuple(args))


def _mul(*factors: ep.Expr) -> ep.Expr:
    out = factors[0]
    for f in factors[1:]:
        out = _call("mul", out, f)
    return out


def _outer(op: str, u: ep.Expr, e: ep.Call) -> Optional[ep.Expr]:
    """d op(u) / du for a unary op, as an expression of u (``e`` is ``op(u)``, reused where the form has it)."""
    c = ep.Const
    if op == "neg":
        return c(-1.0)
    if op == "exp":
        return e
    if op == "log":
        return _call("div", _ONE, u)
    if op == "sqrt":
        return _call("div", c(0.5), e)
    if op == "rsqrt":
        return _mul(c(-0.5), e, e, e)
    if op == "sin":
        return _call("cos", u)
    if op == "cos":
        return _call("neg", _call("sin", u))
    if op == "tanh":
        return _call("sub", _ONE, _call("pow", e, c(2.0)))
    if op == "sigmoid":
        return _call("mul", e, _call("sub", _ONE, e))
    if op == "silu":  # s (1 + u (1 - s))
        s = _call("sigmoid", u)
        return _call("mul", s, _call("add", _ONE, _call("mul", u, _call("sub", _ONE, s))))
    if op == "erf":
        return _call("mul", c(2.0 / math.sqrt(math.pi)), _call("exp", _call("neg", _call("pow", u, c(2.0)))))
    if op == "gelu":  # Phi(u) + u phi(u)
        cdf = _call("mul", c(0.5), _call("add", _ONE, _call("erf", _call("mul", u, c(1.0 / math.sqrt(2.0))))))
        pdf = _call("mul", c(1.0 / math.sqrt(2.0 * math.pi)), _call("exp", _call("mul", c(-0.5),
                                                                                 _call("pow", u, c(2.0)))))
        return _call("add", cdf, _call("mul", u, pdf))
    if op == "gelu_tanh":  # t = tanh(c (u + 0.044715 u^3)): 0.5 (1 + t) + 0.5 u (1 - t^2) c (1 + 0.134145 u^2)
        t = _call("tanh", _call("mul", c(_GELU_TANH_C), _call("add", u, _call("mul", c(0.044715),
                                                                               _call("pow", u, c(3.0))))))
        first = _call("mul", c(0.5), _call("add", _ONE, t))
        slope = _call("mul", c(_GELU_TANH_C), _call("add", _ONE, _call("mul", c(0.134145), _call("pow", u, c(2.0)))))
        return _call("add", first, _mul(c(0.5), u, _call("sub", _ONE, _call("pow", t, c(2.0))), slope))
    return None


def _d(e: ep.Expr) -> Optional[ep.Expr]:
    """d e / d a0, or None where an op has no derivative here."""
    if isinstance(e, ep.Acc):
        return _ONE if e.index == 0 else None
    if isinstance(e, ep.Const):
        return _ZERO
    if isinstance(e, ep.Operand) or e.op in _KINKED:
        return None
    if e.op == "pow":
        u, k = e.args[0], e.args[1].value  # type: ignore[union-attr]
        du = _d(u)
        if du is None:
            return None
        if k == 0.5:
            return _mul(ep.Const(0.5), _call("rsqrt", u), du)
        outer = _ONE if k == 1.0 else _call("mul", ep.Const(k), u if k == 2.0 else _call("pow", u, ep.Const(k - 1)))
        return _call("mul", outer, du)
    if len(e.args) == 1:
        du = _d(e.args[0])
        outer = _outer(e.op, e.args[0], e)
        return None if du is None or outer is None else _call("mul", outer, du)
    x, y = e.args
    dx, dy = _d(x), _d(y)
    if dx is None or dy is None:
        return None
    if e.op == "add":
        return _call("add", dx, dy)
    if e.op == "sub":
        return _call("sub", dx, dy)
    if e.op == "mul":
        return _call("add", _call("mul", dx, y), _call("mul", x, dy))
    if e.op == "div":  # (dx - (x / y) dy) / y: no y^2 to overflow (fp32 past |y| = 1.8e19), as eager computes it
        return _call("div", _call("sub", dx, _call("mul", e, dy)), y)
    return None


def derivative(expr: ep.Expr) -> Optional[ep.Expr]:
    """d ``expr`` / d ``a0`` as an epilogue expression of ``a0``, or None: another accumulator or an operand
    appears, or an op without a derivative here (the kinked ones), or a constant that folds to infinity."""
    try:
        return _d(expr)
    except ValueError:  # (a folded constant that is not finite)
        return None


@functools.lru_cache(maxsize=1024)
def derivative_text(epilogue: str) -> Optional[str]:
    """:func:`derivative` of an epilogue's text, as text (asked on every backward: cached).

    Example:
        >>> derivative_text("mul(a0,sigmoid(mul(1.702,a0)))")
        'add(sigmoid(mul(1.702,a0)),mul(a0,mul(mul(sigmoid(mul(1.702,a0)),sub(1.0,sigmoid(mul(1.702,a0)))),1.702)))'
    """
    d = derivative(ep.parse(epilogue))
    return None if d is None else str(d)
