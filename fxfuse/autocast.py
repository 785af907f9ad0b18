"""Autocast: what a fused region does under ``torch.autocast``.

Under autocast eager runs each ``nn.Linear`` of a region in the autocast dtype (its input, weight and bias cast
to it, weights cast once per autocast context) and the pointwise ops between them in whatever dtype they get.
A fused region (:func:`fxfuse.ops.fused_mlp`) follows that:

* **Weights already in the autocast dtype** (a bf16 model under ``torch.autocast("cuda", torch.bfloat16)``), no
  extra operands, and only activations autocast leaves alone: the input is cast to the autocast dtype, as the
  first Linear would, and the region runs fused. The result is the fused kernels' on those tensors.
* **Anything else** (fp32 master weights, an epilogue with ``exp``/``log``/``pow``, which autocast runs in fp32,
  an operand that type promotion would widen): the region's ops run as the model wrote them, under autocast:
  eager's Linear layers and dtypes; an activation written out as a formula that fxfuse recognised as one op
  (GPT-2's tanh-GELU) runs as that op, which can differ from eager's by a rounding of the autocast dtype.
  A call that records gradients there, under ``FXFUSE_GATED_TRAINING=1``, runs a whole gated MLP as one
  autograd node on its tensors cast to the autocast dtype, as autocast casts a Linear's inputs
  (:mod:`fxfuse.gated_mlp_training`), and another gated stage's ``act(g) * u`` as one kernel each way
  (:mod:`fxfuse.gated_training`): autocast leaves that product in the dtype the projections give it.

The fused path is taken for CUDA autocast only (:data:`FUSED_AUTOCAST_DEVICES`: the op lists it was checked
against); autocast on another device type than the input's changes nothing here.

Example:
    >>> import torch
    >>> x = torch.randn(2, 8)
    >>> autocast_input(x, [torch.randn(4, 8)], [], [], "1:relu(a0)") is x  # no autocast: x as it is
    True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from . import epilogue as ep
from .spec import MLPSpec

__all__ = ["AUTOCAST_NEUTRAL_OPS", "FUSED_AUTOCAST_DEVICES", "REFERENCE", "any_autocast", "autocast_input"]

# Whether autocast is on for any device type (one C call; checked on every call of a fused graph).
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or \
    (lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))

# Epilogue ops that run in their input's dtype under CUDA autocast (none is on its fp32 or lower-precision lists;
# ``div`` is left out: ``c / x`` is ``__rtruediv__``, which CUDA autocast runs in fp32).
AUTOCAST_NEUTRAL_OPS = frozenset({"abs", "add", "clamp_max", "clamp_min", "gelu", "gelu_tanh", "leaky_relu",
                                  "maximum", "minimum", "mul", "neg", "relu", "sigmoid", "silu", "sub", "tanh"})
# Device types whose autocast may run a region fused (tests add "cpu" to run the interpreter under it).
FUSED_AUTOCAST_DEVICES = {"cuda"}
_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

REFERENCE = None  # autocast_input's answer when the original ops must run


@functools.lru_cache(maxsize=256)
def _neutral(spec: str) -> bool:
    """Whether every epilogue op of ``spec`` runs in its input's dtype under autocast, with no operands."""
    def ops(expr):
        if isinstance(expr, ep.Call):
            yield expr.op
            for arg in expr.args:
                yield from ops(arg)
        elif isinstance(expr, ep.Operand):
            yield "operand"

    return all(set(ops(stage.expr)) <= AUTOCAST_NEUTRAL_OPS for stage in MLPSpec.loads(spec).stages)


def autocast_input(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], operands: Sequence[Tensor],
                   spec: str) -> Optional[Tensor]:
    """The input a fused region runs on under the current autocast state, or :data:`REFERENCE` (None) when the
    original ops must run for eager's result: ``x`` itself when autocast does not touch x's device type, ``x``
    cast to the autocast dtype when the region can run fused under it (see the module doc)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x
    dtype = torch.get_autocast_dtype(device)
    if device not in FUSED_AUTOCAST_DEVICES or operands or x.dtype not in _CAST_DTYPES or not _neutral(spec):
        return REFERENCE
    for t in (*weights, *biases):
        if t.dtype is not dtype:
            return REFERENCE
    return x if x.dtype is dtype else x.to(dtype)
