"""Host and GPU µs of a region's call beside eager's module, and what the call runs.

    python3 benchmarks/probes/probe_region_path.py [shape:M ...]   (default seed:256 gpt2:512 gpt2:32)

For each case (a shape of ``bench_sweep.SHAPES`` at M rows): what runs (the planner's measured choice and its
candidates' times, each stage's implementation, whether the call replays), host µs per call
(``timing.host_us``), do_bench GPU median and wall µs of 200 back-to-back calls for eager and for the optimized
module, and the cProfile top of the optimized module's calls. Where the planner keeps a region's original ops, a
call should cost what eager's does.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_sweep import SHAPES  # noqa: E402
from benchmarks.timing import host_us, profile_top, wall_us  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def main() -> None:
    from triton.testing import do_bench

    import fxfuse
    from fxfuse import replay, stages

    torch.set_grad_enabled(False)
    for case in sys.argv[1:] or ["seed:256", "gpt2:512", "gpt2:32"]:
        name, m = case.split(":")
        w = next(w for w in WORKLOADS if w.name == SHAPES[name])
        mod = build_module(w)
        x = make_input(w, m=int(m))
        opt = fxfuse.optimize(mod)
        opt(x)
        torch.cuda.synchronize()
        opt(x)
        regions = fxfuse.report(opt).regions
        print(f"== {case}: runs {[r.running_at(int(m)) for r in regions]}; planner "
              f"{[dict(p.times) for r in regions for p in r.measurements]}; stages {stages.stage_choices()}; "
              f"{len(replay.replays)} replay(s)", flush=True)
        for label, module in (("eager", mod), ("fxfuse", opt)):
            fn = functools.partial(module, x)
            gpu = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            print(f"  {label:7} host {host_us(fn):6.1f}  gpu {gpu:6.1f}  wall {wall_us(fn):6.1f} us", flush=True)
        print(profile_top(functools.partial(opt, x), calls=200, lines=18), flush=True)


if __name__ == "__main__":
    main()
