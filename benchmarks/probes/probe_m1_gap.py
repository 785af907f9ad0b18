"""Why llama_swiglu_m1 reads ~1 µs slower as the optimized module than as its two stages called directly.

    python3 benchmarks/probes/probe_m1_gap.py [--row llama_swiglu_m1] [--rounds 5]
    python3 benchmarks/probes/probe_m1_gap.py --steps   # the module re-timed after each of the benchmark's steps

Builds the row as the benchmark does (grad off, ``fxfuse.optimize``, one call), records the region's op call,
then times, interleaved (do_bench µs, L2 flushed, median of rounds):

* ``module``: the optimized module (its region replayed, as in the benchmark);
* ``op``: the op's implementation on the same tensors (``fxfuse.ops._dispatch``: the replay);
* ``stage loop``: the chosen strategy's kernels without the replay (``fxfuse.ops._run_kernels``);
* ``direct pair``: ``run_stage_gemv`` twice (gate+up, then down with ``after_gemv``), as ``probe_prefetch.py``.

Then a profiler pass over 20 flushed calls of ``module`` and ``direct pair``: each kernel's device µs, the gap from
the first kernel's end to the second's start (negative: the programmatic dependent launch overlapped them) and the
span from the first kernel's start to the last one's end, with the kernels' names and grids.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton.testing  # noqa: E402

from benchmarks.workloads import optimized_row  # noqa: E402
from fxfuse import ops  # noqa: E402
from fxfuse.kernels import run_stage_gemv  # noqa: E402


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _profile(fn, calls: int = 20) -> list[dict]:
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and "elementwise" not in e.name and "fill" not in e.name.lower() and "zero" not in e.name.lower()]
    events.sort(key=lambda e: e.time_range.start)
    per_call = len(events) // calls
    out = []
    for i in range(calls):
        ks = events[i * per_call:(i + 1) * per_call]
        out.append({"names": [k.name[:40] for k in ks], "us": [k.time_range.elapsed_us() for k in ks],
                    "gaps": [b.time_range.start - a.time_range.end for a, b in zip(ks, ks[1:])],
                    "span": ks[-1].time_range.end - ks[0].time_range.start})
    return out


def bench_steps(row: str) -> None:
    """Time the optimized module (3 do_bench calls) before and after each step ``bench_workloads.py`` takes for a
    decode row in the same process: eager's CUDA graph, torch.compile, the check on another input, the
    ``cuda_graphs=True`` variant, then the interleaved rounds of every variant."""
    import copy

    import fxfuse
    from benchmarks.bench_workloads import cuda_graph
    from benchmarks.workloads import make_input

    w, mod, fast, x = optimized_row(row)
    xc = make_input(w, seed=3)
    keep: dict = {}

    def point(tag: str) -> None:
        ts = [_bench(lambda: fast(x)) for _ in range(3)]
        print(f"  {tag:44s} module {', '.join(f'{t:.2f}' for t in ts)} µs")

    from fxfuse import replay
    from fxfuse.kernels import gemv_launch

    def graph_calls(n: int):
        def step():
            if "optg" not in keep:
                keep["optg"] = fxfuse.optimize(mod, cuda_graphs=True)
            for _ in range(n):
                keep["optg"](x)
            print(f"    (bound small-M launches {len(gemv_launch._bound)}, replays {len(replay.replays)})")
        return step

    steps = [
        ("eager captured in a CUDA graph", lambda: keep.update(graph=cuda_graph(mod, x))),
        ("torch.compile(mod) called", lambda: keep.update(cm=torch.compile(copy.copy(mod)))
         or [keep["cm"](x) for _ in range(2)]),
        ("module called twice on another input", lambda: [fast(xc) for _ in range(2)]),
        ("optimize(cuda_graphs=True), no call", graph_calls(0)),
        ("... its first call", graph_calls(1)),
        ("... its second call", graph_calls(1)),
        ("... its third call", graph_calls(1)),
        ("... a call on another input", lambda: keep["optg"](xc).clone()),
        ("interleaved rounds of every variant", lambda: [_bench(f) for _ in range(3) for f in (
            lambda: mod(x), keep["graph"][0].replay, lambda: keep["cm"](x), lambda: fast(x),
            lambda: keep["optg"](x))]),
    ]
    print(f"{row}: the optimized module after each of the benchmark's steps (do_bench µs)")
    point("built, one call (as optimized_row)")
    for tag, step in steps:
        step()
        torch.cuda.synchronize()
        point(f"after: {tag}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="llama_swiglu_m1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", action="store_true", help="the module after each of the benchmark's steps")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.steps:
        bench_steps(args.row)
        return
    calls = []
    dispatch = ops._dispatch
    ops._dispatch = lambda *a: calls.append(a) or dispatch(*a)
    try:
        w, mod, fast, x = optimized_row(args.row)
        fast(x)
    finally:
        ops._dispatch = dispatch
    xr, weights, biases, operands, spec = calls[-1]
    strategy = ops.cached_choice(calls[-1])
    stages = ops._plan(spec)[0]
    print(f"{args.row}: spec {spec}, strategy {strategy}, x {tuple(xr.shape)}, stages "
          f"{[(s.num_linears, s.epilogue) for s in stages]}")
    x2 = xr.reshape(-1, xr.shape[-1])
    first = [weights[i] for i, _ in stages[0].linears]
    second = [weights[i] for i, _ in stages[1].linears]

    def direct():
        h = run_stage_gemv(x2, first, [None] * len(first), [], stages[0].epilogue, check=False)
        return run_stage_gemv(h, second, [None] * len(second), [], stages[1].epilogue, check=False, after_gemv=True)

    variants = {
        "module": lambda: fast(x),
        "op": lambda: ops._dispatch(xr, weights, biases, operands, spec),
        "stage loop": lambda: ops._run_kernels(xr, weights, biases, operands, spec, strategy),
        "direct pair": direct,
    }
    ref = fast(x).double()
    for name, fn in variants.items():
        fn()
        out = fn().double().reshape(ref.shape)
        print(f"  {name}: rel err vs the module {((out - ref).norm() / ref.norm()).item():.1e}")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(_bench(fn))
    print("do_bench µs (median of rounds; rounds):")
    for name, ts in times.items():
        print(f"  {name:12s} {statistics.median(ts):7.2f}  ({', '.join(f'{t:.2f}' for t in ts)})")
    for name in ("module", "direct pair"):
        rows = _profile(variants[name])[2:]  # the first calls may still bind launches
        print(f"profiler, {name} ({len(rows)} flushed calls): kernels {rows[0]['names']}")
        us = list(zip(*[r["us"] for r in rows]))
        gaps = list(zip(*[r["gaps"] for r in rows]))
        span = statistics.median(r["span"] for r in rows)
        print(f"  device µs per kernel (median): {[round(statistics.median(k), 2) for k in us]}; gaps "
              f"{[round(statistics.median(g), 2) for g in gaps]}; span {span:.2f}")


if __name__ == "__main__":
    main()
