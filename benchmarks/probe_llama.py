"""Why is a transformers Llama slower end to end after optimize? Host and GPU time of one forward.

    python3 benchmarks/probe_llama.py

The 4-layer Llama of examples/profile_demo.py (TinyLlama widths, bf16, 2048 tokens): do_bench median and
wall time of a forward, eager vs fxfuse, under ``torch.no_grad()``; then a cProfile of the fxfuse forward.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from profile_demo import llama  # noqa: E402

import fxfuse  # noqa: E402


def wall_us(fn, n=20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("fxfuse.strategy").setLevel(logging.INFO)
    model, (ids,) = llama()
    with torch.no_grad():
        fast = fxfuse.optimize(model, (ids,))
        print(fxfuse.report(fast))
        for name, m in (("eager", model), ("fxfuse", fast)):
            m(ids)
            print(f"{name}: do_bench {do_bench(lambda m=m: m(ids), return_mode='median') * 1e3:.0f} us, "
                  f"wall {wall_us(lambda m=m: m(ids)):.0f} us per forward")
        for name, m in (("eager", model), ("fxfuse", fast)):
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                m(ids)
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            print(f"== cProfile {name}, 10 forwards, by tottime\n" + s.getvalue()[-4000:])


if __name__ == "__main__":
    main()
