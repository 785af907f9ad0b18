"""The llama M=1 gate+up stage: tl.dot tiles vs ONE_ROW multiply-and-sum, with and without PDL, beside Inductor.

Each variant is timed with ``triton.testing.do_bench`` (median, L2 flushed: the number the benchmark reports)
and as its kernel's device time after the same flush (profiler). Programmatic dependent launch is switched
off by patching ``gemv_launch._pdl_supported``: a PDL launch may start during the flush and wait on the GPU.

    python3 benchmarks/probes/probe_one_row.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.probes.probe_inductor_decode import kernels_after_flush  # noqa: E402
from fxfuse.kernels import gemv_launch, run_stage_gemv  # noqa: E402

CONFIGS = {
    "dot N64 K128 w4 s3": ({"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "ONE_ROW": 0}, 4, 3),
    "dot N128 K64 w8 s4": ({"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "ONE_ROW": 0}, 8, 4),
    "one-row N1 K4096 w16": ({"BLOCK_N": 1, "BLOCK_K": 4096, "SPLIT_K": 1, "ONE_ROW": 1}, 16, 1),
    "one-row N2 K2048 w8": ({"BLOCK_N": 2, "BLOCK_K": 2048, "SPLIT_K": 1, "ONE_ROW": 1}, 8, 1),
    "one-row N4 K1024 w4": ({"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 1, "ONE_ROW": 1}, 4, 1),
    "one-row N8 K512 w4": ({"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 1, "ONE_ROW": 1}, 4, 1),
}


def main() -> None:
    from triton.testing import do_bench

    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, **d)
    ws = [torch.randn(14336, 4096, **d) * 4096**-0.5 for _ in range(2)]
    ref = torch.nn.functional.silu(x.double() @ ws[0].double().T) * (x.double() @ ws[1].double().T)
    real_pdl = gemv_launch._pdl_supported
    for pdl in (True, False):
        gemv_launch._pdl_supported = real_pdl if pdl else (lambda x: False)
        for label, (kw, warps, stages) in CONFIGS.items():
            c = triton.Config(kw, num_warps=warps, num_stages=stages)
            fn = functools.partial(run_stage_gemv, x, ws, [None, None], [], "mul(silu(a0),a1)", config=c)
            err = ((fn().double() - ref).norm() / ref.norm()).item()
            bench = sorted(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3))[1]
            dev = sum(t for name, t in kernels_after_flush(fn) if "gemv" in name)
            print(f"pdl={pdl!s:5} {label:22s} do_bench {bench:6.1f} µs  device {dev:6.1f} µs  rel err {err:.1e}",
                  flush=True)
    gemv_launch._pdl_supported = real_pdl

    def inductor_like(x, wg, wu):
        return torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)

    compiled = torch.compile(inductor_like, mode="max-autotune-no-cudagraphs")
    fn = functools.partial(compiled, x, *ws)
    fn()
    bench = sorted(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3))[1]
    print(f"inductor max-autotune gate+up: do_bench {bench:6.1f} µs; kernels: "
          + ", ".join(f"{n[:40]} {t:.1f}" for n, t in kernels_after_flush(fn)))


if __name__ == "__main__":
    main()
