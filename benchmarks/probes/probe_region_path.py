"""Host and GPU µs of a region's call beside eager's module, and what the call runs.

    python3 benchmarks/probes/probe_region_path.py [--rounds N] [shape:M ...]   (default seed:256 gpt2:512 gpt2:32)

For each case (a shape of ``bench_sweep.SHAPES`` at M rows): what runs (the planner's measured choice and its
candidates' times, each stage's implementation, whether the call replays), host µs per call
(``timing.host_us``), do_bench GPU median and wall µs of 200 back-to-back calls for eager and for the optimized
module, and the cProfile top of the optimized module's calls. Where the planner keeps a region's original ops, a
call should cost what eager's does. With ``--rounds N``, also N interleaved rounds of do_bench medians (eager,
fxfuse) after one discarded timing, and every CUDA kernel each runs with its device µs per call after a flush
(``timing.kernels_after_flush``): whether a difference between the two is GPU work or the host's pace.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_sweep import SHAPES  # noqa: E402
from benchmarks.timing import host_us, kernels_after_flush, profile_top, wall_us  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def main() -> None:
    from triton.testing import do_bench

    import fxfuse
    from fxfuse import replay, stages

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["seed:256", "gpt2:512", "gpt2:32"], help="shape:M")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved do_bench rounds and kernels after a flush")
    args = ap.parse_args()
    rounds = args.rounds
    torch.set_grad_enabled(False)
    for case in args.cases:
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
        if rounds:
            fns = {"eager": functools.partial(mod, x), "fxfuse": functools.partial(opt, x)}
            do_bench(fns["eager"], warmup=25, rep=100, return_mode="median")  # discarded: the GPU back to its clocks
            per_round = {k: [] for k in fns}
            for _ in range(rounds):
                for k, fn in fns.items():
                    per_round[k].append(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
            for k, vals in per_round.items():
                kernels = kernels_after_flush(fns[k])
                device = sum(us for _, us, _ in kernels)  # (µs per call of each kernel name, all its launches)
                print(f"  {k:7} rounds {' '.join(f'{v:.1f}' for v in vals)}  median {statistics.median(vals):.1f}  "
                      f"device {device:.1f} us in {sum(n for _, _, n in kernels)} launches: "
                      + ", ".join(f"{name[:50]} {us:.1f}" for name, us, _ in kernels), flush=True)
        print(profile_top(functools.partial(opt, x), calls=200, lines=18), flush=True)


if __name__ == "__main__":
    main()
