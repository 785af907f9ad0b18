"""Activations for the generated epilogues, fast where the output's precision allows it.

The GEMM kernels apply their epilogue to fp32 accumulators. With ``tl.sigmoid`` a tanh-GELU or SiLU costs an
exponential and an IEEE-exact division per element: ~20 instructions, which on short-K GEMMs (GPT-2's fc1,
K=768: 12 K steps per tile) is not hidden behind the tensor cores. When the result is stored in 16 bits
(``LOW_PRECISION``: bf16 keeps 8 mantissa bits, fp16 11), the hardware's ``tanh.approx.f32`` (one MUFU op,
max relative error ~2^-11) is exact enough: the activations are rewritten around it
(``sigmoid(x) = 0.5 + 0.5 * tanh(x / 2)``). fp32 outputs, the Triton interpreter (no PTX) and non-NVIDIA
backends keep the exact forms.

Example:
    >>> y = gelu_tanh(acc, LOW_PRECISION)  # inside a @triton.jit kernel  # doctest: +SKIP
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["ASM_TANH", "gelu_tanh", "sigmoid", "silu", "tanh"]


def _asm_tanh_available() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False  # the interpreter runs no PTX
    try:
        import torch

        return torch.version.hip is None
    except Exception:  # pragma: no cover - no torch: no CUDA either
        return False


# Whether ``tanh.approx.f32`` may be emitted (decided when the kernels are first imported).
ASM_TANH = tl.constexpr(_asm_tanh_available())


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def tanh(x, LOW_PRECISION: tl.constexpr):
    """tanh of fp32 ``x``: one MUFU op when ``LOW_PRECISION`` (a 16-bit output), else via an exact sigmoid."""
    if LOW_PRECISION and ASM_TANH:
        return _tanh_approx(x)
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def sigmoid(x, LOW_PRECISION: tl.constexpr):
    """sigmoid of fp32 ``x`` (``0.5 + 0.5 * tanh(x / 2)`` when ``LOW_PRECISION``)."""
    if LOW_PRECISION and ASM_TANH:
        return 0.5 + 0.5 * _tanh_approx(0.5 * x)
    else:
        return tl.sigmoid(x)


@triton.jit
def silu(x, LOW_PRECISION: tl.constexpr):
    """``x * sigmoid(x)`` on fp32 ``x``."""
    return x * sigmoid(x, LOW_PRECISION)


@triton.jit
def gelu_tanh(x, LOW_PRECISION: tl.constexpr):
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` on fp32 ``x`` (PyTorch's ``approximate="tanh"``)."""
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    if LOW_PRECISION and ASM_TANH:
        return 0.5 * x * (1.0 + _tanh_approx(inner))
    else:
        return x * tl.sigmoid(2.0 * inner)
