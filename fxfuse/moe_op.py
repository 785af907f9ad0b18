"""``torch.ops.fxfuse.moe_experts``: the experts kernels as one custom op, so that ``torch.compile`` of an optimized
model captures them in its graph (and ``mode="reduce-overhead"`` in its CUDA graph) instead of breaking there.

The installed experts forward (:func:`fxfuse.moe.moe_forward`) calls it while Dynamo traces, for a module whose
kernels an eager call already checked against its own forward (call the optimized model once before compiling
it); anything else traces the module's own forward. Its fake implementation gives Dynamo the output's shape.

Example:
    >>> import torch
    >>> hasattr(torch.ops.fxfuse, "moe_experts")
    True
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .kernels.moe_launch import ExpertsForm, run_moe
from .ops import on_its_device

__all__ = ["moe_experts"]


@torch.library.custom_op("fxfuse::moe_experts", mutates_args=())
def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor], act: str, transposed: bool,
                interleaved: bool, alpha: float, limit: float) -> Tensor:
    """:func:`fxfuse.kernels.moe_launch.run_moe` with the :class:`~fxfuse.kernels.moe_launch.ExpertsForm` spelled
    out (a custom op's arguments are plain types)."""
    form = ExpertsForm(act, transposed=transposed, interleaved=interleaved, alpha=alpha, limit=limit)
    # (another GPU's layer: launch on that GPU, as Triton launches on the current one)
    with torch.cuda.device(hidden.device) if not on_its_device(hidden) else contextlib.nullcontext():
        return run_moe(hidden, top_k_index, top_k_weights, gate_up, down, form, gate_up_bias=gate_up_bias,
                       down_bias=down_bias)


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, act, transposed, interleaved,
      alpha, limit):
    return hidden.new_empty(hidden.shape)
