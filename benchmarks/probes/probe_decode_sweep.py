"""Every decode-kernel config, one by one, at the decode workloads: which hidden slice, tiles and depth win.

    python3 benchmarks/probes/probe_decode_sweep.py [--budget SECONDS]   (split evenly over the rows)

For llama_swiglu m1/m16 and gpt2m_mlp m1/m8 (bf16), each config of a grid of (BLOCK_H, BLOCK_K, BLOCK_N, warps,
stages) that fits shared memory is run directly (``run_decode(config=...)``, no autotuner), checked against float64
(relative error) and timed as the kernel's own device time from the profiler, each call after an L2 flush (the
gpt2m weights would otherwise stay in L2). Prints each row's configs fastest first, with the floor (weight bytes at
the copy bandwidth) and the eager time measured the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402

from benchmarks.timing import kernels_after_flush  # noqa: E402
from fxfuse.kernels import run_decode  # noqa: E402
from fxfuse.kernels.template import fit_stages  # noqa: E402

COPY_TBPS = 4.23
ROWS = [  # name, M, K, H, N, gated, epilogues
    ("llama_swiglu_m1", 1, 4096, 14336, 4096, True, ("mul(silu(a0),a1)", "a0")),
    ("gpt2m_mlp_m1", 1, 1024, 4096, 1024, False, ("gelu_tanh(a0)", "a0")),
    ("llama_swiglu_m16", 16, 4096, 14336, 4096, True, ("mul(silu(a0),a1)", "a0")),
    ("gpt2m_mlp_m8", 8, 1024, 4096, 1024, False, ("gelu_tanh(a0)", "a0")),
]


def configs() -> list[triton.Config]:
    out = []
    for bh in (16, 32, 64, 128):
        for bk, bn in ((128, 128), (256, 128), (64, 256), (256, 64), (512, 64)):
            for warps in (4, 8):
                for stages in (3, 4):
                    out.append(triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "BLOCK_N": bn, "BLOCK_F": 32 * 32 * warps},
                                             num_warps=warps, num_stages=stages))
    return out


def device_us(fn, name: str = "", calls: int = 10) -> float:
    """Device µs per call of the kernels whose name contains ``name`` (all but the flush by default), each call
    after an L2 flush."""
    return sum(us for key, us, _ in kernels_after_flush(fn, calls) if name in key)


def sweep(row, seconds: float) -> None:
    deadline = time.time() + seconds
    name, m, k, h, n, gated, epis = row
    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, **d)
    weights = [torch.randn(h, k, **d) * k**-0.5 for _ in range(2 if gated else 1)] + [torch.randn(n, h, **d) * h**-0.5]
    biases = [None] * len(weights) if gated else [torch.randn(h, **d), torch.randn(n, **d)]
    if gated:
        def eager(x=x):
            return F.linear(F.silu(F.linear(x, weights[0])) * F.linear(x, weights[1]), weights[2])
    else:
        def eager(x=x):
            return F.linear(F.gelu(F.linear(x, weights[0], biases[0]), approximate="tanh"), weights[1], biases[1])
    xd = x.double()
    if gated:
        ref = F.linear(F.silu(F.linear(xd, weights[0].double())) * F.linear(xd, weights[1].double()),
                       weights[2].double())
    else:
        ref = F.linear(F.gelu(F.linear(xd, weights[0].double(), biases[0].double()), approximate="tanh"),
                       weights[1].double(), biases[1].double())
    wbytes = sum(w.numel() for w in weights) * 2
    floor = wbytes / COPY_TBPS / 1e6
    eager_us = device_us(eager)
    print(f"== {name}: M={m} K={k} H={h} N={n}; floor {floor:.1f} us; eager kernels ~{eager_us:.1f} us", flush=True)
    elem = 2
    rows = []
    for c in configs():
        if time.time() > deadline:
            print("   (budget reached)")
            break
        bh, bk, bn = c.kwargs["BLOCK_H"], c.kwargs["BLOCK_K"], c.kwargs["BLOCK_N"]
        if bh > h or bk > max(64, k) or bn > max(64, n):
            continue
        per_stage = max((16 * bk + (2 if gated else 1) * bk * bh) * elem, bh * bn * elem)
        fitted = fit_stages(c, per_stage)
        if fitted is None or fitted.num_stages != c.num_stages:
            continue  # the clipped variant is another entry of the grid
        desc = f"H{bh} K{bk} N{bn} w{c.num_warps} s{c.num_stages}"
        try:
            run = lambda c=c: run_decode(x, weights, biases, [[], []], epis, check=False, config=c)  # noqa: E731
            out = run()
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            us = device_us(run, "fused_decode_kernel")
            rows.append((us, desc, f"{wbytes / us / 1e6:5.2f} TB/s  rel err {err:.1e}"))
        except Exception as e:
            rows.append((float("inf"), desc, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
    for us, desc, note in sorted(rows)[:12]:
        print(f"   {us:8.1f} us  {desc:26s} {note}", flush=True)
    print(f"   ({len(rows)} configs run)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=240.0)
    args = ap.parse_args()
    for row in ROWS:
        sweep(row, args.budget / len(ROWS))


if __name__ == "__main__":
    main()
