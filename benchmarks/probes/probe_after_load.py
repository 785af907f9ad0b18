"""Does a decode row read slower right after a compute-bound row has loaded the GPU (as in the full benchmark)?

    python3 benchmarks/probes/probe_after_load.py [--row llama_swiglu_m1] [--load seed_geglu] [--load-s 8]

llama_swiglu_m1 reads 90.3–91.5 µs in probes run on their own and 92.0–92.5 in the full benchmark, where it runs
right after seed_geglu and gpt2_mlp (do_bench keeps the GPU at its power cap for seconds). This times the row's
optimized module (do_bench, L2 flushed, 3 calls per point) before any load, right after ``--load-s`` seconds of
do_bench on the load row's optimized module, and after idle pauses of 5, 15 and 30 s, with the GPU's SM clock,
temperature and power (nvidia-smi) at each point. The eager module is timed beside it at every point.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton.testing  # noqa: E402

from benchmarks.workloads import optimized_row  # noqa: E402


def _smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"nvidia-smi: {err}"


def _point(tag: str, fast, mod, x) -> None:
    smi = _smi()
    fx = [triton.testing.do_bench(lambda: fast(x), warmup=25, rep=100, return_mode="median") * 1e3
          for _ in range(3)]
    eager = triton.testing.do_bench(lambda: mod(x), warmup=25, rep=100, return_mode="median") * 1e3
    print(f"  {tag:24s} fxfuse {', '.join(f'{t:.2f}' for t in fx)} µs; eager {eager:.1f}; GPU before: {smi}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama_swiglu_m1")
    parser.add_argument("--load", default="seed_geglu")
    parser.add_argument("--load-s", type=float, default=8.0)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    _, mod, fast, x = optimized_row(args.row)
    _, _, load, lx = optimized_row(args.load)
    print(f"{args.row} after {args.load} ({args.load_s:.0f} s of do_bench on its optimized module)")
    _point("before any load", fast, mod, x)
    for pause in (0, 5, 15, 30):
        t = time.perf_counter()
        while time.perf_counter() - t < args.load_s:
            triton.testing.do_bench(lambda: load(lx), warmup=25, rep=500, return_mode="median")
        print(f"  (load: {_smi()})")
        time.sleep(pause)
        _point(f"{pause} s after the load", fast, mod, x)


if __name__ == "__main__":
    main()
