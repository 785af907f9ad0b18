"""MLPs written with 1x1 convolutions: found by module structure, so the report can say why they stay unfused.

fxfuse matches ``nn.Linear`` / ``F.linear`` chains. A channel MLP written as two 1x1 convolutions over an NCHW
tensor (timm's ``ConvMlp`` and ``Mlp(use_conv=True)``, PoolFormer's and EfficientFormer's MLPs) computes the
same thing but is not matched, and without a note it would simply be missing from the report. A module is
listed when its direct children hold exactly two convolutions, both pointwise (kernel 1, stride 1, no padding,
one group), and every other child with parameters is a norm.

Example:
    >>> from torch import nn
    >>> class ConvMlp(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc1, self.act, self.fc2 = nn.Conv2d(8, 32, 1), nn.GELU(), nn.Conv2d(32, 8, 1)
    >>> [f.module_path for f in pointwise_conv_mlps(nn.Sequential(ConvMlp()))]
    ['0']
"""

from __future__ import annotations

from torch import nn

from .capture import CaptureFailure

__all__ = ["CONV_MLP_NOTE", "pointwise_conv_mlps"]

CONV_MLP_NOTE = ("an MLP of 1x1 convolutions ({names}): not matched (fxfuse fuses nn.Linear / F.linear chains; the "
                 "same MLP written with nn.Linear over a channels-last tensor is)")

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _pointwise(conv: nn.Module) -> bool:
    return (isinstance(conv, (nn.Conv1d, nn.Conv2d)) and set(conv.kernel_size) == {1} and set(conv.stride) == {1}
            and conv.padding in ("valid", (0,) * len(conv.kernel_size)) and set(conv.dilation) == {1}
            and conv.groups == 1)


def pointwise_conv_mlps(model: nn.Module) -> list[CaptureFailure]:
    """One note per module of ``model`` that looks like a 1x1-conv MLP (see the module doc)."""
    out = []
    for path, module in model.named_modules():
        children = list(module.named_children())
        convs = [(name, c) for name, c in children if isinstance(c, nn.modules.conv._ConvNd)]
        if len(convs) != 2 or not all(_pointwise(c) for _, c in convs):
            continue
        others = [c for _, c in children if not isinstance(c, nn.modules.conv._ConvNd)]
        if all(isinstance(c, _NORMS) or not any(True for _ in c.parameters()) for c in others):
            out.append(CaptureFailure(path, CONV_MLP_NOTE.format(names=", ".join(name for name, _ in convs))))
    return out
