"""Where an optimized module's time goes on the GPU: kernels, host time before them, and the host path.

For each named workload (default: nerf64, gpt2_mlp, seed_geglu) it prints

* the planner's choice and its timings, the per-stage choices;
* do_bench median of the module call and of the chosen kernels called directly (``ops._run_kernels``);
* the CUDA kernels of one call (torch.profiler) and their sum: do_bench minus that sum is host time the GPU
  waited for;
* wall µs per call; the top of a cProfile of the call.

    python3 benchmarks/probes/probe_module.py [names...]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import profile_top, wall_us  # noqa: E402
from benchmarks.workloads import optimized_row  # noqa: E402
from fxfuse import ops, stages, strategy  # noqa: E402


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def _kernels(fn, calls: int = 5) -> tuple[str, float]:
    """The CUDA kernels ``fn`` launches (torch.profiler): a table, and their summed µs per call (GPU busy time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows, total = [], 0.0
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            total += e.device_time_total / calls
            rows.append(f"    {e.key[:70]:70s} x{e.count // calls:<3d} {e.device_time_total / calls:8.1f} us/call")
    return "\n".join(rows), total


def probe(name: str) -> None:
    _, mod, fast, x = optimized_row(name)
    with torch.no_grad():
        print(fxfuse.report(fast))
        ms = [m for m in strategy.measurements() if m.m == x.numel() // x.shape[-1]]
        print(f"== {name}: measurement {ms[-1] if ms else None}")
        print(f"   stage choices {stages.stage_choices()}")
        eager = _bench(lambda: mod(x))
        module = _bench(lambda: fast(x))
        table, busy = _kernels(lambda: fast(x))
        print(f"   do_bench: eager {eager:.1f} us, module {module:.1f} us; its kernels sum to {busy:.1f} us "
              f"(host wait ~{module - busy:.1f} us)\n" + table)
        if ms:
            m = ms[-1]
            weights = [p for n, p in mod.named_parameters() if n.endswith("weight")]
            biases = [p for n, p in mod.named_parameters() if n.endswith("bias")]
            args = (x.reshape(-1, x.shape[-1]), weights, biases, [], m.spec)
            if strategy.cached_choice(args) not in (None, strategy.ORIGINAL_OPS):
                direct = _bench(lambda: ops._run_kernels(*args, m.strategy))
                print(f"   kernels direct ({m.strategy}): {direct:.1f} us")
        walls = wall_us(lambda: fast(x), 100), wall_us(lambda: mod(x), 100)
        print(f"   wall per call: module {walls[0]:.1f} us, eager {walls[1]:.1f} us")
        print("   cProfile (tottime):\n" + profile_top(lambda: fast(x), 100, 22)[-4000:])


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("fxfuse").setLevel(logging.INFO)
    torch.manual_seed(0)
    names = sys.argv[1:] or ["nerf64", "gpt2_mlp", "seed_geglu"]
    for name in names:
        probe(name)


if __name__ == "__main__":
    main()
