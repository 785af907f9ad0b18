"""What the L2 flush before each timed call costs a weight-streaming kernel: dirty vs clean flush.

    python3 benchmarks/probes/probe_flush.py

``triton.testing.do_bench`` flushes L2 by zeroing a 256 MB buffer before every call, which leaves L2 full of
dirty lines: the timed kernel's reads evict them, so HBM also carries their write-back. This times the same
kernels (device time from the profiler) after that dirty flush, after a clean flush (reading 256 MB), and
with no flush, for the llama decode stages and a plain 117 MiB reduction.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.kernels import run_stage_gemv  # noqa: E402


def device_us(fn, before, calls: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    names = set()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            before()
            torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
    # The timed kernels are the ones not launched by ``before`` (profiled alone once to learn their names).
    with profile(activities=[ProfilerActivity.CUDA]) as pre:
        before()
        torch.cuda.synchronize()
    names = {e.key for e in pre.key_averages() if e.device_type.name == "CUDA"}
    return sum(e.device_time_total / calls for e in prof.key_averages()
               if e.device_type.name == "CUDA" and e.key not in names and e.count)


def main() -> None:
    d = dict(device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flushes = {"dirty (zero 256 MB, as do_bench)": buf.zero_,
               "clean (read 256 MB)": lambda: buf.view(torch.int32).max(),
               "none": lambda: None}
    x1, x16, x16g = torch.randn(1, 4096, **d), torch.randn(16, 14336, **d), torch.randn(16, 4096, **d)
    wg, wu = (torch.randn(14336, 4096, **d) * 0.02 for _ in range(2))
    wd = torch.randn(4096, 14336, **d) * 0.01
    flat = torch.randn(117 << 19, **d)
    kernels = {
        "llama gate+up M=1 (235 MB)": lambda: run_stage_gemv(x1, [wg, wu], [None, None], [], "mul(silu(a0),a1)"),
        "llama gate+up M=16 (235 MB)": lambda: run_stage_gemv(x16g, [wg, wu], [None, None], [], "mul(silu(a0),a1)"),
        "llama down M=16 (117 MB)": lambda: run_stage_gemv(x16, [wd], [None], [], "a0"),
        "sum of 117 MiB": lambda: flat.sum(dtype=torch.float32),
    }
    for name, fn in kernels.items():
        times = {f: device_us(fn, before) for f, before in flushes.items()}
        print(f"{name:28s} " + "  ".join(f"{f}: {t:6.1f} us" for f, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
