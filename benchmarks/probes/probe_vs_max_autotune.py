"""Where torch.compile max-autotune's kernels beat fxfuse's on a workload row: per-kernel device time of both.

    python3 benchmarks/probes/probe_vs_max_autotune.py [row ...]   (default llama_swiglu_4096)

For each row: ``fxfuse.optimize`` (its planner's stage choices and candidate times with ``TORCH_LOGS=fxfuse``) and
``torch.compile(mode="max-autotune-no-cudagraphs")`` (Inductor prints its AUTOTUNE tables to stderr), then three
interleaved rounds of do_bench medians (eager, fxfuse, max-autotune) and every CUDA kernel each runs, with its
device µs per call after a 256 MB L2 flush (``timing.kernels_after_flush``).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.timing import kernels_after_flush  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def main() -> None:
    from triton.testing import do_bench

    import fxfuse
    from fxfuse import stages

    torch.set_grad_enabled(False)
    for name in sys.argv[1:] or ["llama_swiglu_4096"]:
        w = next(w for w in WORKLOADS if w.name == name)
        mod, x = build_module(w), make_input(w)
        t0 = time.perf_counter()
        opt = fxfuse.optimize(mod)
        opt(x)
        torch.cuda.synchronize()
        print(f"== {name}: fxfuse first call {time.perf_counter() - t0:.1f} s; stages {stages.stage_choices()}",
              flush=True)
        t0 = time.perf_counter()
        mat = torch.compile(mod, mode="max-autotune-no-cudagraphs")
        mat(x)
        torch.cuda.synchronize()
        print(f"  max-autotune first call {time.perf_counter() - t0:.1f} s", flush=True)
        variants = {"eager": functools.partial(mod, x), "fxfuse": functools.partial(opt, x),
                    "max-autotune": functools.partial(mat, x)}
        rounds = {k: [] for k in variants}
        for _ in range(3):
            for k, fn in variants.items():
                rounds[k].append(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
        for k, vs in rounds.items():
            print(f"  {k:13} do_bench µs per round: {' '.join(f'{v:7.1f}' for v in vs)}", flush=True)
        for k, fn in variants.items():
            print(f"  {k} kernels (device µs per call after a flush, launches per call):", flush=True)
            for kernel, us, count in kernels_after_flush(fn):
                print(f"    {us:8.1f}  x{count}  {kernel[:110]}", flush=True)


if __name__ == "__main__":
    main()
