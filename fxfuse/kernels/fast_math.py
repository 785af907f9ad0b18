"""Hardware sine and cosine for epilogues with 16-bit outputs, and the lines that choose them per dtype.

``tl.sin`` / ``tl.cos`` are libdevice's ``sinf`` / ``cosf``: exact to an ulp over the whole fp32 range, at ~40
instructions each. A SIREN layer (``sin(30 * linear(x))``) spends more time there than in its matmul: on the
H200 the fused 2-64-64-64-1 fp16 chain took 365 µs at 2^20 rows, about 2 sines per SM per clock (its FLOPs
need ~30 µs). The hardware's ``sin.approx.f32`` / ``cos.approx.f32`` (one MUFU op, 16 per SM per clock) have
an absolute error of at most 2^-20.9 on [-pi, pi]; after a two-constant reduction to that range they stay
within ~1e-6 for |x| up to ~4e5 (with the last step an FMA, as the compiler makes it; the interpreter's
unfused steps: ~5e-6), and drift beyond (0.03 at 1e6, where a bf16 argument is already rounded by more). That
is below a 16-bit output's rounding (half an ulp of fp16 at 1 is 2.4e-4; near 0 about an ulp), so fp16 and
bf16 outputs use them; fp32 outputs keep libdevice's.

The choice is made when the kernel compiles: :func:`epilogue_lines` wraps an epilogue that uses sin or cos in
``if <the output is fp32>: ... else: ...``, a branch on a compile-time value. ``FXFUSE_FAST_MATH=0`` keeps
libdevice's everywhere (as it keeps the exact tanh forms of bf16 epilogues); it is read when a kernel's source
is generated, so it must be set before a process's first call of a region with a sine. The interpreter has no
inline assembly: there the 16-bit branch runs the same reduction, then ``tl.sin`` / ``tl.cos``
(``sin_reduced`` / ``cos_reduced``), so the CPU tests exercise the reduction.

Example:
    >>> test = "out_ptr.dtype.element_ty == tl.float32"
    >>> lines, result = epilogue_lines(ep.parse("sin(mul(30.0,a0))"), ["acc"], [], "_e", test)
    >>> lines[0], result
    ('if out_ptr.dtype.element_ty == tl.float32:', '_y_e')
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl

from .. import epilogue as ep
from .template import fast_math_enabled, interpreting

__all__ = ["IMPORT_LINE", "cos_approx", "cos_reduced", "epilogue_lines", "sin_approx", "sin_reduced", "trig_forms",
           "uses_trig"]

_TRIG = ("sin", "cos")
IMPORT_LINE = "from fxfuse.kernels.fast_math import cos_approx, cos_reduced, sin_approx, sin_reduced"


@triton.jit
def _reduce(x):
    """x - 2 pi k, k = round(x / (2 pi)), in [-pi, pi]: 6.28125 has 8 significant bits, so k * 6.28125 is exact
    for |k| < 2^16, and the remainder of 2 pi comes second. Infinity and NaN give NaN, as sin does."""
    k = tl.floor(x * 0.15915494309189535 + 0.5)
    return (x - k * 6.28125) - k * 0.0019353071795864769


@triton.jit
def sin_approx(x):
    """sin(x) on fp32 values by ``sin.approx.f32`` after :func:`_reduce` (absolute error ~1e-6)."""
    return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [_reduce(x)], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def cos_approx(x):
    """cos(x) on fp32 values by ``cos.approx.f32`` after :func:`_reduce` (absolute error ~1e-6)."""
    return tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [_reduce(x)], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def sin_reduced(x):
    """The interpreter's stand-in for :func:`sin_approx`: the same reduction, then ``tl.sin``."""
    return tl.sin(_reduce(x))


@triton.jit
def cos_reduced(x):
    """The interpreter's stand-in for :func:`cos_approx`."""
    return tl.cos(_reduce(x))


def uses_trig(expr: ep.Expr) -> bool:
    """Whether ``expr`` calls sin or cos."""
    return isinstance(expr, ep.Call) and (expr.op in _TRIG or any(uses_trig(a) for a in expr.args))


def trig_forms() -> dict[str, str]:
    """The 16-bit forms of sin and cos for :func:`fxfuse.epilogue.to_triton` (the interpreter's stand-ins there;
    none under ``FXFUSE_FAST_MATH=0``)."""
    if not fast_math_enabled():
        return {}
    suffix = "reduced" if interpreting() else "approx"
    return {op: f"{op}_{suffix}({{0}})" for op in _TRIG}


def epilogue_lines(expr: ep.Expr, acc_names: Sequence[str], operand_names: Sequence[str], prefix: str,
                   is_fp32: str) -> tuple[list[str], str]:
    """``expr`` as Triton lines (no indent) and the name of its result; with sin or cos, two renderings chosen at
    compile time by ``is_fp32`` (a compile-time Triton condition: the output is fp32): libdevice's for fp32, the
    hardware's for 16-bit outputs."""
    lines, result = ep.to_triton(expr, acc_names=acc_names, operand_names=operand_names, indent="", prefix=prefix)
    forms = trig_forms()
    if not (forms and uses_trig(expr)):
        return lines, result
    fast, fast_result = ep.to_triton(expr, acc_names=acc_names, operand_names=operand_names, indent="    ",
                                     prefix=prefix + "t", forms=forms)
    name = f"_y{prefix}"
    return ([f"if {is_fp32}:", *("    " + line for line in lines), f"    {name} = {result}",
             "else:  # 16-bit output: the hardware's sine / cosine (fxfuse/kernels/fast_math.py)", *fast,
             f"    {name} = {fast_result}"], name)
