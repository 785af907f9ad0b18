"""The small-M kernel at 17-64 rows: the module with it as a timed stage candidate against the module without it.

Up to 16 rows the small-M kernel (``gemv``) is a stage's only kernel candidate; from 17 to 64 rows it is now timed
beside the GEMM kernels and the library stages (``fxfuse.stages``). For each shape and row count: two
``fxfuse.optimize`` modules of the same model, one with the candidate (as shipped) and one without it
(``stages.GEMV_MAX_M`` set to 16 while it plans), each planned at its first call; then eager and both, interleaved
over ``--rounds``: do_bench median (L2 flushed) and wall µs per call of 200 back-to-back calls. Prints each
module's stage choices.

    python3 benchmarks/probes/probe_gemv_many_rows.py [--shapes gpt2m,llama] [--ms 24,32,48,64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import wall_us  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import stages, strategy, tuning_cache  # noqa: E402

ROWS = {"gpt2m": "gpt2m_mlp_m1", "llama": "llama_swiglu_m1"}


@contextlib.contextmanager
def fresh_choices():
    """Plan as a new process with an empty tuning cache would: no region or stage choice in memory, none read from
    disk."""
    strategy._choices.clear()
    stages._choices.clear()
    lookup = tuning_cache.lookup
    tuning_cache.lookup = lambda *args: None
    try:
        yield
    finally:
        tuning_cache.lookup = lookup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gpt2m,llama")
    ap.add_argument("--ms", default="24,32,48,64")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from triton.testing import do_bench

    for shape in args.shapes.split(","):
        w = next(w for w in WORKLOADS if w.name == ROWS[shape])
        # Two copies of the model (their own parameters, so their own replays), each optimized.
        mod, other = build_module(w, seed=3), build_module(w, seed=3)
        with_gemv, without = fxfuse.optimize(mod), fxfuse.optimize(other)
        for m in map(int, args.ms.split(",")):
            x = make_input(w, seed=m, m=m)
            first, choices = {}, {}
            with torch.no_grad():
                for name, module, limit in (("without", without, stages.GEMV_ONLY_M), ("with", with_gemv, None)):
                    saved = stages.GEMV_MAX_M
                    if limit is not None:
                        stages.GEMV_MAX_M = limit  # (its calls plan without the candidate)
                    try:
                        with fresh_choices():
                            t0 = time.perf_counter()
                            module(x)
                            torch.cuda.synchronize()
                            first[name] = time.perf_counter() - t0
                            for _ in range(3):  # recorded and replayed: later calls consult no choice
                                module(x)
                            choices[name] = sorted(f"{k[1]} M~{k[2]} K={k[3]} N={k[4]}{' (replayed)' if k[-2] else ''}"
                                                   f": {v}" for k, v in stages.stage_choices().items())
                    finally:
                        stages.GEMV_MAX_M = saved
                ref = mod(x)
                errs = {k: ((f(x) - ref).float().norm() / ref.float().norm()).item()
                        for k, f in (("with", with_gemv), ("without", without))}
            fns = {"eager": mod, "with gemv": with_gemv, "without": without}
            gpu = {k: [] for k in fns}
            wall = {k: [] for k in fns}
            with torch.no_grad():
                for _ in range(args.rounds):
                    for k, f in fns.items():
                        gpu[k].append(do_bench(lambda f=f, x=x: f(x), warmup=10, rep=50, return_mode="median") * 1e3)
                        wall[k].append(wall_us(lambda f=f, x=x: f(x)))
            print(f"{shape} M={m}: first call s with {first['with']:.2f} / without {first['without']:.2f}; "
                  f"rel err vs eager {errs['with']:.1e} / {errs['without']:.1e}")
            for k in fns:
                print(f"  {k:10s} do_bench {statistics.median(gpu[k]):7.1f} us  wall {statistics.median(wall[k]):7.1f}"
                      f"  (rounds {' '.join(f'{t:.1f}' for t in gpu[k])} / {' '.join(f'{t:.1f}' for t in wall[k])})")
            for name, lines in choices.items():
                print(f"  stages {name}: " + "; ".join(lines))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
