"""SIREN (sin(30 linear(x)) layers, then a linear) beside eager and torch.compile: inference and a training step.

For each row (widths, dtype, M), times with ``triton.testing.do_bench`` (median µs, L2 flushed): eager, torch.compile
(default) and ``fxfuse.optimize`` -- the forward without gradients, then a training step (forward, backward of a
sum of squares, gradients zeroed). Prints the roofline floor of the forward (max of its FLOPs at the fp16 matmul
ceiling and its minimum bytes -- input, weights, output once -- at the copy ceiling, both measured here), the
error of each against the float64 model, the compile time of torch.compile's first call, and the report of
fxfuse's optimized model (which backward the region gets).

    python3 benchmarks/probes/probe_siren.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from models import siren  # noqa: E402

import fxfuse  # noqa: E402
from benchmarks.measure import Timer, cleanup, dynamo_reset, measure_ceilings, rel_err  # noqa: E402

ROWS = [  # (widths, dtype, M): the paper's image fit (256 wide) and narrower fits
    ((2, 256, 256, 256, 3), torch.float16, 1 << 18),
    ((2, 256, 256, 256, 3), torch.float32, 1 << 18),
    ((2, 128, 128, 128, 3), torch.float16, 1 << 20),
    ((2, 64, 64, 64, 1), torch.float16, 1 << 20),
    ((2, 64, 64, 64, 1), torch.float32, 1 << 20),
]


def floor_us(widths, dtype, m, ceilings) -> float:
    size = torch.empty((), dtype=dtype).element_size()
    flops = 2 * m * sum(a * b for a, b in zip(widths, widths[1:]))
    nbytes = size * (m * (widths[0] + widths[-1]) + sum(a * b + b for a, b in zip(widths, widths[1:])))
    return max(flops / ceilings["fp16_flops"], nbytes / ceilings["copy_Bps"]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for siren.json")
    ap.add_argument("--quick", action="store_true", help="the first and third rows only")
    args = ap.parse_args()
    timer = Timer(warmup=25, rep=200, cpu=False)
    ceilings = measure_ceilings(timer, "cuda", False)
    results = []
    for widths, dtype, m in ([ROWS[0], ROWS[2]] if args.quick else ROWS):
        torch.manual_seed(0)
        base = siren(widths).cuda()
        ref = copy.deepcopy(base).double()
        eager = copy.deepcopy(base).to(dtype)
        x = torch.rand(m, widths[0], device="cuda") * 2 - 1
        xd = x.to(dtype)
        row = {"widths": widths, "dtype": str(dtype).split(".")[-1], "M": m,
               "floor_us": floor_us(widths, dtype, m, ceilings)}
        with torch.no_grad():
            expected = ref(x.double())
        variants = {"eager": eager}
        t0 = time.perf_counter()
        compiled = torch.compile(copy.deepcopy(eager))
        with torch.no_grad():
            compiled(xd)
        torch.cuda.synchronize()
        row["compile_first_call_s"] = time.perf_counter() - t0
        variants["torch.compile"] = compiled
        t0 = time.perf_counter()
        fast = fxfuse.optimize(copy.deepcopy(eager).train(), [xd])
        row["fxfuse_optimize_s"] = time.perf_counter() - t0
        variants["fxfuse"] = fast
        for name, net in variants.items():
            with torch.no_grad():
                row[f"{name}_err"] = rel_err(net(xd).float(), expected.float())
                row[f"{name}_fwd_us"] = timer.gpu_us(lambda net=net, xd=xd: net(xd))

            def step(net=net, xd=xd):
                net.zero_grad(set_to_none=True)
                net(xd).float().square().mean().backward()

            row[f"{name}_step_us"] = timer.gpu_us(step)
        row["fxfuse_report"] = str(fxfuse.report(fast))
        print(f"== siren {widths} {row['dtype']} M={m}: floor {row['floor_us']:.1f} µs (forward)")
        for name in variants:
            print(f"  {name:14s} forward {row[f'{name}_fwd_us']:9.1f}  step {row[f'{name}_step_us']:9.1f}  "
                  f"err {row[f'{name}_err']:.1e}")
        print(f"  torch.compile first call {row['compile_first_call_s']:.1f} s, fxfuse.optimize "
              f"{row['fxfuse_optimize_s']:.2f} s")
        print("  " + row["fxfuse_report"].replace("\n", "\n  "))
        results.append(row)
        del variants, compiled, fast, eager, ref, base
        dynamo_reset()
        cleanup()
    if args.out:
        Path(args.out, "siren.json").write_text(json.dumps({"ceilings": ceilings, "rows": results}, indent=1,
                                                           default=str))


if __name__ == "__main__":
    main()
