"""The MoE backward's bias gradients: each expert's column sums over its rows, by the weight-gradient kernel (as the
library ran them until session 39: a sum against a column of ones) against a plain column-sum kernel, and the down
bias's by the library's routed GEMM since (``moe_routed_sums_kernel``, dout read once) at a few tiles.

gpt-oss's experts have a bias on each projection, so its backward sums ``dgu`` (``[padded rows, 2I]``) over each
expert's rows for ``d gate_up_bias``, and the routing-weighted rows of ``dout`` (by token) for ``d down_bias``. The
library computes both with ``moe_weight_grad_kernel`` (a ``tl.dot`` whose second operand is one column of ones); in
session 38's profile of gpt-oss's 4096-token training step the two took 239 µs, ~1.3 TB/s of reads. Here the same
sums by ``segment_column_sums`` (a program per expert and column block, rows summed in fp32 with ``tl.sum``) over a
few tiles, each against the weight-gradient kernel's and a float64 torch reference. Session 39 (H200, 4096 tokens):
weight-gradient kernel 140 / 101 µs, column sums at best 161 / 87: neither kept; the gate/up bias's sums moved into
the gate backward (per block, added per expert by ``moe_block_sums_kernel``), the down bias's to the routed GEMM.

    python3 benchmarks/probes/probe_moe_bias_sums.py [--tokens 512,4096]   # (CPU: the interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.timing import median_us  # noqa: E402
from fxfuse.kernels.fastlaunch import launch  # noqa: E402
from fxfuse.kernels.moe_backward_launch import _segments  # noqa: E402
from fxfuse.kernels.moe_backward_template import moe_weight_grad_kernel  # noqa: E402
from fxfuse.kernels.moe_bias_launch import down_bias_grad, routed_splits  # noqa: E402
from fxfuse.kernels.moe_bias_template import moe_routed_sums_kernel  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs  # noqa: E402
from fxfuse.kernels.template import cdiv  # noqa: E402

TILES = ((128, 32, 4), (128, 64, 8), (256, 32, 8), (256, 64, 8), (512, 16, 8))  # BLOCK_N, BLOCK_R, warps
ROUTED_TILES = ((128, 32, 4), (128, 64, 8), (64, 32, 4))  # BLOCK_T, BLOCK_N, warps
ROUTED_SPLITS = (1, 4, 8, 16, 32)


@triton.jit
def segment_column_sums(a_ptr, routing_ptr, out_ptr, rows_ptr, seg_ptr, N, TOP_K, stride_am, stride_oe,
                        A_BY_TOKEN: tl.constexpr, SCALE_A: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """``out[e, n] = sum over expert e's rows r of A[r, n]`` (A_BY_TOKEN: A's row is the pair's token's; SCALE_A:
    times the pair's routing weight), fp32 sums stored in out's dtype. Grid (E, cdiv(N, BLOCK_N))."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    start = tl.load(seg_ptr + e) * BLOCK_M
    end = tl.load(seg_ptr + e + 1) * BLOCK_M
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        pairs = tl.load(rows_ptr + r, mask=r < end, other=-1)
        valid = pairs >= 0
        src = tl.where(valid, pairs // TOP_K, 0) if A_BY_TOKEN else r
        a = tl.load(a_ptr + src[:, None].to(tl.int64) * stride_am + cols[None, :],
                    mask=valid[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        if SCALE_A:
            a = a * tl.load(routing_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(a, axis=0)
    tl.store(out_ptr + e * stride_oe + cols, acc.to(out_ptr.dtype.element_ty), mask=c_mask)


def library_sums(out, a, a_by_token, ones, routing, layout, segments, top_k, scale_a):
    """As ``run_moe_backward``'s ``expert_sums`` launches it for a bias (``out`` ``[E, N, 1]``)."""
    E, n, k = out.shape
    launch(moe_weight_grad_kernel, lambda meta: (
        E * cdiv(n, meta["BLOCK_N"]) * cdiv(cdiv(k, meta["BLOCK_K"]), meta["K_TILES"]),), dict(
        a_ptr=a, b_ptr=ones, routing_ptr=routing, out_ptr=out, rows_ptr=layout.rows, seg_ptr=segments, N=n, K=k,
        TOP_K=top_k, stride_am=a.stride(0), stride_bm=ones.stride(0), stride_oe=out.stride(0),
        stride_on=out.stride(1), stride_ok=out.stride(2), A_BY_TOKEN=a_by_token, B_BY_TOKEN=False,
        SCALE_A=scale_a, INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", BLOCK_M=layout.block_m), ())


def point(tokens: int, device: str) -> None:
    E, H, inter, top_k = (32, 2880, 2880, 4) if device == "cuda" else (4, 48, 40, 2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=gen), -1), top_k, -1)
    routing = weights.to(device, dtype).reshape(-1).contiguous()
    bm = block_rows(tokens * top_k, E)
    layout = route_pairs(index.to(device), E, bm)
    segments = _segments(layout, E)
    rows = layout.rows.numel()
    dgu = torch.randn(rows, 2 * inter, generator=gen).to(device, dtype)
    dgu[layout.rows.cpu() < 0] = 0  # (the gate backward writes zeros at padding)
    dout = torch.randn(tokens, H, generator=gen).to(device, dtype)
    ones = torch.ones(rows, 1, dtype=dtype, device=device)
    # float64 references
    pair_rows = layout.rows.cpu()
    owner = layout.block_expert.cpu().repeat_interleave(bm)
    used = (pair_rows >= 0) & (owner >= 0)
    want_b1 = torch.zeros(E, 2 * inter, dtype=torch.float64).index_add_(0, owner[used], dgu.cpu().double()[used])
    by_token = dout.cpu().double()[pair_rows[used] // top_k] * routing.cpu().double()[pair_rows[used]][:, None]
    want_b2 = torch.zeros(E, H, dtype=torch.float64).index_add_(0, owner[used], by_token)
    print(f"== gpt-oss shapes{'' if device == 'cuda' else ' (tiny)'}, T={tokens}: {bm} rows a block, dgu "
          f"{dgu.numel() * dgu.element_size() / 1e6:.0f} MB, dout {dout.numel() * dout.element_size() / 1e6:.0f} MB",
          flush=True)
    cases = {"d gate_up_bias": (dgu, False, False, 2 * inter, want_b1),
             "d down_bias": (dout, True, True, H, want_b2)}
    for name, (a, by_token_, scale, n, want) in cases.items():
        out = torch.empty(E, n, 1, dtype=dtype, device=device)

        def lib(out=out, a=a, by_token_=by_token_, scale=scale):
            library_sums(out, a, by_token_, ones, routing, layout, segments, top_k, scale)
        lib()
        err = ((out.squeeze(2).cpu().double() - want).norm() / want.norm()).item()
        print(f"  {name:15s} weight-grad kernel {median_us(lib, device):8.1f} us  rel err {err:.1e}", flush=True)
        for bn, br, warps in TILES if device == "cuda" else ((16, 8, 4),):
            sums = torch.empty(E, n, dtype=dtype, device=device)

            def mine(sums=sums, a=a, by_token_=by_token_, scale=scale, n=n, bn=bn, br=br, warps=warps):
                segment_column_sums[(E, triton.cdiv(n, bn))](
                    a, routing, sums, layout.rows, segments, n, top_k, a.stride(0), sums.stride(0),
                    A_BY_TOKEN=by_token_, SCALE_A=scale, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, num_warps=warps)
            mine()
            err = ((sums.cpu().double() - want).norm() / want.norm()).item()
            print(f"  {name:15s} column sums {bn}x{br} w{warps} {median_us(mine, device):8.1f} us  rel err {err:.1e}",
                  flush=True)
    flat_index = index.to(device).reshape(-1).contiguous()
    for (bt, bn, warps), splits in itertools.product(ROUTED_TILES if device == "cuda" else ((16, 16, 4),),
                                                     ROUTED_SPLITS if device == "cuda" else (1, 3)):
        parts = torch.empty(E, splits, H, dtype=torch.float32, device=device)  # (the kernel alone: parts summed apart)

        def routed(parts=parts, bt=bt, bn=bn, warps=warps, splits=splits):
            moe_routed_sums_kernel[(triton.cdiv(H, bn), splits)](
                dout, flat_index, routing, parts, tokens, H, top_k, E, dout.stride(0), parts.stride(0),
                parts.stride(1), INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                E_PAD=max(16, triton.next_power_of_2(E)), BLOCK_T=bt, BLOCK_N=bn, num_warps=warps)
        routed()
        err = ((parts.sum(1).cpu().double() - want_b2).norm() / want_b2.norm()).item()
        t = median_us(routed, device)
        print(f"  d down_bias     routed GEMM {bt}x{bn} w{warps} splits {splits:2d} {t:8.1f} us  rel err {err:.1e}",
              flush=True)

    def library():
        return down_bias_grad(dout, index.to(device), routing, E, "ieee" if dtype == torch.float32 else "tf32")
    err = ((library().cpu().double() - want_b2).norm() / want_b2.norm()).item()
    t = median_us(library, device)
    print(f"  d down_bias     library (down_bias_grad, {routed_splits(tokens)} splits) {t:8.1f} us  rel err {err:.1e}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,4096")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for tokens in (int(t) for t in args.tokens.split(",")):
        point(tokens if device == "cuda" else min(tokens, 9), device)


if __name__ == "__main__":
    main()
