"""Zeroed scratch buffers for kernels that combine partial sums across programs inside one launch.

The decode kernel adds fp32 partial sums into a workspace and counts finished programs in int32 counters; the
program that finishes last takes the sums out and leaves both at zero. The split-K small-M kernel stores each
split's partial sums in a slice of its own and leaves only the counters at zero (its slices are allocated
unfilled: each is written before it is read). So a pair is allocated zeroed
once and reused, one per (kernel kind, device, stream, shapes): launches on one
stream run in order, so two never share a pair at the same time. A tracer (FakeTensor, ``torch.compile``)
or a CUDA graph capture gets a fresh zeroed pair instead, so the traced or captured program owns its
buffers.

The grid-sync decode kernel keeps its pair here too (kind ``"grid_sync"``): the fp32 part holds its
intermediate and the counters are its barrier's arrivals, left zero, and generation, left as it is.

A captured ``torch.zeros`` is a fill kernel that runs on every replay (3.5 µs of a 21 µs GPT-2-medium decode
replay on the H200), although the kernels leave the pair zero. A capturer that can zero the pair once, after
the capture and before the first replay, and keep it alive as long as the graph (``fxfuse.cuda_graphed``)
captures inside :func:`zero_after_capture`: the pair is then allocated without a fill and handed to it.

Example:
    >>> ws, counters = zeroed_workspace(x, "decode", (16, 4096), 1)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.utils.deterministic

from .fastlaunch import _raw_stream
from .launch import _tracing

__all__ = ["zero_after_capture", "zeroed_workspace"]

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_capturer = threading.local()  # .unfilled: inside zero_after_capture (this thread), the pairs left to the capturer


@contextlib.contextmanager
def zero_after_capture():
    """Within it, a pair asked for while a CUDA graph is being captured is allocated WITHOUT a captured fill and
    appended to the yielded list. The caller must zero each tensor (``t.zero_()``, outside the capture, on the
    stream that replays) before the graph's first replay, and hold the list as long as the graph: the replays
    use that memory, and the kernels leave it zero after each.

    Example:
        >>> with zero_after_capture() as owned, torch.cuda.graph(g):  # doctest: +SKIP
        ...     y = model(x)
        >>> for t in owned: t.zero_()                                 # doctest: +SKIP
    """
    outer = getattr(_capturer, "unfilled", None)
    _capturer.unfilled = owned = []
    try:
        yield owned
    finally:
        _capturer.unfilled = outer


@contextlib.contextmanager
def _unfilled_empty():
    """``torch.empty`` without the fill ``torch.use_deterministic_algorithms(True)`` gives it (NaN, or the largest
    int): a captured fill would run on every replay, after the capturer zeroed the counters once (a split-K tile
    would never see its last split, the grid-sync barrier would wait for ever)."""
    det = torch.utils.deterministic
    before = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = before


def zeroed_workspace(x: torch.Tensor, kind: str, ws_shape: tuple[int, ...], counters: int, *,
                     zero_sums: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 workspace of ``ws_shape`` and ``counters`` int32 counters on x's device, all zero; with
    ``zero_sums=False`` only the counters are (a kernel that writes each part of the workspace before reading it:
    no fill of it is captured into a CUDA graph)."""
    cuda = x.device.type == "cuda"
    tracing, capturing = _tracing(x), cuda and torch.cuda.is_current_stream_capturing()
    if tracing or capturing:
        key = None
    else:
        key = (kind, x.device, _raw_stream(x.device.index) if cuda else 0, ws_shape, counters)
    pair = None if key is None else _workspaces.get(key)
    unfilled = getattr(_capturer, "unfilled", None)
    if pair is None and capturing and not tracing and unfilled is not None:
        with _unfilled_empty():
            pair = (torch.empty(ws_shape, dtype=torch.float32, device=x.device),
                    torch.empty((counters,), dtype=torch.int32, device=x.device))
        unfilled.extend(pair)  # the capturer zeroes them once, after the capture
    if pair is None:
        if zero_sums:
            sums = torch.zeros(ws_shape, dtype=torch.float32, device=x.device)
        else:
            with _unfilled_empty():
                sums = torch.empty(ws_shape, dtype=torch.float32, device=x.device)
        pair = (sums, torch.zeros((counters,), dtype=torch.int32, device=x.device))
        if key is not None:
            _workspaces[key] = pair
    return pair
