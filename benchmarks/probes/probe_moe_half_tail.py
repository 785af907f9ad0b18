"""Would MoE programs whose block is at most half pairs run faster on a half-height tile?

The pair layout pads each expert's rows to whole blocks of ``BLOCK_M`` rows (128 at large token counts), and the
padding sits at the end of the expert's last block. Every GEMM over the layout computes it: at 4096 tokens 18% of
Qwen3-MoE's rows, 11% of gpt-oss's, 7% of Mixtral's (``probe_moe_block_rows.py``, session 37, where 64-row blocks
for every program ran slower than the padding they saved). Here a program first counts its block's pairs, and when
they fit ``BLOCK_M / 2`` rows it runs the same K loop on a ``[BLOCK_M / 2, ...]`` tile (a second code path in the
kernel; full blocks keep the full tile). Two kernels, each with ``HALF_TAIL`` off and on over the same layout:

* gate/up: x's rows gathered by pointer, gate and up as one dot over a ``[BLOCK_K, 2 * BLOCK_N]`` weight tile
  (the library's ``moe_gate_up_kernel`` form for weights in halves), ``silu(g) * u`` stored;
* down: h's rows and the weights by TMA (a second descriptor of ``[BLOCK_M / 2, BLOCK_K]`` blocks for the half
  path), grouped tile order, rows scaled by the routing weight and stored per pair (the library's
  ``moe_down_tma_kernel`` form).

GPU µs (do_bench), the share of blocks that take the half path, and each output against HALF_TAIL off.

    python3 benchmarks/probes/probe_moe_half_tail.py [--shapes qwen3_moe,gpt_oss,mixtral] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_moe_gemm_variants import descriptor, down_rows, gate_up_rows, us  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs  # noqa: E402
from fxfuse.kernels.moe_template import grouped_tile  # noqa: E402

# (E, H, I, top_k): weights [E, 2I, H] and [E, H, I] for every family here (the padding is what differs)
SHAPES = {"qwen3_moe": (128, 2048, 768, 8), "gpt_oss": (32, 2880, 2880, 4), "mixtral": (8, 4096, 14336, 2),
          "small": (4, 64, 96, 2)}
GATE_UP_TILE = (64, 64, 8, 4)  # BLOCK_N, BLOCK_K, warps, stages (the library's picks at 4096 tokens, roughly)
DOWN_TILE = (256, 64, 8, 3)


@triton.jit
def _half(rows_ptr, block, BLOCK_M: tl.constexpr):
    """Whether the block's pairs fit its first half (they come first: padding only ends an expert's last block)."""
    return tl.sum((tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)) >= 0).to(tl.int32)) <= BLOCK_M // 2


@triton.jit
def gate_up_half_tail(x_ptr, w_ptr, h_ptr, rows_ptr, block_expert_ptr, K, N, TOP_K, stride_xm, stride_we, stride_wn,
                      stride_hm, HALF_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    half = False
    if HALF_TAIL:
        half = _half(rows_ptr, block, BLOCK_M)
    if half:
        gate_up_rows(x_ptr, w_ptr, w_ptr, h_ptr, rows_ptr, block, expert, pid_n, K, N, TOP_K, stride_xm, stride_we,
                     stride_wn, stride_hm, False, BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        gate_up_rows(x_ptr, w_ptr, w_ptr, h_ptr, rows_ptr, block, expert, pid_n, K, N, TOP_K, stride_xm, stride_we,
                     stride_wn, stride_hm, False, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def down_half_tail(h_desc, h_half_desc, w_desc, out_ptr, rows_ptr, block_expert_ptr, routing_ptr, K, N, stride_om,
                   blocks, HALF_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    block, pid_n = grouped_tile(tl.program_id(0), blocks, tl.cdiv(N, BLOCK_N), 8)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    half = False
    if HALF_TAIL:
        half = _half(rows_ptr, block, BLOCK_M)
    # (TMA: the pointer arguments are unused, any pointer does)
    if half:
        down_rows(out_ptr, h_half_desc, out_ptr, w_desc, out_ptr, rows_ptr, routing_ptr, block, expert, pid_n, K, N,
                  0, 0, 0, stride_om, True, BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        down_rows(out_ptr, h_desc, out_ptr, w_desc, out_ptr, rows_ptr, routing_ptr, block, expert, pid_n, K, N,
                  0, 0, 0, stride_om, True, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K)


def point(name: str, tokens: int, device: str) -> None:
    E, H, inter, top_k = SHAPES[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=gen).to(device, dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=gen), -1), top_k, -1)
    index, routing = index.to(device), weights.to(device, dtype).reshape(-1).contiguous()
    bm = block_rows(tokens * top_k, E) if device == "cuda" else 32
    layout = route_pairs(index, E, bm)
    blocks = layout.block_expert.numel()
    used = layout.block_expert >= 0
    counts = (layout.rows.view(blocks, bm) >= 0).sum(1)
    half_share = ((counts <= bm // 2) & used).sum().item() / max(used.sum().item(), 1)
    padding = 1 - tokens * top_k / (used.sum().item() * bm)
    print(f"== {name} T={tokens} (E={E}, H={H}, I={inter}, top-{top_k}; {bm} rows a block): padding {padding:.1%} of "
          f"the rows, {half_share:.1%} of the used blocks at most half full", flush=True)
    bn, bk, warps, stages = GATE_UP_TILE if device == "cuda" else (16, 16, 4, 1)
    h = {}
    for half in (False, True):
        h[half] = torch.zeros(layout.rows.numel(), inter, dtype=dtype, device=device)

        def gate_up(half=half):
            gate_up_half_tail[(blocks, triton.cdiv(inter, bn))](
                x, w1, h[half], layout.rows, layout.block_expert, H, inter, top_k, x.stride(0), w1.stride(0),
                w1.stride(1), h[half].stride(0), HALF_TAIL=half, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=warps, num_stages=stages)
        gate_up()
        err = ((h[half].float() - h[False].float()).norm() / h[False].float().norm()).item()
        t = us(gate_up) if device == "cuda" else float("nan")
        print(f"   gate/up HALF_TAIL={int(half)}  {t:8.1f} us  against HALF_TAIL=0: {err:.1e}", flush=True)
    if device != "cuda":  # (a smoke run: the gate/up against torch too)
        ref = torch.zeros_like(h[False])
        for r, p in enumerate(layout.rows.tolist()):
            if p >= 0:
                e = int(layout.block_expert[r // bm])
                g, u = (w1[e].float() @ x[p // top_k].float()).chunk(2)
                ref[r] = torch.nn.functional.silu(g) * u
        print(f"   gate/up HALF_TAIL=1 against torch: {((h[True] - ref).norm() / ref.norm()).item():.1e}")
    bn, bk, warps, stages = DOWN_TILE if device == "cuda" else (16, 16, 4, 1)
    a = h[False]
    out = {}
    for half in (False, True):
        out[half] = torch.zeros(tokens * top_k, H, dtype=dtype, device=device)
        descs = (descriptor(a, a.shape, a.stride(), (bm, bk)), descriptor(a, a.shape, a.stride(), (bm // 2, bk)),
                 descriptor(w2, w2.shape, w2.stride(), (1, bn, bk)))

        def down(half=half, descs=descs):
            down_half_tail[(blocks * triton.cdiv(H, bn),)](
                *descs, out[half], layout.rows, layout.block_expert, routing, inter, H, out[half].stride(0), blocks,
                HALF_TAIL=half, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        down()
        err = ((out[half].float() - out[False].float()).norm() / out[False].float().norm()).item()
        t = us(down) if device == "cuda" else float("nan")
        print(f"   down    HALF_TAIL={int(half)}  {t:8.1f} us  against HALF_TAIL=0: {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_moe,gpt_oss,mixtral")
    ap.add_argument("--tokens", default="4096")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            point(name, tokens, device)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
