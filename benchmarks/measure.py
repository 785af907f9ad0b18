"""The benchmarks' measuring tools: the GPU timer, the ceilings, the relative error, and cleaning up between rows.

Shared by ``bench_workloads.py``, ``bench_sweep.py``, ``bench_autocast.py`` and the probes. On a GPU, :class:`Timer`
times with ``triton.testing.do_bench`` (L2 flushed, median); with ``cpu=True`` (the benchmarks' ``--cpu-smoke``)
it uses a host timer, so the code paths run in the interpreter.

Example:
    >>> timer = Timer(warmup=1, rep=1, cpu=True)
    >>> timer.gpu_us(lambda: None) >= 0.0
    True
    >>> rel_err(torch.ones(3), torch.ones(3, dtype=torch.float64))
    0.0
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.workloads import DECODE_CALLS, DECODE_LOOPS, REF_CEILINGS

__all__ = ["Timer", "cleanup", "dynamo_reset", "measure_ceilings", "rel_err", "round_order"]


class Timer:
    def __init__(self, warmup: int, rep: int, cpu: bool):
        self.warmup, self.rep, self.cpu = warmup, rep, cpu

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize()

    def gpu_us(self, fn) -> float:
        """Median µs of ``fn`` by triton's do_bench (events, L2 flushed before each run)."""
        if self.cpu:  # --cpu-smoke: host timer
            fn()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(ts)
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median")) * 1e3

    def wall_us(self, fn, calls: int = DECODE_CALLS, loops: int = DECODE_LOOPS) -> dict:
        """Wall µs per call of ``calls`` back-to-back calls (synchronized before and after); median of loops."""
        if self.cpu:  # --cpu-smoke exercises the code path only (a CPU llama GEMV takes ~20 ms a call)
            calls = min(calls, 20)
        for _ in range(min(10, calls)):
            fn()
        self.sync()
        vals = []
        for _ in range(loops):
            self.sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            vals.append((time.perf_counter() - t0) / calls * 1e6)
        return {"median": statistics.median(vals), "all": vals}


def round_order(names: list, r: int, rounds: int) -> list:
    """The order in which round ``r`` of ``rounds`` interleaved rounds times the variants ``names``: the list
    rotated by ``r * len(names) // rounds``, so that over the rounds every variant is timed early, in the middle
    and late in a round. In a fixed order the variant timed after several compute-bound ones always met the GPU
    hotter (an H100 run of llama_swiglu_4096: fxfuse, timed right after ``backend="fxfuse"`` on the same
    kernels, read 2386 / 2285 / 2257 µs against its 2152 / 2165 / 2174).

    >>> [round_order(["a", "b", "c", "d", "e", "f"], r, 3) for r in range(3)]
    [['a', 'b', 'c', 'd', 'e', 'f'], ['c', 'd', 'e', 'f', 'a', 'b'], ['e', 'f', 'a', 'b', 'c', 'd']]
    """
    shift = r * len(names) // max(rounds, 1) % max(len(names), 1)
    return list(names[shift:]) + list(names[:shift])


def cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def dynamo_reset():
    try:
        torch._dynamo.reset()
    except Exception as e:  # pragma: no cover
        print(f"  (torch._dynamo.reset failed: {type(e).__name__}: {e})")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    d = out.double() - ref
    return float(d.norm() / ref.norm())


def measure_ceilings(timer: Timer, device: str, cpu_smoke: bool) -> dict:
    print("== ceilings")
    out = {}
    nbytes = (1 << 24) if cpu_smoke else (1 << 30)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = timer.gpu_us(lambda: dst.copy_(src))
    out["copy_us"] = t
    out["copy_bytes"] = 2 * nbytes
    out["copy_Bps"] = 2 * nbytes / (t * 1e-6)
    src = dst = None
    cleanup()
    n = 512 if cpu_smoke else 8192
    for tag, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)
        c = torch.empty(n, n, device=device, dtype=dt)
        t = timer.gpu_us(lambda a=a, b=b, c=c: torch.mm(a, b, out=c))
        out[f"{tag}_mm_us"] = t
        out[f"{tag}_flops"] = 2 * n**3 / (t * 1e-6)
        del a, b, c
        cleanup()
    out["mm_n"] = n
    print(f"  copy {out['copy_Bps'] / 1e12:.2f} TB/s (1 GiB d2d, read+write)   "
          f"bf16 {out['bf16_flops'] / 1e12:.0f} TFLOP/s   fp16 {out['fp16_flops'] / 1e12:.0f} TFLOP/s  ({n}³)")
    print(f"  reference: copy {REF_CEILINGS['copy_Bps'] / 1e12:.2f} TB/s, "
          f"bf16 {REF_CEILINGS['bf16_flops'] / 1e12:.0f}, fp16 {REF_CEILINGS['fp16_flops'] / 1e12:.0f} TFLOP/s")
    return out
