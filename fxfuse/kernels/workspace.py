"""Zeroed scratch buffers for kernels that combine partial sums across programs inside one launch.

The decode kernel and the split-K small-M kernel add fp32 partial sums into a workspace and count finished
programs in int32 counters; the program that finishes last takes the sums out and leaves both at zero. So
a pair is allocated zeroed once and reused, one per (kernel kind, device, stream, shapes): launches on one
stream run in order, so two never share a pair at the same time. A tracer (FakeTensor, ``torch.compile``)
or a CUDA graph capture gets a fresh zeroed pair instead, so the traced or captured program owns its
buffers.

Example:
    >>> ws, counters = zeroed_workspace(x, "decode", (16, 4096), 1)  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from .fastlaunch import _raw_stream
from .launch import _tracing

__all__ = ["zeroed_workspace"]

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def zeroed_workspace(x: torch.Tensor, kind: str, ws_shape: tuple[int, ...], counters: int) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 workspace of ``ws_shape`` and ``counters`` int32 counters on x's device, all zero."""
    cuda = x.device.type == "cuda"
    if _tracing(x) or (cuda and torch.cuda.is_current_stream_capturing()):
        key = None
    else:
        key = (kind, x.device, _raw_stream(x.device.index) if cuda else 0, ws_shape, counters)
    pair = None if key is None else _workspaces.get(key)
    if pair is None:
        pair = (torch.zeros(ws_shape, dtype=torch.float32, device=x.device),
                torch.zeros((counters,), dtype=torch.int32, device=x.device))
        if key is not None:
            _workspaces[key] = pair
    return pair
