"""A one-row stage after another small-M stage loading its first weights before the wait (``PREFETCH``): A/B.

The decode MLP's second stage is a programmatic dependent launch: its programs become resident while the first
stage finishes, then wait (``gdc_wait``) for it. With ``PREFETCH`` a one-row program issues its first K step's
weight loads before that wait (``fxfuse/kernels/gemv_template.py`` says why that is safe), so the stage's first
DRAM round trip overlaps the first stage's tail.

1. The two stages called directly (llama_swiglu_m1's gate+up, then down with each one-row config), prefetch off
   and on, do_bench (L2 flushed), interleaved rounds.
2. The optimized module (``fxfuse.optimize``), ``gemv_launch.prefetch_weights`` off and on (bound launches and
   replays dropped at each switch), do_bench, interleaved rounds; outputs checked against float64.

    python3 benchmarks/probes/probe_prefetch.py [--rounds 5] [--only llama_swiglu_m1,gpt2m_mlp_m1]
        [--down 1x16384x16,2x8192x16,1x8192x16x2]   # part 1's down configs: BLOCK_N x BLOCK_K x warps [x SPLIT_K]
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
from fxfuse import replay  # noqa: E402
from fxfuse.kernels import gemv_launch, run_stage_gemv  # noqa: E402

# (BLOCK_N, BLOCK_K, warps[, SPLIT_K]) of one-row down configs; 16384 holds llama's whole K = 14336 row in one step.
DOWN = [(1, 8192, 16), (1, 1024, 16), (1, 16384, 16), (1, 16384, 32)]


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _switch(on: bool) -> None:
    gemv_launch.prefetch_weights = on
    gemv_launch._bound.clear()
    replay.replays.clear()


def direct_pair(rounds: int, down=DOWN) -> None:
    torch.manual_seed(0)
    d, hdim = 4096, 14336
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(hdim, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5 for _ in range(2))
    wd = torch.randn(d, hdim, device="cuda", dtype=torch.bfloat16) / hdim ** 0.5
    ref = (torch.nn.functional.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T)) @ wd.double().T
    print("1. gate+up then down, llama_swiglu_m1 (device do_bench µs, median of rounds)")
    for bn, bk, warps, *split in down:
        split = split[0] if split else 1
        config = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "ONE_ROW": 1}, num_warps=warps,
                               num_stages=1)
        times: dict[bool, list[float]] = {False: [], True: []}

        def pair(prefetch: bool, config=config):
            h = run_stage_gemv(x, [wg, wu], [None, None], [], "mul(silu(a0),a1)")
            return run_stage_gemv(h, [wd], [None], [], "a0", config=config, after_gemv=prefetch)

        try:
            for prefetch in (False, True):
                err = ((pair(prefetch).double() - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (config, prefetch, err)
            for _ in range(rounds):
                for prefetch in (False, True):
                    times[prefetch].append(_bench(lambda prefetch=prefetch: pair(prefetch)))
        except Exception as e:  # a config that does not compile (registers) is reported, not fatal
            print(f"   down N{bn} K{bk} w{warps} split{split}: {type(e).__name__}: {str(e)[:120]}")
            continue
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"   down N{bn} K{bk} w{warps} split{split}: off {off:.2f}  on {on:.2f}  (on - off {on - off:+.2f}; "
              f"rounds off {', '.join(f'{t:.2f}' for t in times[False])} / on "
              f"{', '.join(f'{t:.2f}' for t in times[True])})")


def module_ab(names: list[str], rounds: int) -> None:
    print("2. the optimized module (do_bench µs, median of rounds)")
    for name in names:
        w, mod, fast, x = optimized_row(name)
        with torch.no_grad():
            ref = copy.deepcopy(mod).double()(x.double())
            times: dict[bool, list[float]] = {False: [], True: []}
            for on in (False, True):
                _switch(on)
                out = fast(x)
                fast(x)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                print(f"   {name} prefetch {'on' if on else 'off'}: rel err {err:.1e}")
            for _ in range(rounds):
                for on in (False, True):
                    _switch(on)
                    fast(x)
                    fast(x)
                    times[on].append(_bench(lambda fast=fast, x=x: fast(x)))
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"   {name}: off {off:.2f}  on {on:.2f}  (on - off {on - off:+.2f}; rounds off "
              f"{', '.join(f'{t:.2f}' for t in times[False])} / on {', '.join(f'{t:.2f}' for t in times[True])})")
    _switch(True)


def bench_like(name: str, rounds: int) -> None:
    """As ``bench_workloads.py`` runs the row (grad mode off for the process, ``optimize`` then one call), then
    which launches were bound and which configs the small-M kernels were tuned to."""
    import fxfuse
    from benchmarks.workloads import WORKLOADS, build_module, make_input
    from fxfuse import codegen

    print(f"3. {name} as the benchmark runs it")
    torch.set_grad_enabled(False)
    w = next(w for w in WORKLOADS if w.name == name)
    mod, x = build_module(w), make_input(w)
    opt = fxfuse.optimize(mod)
    opt(x)
    times = [_bench(lambda: opt(x)) for _ in range(rounds)]
    print(f"   do_bench µs: {', '.join(f'{t:.2f}' for t in times)}")
    print(f"   bound small-M launches (tag): {[k[0] for k in gemv_launch._bound]}")
    # The benchmark builds the CUDA-graph variant next, before it times anything.
    graphed = fxfuse.optimize(mod, cuda_graphs=True)
    for _ in range(3):
        graphed(x)
    times = [_bench(lambda: opt(x)) for _ in range(rounds)]
    print(f"   after building cuda_graphs=True: do_bench µs {', '.join(f'{t:.2f}' for t in times)}; "
          f"graphed {_bench(lambda: graphed(x)):.2f}")
    print(f"   bound small-M launches (tag): {[k[0] for k in gemv_launch._bound]}; replays {len(replay.replays)}")
    _switch(True)
    opt(x)
    opt(x)
    times = [_bench(lambda: opt(x)) for _ in range(rounds)]
    print(f"   bound launches and replays dropped: do_bench µs {', '.join(f'{t:.2f}' for t in times)}")
    for n_lin, epi in ((2, "mul(a0,silu(a1))"), (2, "mul(silu(a0),a1)"), (1, "a0")):
        kernel = codegen.generated_gemv_kernel(n_lin, epi).fused_gemv_kernel
        for key, config in getattr(kernel, "cache", {}).items():
            print(f"   {epi} tuned {key}: {config}")
    torch.set_grad_enabled(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="llama_swiglu_m1")
    parser.add_argument("--down", default=None, help="part 1's down configs, e.g. 1x16384x16,2x8192x16,1x8192x16x2")
    parser.add_argument("--module", action="store_true", help="also part 2 (the module, prefetch off and on)")
    parser.add_argument("--bench-like", action="store_true", help="only part 3 (a fresh process's first row)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if args.bench_like:
        bench_like(args.only.split(",")[0], args.rounds)
        return
    down = [tuple(int(v) for v in c.split("x")) for c in args.down.split(",")] if args.down else DOWN
    direct_pair(args.rounds, down)
    if args.module or not args.down:
        module_ab(args.only.split(","), args.rounds)


if __name__ == "__main__":
    main()
