"""Which form of the MoE grouped GEMMs runs fastest at large token counts? Variants of the gate/up and down kernels
timed config by config on the pair layout, beside the library's kernels and ``torch._grouped_mm``.

The library's MoE kernels (``fxfuse/kernels/moe_template.py``) load the weights by pointer and, for gate and up in
halves (Mixtral, Qwen3-MoE), run TWO ``[BLOCK_M, BLOCK_N]`` dots per K step; on the H200 they reach ~460-560
TFLOP/s at 4096 tokens where CUTLASS's grouped GEMMs reach ~610 (``probe_moe_grouped.py``, session 36). The dense
TMA stage found one ``[BLOCK_M, 2 * BLOCK_N]`` dot ~1.45x faster than two. Variants, each over a few tiles:

* ``ptr``: gate and up as ONE dot over a ``[BLOCK_K, 2 * BLOCK_N]`` weight tile gathered by pointer (gate columns,
  then up columns), split in registers after the K loop;
* ``tma``: the same with the weight tile loaded by TMA (a host descriptor over the weights as ``[E, 2, I, H]``: one
  load brings the gate and up tiles of an expert), x's rows still gathered by pointer;
* ``GROUP``: 0 the library's grid order (every block of a column tile, then the next), else grouped (GROUP blocks
  walk all column tiles together: x's rows stay in L2);
* down: the h tile and the weight tile by TMA (h's rows are contiguous in the layout), the pair rows stored by
  pointer.

Weights ``[E, out, in]`` (Mixtral's, Qwen3-MoE's layout); bf16; random routing as ``bench_moe.py``'s.

    python3 benchmarks/probes/probe_moe_gemm_variants.py [--shapes mixtral,qwen3_moe] [--tokens 4096] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.kernels.moe_backward_launch import _segments  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs, run_moe  # noqa: E402
from fxfuse.kernels.moe_template import grouped_tile, moe_down_kernel, moe_gate_up_kernel  # noqa: E402
from fxfuse.kernels.moe_weight_grads import _sorted_rows  # noqa: E402

SHAPES = {"mixtral": (8, 4096, 14336, 2), "qwen3_moe": (128, 2048, 768, 8), "small": (4, 64, 96, 2)}


@triton.jit
def _block_and_tile(pid, blocks, n_tiles, GROUP: tl.constexpr):
    if GROUP == 0:
        return pid % blocks, pid // blocks
    return grouped_tile(pid, blocks, n_tiles, GROUP)


@triton.jit
def gate_up_rows(x_ptr, w_ptr, w_desc, h_ptr, rows_ptr, block, expert, pid_n, K, N, TOP_K, stride_xm, stride_we,
                 stride_wn, stride_hm, W_TMA: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first ROWS rows of one block: gate and up as one dot over a ``[BLOCK_K, 2 * BLOCK_N]`` weight tile (by
    pointer, or by TMA with W_TMA), ``silu(g) * u`` stored."""
    offs_m = block * BLOCK_M + tl.arange(0, ROWS)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    tokens = tl.where(valid, pairs // TOP_K, 0)
    offs_k = tl.arange(0, BLOCK_K)
    c = tl.arange(0, 2 * BLOCK_N)
    col = pid_n * BLOCK_N + c % BLOCK_N
    n_ok = col < N
    wcol = col + (c // BLOCK_N) * N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    x_base = x_ptr + tokens[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((ROWS, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_base + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
        if W_TMA:
            w = w_desc.load([expert, 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K)
            acc = tl.dot(x, w.T, acc)
        else:
            w = tl.load(w_base + wcol[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & (k < K)[:, None],
                        other=0.0)
            acc = tl.dot(x, w, acc)
    g, u = tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, BLOCK_N)), (0, 2, 1)))
    h = g / (1.0 + tl.exp(-g)) * u
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n < N)[None, :])


