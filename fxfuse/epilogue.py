"""The epilogue language: the pointwise math fused between two GEMMs.

An epilogue is a small expression tree over
  * accumulators ``a0``, ``a1``: the fp32 GEMM results of the stage (bias already added),
  * operands ``v0``, ``v1``, ...: tensors broadcast along the output's last dim (``[N]`` or one element),
  * float constants.

Its text form (``mul(gelu_tanh(a0),a1)``) is the single source of truth: it is the key of the
generated kernel, the ``spec`` argument of the ``torch.ops.fxfuse`` op (so an exported program
can rebuild everything from it), and the signature the matcher compares patterns by.
It renders two ways: Triton statements applied to the fp32 accumulator (``to_triton``) and a
torch reference (``evaluate``) used by the CPU implementation, the fallback and autograd.

Example:
    >>> e = parse("mul(silu(a0),a1)")
    >>> str(e), num_accumulators(e), num_operands(e)
    ('mul(silu(a0),a1)', 2, 0)
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = [
    "OPS",
    "Acc",
    "Call",
    "Const",
    "Expr",
    "Operand",
    "canonicalize",
    "compiled_reference",
    "evaluate",
    "num_accumulators",
    "num_operands",
    "parse",
    "to_triton",
]


@dataclass(frozen=True)
class OpDef:
    """One pointwise op of the language.

    ``triton`` is a format string over the rendered arguments ``{0}``, ``{1}`` (fp32 values);
    ``torch`` computes the same op on tensors (used by the reference path).
    """

    name: str
    arity: int
    triton: str
    torch: Callable
    commutative: bool = False


def _pow(x, c):
    return torch.pow(x, c)


# tanh on fp32 values. Triton has no portable tanh (libdevice's does not run in the interpreter), so it goes through
# sigmoid, 2 * sigmoid(2x) - 1, where |x| >= TANH_SMALL. Below, that difference cancels: its absolute error (~6e-8)
# is a large relative error at small x (an fp32 MLP whose pre-activations were ~1e-4 came out 7e-4 off, eager
# 1e-7), so there an odd polynomial x + x^3 p(x^2) runs instead, fitted for the least relative error on
# [0, TANH_SMALL] (4.4e-9: below fp32's rounding). Evaluated in fp32 against float64: at most 7.9e-8 relative below
# TANH_SMALL, 3.0e-7 above (a few ulp). Its cost, five FMAs and a select beside the exp and the division, is paid
# for every dtype (an epilogue does not know the output's); bf16 under FAST_MATH has the hardware tanh instead
# (FAST_FORMS). Infinities give +-1 and NaN stays NaN (the sigmoid branch's; ``tl.where`` drops the other branch).
TANH_SMALL = 0.625
_TANH_POLY = (-0.3333328193, 0.1333144199, -0.05373970001, 0.02063904271, -0.005704941115)  # x^3 .. x^11


def _tanh_triton() -> str:
    u = "({0} * {0})"
    poly = repr(_TANH_POLY[-1])
    for c in reversed(_TANH_POLY[:-1]):
        poly = f"({c!r} + {u} * {poly})"
    return (f"tl.where(tl.abs({{0}}) < {TANH_SMALL!r}, {{0}} + {{0}} * {u} * {poly}, "
            "2.0 * tl.sigmoid(2.0 * {0}) - 1.0)")


_TANH = _tanh_triton()

# Activations are written on fp32 values, tutorial style (tanh: see above). Maxima and minima propagate NaN, as
# torch.relu / clamp / maximum do (Triton's default returns the other operand: a NaN would vanish).
OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        OpDef("relu", 1, "tl.maximum({0}, 0.0, propagate_nan=tl.PropagateNan.ALL)", torch.relu),
        OpDef("gelu", 1, "0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476))", F.gelu),
        OpDef(
            "gelu_tanh",
            1,
            "{0} * tl.sigmoid(1.5957691216057308 * ({0} + 0.044715 * {0} * {0} * {0}))",
            lambda x: F.gelu(x, approximate="tanh"),
        ),
        OpDef("silu", 1, "{0} * tl.sigmoid({0})", F.silu),
        OpDef("sigmoid", 1, "tl.sigmoid({0})", torch.sigmoid),
        OpDef("tanh", 1, _TANH, torch.tanh),
        OpDef("neg", 1, "(-{0})", torch.neg),
        OpDef("exp", 1, "tl.exp({0})", torch.exp),
        OpDef("log", 1, "tl.log({0})", torch.log),
        OpDef("abs", 1, "tl.abs({0})", torch.abs),
        OpDef("sqrt", 1, "tl.sqrt({0})", torch.sqrt),
        OpDef("rsqrt", 1, "tl.rsqrt({0})", torch.rsqrt),
        OpDef("erf", 1, "tl.erf({0})", torch.erf),  # a written-out erf GELU (ESM's): x * 0.5 * (1 + erf(x / sqrt(2)))
        OpDef("sin", 1, "tl.sin({0})", torch.sin),  # SIREN's sin(omega_0 * linear(x))
        OpDef("cos", 1, "tl.cos({0})", torch.cos),
        OpDef("leaky_relu", 2, "tl.where({0} >= 0.0, {0}, {0} * {1})", F.leaky_relu),
        OpDef("add", 2, "({0} + {1})", torch.add, commutative=True),
        OpDef("sub", 2, "({0} - {1})", torch.sub),
        OpDef("mul", 2, "({0} * {1})", torch.mul, commutative=True),
        OpDef("div", 2, "({0} / {1})", torch.div),
        OpDef("maximum", 2, "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", torch.maximum, commutative=True),
        OpDef("minimum", 2, "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", torch.minimum, commutative=True),
        OpDef("clamp_min", 2, "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", torch.clamp_min),
        OpDef("clamp_max", 2, "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)", torch.clamp_max),
        # ReLU6 / Hardtanh: clamp's values, but not its gradient (0 at the bounds, where clamp's passes)
        OpDef("hardtanh", 3, "tl.minimum(tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL), {2}, "
                             "propagate_nan=tl.PropagateNan.ALL)", F.hardtanh),
        # Only small integer powers (and 0.5) are allowed: see ``_check_pow``.
        OpDef("pow", 2, "<pow>", _pow),
    ]
}

# Hardware forms for bf16 outputs in the compute-bound kernels: one `tanh.approx.f32` (a single MUFU op, max
# relative error 2^-11, below bf16's 2^-9 rounding) instead of an exp and a reciprocal (two MUFU ops). The MUFU
# unit runs 16 ops per clock per SM against 128 FMAs, so at short K the epilogue's transcendentals cost as much
# as a tenth of the tile's MMAs (H100, seed GeGLU gate+up: 129.4 -> 120.3 µs, 112.6 with no activation).
# ``_tanh_approx`` is a helper of the templates that use these (fxfuse/kernels/tma_template.py). Each form is
# written for the fewest instructions once the compiler fuses a multiply and an add into an FMA: tanh-GELU as
# ``h + h·tanh(x·(c0 + c1·x²))`` with ``h = x/2`` (two FMAs, three multiplies), not ``0.5·x·(1 + tanh(c0·(x +
# 0.044715·x³)))`` (seven ops), SiLU as ``h + h·tanh(h)``, since at short K the epilogue's instruction issue
# competes with the MMAs.
FAST_FORMS: dict[str, str] = {
    "gelu_tanh": "(0.5 * {0} + 0.5 * {0} * _tanh_approx({0} * (0.7978845608028654 + 0.0356774081363 * {0} * {0})))",
    "silu": "(0.5 * {0} + 0.5 * {0} * _tanh_approx(0.5 * {0}))",
    "sigmoid": "(0.5 + 0.5 * _tanh_approx(0.5 * {0}))",
    "tanh": "_tanh_approx({0})",
}

_ALLOWED_POWERS = {0.5: "tl.sqrt({0})", 1.0: "{0}", 2.0: "({0} * {0})", 3.0: "({0} * {0} * {0})",
                   4.0: "({0} * {0} * {0} * {0})"}


@dataclass(frozen=True)
class Acc:
    """The fp32 accumulator of GEMM number ``index`` of the stage (bias included)."""

    index: int

    def __str__(self) -> str:
        return f"a{self.index}"


@dataclass(frozen=True)
class Operand:
    """Tensor operand ``index``, broadcast along the last dim (``[N]`` or a single element)."""

    index: int

    def __str__(self) -> str:
        return f"v{self.index}"


@dataclass(frozen=True)
class Const:
    value: float

    def __post_init__(self):
        if not math.isfinite(self.value):
            raise ValueError(f"epilogue constants must be finite, got {self.value}")

    def __str__(self) -> str:
        return repr(float(self.value))


@dataclass(frozen=True)
class Call:
    op: str
    args: tuple[Expr, ...]

    def __post_init__(self):
        opdef = OPS.get(self.op)
        if opdef is None:
            raise ValueError(f"unknown epilogue op {self.op!r}")
        if len(self.args) != opdef.arity:
            raise ValueError(f"{self.op} takes {opdef.arity} argument(s), got {len(self.args)}")
        if self.op == "pow" and not (isinstance(self.args[1], Const) and self.args[1].value in _ALLOWED_POWERS):
            raise ValueError(f"pow exponent must be one of {sorted(_ALLOWED_POWERS)}")
        if opdef.arity == 2 and all(isinstance(a, Const) for a in self.args):
            raise ValueError(f"{self.op} on two constants should be folded before it reaches the epilogue")

    def __str__(self) -> str:
        return f"{self.op}({','.join(str(a) for a in self.args)})"


Expr = Union[Acc, Operand, Const, Call]


def _leaves(expr: Expr):
    if isinstance(expr, Call):
        for a in expr.args:
            yield from _leaves(a)
    else:
        yield expr


def num_accumulators(expr: Expr) -> int:
    return 1 + max((x.index for x in _leaves(expr) if isinstance(x, Acc)), default=-1)


def num_operands(expr: Expr) -> int:
    return 1 + max((x.index for x in _leaves(expr) if isinstance(x, Operand)), default=-1)


_TOKEN = re.compile(r"\s*(?:(?P<name>[a-z_][a-z_0-9]*)|(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)|(?P<p>[(),]))",
                    re.IGNORECASE)


def parse(text: str) -> Expr:
    """Parse the text form (``str(expr)``) back into an expression tree."""
    tokens = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"bad epilogue text at {pos}: {text!r}")
        tokens.append(m.group("name") or m.group("num") or m.group("p"))
        pos = m.end()
    tokens.append(None)
    it = iter(range(len(tokens)))
    cur = [next(it)]

    def peek():
        return tokens[cur[0]]

    def take(expected=None):
        tok = tokens[cur[0]]
        if expected is not None and tok != expected:
            raise ValueError(f"expected {expected!r}, got {tok!r} in {text!r}")
        cur[0] = next(it)
        return tok

    def expr() -> Expr:
        tok = take()
        if tok is None:
            raise ValueError(f"unexpected end of {text!r}")
        if re.fullmatch(r"a\d+", tok):
            return Acc(int(tok[1:]))
        if re.fullmatch(r"v\d+", tok):
            return Operand(int(tok[1:]))
        if tok[0].isdigit() or tok[0] in "+-.":
            return Const(float(tok))
        take("(")
        args = [expr()]
        while peek() == ",":
            take(",")
            args.append(expr())
        take(")")
        return Call(tok, tuple(args))

    result = expr()
    if peek() is not None:
        raise ValueError(f"trailing text in {text!r}")
    return result


def canonicalize(expr: Expr) -> tuple[Expr, list[Acc | Operand]]:
    """Put ``expr`` in canonical form, so that equal math gives equal text.

    Arguments of commutative ops are sorted (with leaves anonymised, so ``mul(a0,gelu(a1))`` and
    ``mul(gelu(a0),a1)`` agree), then accumulators and operands are renumbered in order of first
    appearance. Returns the canonical expression and, for each new index, the leaf of ``expr`` it
    came from: ``order[k]`` is the old leaf now called ``a_k``/``v_k`` (accumulators first, then operands).
    """

    def shape_key(e: Expr) -> str:
        if isinstance(e, Acc):
            return "a"
        if isinstance(e, Operand):
            return "v"
        if isinstance(e, Const):
            return str(e)
        return f"{e.op}({','.join(shape_key(a) for a in e.args)})"

    def sort(e: Expr) -> Expr:
        if not isinstance(e, Call):
            return e
        args = tuple(sort(a) for a in e.args)
        if OPS[e.op].commutative:
            args = tuple(sorted(args, key=shape_key))
        return Call(e.op, args)

    sorted_expr = sort(expr)
    accs: list[Acc] = []
    operands: list[Operand] = []
    for leaf in _leaves(sorted_expr):
        if isinstance(leaf, Acc) and leaf not in accs:
            accs.append(leaf)
        elif isinstance(leaf, Operand) and leaf not in operands:
            operands.append(leaf)
    remap: dict[Expr, Expr] = {old: Acc(i) for i, old in enumerate(accs)}
    remap.update({old: Operand(i) for i, old in enumerate(operands)})

    def rename(e: Expr) -> Expr:
        if isinstance(e, Call):
            return Call(e.op, tuple(rename(a) for a in e.args))
        return remap.get(e, e)

    return rename(sorted_expr), [*accs, *operands]


def has_fast_forms(expr: Expr) -> bool:
    """Whether ``expr`` uses an op with a hardware form in :data:`FAST_FORMS`.

    Example:
        >>> has_fast_forms(parse("mul(gelu_tanh(a0),a1)")), has_fast_forms(parse("relu(a0)"))
        (True, False)
    """
    if isinstance(expr, Call):
        return expr.op in FAST_FORMS or any(has_fast_forms(a) for a in expr.args)
    return False


def to_triton(expr: Expr, *, acc_names: Sequence[str], operand_names: Sequence[str], indent: str = "    ",
              prefix: str = "_e", fast: bool = False, forms: Optional[Mapping[str, str]] = None) \
        -> tuple[list[str], str]:
    """Render ``expr`` as Triton statements on fp32 values.

    ``acc_names[i]`` / ``operand_names[i]`` are the Triton variables holding ``a_i`` / ``v_i`` (already
    fp32 and broadcastable). Returns ``(lines, result_variable)``; shared subtrees are computed once.
    ``fast``: ops with a hardware form use it (:data:`FAST_FORMS`). ``forms``: other forms of some ops, which
    take precedence (the 16-bit sine and cosine of :mod:`fxfuse.kernels.fast_math`).

    Example:
        >>> to_triton(parse("silu(a0)"), acc_names=["acc0"], operand_names=[], fast=True)
        (['    _e0 = (0.5 * acc0 + 0.5 * acc0 * _tanh_approx(0.5 * acc0))'], '_e0')
    """
    lines: list[str] = []
    memo: dict[Expr, str] = {}

    def render(e: Expr) -> str:
        if isinstance(e, Acc):
            return acc_names[e.index]
        if isinstance(e, Operand):
            return operand_names[e.index]
        if isinstance(e, Const):
            return f"{float(e.value)!r}"
        if e in memo:
            return memo[e]
        args = [render(a) for a in e.args]
        if e.op == "pow":
            template = _ALLOWED_POWERS[e.args[1].value]  # type: ignore[union-attr]
            code = template.format(args[0])
        else:
            code = (forms[e.op] if forms and e.op in forms else
                    FAST_FORMS[e.op] if fast and e.op in FAST_FORMS else OPS[e.op].triton).format(*args)
        name = f"{prefix}{len(memo)}"
        lines.append(f"{indent}{name} = {code}")
        memo[e] = name
        return name

    result = render(expr)
    return lines, result


def evaluate(expr: Expr, accs: Sequence[torch.Tensor], operands: Sequence[torch.Tensor]) -> torch.Tensor:
    """The torch reference of ``expr``: the same ops eager PyTorch would run, in the tensors' dtype."""
    return compiled_reference(expr)(accs, operands)


