"""How close do the MoE weight gradients come to writing their output at HBM speed?

At few rows per expert (Qwen3-MoE at 512 tokens: ~32 rows each of 128 experts) an expert's weight gradient is a
GEMM with a K of ~32: ``d gate_up`` is 0.8 GB of bf16 written for ~26 GFLOP, so the kernel is bound by its writes.
Session 36 measured ``moe_weight_grad_kernel`` writing ~2.2 TB/s there. This probe times, for each weight (d
gate_up: A = the gate/up gradient's sorted rows, B = x by token; d down: A = dout by token, B = h's sorted rows):

* ``floor``: ``out.zero_()`` (torch's fill) of the same tensor: the write rate the output allows;
* ``library``: the library's autotuned kernel as the backward launches it, then each of its configs and a few more
  (fewer stages: more programs per SM);
* ``flat KT``: a variant whose program keeps one output row tile of an expert and walks ``KT`` column tiles in one
  flattened loop over (column tile, row chunk), so the pipeliner prefetches the next tile's rows while this tile's
  sum is stored (the library's program does one tile: load, one short sum, store, exit);
  ``+tma``: the tile stored by a TMA descriptor (an async bulk store from shared memory);
* ``grouped_mm``: ``torch._grouped_mm`` as :mod:`fxfuse.kernels.moe_weight_grads` calls it.

Each variant's output is checked against the library's. bf16, random routing as ``bench_moe.py``'s.

    python3 benchmarks/probes/probe_moe_weight_grad.py [--shapes qwen3_moe,gpt_oss] [--tokens 512,4096] [--quick]
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

from fxfuse.kernels.moe_backward_launch import _GROUP_N, _segments  # noqa: E402
from fxfuse.kernels.moe_backward_template import moe_weight_grad_kernel  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs  # noqa: E402
from fxfuse.kernels.moe_weight_grads import grouped_down_grad, grouped_gate_up_grad  # noqa: E402

# (E, H, I, top_k, transposed: the parameters' memory [E, in, out] as gpt-oss's)
SHAPES = {"qwen3_moe": (128, 2048, 768, 8, False), "gpt_oss": (32, 2880, 2880, 4, True),
          "mixtral": (8, 4096, 14336, 2, False), "small": (4, 64, 96, 2, False), "small_t": (4, 64, 96, 2, True)}
# (BLOCK_N, BLOCK_K, BLOCK_R, warps, stages) for the library kernel beyond its own configs
EXTRA_TILES = [(128, 128, 64, 8, 1), (128, 128, 32, 8, 2), (128, 128, 32, 4, 2), (64, 128, 32, 4, 2),
               (128, 64, 32, 4, 2), (64, 64, 32, 4, 2), (128, 256, 32, 8, 2), (256, 128, 32, 8, 2)]
# (BLOCK_N, BLOCK_K, BLOCK_R, warps, stages) for the flat variant
FLAT_TILES = [(128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 3), (128, 256, 32, 8, 3),
              (256, 128, 32, 8, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4)]


@triton.jit
def weight_grad_flat(a_ptr, b_ptr, out_ptr, out_desc, rows_ptr, seg_ptr, N, K, TOP_K, stride_am, stride_bm,
                     stride_oe, stride_on, stride_ok, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
                     TMA_STORE: tl.constexpr, OUT_KN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, K_TILES: tl.constexpr):
    """``out[e, n, k] = sum over e's rows r of A[r, n] * B[r, k]``; a program: expert e, one n tile, K_TILES k tiles,
    walked as one loop over (k tile, row chunk) so loads of the next step overlap this tile's store."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    k_groups = tl.cdiv(tiles_k, K_TILES)
    pid = tl.program_id(0)
    expert = pid // (tiles_n * k_groups)
    tile = pid % (tiles_n * k_groups)
    pid_n = tile % tiles_n  # (consecutive programs share the expert's B columns of one k group)
    first_k = (tile // tiles_n) * K_TILES
    k_count = tl.minimum(tiles_k - first_k, K_TILES)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row_start = tl.load(seg_ptr + expert) * BLOCK_M
    row_end = tl.load(seg_ptr + expert + 1) * BLOCK_M
    chunks = tl.maximum(tl.cdiv(row_end - row_start, BLOCK_R), 1)  # (an empty expert: one chunk of zeros)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(0, k_count * chunks):
        kt = first_k + i // chunks
        chunk = i % chunks
        offs_m = row_start + chunk * BLOCK_R + tl.arange(0, BLOCK_R)
        pair = tl.load(rows_ptr + offs_m, mask=offs_m < row_end, other=-1)
        valid = pair >= 0
        safe = tl.where(valid, pair, 0)
        a_rows = (safe // TOP_K) if A_BY_TOKEN else offs_m
        b_rows = (safe // TOP_K) if B_BY_TOKEN else offs_m
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_n[None, :],
                    mask=valid[:, None] & n_mask[None, :], other=0.0)
        b = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * stride_bm + offs_k[None, :],
                    mask=valid[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
        if chunk == chunks - 1:
            if TMA_STORE:
                if OUT_KN:
                    out_desc.store([expert, kt * BLOCK_K, pid_n * BLOCK_N],
                                   tl.trans(acc.to(a_ptr.dtype.element_ty)).reshape(1, BLOCK_K, BLOCK_N))
                else:
                    out_desc.store([expert, pid_n * BLOCK_N, kt * BLOCK_K],
                                   acc.to(a_ptr.dtype.element_ty).reshape(1, BLOCK_N, BLOCK_K))
            else:
                tl.store(out_ptr + expert.to(tl.int64) * stride_oe + offs_n[:, None] * stride_on
                         + offs_k[None, :] * stride_ok, acc.to(out_ptr.dtype.element_ty),
                         mask=n_mask[:, None] & (offs_k < K)[None, :])
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


def us(fn) -> float:
    if not torch.cuda.is_available():  # (a smoke run in the interpreter: outputs checked, nothing timed)
        return float("nan")
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def library_call(out_view, a, a_by_token, b, b_by_token, layout, segments, top_k, routing, config=None):
    """The library kernel as ``run_moe_backward``'s ``expert_sums`` launches it (``config``: that config alone)."""
    E, n, k = out_view.shape
    args = dict(a_ptr=a, b_ptr=b, routing_ptr=routing, out_ptr=out_view, rows_ptr=layout.rows, seg_ptr=segments,
                N=n, K=k, TOP_K=top_k, stride_am=a.stride(0), stride_bm=b.stride(0), stride_oe=out_view.stride(0),
                stride_on=out_view.stride(1), stride_ok=out_view.stride(2), A_BY_TOKEN=a_by_token,
                B_BY_TOKEN=b_by_token, SCALE_A=False, INPUT_PRECISION="tf32" if a.element_size() == 2 else "ieee", BLOCK_M=layout.block_m)
    if config is None:
        args["GROUP_N"] = _GROUP_N
        return lambda: moe_weight_grad_kernel[lambda m: (E * triton.cdiv(n, m["BLOCK_N"]) * triton.cdiv(
            k, m["BLOCK_K"]),)](**args)
    meta = config.all_kwargs()
    grid = (E * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]),)
    return lambda: moe_weight_grad_kernel.fn[grid](**args, **meta)


def flat_call(out_view, memory, a, a_by_token, b, b_by_token, layout, segments, top_k, tile, k_tiles, tma):
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, n, k = out_view.shape
    bn, bk, br, warps, stages = tile
    out_kn = out_view.stride(1) == 1  # (memory [E, K, N])
    desc = TensorDescriptor(memory, list(memory.shape), list(memory.stride()),
                            [1, bk, bn] if out_kn else [1, bn, bk])
    grid = (E * triton.cdiv(n, bn) * triton.cdiv(triton.cdiv(k, bk), k_tiles),)
    return lambda: weight_grad_flat[grid](
        a, b, out_view, desc, layout.rows, segments, n, k, top_k, a.stride(0), b.stride(0), out_view.stride(0),
        out_view.stride(1), out_view.stride(2), A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, TMA_STORE=tma,
        OUT_KN=out_kn, BLOCK_M=layout.block_m, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=br, K_TILES=k_tiles,
        num_warps=warps, num_stages=stages)


def timed(label: str, call, got: torch.Tensor, want: torch.Tensor, gbytes: float) -> None:
    try:
        got.fill_(float("nan"))
        call()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        t = us(call)
        print(f"   {label:52s} {t:8.1f} us {gbytes / t * 1e3:5.2f} TB/s  err {err:.1e}", flush=True)
    except Exception as exc:  # (a config that does not compile: shared memory)
        print(f"   {label:52s} failed: {type(exc).__name__}: {str(exc)[:90]}", flush=True)


def point(name: str, tokens: int, quick: bool) -> None:
    E, H, inter, top_k, transposed = SHAPES[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=gen), -1), top_k, -1)
    index, weights = index.to(device), weights.to(device, dtype)
    layout = route_pairs(index, E, block_rows(tokens * top_k, E))
    rows = layout.rows.numel()
    pad = (layout.rows < 0).unsqueeze(1)
    x = torch.randn(tokens, H, generator=gen).to(device, dtype)
    dout = torch.randn(tokens, H, generator=gen).to(device, dtype)
    dgu = torch.randn(rows, 2 * inter, generator=gen).to(device, dtype).masked_fill_(pad, 0)
    h = torch.randn(rows, inter, generator=gen).to(device, dtype).masked_fill_(pad, 0)
    routing = weights.reshape(-1).contiguous()
    segments = _segments(layout, E)
    print(f"== {name} T={tokens} (E={E}, H={H}, I={inter}, top-{top_k}, {'[E, in, out]' if transposed else '[E, out, in]'}"
          f" weights; {layout.block_m} rows per block, {tokens * top_k / E:.0f} pairs an expert)", flush=True)
    for which, (n, k), a, a_tok, b, b_tok, grouped in (
            ("d gate_up", (2 * inter, H), dgu, False, x, True, grouped_gate_up_grad),
            ("d down", (H, inter), dout, True, h, False, grouped_down_grad)):
        memory = torch.empty(E, k, n, dtype=dtype, device=device) if transposed else torch.empty(
            E, n, k, dtype=dtype, device=device)
        view = memory.transpose(1, 2) if transposed else memory
        gbytes = memory.numel() * 2 / 1e9
        flop = 2 * tokens * top_k * n * k
        print(f"  {which} [{E}, {n}, {k}]: {gbytes:.2f} GB written, {flop / 1e9:.0f} GFLOP", flush=True)
        t = us(lambda: memory.zero_())
        print(f"   {'floor: out.zero_()':52s} {t:8.1f} us {gbytes / t * 1e3:5.2f} TB/s", flush=True)
        lib = library_call(view, a, a_tok, b, b_tok, layout, segments, top_k, routing)
        lib()
        want = memory.clone()
        timed(f"library autotuned ({moe_weight_grad_kernel.best_config})", lib, memory, want, gbytes)
        if device == "cpu":  # (the interpreter: one small tile of each variant)
            for tma in (False, True):
                timed(f"flat K_TILES=2{' +tma' if tma else ''}", flat_call(
                    view, memory, a, a_tok, b, b_tok, layout, segments, top_k, (16, 16, 16, 4, 1), 2, tma),
                    memory, want, gbytes)
            continue
        rh = b if which == "d down" else a
        ref = grouped(layout, segments, top_k, b if which == "d gate_up" else a, rh, transposed)
        err = ((ref.float() - want.float()).norm() / want.float().norm()).item()
        t = us(lambda: grouped(layout, segments, top_k, b if which == "d gate_up" else a, rh, transposed))
        print(f"   {'grouped_mm':52s} {t:8.1f} us {gbytes / t * 1e3:5.2f} TB/s  err {err:.1e}", flush=True)
        if quick:
            continue
        configs = list(moe_weight_grad_kernel.configs) + [
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_R": br}, num_warps=w, num_stages=s)
            for bn, bk, br, w, s in EXTRA_TILES]
        for config in configs:
            config.kwargs.setdefault("GROUP_N", _GROUP_N)
            timed(f"library {config}", library_call(view, a, a_tok, b, b_tok, layout, segments, top_k, routing,
                                                    config), memory, want, gbytes)
        for tile in FLAT_TILES:
            for k_tiles in (2, 4, 8):
                for tma in (False, True):
                    timed(f"flat K_TILES={k_tiles}{' +tma' if tma else ''} {tile}",
                          flat_call(view, memory, a, a_tok, b, b_tok, layout, segments, top_k, tile, k_tiles, tma),
                          memory, want, gbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3_moe,gpt_oss")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--quick", action="store_true", help="the floor, the library's pick and grouped_mm only")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            point(name, tokens, args.quick)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
