"""Every TMA stage config, one by one, on the large-M stages: which tile, pipeline depth and warp specialization win.

    python3 benchmarks/probes/probe_tma_sweep.py [--budget SECONDS] [--skip-ws] [--m M,...] [--n N,...] [case names...]

For each stage of ``probe_tma.CASES`` (bf16), each config of ``tma_template.sweep_configs()`` that the pruning keeps
is compiled and run directly (no autotuner), checked against the fp32 reference (relative error) and timed
(``do_bench`` median, L2 flushed); a config that fails to compile or run is listed with its error. The cuBLAS stage
(``F.linear`` + the eager epilogue) is timed beside it. Prints a table per stage, fastest first. ``--m`` / ``--n``
run each named case at other rows / output columns (every combination), e.g. Llama's gate/up at mid-size M, or
at an N whose tile count fills whole waves of the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_tma import CASES  # noqa: E402
from fxfuse.epilogue import evaluate, parse  # noqa: E402
from fxfuse.kernels import run_stage_tma, tma_template  # noqa: E402


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def describe(c) -> str:
    k = c.kwargs
    return (f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} s{c.num_stages} w{c.num_warps} ctas{k['CTAS_PER_SM']}"
            f"{' sub' if k['EPILOGUE_SUBTILE'] else ''}{' WS' if k['WARP_SPECIALIZE'] else ''}")


def sweep(case, deadline: float, skip_ws: bool = False) -> None:
    workload, stage, m, k, n, gated, epi, bias = case
    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, **d)
    weights = [torch.randn(n, k, **d) * k**-0.5 for _ in range(2 if gated else 1)]
    biases = [torch.randn(n, **d) if bias else None for _ in weights]
    expr = parse(epi)

    def cublas():
        return evaluate(expr, [F.linear(x, w, b) for w, b in zip(weights, biases)], [])

    ref = evaluate(expr, [F.linear(x.float(), w.float(), None if b is None else b.float())
                          for w, b in zip(weights, biases)], [])
    flops = 2 * m * k * n * len(weights)
    base = bench_us(cublas)
    gemms = bench_us(lambda: [F.linear(x, w, b) for w, b in zip(weights, biases)])  # cuBLAS, no epilogue
    print(f"== {workload} {stage}: M={m} K={k} N={n}{' gated' if gated else ''}, cuBLAS+eager {base:.1f} us "
          f"({flops / base / 1e6:.0f} TFLOP/s), cuBLAS GEMMs alone {gemms:.1f} us ({flops / gemms / 1e6:.0f})",
          flush=True)
    if not gated and bias and epi in ("gelu_tanh(a0)", "relu(a0)"):  # the planner's cuBLASLt candidate
        lt = bench_us(lambda: torch._addmm_activation(biases[0], x, weights[0].t(), use_gelu=epi != "relu(a0)"))
        print(f"   cuBLASLt bias+activation epilogue {lt:.1f} us ({flops / lt / 1e6:.0f} TFLOP/s)", flush=True)
    # The pruning needs the launch's arguments: the descriptors' shapes and M (as the autotuner passes them).
    from triton.tools.tensor_descriptor import TensorDescriptor

    probe_args = {"M": m, "x_desc": TensorDescriptor.from_tensor(x, [16, 16]),
                  "w_desc": TensorDescriptor(weights[0], [2, n, k] if gated else [n, k],
                                             [n * k, k, 1] if gated else [k, 1], [2, 16, 16] if gated else [16, 16])}
    configs = tma_template._prune(tma_template.sweep_configs(), probe_args)
    if skip_ws:  # Triton 3.6 can abort the process (not raise) compiling some warp-specialized configs
        configs = [c for c in configs if not c.kwargs["WARP_SPECIALIZE"]]
    rows = []
    for c in configs:
        if time.time() > deadline:
            print("   (budget reached: the remaining configs were not run)")
            break
        try:
            run = lambda c=c: run_stage_tma(x, weights, biases, [], epi, check=False, config=c)  # noqa: E731
            out = run()
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us = bench_us(run)
            rows.append((us, describe(c), f"rel err {err:.1e}"))
        except Exception as e:  # a config that does not compile or run here: say why, go on
            rows.append((float("inf"), describe(c), f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
    for us, name, note in sorted(rows):
        tflops = f"{flops / us / 1e6:5.0f} TFLOP/s" if us != float("inf") else ""
        print(f"   {us:8.1f} us {tflops:>14s}  {name:40s} {note}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole sweep")
    ap.add_argument("--skip-ws", action="store_true", help="leave out the warp-specialized configs")
    ap.add_argument("--m", default="", help="comma-separated rows to run each case at instead of its own")
    ap.add_argument("--n", default="", help="comma-separated output columns to run each case at instead")
    ap.add_argument("names", nargs="*", help="cases as 'workload:stage' (default: all)")
    args = ap.parse_args()
    deadline = time.time() + args.budget
    for case in CASES:
        if args.names and f"{case[0]}:{case[1]}" not in args.names:
            continue
        workload, stage, m, k, n, *rest = case
        for m_ in [int(v) for v in args.m.split(",") if v] or [m]:
            for n_ in [int(v) for v in args.n.split(",") if v] or [n]:
                sweep((workload, stage, m_, k, n_, *rest), deadline, args.skip_ws)


if __name__ == "__main__":
    main()
