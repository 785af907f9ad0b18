"""Each token's top-k rows summed (the MoE forward's output, the backward's dx): torch's reduction over the middle dim
of ``[T, top_k, H]`` (the library until session 39), the two-row elementwise add, and ``moe_sum_pairs_kernel`` at a
few tiles, at the benchmark families' shapes; GPU µs by do_bench (L2 flushed) and bytes moved per µs.

    python3 benchmarks/probes/probe_moe_sum_pairs.py [--tokens 4096]   # (CPU: the interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.timing import median_us  # noqa: E402
from fxfuse.kernels.moe_combine_template import moe_sum_pairs_kernel  # noqa: E402

SHAPES = {"gpt_oss": (4, 2880), "qwen3_moe": (8, 2048), "mixtral": (2, 4096)}  # top_k, H
TILES = ((8, 256, 4), (4, 512, 4), (16, 128, 4), (2, 1024, 4), (8, 512, 8), (16, 256, 8))  # BLOCK_T, BLOCK_H, warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    T = args.tokens if device == "cuda" else 9
    for family, (top_k, H) in SHAPES.items():
        H = H if device == "cuda" else 40
        pairs = torch.randn(T * top_k, H, device=device).to(dtype)
        want = pairs.double().view(T, top_k, H).sum(1)
        moved = (pairs.numel() + T * H) * pairs.element_size()
        print(f"== {family}: T={T}, top_k={top_k}, H={H}: {moved / 1e6:.0f} MB", flush=True)

        def torch_sum(pairs=pairs, top_k=top_k, H=H):
            return pairs.view(T, top_k, H).sum(1)
        t = median_us(torch_sum, device, run_off_gpu=True)
        print(f"  torch sum(1)          {t:7.1f} us  {moved / t / 1e6:5.2f} TB/s", flush=True)
        if top_k == 2:
            t = median_us(lambda pairs=pairs, H=H: pairs.view(T, 2, H)[:, 0] + pairs.view(T, 2, H)[:, 1], device,
                          run_off_gpu=True)
            print(f"  elementwise add       {t:7.1f} us  {moved / t / 1e6:5.2f} TB/s", flush=True)
        for bt, bh, warps in TILES if device == "cuda" else ((4, 16, 4),):
            out = torch.empty(T, H, dtype=dtype, device=device)

            def kernel(out=out, bt=bt, bh=bh, warps=warps, pairs=pairs, H=H, top_k=top_k):
                moe_sum_pairs_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh))](
                    pairs, out, T, H, top_k, BLOCK_T=bt, BLOCK_H=bh, num_warps=warps)
            kernel()
            err = ((out.double() - want).norm() / want.norm()).item()
            t = median_us(kernel, device, run_off_gpu=True)
            print(f"  kernel {bt:2d}x{bh:4d} w{warps}    {t:7.1f} us  {moved / t / 1e6:5.2f} TB/s  rel err {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
