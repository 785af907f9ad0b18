"""The fused backward of a narrow chain: one kernel for a NeRF-style region's gradients.

``torch.ops.fxfuse.mlp`` saves only its inputs. For most regions its backward is the vjp of the original ops,
which recomputes the forward op by op (see :mod:`fxfuse.ops`). A chain of single-linear stages whose
activations have a derivative (:func:`fxfuse.kernels.chain_backward_template.derivative_kind`), no layer wider
than 128 and weights that fit on chip, instead runs
:func:`fxfuse.kernels.chain_backward_launch.run_chain_backward`:

* where the weight gradients fit in registers (nerf64), one kernel recomputes the forward on chip and produces
  every gradient; no intermediate reaches memory;
* wider chains (nerf128) run the fused forward storing each layer's input, a walk kernel writing each layer's
  activation gradient (:mod:`fxfuse.kernels.chain_walk_template`), and one dW GEMM per layer. Once a region's
  walk has run, :mod:`fxfuse.ops` runs its gradient-recording forwards through :func:`forward_for_walk`, which
  stores the layer inputs then and there, and the backward skips its forward.

Anything else, and any failure of the kernel (logged once), keeps the vjp path, so gradients are always
those of the original ops within rounding. ``FXFUSE_FUSED_BACKWARD=0`` turns the kernel off.

Example:
    >>> fused_backward_reason("1b:relu(a0);1b:a0", (32, 64, 16)) is None
    True
    >>> fused_backward_reason("1b:abs(a0);1b:a0", (32, 64, 16))
    'no derivative for abs(a0)'
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .kernels import fastlaunch
from .kernels.chain_backward_template import MAX_BACKWARD_WIDTH, backward_fits, derivative_kind, walks
from .kernels.chain_walk_template import walk_inputs
from .kernels.template import interpreting
from .spec import MLPSpec
from .transforms import batched

__all__ = ["forward_for_walk", "fused_backward_enabled", "fused_backward_reason", "fused_chain_gradients",
           "walk_reads_output"]

log = logging.getLogger(__name__)
_failed: set[tuple[str, str, str]] = set()
_storing_steps = fastlaunch.Bindings()  # forward_for_walk's bound launches (chain_launch.storing_step)


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
        if derivative_kind(s.epilogue) is None:
            return f"no derivative for {s.epilogue}"
    if not backward_fits([s.epilogue for s in stages], widths, elem_size):
        if max(widths) > MAX_BACKWARD_WIDTH:
            return f"widths {widths}: a layer wider than {MAX_BACKWARD_WIDTH}"
        return f"widths {widths}: {elem_size}-byte weights too large for the kernel's shared memory"
    return None


def _fused_widths(spec: str, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                  extra: Sequence[Tensor] = ()) -> Optional[tuple[int, ...]]:
    """The chain's widths when the fused backward takes these tensors (``extra``: more tensors that must match
    x's dtype and device, e.g. the output gradient), else None."""
    if not fused_backward_enabled() or torch.compiler.is_compiling():
        return None  # tracing needs the traced ops
    if type(x) is not Tensor or any(type(t) is not Tensor or batched(t) for t in extra) or x.numel() == 0:
        return None  # (a subclass, or a batched gradient: jacobian(vectorize=True))
    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    if x.numel() // widths[0] * max(widths) >= 2**31:  # the kernel forms int32 offsets into [M, width] tiles
        return None
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        return None
    dtype = x.dtype
    if dtype is torch.bfloat16 and not x.is_cuda:
        return None  # (the interpreter's tl.dot cannot multiply bf16: the forward takes the reference ops too)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or any(
            t is not None and (t.dtype != dtype or t.device != x.device) for t in (*weights, *biases, *extra)):
        return None
    return widths if fused_backward_reason(spec, widths, x.element_size()) is None else None


