"""Why is a transformers Llama slower end to end after optimize? Host and GPU time of one forward.

    python3 benchmarks/probes/probe_llama.py

The 4-layer Llama of examples/profile_demo.py (TinyLlama widths, bf16, 2048 tokens): do_bench median and
wall time of a forward, eager vs fxfuse, under ``torch.no_grad()``; then a cProfile of the fxfuse forward.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

from profile_demo import llama  # noqa: E402

import fxfuse  # noqa: E402
from benchmarks.timing import profile_top, wall_us  # noqa: E402


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
                  f"wall {wall_us(lambda m=m: m(ids), 20, 1):.0f} us per forward")
        for name, m in (("eager", model), ("fxfuse", fast)):
            torch.cuda.synchronize()
            print(f"== cProfile {name}, 10 forwards, by tottime\n" + profile_top(lambda m=m: m(ids), 10, 18)[-4000:])


if __name__ == "__main__":
    main()
