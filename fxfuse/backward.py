"""The fused backward of a narrow chain: one kernel for a NeRF-style region's gradients.

``torch.ops.fxfuse.mlp`` saves only its inputs. For most regions its backward is the vjp of the original ops,
which recomputes the forward op by op (see :mod:`fxfuse.ops`). A chain of single-linear stages whose
activations have a derivative in :data:`fxfuse.kernels.chain_backward_template.DERIVATIVES`, no layer wider
than 128 and weights that fit on chip, instead runs
:func:`fxfuse.kernels.chain_backward_launch.run_chain_backward`:

* where the weight gradients fit in registers (nerf64), one kernel recomputes the forward on chip and produces
  every gradient; no intermediate reaches memory;
* wider chains (nerf128) run the fused forward storing each layer's input, a walk kernel writing each layer's
  activation gradient (:mod:`fxfuse.kernels.chain_walk_template`), and one dW GEMM per layer.

Anything else, and any failure of the kernel (logged once), keeps the vjp path, so gradients are always
those of the original ops within rounding. ``FXFUSE_FUSED_BACKWARD=0`` turns the kernel off.

Example:
    >>> fused_backward_reason("1b:relu(a0);1b:a0", (32, 64, 16)) is None
    True
    >>> fused_backward_reason("1b:exp(a0);1b:a0", (32, 64, 16))
    'no derivative for exp(a0)'
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .kernels.chain_backward_template import DERIVATIVES, MAX_BACKWARD_WIDTH, backward_fits
from .kernels.template import interpreting
from .spec import MLPSpec

__all__ = ["fused_backward_enabled", "fused_backward_reason", "fused_chain_gradients"]

log = logging.getLogger(__name__)
_failed: set[tuple[str, str]] = set()


def fused_backward_enabled() -> bool:
    """``FXFUSE_FUSED_BACKWARD`` is not ``0`` (read on every backward, so tests and users can flip it)."""
    return os.environ.get("FXFUSE_FUSED_BACKWARD", "1") != "0"


@functools.lru_cache(maxsize=1024)
def fused_backward_reason(spec: str, widths: tuple[int, ...], elem_size: int = 2) -> Optional[str]:
    """Why the region ``spec`` at these widths (input, then each stage's output) and element size keeps the
    generic backward, or None when the fused chain backward takes it."""
    stages = MLPSpec.loads(spec).stages
    for s in stages:
        if s.num_linears != 1:
            return "a gated stage"
        if s.num_operands:
            return f"epilogue operands in {s.epilogue}"
        if s.epilogue not in DERIVATIVES:
            return f"no derivative for {s.epilogue}"
    if not backward_fits([s.epilogue for s in stages], widths, elem_size):
        if max(widths) > MAX_BACKWARD_WIDTH:
            return f"widths {widths}: a layer wider than {MAX_BACKWARD_WIDTH}"
        return f"widths {widths}: {elem_size}-byte weights too large for the kernel's shared memory"
    return None


def fused_chain_gradients(spec: str, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                          grad: Tensor, need_dx: bool) -> Optional[tuple[Optional[Tensor], list, list]]:
    """``(dx, [dW_i], [db_i])`` of the region from the fused kernel, or None when the caller must use the
    generic backward (not a chain the kernel takes, tensors it does not take, a second-order backward,
    or the kernel failed).

    ``biases`` has one entry per stage (None where there is none); ``x`` and ``grad`` any leading shape.
    """
    if not fused_backward_enabled() or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None  # create_graph=True needs a differentiable backward; tracing needs the traced ops
    if type(x) is not Tensor or type(grad) is not Tensor or x.numel() == 0:
        return None
    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    if x.numel() // widths[0] * max(widths) >= 2**31:  # the kernel forms int32 offsets into [M, width] tiles
        return None
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        return None
    dtype = x.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or grad.dtype != dtype or any(
            t is not None and (t.dtype != dtype or t.device != x.device) for t in (*weights, *biases, grad)):
        return None
    reason = fused_backward_reason(spec, widths, x.element_size())
    if reason is not None:
        return None
    from .kernels.chain_backward_launch import run_chain_backward

    epilogues = tuple(s.epilogue for s in MLPSpec.loads(spec).stages)
    try:
        dx, grad_w, grad_b = run_chain_backward(x.reshape(-1, widths[0]), weights, biases,
                                                grad.reshape(-1, widths[-1]), epilogues, need_dx)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # never expected: the generic backward still gives the right gradients
        where = (spec, type(err).__name__)
        if where not in _failed:
            _failed.add(where)
            log.warning("fxfuse: the fused backward of %s failed (%s: %s); using the original ops' gradients",
                        spec, type(err).__name__, err)
        return None
    return (None if dx is None else dx.reshape(x.shape)), grad_w, grad_b
