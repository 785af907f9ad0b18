"""Every fused-chain variant on the NeRF rows: which one wins, by how much, and against the floor.

    python3 benchmarks/probes/probe_chain.py

For nerf64 (32→64→64→64→16) and nerf128 (64→128→128→128→64), fp16, M = 2^20: do_bench median µs of each
config in ``chain_configs()`` run directly (no autotuner), the autotuned choice, and eager.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.codegen import generated_chain_kernel  # noqa: E402
from fxfuse.kernels import run_chain  # noqa: E402
from fxfuse.kernels.chain_template import chain_configs  # noqa: E402

ROWS = {"nerf64": [32, 64, 64, 64, 16], "nerf128": [64, 128, 128, 128, 64]}


def probe(name: str, dims: list[int], m: int = 1 << 20) -> None:
    x = torch.randn(m, dims[0], device="cuda", dtype=torch.float16)
    ws = [torch.randn(o, i, device="cuda", dtype=torch.float16) / i ** 0.5 for i, o in zip(dims, dims[1:])]
    bs = [torch.randn(o, device="cuda", dtype=torch.float16) * 0.1 for o in dims[1:]]
    epis = tuple(["relu(a0)"] * (len(ws) - 1) + ["a0"])
    call = (x, ws, bs, [[] for _ in ws], epis)

    def eager():
        h = x
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = F.linear(h, w, b)
            h = torch.relu(h) if i < len(ws) - 1 else h
        return h

    ref = eager().float()
    flops = 2 * m * sum(a * b for a, b in zip(dims, dims[1:]))
    floor = max(flops / 707e12, m * (dims[0] + dims[-1]) * 2 / 4.23e12) * 1e6
    print(f"== {name}: floor {floor:.1f} us, eager {do_bench(eager, return_mode='median') * 1e3:.1f} us")
    for c in chain_configs():
        try:
            out = run_chain(*call, config=c)
            us = do_bench(lambda c=c: run_chain(*call, config=c), return_mode="median") * 1e3
        except OutOfResources as e:
            print(f"  {c}: out of resources ({e})")
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item()
        print(f"  {us:8.1f} us  err {err:.1e}  {c}")
    us = do_bench(lambda: run_chain(*call), return_mode="median") * 1e3
    print(f"  autotuned: {us:.1f} us, chose {generated_chain_kernel(epis).fused_chain_kernel.best_config}")


def main() -> None:
    torch.manual_seed(0)
    for name, dims in ROWS.items():
        probe(name, dims)


if __name__ == "__main__":
    main()
