"""Host-side timing helpers shared by the probe scripts (GPU only)."""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch


def _best_us_per_call(fn: Callable[[], object], calls: int, loops: int, sync_in_timing: bool) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync_in_timing:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        if not sync_in_timing:
            torch.cuda.synchronize()
    return best


def median_us(fn: Callable[[], object], device: str, run_off_gpu: bool = False) -> float:
    """``do_bench``'s median µs of ``fn`` (L2 flushed; warmup 10 ms, rep 50 ms) on ``device == "cuda"``; NaN
    elsewhere (the probes' interpreter runs), after one call of ``fn`` with ``run_off_gpu``."""
    if device != "cuda":
        if run_off_gpu:
            fn()
        return float("nan")
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def wall_us(fn: Callable[[], object], calls: int = 200, loops: int = 5) -> float:
    """µs per call of ``calls`` back-to-back calls, synchronized before and after; best of ``loops``."""
    return _best_us_per_call(fn, calls, loops, sync_in_timing=True)


def synced_us(fn: Callable[[], object], calls: int = 20, loops: int = 5) -> float:
    """µs per call with a synchronize after each call (a training loop that reads its loss every step): the
    host's time to issue a call and the GPU's time to run it add up, best of ``loops``."""
    def call_and_wait() -> None:
        fn()
        torch.cuda.synchronize()

    return _best_us_per_call(call_and_wait, calls, loops, sync_in_timing=True)


def host_us(fn: Callable[[], object], calls: int = 50, loops: int = 20) -> float:
    """Host µs per call: ``calls`` calls issued back to back with no synchronization inside (the GPU queue does
    not fill at this count), best of ``loops``."""
    return _best_us_per_call(fn, calls, loops, sync_in_timing=False)


def profile_top(fn: Callable[[], object], calls: int = 200, lines: int = 14, sort: str = "tottime") -> str:
    """cProfile of ``calls`` calls (synchronized at the end): the top ``lines`` functions as text."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(lines)
    return s.getvalue()


def capture_graph(fn: Callable[[], object], calls: int = 1, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured into one CUDA graph, after ``warmup`` calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def kernels_after_flush(fn: Callable[[], object], calls: int = 10) -> list[tuple[str, float, int]]:
    """``(kernel name, device µs per call, launches per call)`` of the CUDA kernels ``fn`` runs (torch.profiler),
    each call after a 256 MB L2 flush, whose fill kernel is left out."""
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / calls, e.count // calls) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count and "FillFunctor" not in e.key]
