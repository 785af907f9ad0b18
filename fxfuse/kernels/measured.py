"""Timing kernels that compute the same result, for the choices the MoE launchers measure at a first call.

A choice between two kernels whose speed depends on the shape more than a rule can say (the MoE weight gradients
on ``torch._grouped_mm`` or the Triton kernel, the gate/up GEMM by TMA or by pointer) is timed once per key at
its first call: each candidate run once (their first calls compile and tune), then timed in interleaved rounds by
``triton.testing.do_bench``, the best median of each kept; the plain candidate stays unless the other wins by a
margin (:func:`faster`). Untimed inside a CUDA graph capture and with ``FXFUSE_AUTOTUNE=0``: the caller's
default then. The times are kept in the tuning cache (:func:`stored_times`, :func:`store_times`), so another process
on the same GPU takes the same choice without timing (the two forms of a weight gradient sum in other orders: the
same choice is the same bits).

Example:
    >>> may_time() in (True, False)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from .template import autotune_enabled

__all__ = ["faster", "gpu_us", "may_time", "store_times", "stored_times", "time_runners"]

ROUNDS = 2  # interleaved timing rounds per candidate (the best median of each kept)
# The share of the plain candidate's GPU time the other must beat: the other costs more host time a call (a gather
# launch and tensor descriptors, or grouped_mm's torch glue), which a host-bound step pays and do_bench does not see
# (gpt-oss's 512-token training step, H200: a weight gradient whose two forms timed 246.8 / 247.2 µs went to
# grouped_mm and the step read 2043 -> 2688 µs).
MARGIN = 0.95


def gpu_us(run: Callable[[], Any]) -> float:
    """GPU µs of ``run``: do_bench's median over a short window (L2 flushed before each call)."""
    from triton.testing import do_bench

    return do_bench(run, warmup=5, rep=20, return_mode="median") * 1e3


def may_time(device: Optional[torch.device] = None) -> bool:
    """Whether a measured choice may time its candidates now: autotuning on, no CUDA graph capture running, and
    the candidates' ``device`` (if given) a GPU (the interpreter's CPU runs take the caller's default)."""
    return (autotune_enabled() and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
            and (device is None or device.type == "cuda"))


def faster(times: dict[str, float], plain: str, other: str) -> str:
    """``other`` where it beat ``plain`` by :data:`MARGIN`, else ``plain``.

    Example:
        >>> faster({"pointer": 100.0, "TMA": 97.0}, "pointer", "TMA")
        'pointer'
        >>> faster({"pointer": 100.0, "TMA": 90.0}, "pointer", "TMA")
        'TMA'
    """
    return other if times[other] < MARGIN * times[plain] else plain


def time_runners(runners: dict[str, Callable[[], Any]], rounds: int = ROUNDS) -> dict[str, float]:
    """µs of each runner (already run once: compiled and tuned), the best of ``rounds`` interleaved rounds."""
    times: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name] = min(times.get(name, float("inf")), gpu_us(run))
    return times


def _disk_key(what: str, key: tuple) -> str:
    return f"{what} | {key!r}"


def _gpu_name(device: Optional[torch.device]) -> Optional[str]:
    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # (no CUDA: nothing is kept)
        return None


def stored_times(what: str, key: tuple, names: tuple[str, ...], device: Optional[torch.device] = None) \
        -> Optional[dict[str, float]]:
    """The µs :func:`store_times` kept for ``what`` at ``key`` on this GPU (``device``, else the current one) with
    this torch and Triton, or None (also when an entry lacks one of the candidates ``names``). ``key``'s ``repr``
    is its disk key: ints, strings, dtypes, dataclasses."""
    from .. import tuning_cache

    name = _gpu_name(device)
    stored = None if name is None else tuning_cache.lookup(_disk_key(what, key), name)
    times = None if stored is None else dict(stored.times)
    return times if times is not None and all(n in times for n in names) else None


def store_times(what: str, key: tuple, times: dict[str, float], device: Optional[torch.device] = None) -> None:
    """Keep ``times`` for ``what`` at ``key`` in the tuning cache (:mod:`fxfuse.tuning_cache`; nothing raises)."""
    from .. import tuning_cache

    name = _gpu_name(device)
    if name is not None:
        tuning_cache.store(_disk_key(what, key), name, tuning_cache.TunedChoice.of(times))
