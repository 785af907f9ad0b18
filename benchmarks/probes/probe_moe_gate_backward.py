"""The MoE backward's gate kernel (``moe_gate_backward_kernel``) with and without the gate/up bias's column sums
(``SUM_DGU``, session 39), at a few column tiles: what writing each block's sums costs against the separate pass over
``dgu`` it replaces (``probe_moe_bias_sums.py``).

gpt-oss-20b's shapes (interleaved gate/up, clamped SwiGLU) and Mixtral's (halves, SiLU), random G and
pre-activations over a real routing's layout; GPU µs by do_bench (L2 flushed) and the bytes moved per µs.

    python3 benchmarks/probes/probe_moe_gate_backward.py [--tokens 4096]   # (CPU: the interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.timing import median_us  # noqa: E402
from fxfuse.kernels.moe_backward_template import moe_gate_backward_kernel  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs  # noqa: E402
from fxfuse.kernels.moe_template import ACTIVATIONS  # noqa: E402
from fxfuse.kernels.template import cdiv  # noqa: E402

FAMILIES = {  # E, inter, top_k, act, interleaved, alpha, limit
    "gpt_oss": (32, 2880, 4, "clamped_swiglu", True, 1.702, 7.0),
    "mixtral": (8, 14336, 2, "silu", False, 1.0, float("inf")),
}
TILES = ((64, 8), (32, 4), (128, 8), (64, 4))  # BLOCK_N, warps at 128 rows a block (the library: 8192 // rows, 8)


def point(family: str, tokens: int, device: str) -> None:
    E, inter, top_k, act, interleaved, alpha, limit = FAMILIES[family]
    if device != "cuda":
        E, inter = 4, 40
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=gen), -1), top_k, -1)
    routing = weights.to(device, dtype).reshape(-1).contiguous()
    pairs = tokens * top_k
    bm = block_rows(pairs, E)
    layout = route_pairs(index.to(device), E, bm)
    rows, blocks = layout.rows.numel(), layout.block_expert.numel()
    grad_h = torch.randn(rows, inter, generator=gen).to(device, dtype)
    gu = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(device, dtype)
    dgu = torch.empty(rows, 2 * inter, dtype=dtype, device=device)
    h = torch.empty(rows, inter, dtype=dtype, device=device)
    moved = (grad_h.numel() + 2 * gu.numel() + h.numel()) * grad_h.element_size()
    print(f"== {family}, T={tokens}: {rows} rows ({bm} a block), {moved / 1e6:.0f} MB read + written", flush=True)
    reference = None
    for bn, warps in TILES if device == "cuda" else ((16, 4),):
        for sum_dgu in (False, True):
            dr = torch.zeros(cdiv(inter, bn), pairs, dtype=torch.float32, device=device)
            db = torch.empty(blocks, 2 * inter, dtype=torch.float32, device=device)

            def run(dr=dr, db=db, bn=bn, warps=warps, sum_dgu=sum_dgu):
                moe_gate_backward_kernel[(blocks, cdiv(inter, bn))](
                    grad_h, gu, h, routing, dgu, dr, db, layout.rows, layout.block_expert, inter, pairs, alpha,
                    min(limit, 3.0e38), ACT=ACTIVATIONS[act], INTERLEAVED=interleaved, STORE_H=True,
                    SUM_DGU=sum_dgu, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
            run()
            if reference is None:
                reference = dgu.clone()
            same = torch.equal(dgu, reference)
            extra = ""
            if sum_dgu:  # the blocks' sums against dgu's own (bf16-rounded) rows, summed per block in float64
                used = layout.block_expert >= 0
                want = dgu.double().view(blocks, bm, 2 * inter).sum(1)[used]
                got = db.double()[used]
                extra = f"  sums rel err {((got - want).norm() / want.norm()).item():.1e}"
            t = median_us(run, device)
            print(f"  BLOCK_N {bn:3d} w{warps} SUM_DGU {sum_dgu!s:5s} {t:8.1f} us  {moved / t / 1e6:5.2f} TB/s  "
                  f"dgu as the first {same}{extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--families", default="gpt_oss,mixtral")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for family in args.families.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            point(family, tokens if device == "cuda" else min(tokens, 9), device)


if __name__ == "__main__":
    main()
