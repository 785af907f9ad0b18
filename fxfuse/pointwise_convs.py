"""MLPs written with 1x1 convolutions: found so the report can say why they stay unfused.

fxfuse matches ``nn.Linear`` / ``F.linear`` chains. A channel MLP written as two 1x1 convolutions over an NCHW
tensor (timm's ``ConvMlp`` and ``Mlp(use_conv=True)``, PoolFormer's and EfficientFormer's MLPs) computes the
same thing but is not matched, and without a note it would simply be missing from the report. A module is
listed when
* its direct children hold exactly two convolutions, both pointwise (kernel 1, stride 1, no padding, one group),
  whose channels chain (the first's outputs are the second's inputs), and every other child with parameters is a
  norm;
* and its ``forward``, traced with torch.fx (its children as leaves; the model left as it was), feeds the first
  convolution's output to the second through single-input ops only (a norm, an activation, dropout), does not
  pool the first one's input and does not gate with the second one's output (a squeeze-and-excitation gate, an
  MLP of a few values per image on a pooled map: nothing to fuse). A forward that does not trace lists nothing.

Example:
    >>> from torch import nn
    >>> class ConvMlp(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc1, self.act, self.fc2 = nn.Conv2d(8, 32, 1), nn.GELU(), nn.Conv2d(32, 8, 1)
    ...     def forward(self, x):
    ...         return self.fc2(self.act(self.fc1(x)))
    >>> [f.module_path for f in pointwise_conv_mlps(nn.Sequential(ConvMlp()))]
    ['0']
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch.fx as fx
from torch import nn

from .capture import CaptureFailure, leaving_unchanged

__all__ = ["CONV_MLP_NOTE", "pointwise_conv_mlps"]

log = logging.getLogger(__name__)

CONV_MLP_NOTE = ("an MLP of 1x1 convolutions ({names}): not matched (fxfuse fuses nn.Linear / F.linear chains; the "
                 "same MLP written with nn.Linear over a channels-last tensor is)")

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_POOLS = {"mean", "amax", "sum", "adaptive_avg_pool2d", "adaptive_max_pool2d", "adaptive_avg_pool1d",
          "adaptive_max_pool1d", "avg_pool2d", "max_pool2d"}
_POOL_MODULES = (nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd,
                 nn.modules.pooling._AvgPoolNd, nn.modules.pooling._MaxPoolNd)
_GATES = {"sigmoid", "hardsigmoid", "sigmoid_"}
_GATE_MODULES = (nn.Sigmoid, nn.Hardsigmoid)


def _pointwise(conv: nn.Module) -> bool:
    return (isinstance(conv, (nn.Conv1d, nn.Conv2d)) and set(conv.kernel_size) == {1} and set(conv.stride) == {1}
            and conv.padding in ("valid", "same", (0,) * len(conv.kernel_size)) and set(conv.dilation) == {1}
            and conv.groups == 1)


def _candidate(module: nn.Module) -> Optional[tuple[str, str]]:
    """The two pointwise convolutions' names, in the order their channels chain, when the structure fits."""
    children = list(module.named_children())
    convs = [(name, c) for name, c in children if isinstance(c, nn.modules.conv._ConvNd)]
    if len(convs) != 2 or not all(_pointwise(c) for _, c in convs):
        return None
    others = [c for _, c in children if not isinstance(c, nn.modules.conv._ConvNd)]
    if not all(isinstance(c, _NORMS) or not any(True for _ in c.parameters()) for c in others):
        return None
    (a, ca), (b, cb) = convs
    if ca.out_channels == cb.in_channels:
        return a, b
    if cb.out_channels == ca.in_channels:
        return b, a
    return None


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op in ("call_method", "call_module") else getattr(node.target, "__name__", "")


def _is(module: nn.Module, node: object, names: set[str], classes: tuple) -> bool:
    """Whether ``node`` calls one of ``names`` (functions, methods) or a child of one of ``classes``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_module":
        return isinstance(module.get_submodule(str(node.target)), classes)
    return node.op in ("call_function", "call_method") and _name(node) in names


def _feeds(module: nn.Module, first: str, second: str) -> bool:
    """Whether ``module``'s traced forward feeds ``first``'s output to ``second`` through single-input ops, from an
    input that is not pooled, into anything but a sigmoid gate (squeeze-and-excitation)."""

    class Leaves(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return m is not module

    try:
        with leaving_unchanged(module, values=False):
            graph = Leaves().trace(module)
    except Exception as err:  # (a forward that needs real tensors, control flow on values...)
        log.debug("fxfuse: %s's forward does not trace (%s): no 1x1-conv MLP note", type(module).__name__, err)
        return False
    calls = {str(n.target): n for n in graph.nodes if n.op == "call_module"}
    if first not in calls or second not in calls or not calls[second].args:
        return False
    source = calls[first].args[0] if calls[first].args else None
    if _is(module, source, _POOLS, _POOL_MODULES) or \
            any(_is(module, user, _GATES, _GATE_MODULES) for user in calls[second].users):
        return False
    node = calls[second].args[0]
    while isinstance(node, fx.Node) and node is not calls[first]:
        inputs = node.all_input_nodes
        if len(inputs) != 1 or node.op not in ("call_module", "call_function", "call_method") or \
                node.target is operator.getitem:
            return False
        node = inputs[0]
    return node is calls[first]


def pointwise_conv_mlps(model: nn.Module) -> list[CaptureFailure]:
    """One note per module of ``model`` that is a 1x1-conv MLP (see the module doc)."""
    out = []
    for path, module in model.named_modules():
        pair = _candidate(module)
        if pair is not None and _feeds(module, *pair):
            out.append(CaptureFailure(path, CONV_MLP_NOTE.format(names=", ".join(pair))))
    return out

