"""Host cost of one fused call on the GPU: is the lean launch path taken, and where does the time go?

    python3 benchmarks/probe_launch.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fxfuse import codegen  # noqa: E402
from fxfuse.kernels import fastlaunch, run_decode, run_stage  # noqa: E402


def wall_us(fn, n=300) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def top(fn, n=200, k=14) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k)
    return s.getvalue()[-3500:]


def main() -> None:
    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, **d)
    w1, b1 = torch.randn(4096, 1024, **d) / 32, torch.randn(4096, **d)
    w2, b2 = torch.randn(1024, 4096, **d) / 64, torch.randn(1024, **d)
    print("lean enabled:", fastlaunch.lean_launch_enabled(), "hooks:",
          fastlaunch._knobs.runtime.launch_enter_hook, fastlaunch._knobs.runtime.launch_exit_hook)
    kernel = codegen.generated_kernel(1, "gelu_tanh(a0)").fused_stage_kernel
    ret = kernel[lambda meta: (1,)]  # noqa: F841  (only checks indexing works)

    def stage():
        return run_stage(x, [w1], [b1], [], "gelu_tanh(a0)", check=False)

    stage()
    stage()
    lean = getattr(kernel, "_fxfuse_lean", None)
    print("run_stage: lean entries", lean and len(lean.entries), "hits", lean and lean.hits,
          "best_config", getattr(kernel, "best_config", None))
    print(f"run_stage wall {wall_us(stage):.1f} us; F.linear+gelu wall "
          f"{wall_us(lambda: F.gelu(F.linear(x, w1, b1), approximate='tanh')):.1f} us")

    def decode():
        return run_decode(x, [w1, w2], [b1, b2], [[], []], ("gelu_tanh(a0)", "a0"), check=False)

    decode()
    decode()
    dk = codegen.generated_decode_kernel(1, "gelu_tanh(a0)", "a0").fused_decode_kernel
    lean = getattr(dk, "_fxfuse_lean", None)
    print("run_decode: lean entries", lean and len(lean.entries), "hits", lean and lean.hits)
    print(f"run_decode wall {wall_us(decode):.1f} us; eager MLP wall "
          f"{wall_us(lambda: F.linear(F.gelu(F.linear(x, w1, b1), approximate='tanh'), w2, b2)):.1f} us")
    print("== cProfile run_stage\n" + top(stage))
    print("== cProfile run_decode\n" + top(decode))


if __name__ == "__main__":
    main()
