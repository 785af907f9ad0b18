"""Replays: a decode-size region's launches, bound once, run again with only the input changing.

At decode sizes (M ≤ 16) a region's kernels take a few µs each, and every layer of the call path (argument
checks, the strategy and per-stage choices, the launch arguments) costs as much again on the host. Once a
region runs with its choice made (timed, or taken without timing), the next call like it
replays what that call launched: the stage kernels' bound launches (:func:`fxfuse.kernels.fastlaunch.bind`),
each with a fresh output. "Like it" is the :func:`replay_key`: the spec, the input's shape, strides, dtype,
device, alignment and stream, and every weight's, bias's and operand's address, shape, strides and dtype, so
a moved, replaced or re-typed parameter, a new batch shape or another stream is recorded again.

Only regions whose every stage ran the small-M kernel are replayed (the other kernels' host paths are not
bound); nothing is replayed while tracing or capturing a CUDA graph.

Example:
    >>> key = replay_key(x, weights, biases, operands, spec)          # doctest: +SKIP
    >>> run = replays.get(key)                                          # doctest: +SKIP
    >>> out = run(x) if run is not None else ...                        # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor

from .kernels import gemv_launch
from .kernels.fastlaunch import _raw_stream

__all__ = ["build", "replay_key", "replaying", "replays"]

log = logging.getLogger(__name__)

_MAX_REPLAYS = 1024  # past it, all are dropped (recorded again on the next call of each)
replays: dict[tuple, Callable[[Tensor], Tensor]] = {}


def replay_key(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], operands: Sequence[Tensor],
               spec: str) -> tuple:
    """What a replay of this call depends on (see the module doc)."""
    key = [spec, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0, _raw_stream(x.device.index)]
    if x.dtype == torch.float32:
        key.append(torch.backends.cuda.matmul.allow_tf32)
    for group in (weights, biases, operands):
        for t in group:
            key.append((t.data_ptr(), t.shape, t.stride(), t.dtype))
    return tuple(key)


def build(key: tuple, x: Tensor, run: Callable[[], Tensor], num_stages: int) -> Tensor:
    """Run the region once (``run()``) while recording its launches; keep a replay under ``key`` if every one of
    its ``num_stages`` stages was a bound small-M launch. Returns ``run()``'s output."""
    with gemv_launch.recording() as steps:
        out = run()
    if len(steps) == num_stages and all(s is not None for s in steps) and out.shape[-1] == steps[-1][1][1]:
        rows, k = steps[0][1][0], x.shape[-1]
        out_shape, device = out.shape, x.device
        frozen = tuple(steps)

        def replay(x: Tensor) -> Tensor:
            h = x.reshape(rows, k)  # a view: the key fixed x's shape and strides
            for bound, shape, dtype in frozen:
                nxt = torch.empty(shape, dtype=dtype, device=device)
                bound(h, nxt)
                h = nxt
            return h.view(out_shape)

        if len(replays) >= _MAX_REPLAYS:
            replays.clear()
        replays[key] = replay
        log.debug("fxfuse: replaying %s at %s from now on (%d launches)", key[0], tuple(x.shape), num_stages)
    return out


def replaying(x: Tensor, run: Callable[[], Tensor], num_stages: int) -> Callable[[], Tensor]:
    """``run`` as the planner should time it: the full path until a call records a replay, then the replay.

    The planner times candidates by their host time too; a candidate that will be replayed must be timed as
    replayed, or the host path it will not take decides against it.
    """
    state: dict[str, Callable[[Tensor], Tensor]] = {}
    key = ("replaying", id(state))  # private: the replay is kept in ``state``, not in ``replays``

    def runner() -> Tensor:
        fn = state.get("replay")
        if fn is not None:
            return fn(x)
        out = build(key, x, run, num_stages)
        fn = replays.pop(key, None)
        if fn is not None:
            state["replay"] = fn
        return out

    return runner


def forget_all() -> None:
    """Drop every replay (tests; a region whose choice changed is keyed the same way and must be recorded again)."""
    replays.clear()


def lookup(key: tuple) -> Optional[Callable[[Tensor], Tensor]]:
    """The replay for ``key``, if recorded and nothing is being captured into a CUDA graph."""
    run = replays.get(key)
    if run is None or torch.cuda.is_current_stream_capturing():
        return None
    return run
