"""Transforms the kernels cannot follow: ``torch.func`` (``vmap``, ``grad``, ``jvp``) and forward-mode AD.

Under them a region runs its original ops: the kernels see neither batched tensors nor tangents, and the fused
``autograd.Function`` has no vmap or jvp rule. Checked where a call would reach a kernel (``fused_mlp``, the
shortcut, the MoE experts, the training kernels); two C-level reads. A backward's output gradient may be
batched outside any transform (``jacobian(vectorize=True)``): :func:`batched`.

Example:
    >>> import torch
    >>> from torch.autograd import forward_ad
    >>> transformed()
    False
    >>> with forward_ad.dual_level():
    ...     transformed()
    True
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

__all__ = ["batched", "transformed"]

_functorch_active = torch._C._are_functorch_transforms_active
_batched = torch._C._functorch.is_batchedtensor
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def transformed() -> bool:
    """Whether a ``torch.func`` transform or a forward-AD level (``forward_ad.dual_level()``) is active."""
    return _functorch_active() or forward_ad._current_level >= 0


def batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a batched tensor: ``torch.func.vmap``'s, or the legacy one that ``torch.autograd.grad(...,
    is_grads_batched=True)`` and ``jacobian(vectorize=True)`` hand a backward (outside any functorch transform)."""
    return _batched(t) or _legacy_batched(t)