@triton.jit
def gate_up_variant(x_ptr, w_ptr, w_desc, h_ptr, rows_ptr, block_expert_ptr, K, N, TOP_K, stride_xm, stride_we,
                    stride_wn, stride_hm, blocks, W_TMA: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block, pid_n = _block_and_tile(tl.program_id(0), blocks, tl.cdiv(N, BLOCK_N), GROUP)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    gate_up_rows(x_ptr, w_ptr, w_desc, h_ptr, rows_ptr, block, expert, pid_n, K, N, TOP_K, stride_xm, stride_we,
                 stride_wn, stride_hm, W_TMA, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def down_rows(h_ptr, h_desc, w_ptr, w_desc, out_ptr, rows_ptr, routing_ptr, block, expert, pid_n, K, N, stride_hm,
              stride_we, stride_wn, stride_om, TMA: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first ROWS rows of one block times the expert's down weights (both tiles by pointer, or by TMA: then
    ``h_desc``'s blocks are ``[ROWS, BLOCK_K]``), scaled by the routing weight and stored per pair."""
    offs_m = block * BLOCK_M + tl.arange(0, ROWS)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            a = h_desc.load([block * BLOCK_M, k0])
            w = w_desc.load([expert, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w.T, acc)
        else:
            k = k0 + offs_k
            a = tl.load(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + k[None, :],
                        mask=valid[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None], mask=n_mask[None, :] & (k < K)[:, None],
                        other=0.0)
            acc = tl.dot(a, w, acc)
    scale = tl.load(routing_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)
    safe = tl.where(valid, pairs, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_om + offs_n[None, :], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def down_variant(h_ptr, h_desc, w_ptr, w_desc, out_ptr, rows_ptr, block_expert_ptr, routing_ptr, K, N, stride_hm,
                 stride_we, stride_wn, stride_om, blocks, TMA: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block, pid_n = _block_and_tile(tl.program_id(0), blocks, tl.cdiv(N, BLOCK_N), GROUP)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    down_rows(h_ptr, h_desc, w_ptr, w_desc, out_ptr, rows_ptr, routing_ptr, block, expert, pid_n, K, N, stride_hm,
              stride_we, stride_wn, stride_om, TMA, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K)


def descriptor(t, shape, strides, block):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(shape), list(strides), list(block))


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def gate_up_call(x, w1, h, layout, top_k, variant, group, bn, bk, warps, stages):
    E, two_i, H = w1.shape
    inter = two_i // 2
    blocks = layout.block_expert.numel()
    bm = layout.block_m
    w_desc = descriptor(w1, (E, 2, inter, H), (w1.stride(0), inter * H, H, 1), (1, 2, bn, bk))
    grid = (blocks * triton.cdiv(inter, bn),)

    def call():
        gate_up_variant[grid](x, w1, w_desc, h, layout.rows, layout.block_expert, H, inter, top_k, x.stride(0),
                              w1.stride(0), w1.stride(1), h.stride(0), blocks, W_TMA=variant == "tma", GROUP=group,
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return call


def down_call(h, w2, out, layout, routing, variant, group, bn, bk, warps, stages):
    E, H, inter = w2.shape
    blocks = layout.block_expert.numel()
    bm = layout.block_m
    h_desc = descriptor(h, h.shape, h.stride(), (bm, bk))
    w_desc = descriptor(w2, w2.shape, w2.stride(), (1, bn, bk))
    grid = (blocks * triton.cdiv(H, bn),)

    def call():
        down_variant[grid](h, h_desc, w2, w_desc, out, layout.rows, layout.block_expert, routing, inter, H,
                           h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), blocks, TMA=variant == "tma",
                           GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return call


GATE_UP_TILES = [(64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3), (128, 32, 8, 6)]
DOWN_TILES = [(128, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 4)]


def sweep_library(name: str, kernel, launch_once) -> None:
    """Time each config the autotuned ``kernel``'s pruning keeps for the call ``launch_once`` makes."""
    captured = {}
    original = kernel.run

    def capture(*a, **kw):
        captured.update(args=a, kwargs=kw)
        return original(*a, **kw)

    kernel.run = capture
    launch_once()
    del kernel.run  # (the class's method again)
    args, kwargs = captured["args"], dict(captured["kwargs"])
    grid = kwargs.pop("grid")
    kwargs.pop("warmup", None)
    kept = kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, args)), **kwargs)
    for config in kept:
        meta = config.all_kwargs()

        def one(meta=meta):
            kernel.fn[grid(meta) if callable(grid) else grid](*args, **kwargs, **meta)

        try:
            print(f"   {name:7s} library {config}  {us(one):8.1f} us", flush=True)
        except Exception as exc:  # (shared memory)
            print(f"   {name:7s} library {config}  failed: {type(exc).__name__}", flush=True)


def point(name: str, tokens: int, quick: bool, device: str, library_only: bool = False) -> None:
    E, H, inter, top_k = SHAPES[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=gen).to(device, dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=gen), -1), top_k, -1)
    index, weights = index.to(device), weights.to(device, dtype)
    layout = route_pairs(index, E, block_rows(tokens * top_k, E))
    rows = layout.rows.numel()
    routing = weights.reshape(-1).contiguous()
    h_ref = torch.zeros(rows, inter, dtype=dtype, device=device)
    out_ref = torch.empty(tokens * top_k, H, dtype=dtype, device=device)
    ref = run_moe(x, index, weights, w1, w2, "silu")
    gflop_gu = 2 * tokens * top_k * H * 2 * inter / 1e9
    gflop_down = 2 * tokens * top_k * H * inter / 1e9
    print(f"== {name} T={tokens} (E={E}, H={H}, I={inter}, top-{top_k}; {layout.block_m} rows per block)", flush=True)

    # The library's kernels, as run_moe launches them (autotuned), each alone.
    blocks = layout.block_expert.numel()

    def lib_gate_up():
        moe_gate_up_kernel[lambda m: (blocks, triton.cdiv(inter, m["BLOCK_N"]))](
            x, w1, w1, h_ref, h_ref, layout.rows, layout.block_expert, H, inter, top_k, x.stride(0), w1.stride(0),
            w1.stride(1), w1.stride(2), 0, h_ref.stride(0), 1.0, 3.0e38, ACT=0, INTERLEAVED=False, HAS_BIAS=False,
            STORE_GU=False, INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_M=layout.block_m)

    def lib_down():
        moe_down_kernel[lambda m: (blocks, triton.cdiv(H, m["BLOCK_N"]))](
            h_ref, w2, w2, out_ref, layout.rows, layout.block_expert, routing, inter, H, h_ref.stride(0),
            w2.stride(0), w2.stride(1), w2.stride(2), 0, out_ref.stride(0), HAS_BIAS=False,
            INPUT_PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_M=layout.block_m)

    lib_gate_up()
    lib_down()
    summed = out_ref.view(tokens, top_k, H).sum(1)
    assert ((summed.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    if device == "cuda":
        t = us(lib_gate_up)
        best = getattr(moe_gate_up_kernel, "best_config", None)
        print(f"   gate/up library        {t:8.1f} us {gflop_gu / t * 1e3:5.0f} TFLOP/s  ({best})", flush=True)
        t = us(lib_down)
        best = getattr(moe_down_kernel, "best_config", None)
        print(f"   down    library        {t:8.1f} us {gflop_down / t * 1e3:5.0f} TFLOP/s  ({best})", flush=True)
        offs = (_segments(layout, E)[1:] * layout.block_m).to(torch.int32)
        x_rows = _sorted_rows(x, layout.rows, top_k)
        t = us(lambda: torch._grouped_mm(x_rows, w1.transpose(1, 2), offs=offs))
        print(f"   gate/up grouped_mm     {t:8.1f} us {gflop_gu / t * 1e3:5.0f} TFLOP/s", flush=True)
        t = us(lambda: torch._grouped_mm(h_ref, w2.transpose(1, 2), offs=offs))
        print(f"   down    grouped_mm     {t:8.1f} us {gflop_down / t * 1e3:5.0f} TFLOP/s", flush=True)

    if device == "cuda":  # each config the library's pruning keeps, launched directly
        sweep_library("gate/up", moe_gate_up_kernel, lib_gate_up)
        sweep_library("down", moe_down_kernel, lib_down)
    if library_only:
        return
    tiles_gu = GATE_UP_TILES[:2] if quick else GATE_UP_TILES
    tiles_down = DOWN_TILES[:2] if quick else DOWN_TILES
    if device != "cuda":
        tiles_gu, tiles_down = [(16, 16, 4, 1)], [(16, 16, 4, 1)]
    for variant in ("ptr", "tma"):
        for group in (0, 8):
            for tile in tiles_gu:
                h = torch.zeros_like(h_ref)
                one_variant(f"gate/up {variant} G{group}", tile, h, h_ref, gflop_gu, device,
                            gate_up_call(x, w1, h, layout, top_k, variant, group, *tile))
            for tile in tiles_down:
                out = torch.zeros_like(out_ref)
                one_variant(f"down    {variant} G{group}", tile, out, out_ref, gflop_down, device,
                            down_call(h_ref, w2, out, layout, routing, variant, group, *tile))


def one_variant(name: str, tile: tuple, got: torch.Tensor, want: torch.Tensor, gflop: float, device: str,
                call) -> None:
    """Run ``call`` (it writes ``got``), its error against ``want``, its time; a config that fails says so."""
    bn, bk, warps, stages = tile
    label = f"   {name} {bn}x{bk} w{warps} s{stages}"
    try:
        call()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        t = us(call) if device == "cuda" else float("nan")
        print(f"{label}  {t:8.1f} us {gflop / t * 1e3:5.0f} TFLOP/s  err {err:.1e}", flush=True)
    except Exception as exc:  # a config that does not compile (shared memory)
        print(f"{label}  failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,qwen3_moe")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--quick", action="store_true", help="two tiles per kernel")
    ap.add_argument("--library-only", action="store_true", help="the library's kernels, config by config, only")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            point(name, tokens, args.quick, device, args.library_only)


if __name__ == "__main__":
    main()
