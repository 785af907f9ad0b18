"""Transforms the kernels cannot follow: ``torch.func`` (``vmap``, ``grad``, ``jvp``) and forward-mode AD; and
activation checkpointing, whose recomputation must repeat what its forward did (:func:`checkpointed`).

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

__all__ = ["batched", "checkpointed", "transformed"]

_functorch_active = torch._C._are_functorch_transforms_active
_batched = torch._C._functorch.is_batchedtensor
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def transformed() -> bool:
    """Whether a ``torch.func`` transform or a forward-AD level (``forward_ad.dual_level()``) is active."""
    return _functorch_active() or forward_ad._current_level >= 0


def batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a batched tensor: ``torch.func.vmap``'s, or the legacy one that ``torch.autograd.grad(...,
    is_grads_batched=True)`` and ``jacobian(vectorize=True)`` hand a backward (outside any functorch transform)."""
    return _batched(t) or _legacy_batched(t)


def checkpointed() -> bool:
    """Whether this call records gradients inside a non-reentrant activation checkpoint (``torch.utils.checkpoint``,
    transformers' ``gradient_checkpointing_enable()``): in its forward or in the recomputation its backward runs.
    The recomputation must save what the forward saved, and what decided the forward's path (a global module hook
    such as ``FlopCounterMode``'s, a mode, a hook) may not hold in the backward: a host then runs its original
    code in both."""
    if not torch.is_grad_enabled():
        return False
    hooks = _top_saved_tensors_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"