@functools.lru_cache(maxsize=1024)
def compiled_reference(expr: Expr) -> Callable:
    """``expr``'s torch reference as nested closures ``(accs, operands) -> tensor``, built once: the reference
    path runs on every forward.

    Example:
        >>> f = compiled_reference(parse("mul(relu(a0),v0)"))
        >>> f([torch.tensor([-1.0, 2.0])], [torch.tensor([3.0, 3.0])]).tolist()
        [0.0, 6.0]
    """
    if isinstance(expr, Acc):
        i = expr.index
        return lambda accs, ops: accs[i]
    if isinstance(expr, Operand):
        i = expr.index
        return lambda accs, ops: ops[i]
    if isinstance(expr, Const):
        value = expr.value
        return lambda accs, ops: value
    fn = OPS[expr.op].torch
    children = [compiled_reference(a) for a in expr.args]
    if expr.op in ("maximum", "minimum"):  # these two take tensors only
        def tensors(accs, ops):
            args = [c(accs, ops) for c in children]
            return fn(*[a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=accs[0].dtype,
                                                                           device=accs[0].device) for a in args])
        return tensors
    if len(children) == 1:
        (c0,) = children
        return lambda accs, ops: fn(c0(accs, ops))
    if len(children) == 2:
        c0, c1 = children
        return lambda accs, ops: fn(c0(accs, ops), c1(accs, ops))
    return lambda accs, ops: fn(*[c(accs, ops) for c in children])