def forward_for_walk(spec: str, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]]) \
        -> Optional[tuple[Tensor, list[Tensor]]]:
    """The region's output and every layer's input after the first (``[M, D_i]``), from the fused forward
    storing them, for a chain whose backward is the walk (:func:`fxfuse.kernels.chain_backward_template.walks`);
    None for any other chain or tensors (the caller runs its usual forward). Handing them to
    :func:`fused_chain_gradients` spares the backward its own forward.
    """
    widths = _fused_widths(spec, x, weights, biases)
    if widths is None or not walks(widths):
        return None
    from .kernels.chain_launch import run_chain

    m = x.numel() // widths[0]
    rows = x.reshape(m, widths[0])
    # After the first call at a layout, the launch bound to all but x and the outputs (as a region replay is:
    # the argument dict, signature and lookup cost ~80 µs of host per call on the H200 machine).
    key = None
    if fastlaunch.may_bind(x):
        key = fastlaunch.bound_key(spec, rows, weights, biases)
        step = _storing_steps.get(key)
        if step is not None:
            out, hidden = step(rows)
            return out.reshape(*x.shape[:-1], widths[-1]), hidden
    hidden = [torch.empty((m, d), dtype=x.dtype, device=x.device) for d in widths[1:-1]]
    try:
        with fastlaunch.recording() as steps:
            out = run_chain(rows, weights, biases, [[] for _ in weights], _epilogues(spec), hidden=hidden)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # never expected: the caller's forward still runs
        _log_failure(spec, err, "forward storing the layer inputs")
        return None
    if key is not None and len(steps) == 1 and steps[0] is not None:
        _storing_steps.keep(key, steps[0])
    return out.reshape(*x.shape[:-1], widths[-1]), hidden


def fused_chain_gradients(spec: str, x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                          grad: Tensor, need_dx: bool, stored: Optional[Sequence[Tensor]] = None) \
        -> Optional[tuple[Optional[Tensor], list, list]]:
    """``(dx, [dW_i], [db_i])`` of the region from the fused kernels, or None when the caller must use the
    generic backward (not a chain the kernels take, tensors they do not take, a second-order backward,
    or a kernel failed).

    ``biases`` has one entry per stage (None where there is none); ``x`` and ``grad`` any leading shape.
    ``stored``: for a walk chain, what its forward stored (:func:`forward_for_walk`): the layer inputs
    ``h_1 .. h_{L-1}``, then the output where :func:`walk_reads_output`.
    """
    if torch.is_grad_enabled():
        return None  # create_graph=True needs a differentiable backward
    widths = _fused_widths(spec, x, weights, biases, (grad,))
    if widths is None:
        return None
    from .kernels.chain_backward_launch import run_chain_backward

    saved = list(stored) if stored else None
    if saved and len(saved) == len(weights):  # the output too, in the [M, D_last] shape of the rest
        saved[-1] = saved[-1].reshape(-1, widths[-1])
    try:
        dx, grad_w, grad_b = run_chain_backward(x.reshape(-1, widths[0]), weights, biases,
                                                grad.reshape(-1, widths[-1]), _epilogues(spec), need_dx,
                                                saved=saved)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # never expected: the generic backward still gives the right gradients
        _log_failure(spec, err, "backward")
        return None
    return (None if dx is None else dx.reshape(x.shape)), grad_w, grad_b


@functools.lru_cache(maxsize=1024)
def walk_reads_output(spec: str) -> bool:
    """Whether the walk reads the chain's output (a last activation whose derivative comes from its output:
    sigmoid, tanh, ReLU), so the forward must keep it for the backward.

    Example:
        >>> walk_reads_output("1b:relu(a0);1b:a0"), walk_reads_output("1b:relu(a0);1b:sigmoid(a0)")
        (False, True)
    """
    epilogues = _epilogues(spec)
    return len(epilogues) in walk_inputs(epilogues)


def _epilogues(spec: str) -> tuple[str, ...]:
    return tuple(s.epilogue for s in MLPSpec.loads(spec).stages)


def _log_failure(spec: str, err: Exception, what: str) -> None:
    where = (spec, what, type(err).__name__)
    if where not in _failed:
        _failed.add(where)
        log.warning("fxfuse: the fused %s of %s failed (%s: %s); using the original ops' path", what, spec,
                    type(err).__name__, err)
