"""Typed records passed between the stages of the pass (match/plan → rewrite → report)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

from .spec import MLPSpec

__all__ = ["FusionRegion", "Rejection"]


@dataclass
class FusionRegion:
    """A matched, checked chain that the rewrite replaces with one ``torch.ops.fxfuse.mlp`` call.

    ``weights``/``biases`` follow the order of ``spec``'s linears (for a gated stage: the linear that
    feeds ``a0`` first, then ``a1``); ``operands`` follow the stages' ``v0, v1, ...`` in order.
    """

    pattern: str
    spec: MLPSpec
    input: fx.Node
    weights: list[fx.Node]
    biases: list[Optional[fx.Node]]
    operands: list[fx.Node]
    output: fx.Node
    nodes: list[fx.Node]
    module_path: str = ""
    strategy: str = "gemm_epilogue"
    # A user pattern registered with ``replacement=``: called instead of the generated kernel,
    # with the pattern function's arguments bound to these model nodes (by parameter name).
    replacement: Optional[Callable] = None
    replacement_args: dict[str, Optional[fx.Node]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class Rejection:
    """A candidate chain that was NOT fused, and why (shown by ``fxfuse.report``)."""

    pattern: str
    module_path: str
    reason: str
    nodes: list[str] = field(default_factory=list)
