"""llama_swiglu_m1's optimized module with each near-tied gate+up config: does the autotuner's pick move the row?

The gate+up stage's configs sit within ~1% of each other timed alone; the row is timed as the whole module (gate+up,
then the prefetching down stage). After ``optimize`` and a first call, the tuned config of the gate+up key is
replaced by each candidate in turn (bound launches and replays dropped, so the next calls use it), and the module is
timed with ``do_bench`` (L2 flushed) in interleaved rounds. Outputs checked against float64.

    python3 benchmarks/probes/probe_m1_pick.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.workloads import optimized_row  # noqa: E402
from fxfuse import codegen, replay  # noqa: E402
from fxfuse.kernels import gemv_launch  # noqa: E402

# (BLOCK_N, BLOCK_K, warps, stages) of one-row gate+up configs.
CANDIDATES = [(1, 2048, 16, 1), (1, 2048, 8, 2), (1, 4096, 8, 1), (1, 1024, 16, 1), (1, 4096, 8, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    _, mod, fast, x = optimized_row("llama_swiglu_m1")
    kernel = next(codegen.generated_gemv_kernel(2, epi).fused_gemv_kernel for epi in ("mul(a0,silu(a1))",
                                                                                        "mul(silu(a0),a1)")
                  if any(14336 in k for k in getattr(codegen.generated_gemv_kernel(2, epi).fused_gemv_kernel,
                                                     "cache", {})))
    key = next(k for k in kernel.cache if 14336 in k)
    print(f"tuned gate+up {key}: {kernel.cache[key]}")
    configs = {f"N{bn} K{bk} w{w} s{s}": triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "ONE_ROW": 1},
                                                      num_warps=w, num_stages=s) for bn, bk, w, s in CANDIDATES}
    with torch.no_grad():
        ref = copy.deepcopy(mod).double()(x.double())
        times: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, config in configs.items():
                kernel.cache[key] = config
                gemv_launch._bound.clear()
                replay.replays.clear()
                out = fast(x)
                fast(x)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (name, err)
                times[name].append(triton.testing.do_bench(lambda: fast(x), warmup=25, rep=100,
                                                           return_mode="median") * 1e3)
    for name in sorted(times, key=lambda n: statistics.median(times[n])):
        print(f"   gate+up {name}: {statistics.median(times[name]):.2f} µs (rounds "
              f"{', '.join(f'{t:.2f}' for t in times[name])})")


if __name__ == "__main__":
    main()
