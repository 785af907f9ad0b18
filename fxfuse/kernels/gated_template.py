"""Triton kernels for a gated MLP's pointwise middle in training: ``h = act(g) * u`` and its gradients.

Eager runs the middle of ``down(act(gate(x)) * up(x))`` as two kernels forward (the activation, the product)
and three backward (the product's two gradients, the activation's), moving the ``[M, hidden]`` tensors through
memory 14 times and saving ``act(g)`` besides ``g`` and ``u``. These two kernels move them 8 times (forward:
read g and u, write h; backward: read dh, g and u, write dg and du) and save only ``g`` and ``u`` (Liger-Kernel's
SwiGLU/GeGLU scheme). The activation and its derivative are computed on fp32 values and each result is cast
once to the dtype.

Activations (:data:`GATED_ACTIVATIONS`): SiLU, GELU (erf) and GELU (tanh form), the three gated MLPs in use
(Llama's SwiGLU, GeGLU in both forms).

Example:
    >>> sorted(GATED_ACTIVATIONS)
    ['gelu', 'gelu_tanh', 'silu']
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["GATED_ACTIVATIONS", "gated_backward_kernel", "gated_forward_kernel"]

# Epilogue op name -> the kernels' ACT code.
GATED_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """act(g) and act'(g), on fp32 values."""
    if ACT == 0:  # silu: g * s, s = sigmoid(g)
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACT == 1:  # gelu (erf): g * cdf(g)
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:  # gelu (tanh form): 0.5 g (1 + t), t = tanh(c (g + 0.044715 g^3)) = 2 sigmoid(2 c (...)) - 1
        t = 2.0 * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) - 1.0
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 0.134145 * g * g)


@triton.jit
def _load_block(ptr, N, BLOCK: tl.constexpr):
    """This program's block of N contiguous elements, as fp32, with its offsets and mask."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32), offs, mask


# One config: a streaming kernel (the Triton tutorial's vector add). The autotuner wrapper is what lets
# ``fastlaunch`` relaunch it without Triton's Python launch path.
_CONFIGS = [triton.Config({"BLOCK": 1024}, num_warps=4)]


@triton.autotune(configs=_CONFIGS, key=[])
@triton.jit
def gated_forward_kernel(g_ptr, u_ptr, h_ptr, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """``h = act(g) * u`` over N contiguous elements.

    Args:
        g_ptr: the gate projection's output (the activation's input), N elements.
        u_ptr: the up projection's output, N elements, g's dtype.
        h_ptr: the result, N elements, g's dtype.
        N: the element count (int64 offsets where it needs them: Triton specializes on its size).
        ACT: which activation (:data:`GATED_ACTIVATIONS`).
        BLOCK: elements per program.
    """
    g, offs, mask = _load_block(g_ptr, N, BLOCK)
    u, _, _ = _load_block(u_ptr, N, BLOCK)
    a, _ = _activation(g, ACT)
    tl.store(h_ptr + offs, (a * u).to(h_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_CONFIGS, key=[])
@triton.jit
def gated_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """``du = dh * act(g)`` and ``dg = dh * u * act'(g)`` over N contiguous elements.

    Args:
        dh_ptr: the gradient of ``h``, N elements.
        g_ptr, u_ptr: the forward's inputs (saved), N elements each.
        dg_ptr, du_ptr: the gradients of g and u, N elements each, in g's dtype. ``dg_ptr`` may be ``dh_ptr``
            (each element is read before it is written, by the same program): a caller that needs dh no more saves
            one ``[M, hidden]`` buffer.
        N: the element count.
        ACT: which activation (:data:`GATED_ACTIVATIONS`).
        BLOCK: elements per program.
    """
    dh, offs, mask = _load_block(dh_ptr, N, BLOCK)
    g, _, _ = _load_block(g_ptr, N, BLOCK)
    u, _, _ = _load_block(u_ptr, N, BLOCK)
    a, da = _activation(g, ACT)
    tl.store(du_ptr + offs, (dh * a).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dh * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
