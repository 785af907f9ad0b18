"""How close do the MoE weight gradients come to writing their output at HBM speed?

At few rows per expert (Qwen3-MoE at 512 tokens: ~32 rows each of 128 experts) an expert's weight gradient is a
GEMM with a K of ~32: ``d gate_up`` is 0.8 GB of bf16 written for ~26 GFLOP, so the kernel is bound by its writes.
For each weight (d gate_up: A = the gate/up gradient's sorted rows, B = x by token; d down: A = dout by token, B =
h's sorted rows) it times:

* ``floor``: ``out.zero_()`` (torch's fill) of the same tensor: the write rate the output allows;
* ``library``: ``moe_weight_grad_kernel`` autotuned as the backward launches it, then each of its configs and a few
  more (``EXTRA_TILES``);
* ``grouped_mm``: ``torch._grouped_mm`` as :mod:`fxfuse.kernels.moe_weight_grads` calls it.

Outputs are checked against the library's autotuned one. bf16, random routing as ``bench_moe.py``'s. Session 37
(H200, Qwen3-MoE at 512 tokens, d gate_up): a tile a program 376 µs (2.1 TB/s), K_TILES = 8 column tiles a program
in one flattened loop 275 (2.9; now the library's), the same with the tile stored by a TMA descriptor 330, torch's
fill 240 (3.35). gpt-oss's gradients (``[E, in, out]`` memory: tiles stored along their columns) summed transposed
so each tile is stored along its rows ran no faster (d gate_up 521 against 498 µs, d down 265 / 268).

    python3 benchmarks/probes/probe_moe_weight_grad.py [--shapes qwen3_moe,gpt_oss] [--tokens 512,4096] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.kernels.moe_backward_launch import _segments  # noqa: E402
from fxfuse.kernels.moe_backward_template import moe_weight_grad_kernel  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs  # noqa: E402
from fxfuse.kernels.moe_weight_grads import grouped_down_grad, grouped_gate_up_grad  # noqa: E402

# (E, H, I, top_k, transposed: the parameters' memory [E, in, out] as gpt-oss's)
SHAPES = {"qwen3_moe": (128, 2048, 768, 8, False), "gpt_oss": (32, 2880, 2880, 4, True),
          "mixtral": (8, 4096, 14336, 2, False), "small": (4, 64, 96, 2, False), "small_t": (4, 64, 96, 2, True)}
# (BLOCK_N, BLOCK_K, BLOCK_R, K_TILES, warps, stages) for the library kernel beyond its own configs
EXTRA_TILES = [(128, 128, 32, 4, 8, 3), (128, 128, 64, 16, 8, 3), (128, 128, 64, 1, 4, 3), (128, 128, 64, 2, 8, 3),
               (128, 256, 64, 2, 8, 3)]


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
                B_BY_TOKEN=b_by_token, SCALE_A=False, BLOCK_M=layout.block_m,
                INPUT_PRECISION="tf32" if a.element_size() == 2 else "ieee")
    def grid(meta):
        return (E * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(triton.cdiv(k, meta["BLOCK_K"]), meta["K_TILES"]),)

    if config is None:
        return lambda: moe_weight_grad_kernel[grid](**args)
    meta = config.all_kwargs()
    grid = grid(meta)
    return lambda: moe_weight_grad_kernel.fn[grid](**args, **meta)


def timed(label: str, call, got: torch.Tensor, want: torch.Tensor, gbytes: float, gflop: float) -> None:
    try:
        got.fill_(float("nan"))
        call()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        t = us(call)
        print(f"   {label:52s} {t:8.1f} us {gbytes / t * 1e3:5.2f} TB/s {gflop / t * 1e3:4.0f} TFLOP/s  err {err:.1e}",
              flush=True)
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
    form = "[E, in, out]" if transposed else "[E, out, in]"
    print(f"== {name} T={tokens} (E={E}, H={H}, I={inter}, top-{top_k}, {form} weights; {layout.block_m} rows per "
          f"block, {tokens * top_k / E:.0f} pairs an expert)", flush=True)
    for which, (n, k), a, a_tok, b, b_tok, grouped in (
            ("d gate_up", (2 * inter, H), dgu, False, x, True, grouped_gate_up_grad),
            ("d down", (H, inter), dout, True, h, False, grouped_down_grad)):
        memory = torch.empty(E, k, n, dtype=dtype, device=device) if transposed else torch.empty(
            E, n, k, dtype=dtype, device=device)
        view = memory.transpose(1, 2) if transposed else memory
        gbytes = memory.numel() * 2 / 1e9
        gflop = 2 * tokens * top_k * n * k / 1e9
        print(f"  {which} [{E}, {n}, {k}]: {gbytes:.2f} GB written, {gflop:.0f} GFLOP", flush=True)
        t = us(memory.zero_)
        print(f"   {'floor: out.zero_()':52s} {t:8.1f} us {gbytes / t * 1e3:5.2f} TB/s", flush=True)
        lib = library_call(view, a, a_tok, b, b_tok, layout, segments, top_k, routing)
        lib()
        want = memory.clone()
        timed(f"library autotuned ({moe_weight_grad_kernel.best_config})", lib, memory, want, gbytes, gflop)
        if device == "cpu":  # (the interpreter: one small config)
            small = triton.Config({"BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_R": 16, "K_TILES": 3, "GROUP_N": 2})
            timed("library 16x16x16, K_TILES=3", library_call(view, a, a_tok, b, b_tok, layout, segments, top_k,
                                                              routing, small), memory, want, gbytes, gflop)
            continue
        by_token, by_row = (b, a) if which == "d gate_up" else (a, b)
        run_grouped = functools.partial(grouped, layout, segments, top_k, by_token, by_row, transposed)
        ref = run_grouped()
        err = ((ref.float() - want.float()).norm() / want.float().norm()).item()
        t = us(run_grouped)
        print(f"   {'grouped_mm':52s} {t:8.1f} us {gbytes / t * 1e3:5.2f} TB/s  err {err:.1e}", flush=True)
        if quick:
            continue
        configs = list(moe_weight_grad_kernel.configs) + [
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_R": br, "K_TILES": kt, "GROUP_N": 8}, num_warps=w,
                          num_stages=s) for bn, bk, br, kt, w, s in EXTRA_TILES]
        for config in configs:
            timed(f"library {config}", library_call(view, a, a_tok, b, b_tok, layout, segments, top_k, routing,
                                                    config), memory, want, gbytes, gflop)


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
