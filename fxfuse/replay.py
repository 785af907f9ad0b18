"""Replays: a region's stages, bound once, run again with only the input changing.

A region's call path (argument checks, the strategy and per-stage choices, the launch arguments) costs tens
of µs on the host: as much as a decode-size region's kernels, and in a host-bound model (a small transformer
at a few thousand tokens) it adds to every layer. Once a region runs with its choice made (timed, or taken
without timing), the next call like it replays what that call ran: each stage's *step*, a launch bound to
everything but its input and output (:func:`fxfuse.kernels.fastlaunch.bind`) or the stage's library call.
"Like it" is the :func:`replay_key`: the spec, the input's shape, strides, dtype, device, alignment and
stream, every weight's, bias's and operand's address, shape, strides and dtype, and whether
``torch.use_deterministic_algorithms`` is on, so a moved, replaced or re-typed parameter, a new batch shape,
another stream or the flag turned on (whose choices are their own: :mod:`fxfuse.strategy`) is recorded again.

Only regions whose every launch left a step are replayed (the small-M, TMA and pointer GEMM kernels and the
library stages leave one per stage, the one-row grid-sync kernel, the fused chain and the original ops one for the
whole region; the split-hidden decode kernel leaves none); nothing is replayed while tracing or capturing a CUDA
graph.

Example:
    >>> key = replay_key(x, weights, biases, operands, spec)          # doctest: +SKIP
    >>> run = replays.get(key)                                          # doctest: +SKIP
    >>> out = run(x) if run is not None else ...                        # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor

from .kernels import fastlaunch

__all__ = ["build", "may_replay", "path_us", "replay_key", "replaying", "replays", "weak_step", "weak_tensor",
           "will_not_replay"]

log = logging.getLogger(__name__)

_MAX_REPLAYS = 1024  # past it, all are dropped (recorded again on the next call of each)
_MAX_FAILED_BUILDS = 3  # recordings that left no replay before a region shape stops trying


class _Replays(dict):
    """The replays by key; ``generation`` counts the changes that drop or replace one (a host method's shortcut
    to a replay, :mod:`fxfuse.shortcut`, is valid while it is unchanged). Adding a replay changes nothing."""

    generation = 0

    def __setitem__(self, key, value) -> None:
        if key in self:
            self.generation += 1
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.generation += 1
        super().__delitem__(key)

    def pop(self, *args):
        self.generation += 1
        return super().pop(*args)

    def popitem(self):
        self.generation += 1
        return super().popitem()

    def clear(self) -> None:
        self.generation += 1
        super().clear()


replays: _Replays = _Replays()  # key -> replay (``Callable[[Tensor], Tensor]``)
_failed_builds: dict[tuple, int] = {}  # (spec, input shape, flag) -> recordings that left no replay
_deterministic = torch.are_deterministic_algorithms_enabled


def weak_tensor(t: Optional[Tensor]) -> Callable[[], Optional[Tensor]]:
    """A getter of ``t`` that does not keep it alive: a replay must not hold a deleted model's weights.

    A view (a packed weight's half, a transposed parameter) is remade from a weak reference to its base on
    each call; a getter whose tensor is gone raises ``ReferenceError`` (the replay is then dropped).
    """
    if t is None:
        return lambda: None
    if t._base is None:
        ref = weakref.ref(t)
        view = None
    else:  # no name in this scope may hold the base: the closure would keep it alive
        ref = weakref.ref(t._base)
        view = (t.shape, t.stride(), t.storage_offset())

    def get() -> Tensor:
        target = ref()
        if target is None:
            raise ReferenceError("a tensor of a replayed stage was freed")
        return target if view is None else target.as_strided(*view)

    return get


def weak_step(impl: Callable[..., Tensor], weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
              operands: Sequence[Tensor], what: str) -> Callable[[Tensor], Tensor]:
    """``impl(h, weights, biases, operands, what)`` as a replay step of input ``h``, holding its tensors weakly
    (a library stage, or a region's original ops)."""
    getters = [weak_tensor(t) for t in (*weights, *biases, *operands)]
    nw, nb = len(weights), len(biases)

    def step(h: Tensor) -> Tensor:
        ts = [get() for get in getters]
        return impl(h, ts[:nw], ts[nw:nw + nb], ts[nw + nb:], what)

    return step


def may_replay(spec: str, x: Tensor) -> bool:
    """False for a region shape that will not be replayed (its strategy leaves no steps): no key is computed."""
    return _failed_builds.get((spec, x.shape, _deterministic()), 0) < _MAX_FAILED_BUILDS


def will_not_replay(spec: str, x: Tensor) -> None:
    """Stop computing replay keys for this region shape (its strategy is one kernel or the original ops), while
    ``torch.use_deterministic_algorithms`` stays as it is (the flag has choices of its own)."""
    _failed_builds[(spec, x.shape, _deterministic())] = _MAX_FAILED_BUILDS


def replay_key(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], operands: Sequence[Tensor],
               spec: str) -> tuple:
    """What a replay of this call depends on (see the module doc): the key of its bound launches, and whether
    ``torch.use_deterministic_algorithms`` is on (its last entry).

    Example:
        >>> w = torch.randn(4, 3)
        >>> key = replay_key(torch.randn(2, 3), [w], [], [], "1:a0")
        >>> key[0], key[-1]  # (the flag off, as by default)
        ('1:a0', False)
    """
    return (*fastlaunch.bound_key(spec, x, weights, biases, operands), _deterministic())


def _chained(steps: tuple[Callable[[Tensor], Tensor], ...], x: Tensor, out: Tensor) -> Callable[[Tensor], Tensor]:
    """The replay: ``steps`` one after the other on x viewed as rows (each step returns ``[rows, N]``)."""
    if x.dim() == 2:  # the key fixed x's shape: no views to make (each costs ~1 µs of host time)
        if len(steps) == 1:
            return steps[0]
        if len(steps) == 2:
            first, second = steps
            return lambda x: second(first(x))
        if len(steps) == 3:  # (two stages after an input cast: an fp32 input under autocast)
            first, second, third = steps
            return lambda x: third(second(first(x)))
    rows, k, out_shape = x.numel() // x.shape[-1], x.shape[-1], out.shape

    def replay(x: Tensor) -> Tensor:
        h = x.reshape(rows, k)  # a view: the key fixed x's shape and strides
        for step in steps:
            h = step(h)
        return h.reshape(out_shape)

    return replay


def build(key: tuple, x: Tensor, run: Callable[[], Tensor], num_steps: int) -> Tensor:
    """Run the region once (``run()``) while recording its launches; keep a replay under ``key`` if it left
    ``num_steps`` steps, none None (:func:`fxfuse.kernels.fastlaunch.record`). Returns ``run()``'s output."""
    with fastlaunch.recording() as steps:
        out = run()
    if len(steps) == num_steps and all(step is not None for step in steps):
        if len(replays) >= _MAX_REPLAYS:
            replays.clear()
        replays[key] = _chained(tuple(steps), x, out)
        log.debug("fxfuse: replaying %s at %s from now on (%d steps)", key[0], tuple(x.shape), num_steps)
    elif len(steps) <= num_steps:  # a launch without a step (more steps: a timing run, which proves nothing)
        site = (key[0], x.shape, key[-1])  # (a replay key's last entry is the deterministic-algorithms flag)
        _failed_builds[site] = _failed_builds.get(site, 0) + 1
    return out


def replaying(x: Tensor, run: Callable[[], Tensor], num_steps: int) -> Callable[[], Tensor]:
    """``run`` as the planner should time it: the full path until a call records a replay, then the replay.

    The planner times candidates by their host time too; a candidate that will be replayed must be timed as
    replayed, or the host path it will not take decides against it.
    """
    state: dict[str, Callable[[Tensor], Tensor]] = {}
    # private: the replay is kept in ``state``, not in ``replays`` (its last entry, as a replay key's, the flag)
    key = ("replaying", id(state), _deterministic())

    def runner() -> Tensor:
        fn = state.get("replay")
        if fn is not None:
            return fn(x)
        out = build(key, x, run, num_steps)
        fn = replays.pop(key, None)
        if fn is not None:
            state["replay"] = fn
        return out

    return runner


def _unchanged(x: Tensor) -> Tensor:
    return x


class _Timed(threading.local):
    key: Optional[tuple] = None  # the key whose calls :func:`path_us` is timing in this thread


_timed = _Timed()


def path_us(key: tuple, call: Callable[[], object]) -> float:
    """Host µs a replayed call spends besides its steps: ``call()`` (the op's dispatch for this call) timed while
    a replay that does nothing stands under ``key`` for this thread (:func:`lookup`; another thread calling the
    same region meanwhile must not get its input back). The planner adds it to every candidate's host time."""
    from .strategy import host_us

    _timed.key = key
    try:
        call()  # warm
        return host_us(call, calls=20, bursts=3)
    finally:
        _timed.key = None


def forget_all() -> None:
    """Drop every replay and every region shape marked as not replayable (tests)."""
    replays.clear()
    _failed_builds.clear()


def lookup(key: tuple) -> Optional[Callable[[Tensor], Tensor]]:
    """The replay for ``key``, if recorded and nothing is being captured into a CUDA graph."""
    run = replays.get(key) if _timed.key is None or _timed.key != key else _unchanged
    if run is None or torch.cuda.is_current_stream_capturing():
        return None
    return run
