"""Can the M=16 decode stages stream their weights as fast as the M=1 ones? Swap-AB tiles, TMA vs pointers.

fxfuse's small-M kernel at M=16 multiplies ``W_tile [BLOCK_N, BLOCK_K] @ x_tile^T [BLOCK_K, 16]`` with the
weight tiles loaded by pointer (cp.async, ``num_stages`` deep): llama gate+up streams at ~3.6 TB/s there,
against ~3.95 TB/s for the one-row kernel at M=1. This probe runs one standalone kernel of the same shape,
changing one thing at a time:

* ``ptr``: weight tiles by pointer, as fxfuse does (the baseline);
* ``tma``: weight tiles by TMA through host tensor descriptors (bulk copies into shared memory, no address
  arithmetic per element), everything else the same;
* tile, pipeline depth, warps, and split-K (partials added into an fp32 workspace with atomics; the probe
  times the kernel only, so it shows the stream's speed, not a finished epilogue).

Each: device µs after a 256 MB fill (profiler, mean of 10) and TB/s of weights; the fastest few per stage,
then fxfuse's autotuned stage kernel for comparison. Compiles in worker processes first.

    python3 benchmarks/probes/probe_m16.py [--workers 12] [--budget 240]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

M = 16
STAGES = (  # label, K, N, gated
    ("llama gate+up M=16", 4096, 14336, True),
    ("llama down M=16", 14336, 4096, False),
)


@triton.jit
def _mac(w, xt, acc, SWAP: tl.constexpr):
    """``acc + w @ xt`` (``[BLOCK_N, 16]``), as that product or as the transpose of ``xt^T @ w^T``."""
    if SWAP:
        return tl.dot(w, xt, acc)
    return tl.trans(tl.dot(tl.trans(xt), tl.trans(w), tl.trans(acc)))


@triton.jit
def _weight_tile(w, offs_n, ks, n0, k0, K: tl.constexpr, USE_TMA: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at (n0, k0): a TMA descriptor load, or a pointer load."""
    if USE_TMA:
        return w.load([n0, k0])
    return tl.load(w + offs_n[:, None] * K + ks[None, :], eviction_policy="evict_first")


@triton.jit
def swap_ab_kernel(x_ptr, w0, w1, out_ptr, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
                   USE_TMA: tl.constexpr, SWAP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """``acc[BLOCK_N, 16] = W[n-tile, k-share] @ x^T``; gated: silu(acc0) * acc1.

    SWAP False: the same product as ``(x @ W_tile^T)^T``, x the tl.dot's first operand (16 rows: mma.sync
    from registers on Hopper, instead of wgmma reading the weight tile from shared memory).

    x_ptr: ``[16, K]`` contiguous. w0, w1: ``[N, K]`` weights, as tensor descriptors (``USE_TMA``, block
    ``[BLOCK_N, BLOCK_K]``) or contiguous pointers. out_ptr: fp32 ``[16, N]``, stored (``SPLIT_K == 1``) or
    added to atomically (each split adds its partial sums; gated with a split is not run).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    per_split: tl.constexpr = K // BLOCK_K // SPLIT_K
    k_first = pid_k * per_split
    acc0 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in range(k_first, k_first + per_split):
        ks = k * BLOCK_K + offs_k
        xt = tl.load(x_ptr + offs_m[None, :] * K + ks[:, None])
        acc0 = _mac(_weight_tile(w0, offs_n, ks, pid_n * BLOCK_N, k * BLOCK_K, K, USE_TMA), xt, acc0, SWAP)
        if GATED:
            acc1 = _mac(_weight_tile(w1, offs_n, ks, pid_n * BLOCK_N, k * BLOCK_K, K, USE_TMA), xt, acc1, SWAP)
    if GATED:
        acc0 = acc0 * tl.sigmoid(acc0) * acc1
    ptrs = out_ptr + offs_m[None, :] * N + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(ptrs, acc0)
    else:
        tl.atomic_add(ptrs, acc0, sem="relaxed")


KINDS = {(False, True): "ptr", (True, True): "tma", (False, False): "ptr x-first"}


def configs(k: int, n: int, gated: bool):
    """(use_tma, swap, split, block_n, block_k, warps, stages) that fit shared memory and divide the shape."""
    n_w = 2 if gated else 1
    out = []
    for (tma, swap), bn, bk, warps, stages in itertools.product(KINDS, (16, 32, 64, 128), (64, 128, 256, 512),
                                                                (4, 8), (1, 2, 3, 4, 6)):
        if (n_w * bn * bk + 16 * bk) * 2 * max(stages - 1, 1) > 200 * 1024 or (warps == 8 and bn <= 32) or \
                (tma and stages < 3) or (bk == 512 and stages > 2) or (swap and bn == 16) or (bk >= 256 and stages > 4):
            continue
        for split in (1, 2, 4):
            steps = k // bk
            if steps % split or (gated and split > 1) or not 132 <= (n // bn) * split <= 8 * 132 or \
                    (split > 1 and n // bn >= 2 * 132):
                continue
            out.append((tma, swap, split, bn, bk, warps, stages))
    return out


def tensors(k: int, n: int, gated: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, k, generator=g, **d)
    ws = [torch.randn(n, k, generator=g, **d) * k**-0.5 for _ in range(2 if gated else 1)]
    return x, ws


def launcher(x, ws, out, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor

    tma, swap, split, bn, bk, warps, stages = cfg
    n, k = ws[0].shape
    if tma:
        ws = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
    grid = (n // bn, split)

    def run():
        if split > 1:
            out.zero_()
        swap_ab_kernel[grid](x, ws[0], ws[-1], out, N=n, K=k, GATED=len(ws) == 2, USE_TMA=tma, SWAP=swap,
                             SPLIT_K=split,
                             BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return out
    return run


def _warm(job) -> str:
    stage, part, parts = job
    _, k, n, gated = stage
    x, ws = tensors(k, n, gated)
    out = torch.empty(M, n, device="cuda", dtype=torch.float32)
    failed = 0
    for cfg in configs(k, n, gated)[part::parts]:
        try:
            launcher(x, ws, out, cfg)()
        except Exception:
            failed += 1
    torch.cuda.synchronize()
    return f"{stage[0]} part {part}: compiled ({failed} failed)"


def sweep(stage, deadline: float) -> None:
    from benchmarks.probes.probe_inductor_decode import kernels_after_flush
    from fxfuse.kernels import run_stage_gemv

    label, k, n, gated = stage
    x, ws = tensors(k, n, gated)
    wbytes = sum(w.numel() for w in ws) * 2
    xd = x.double()
    accs = [xd @ w.double().T for w in ws]
    ref = torch.nn.functional.silu(accs[0]) * accs[1] if gated else accs[0]
    out = torch.empty(M, n, device="cuda", dtype=torch.float32)
    print(f"== {label}: N={n} K={k}, {wbytes / 1e6:.0f} MB of weights", flush=True)
    rows = []
    for cfg in configs(k, n, gated):
        if time.time() > deadline:
            print("   (budget reached)")
            break
        try:
            run = launcher(x, ws, out, cfg)
            err = ((run().double() - ref).norm() / ref.norm()).item()
            us = sum(t for name, t in kernels_after_flush(run) if "swap_ab" in name)
            rows.append((us, cfg, err))
        except Exception as e:
            print(f"   {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    rows.sort(key=lambda r: r[0])
    for kind, name in KINDS.items():
        for shallow in (False, True):  # the best of each kind, then its best with at most 2 stages (register loads)
            best = [r for r in rows if r[1][:2] == kind and (not shallow or r[1][-1] <= 2)][:3 if shallow else 6]
            for us, (_, _, split, bn, bk, warps, stages), err in best:
                print(f"   {name} N{bn} K{bk} split{split} w{warps} s{stages}: {us:7.1f} µs "
                      f"{wbytes / us / 1e6:5.2f} TB/s  rel err {err:.1e}", flush=True)
    print(f"   ({len(rows)} configs run)")
    epi = "mul(silu(a0),a1)" if gated else "a0"
    fx = lambda: run_stage_gemv(x, ws, [None] * len(ws), [], epi)  # noqa: E731
    fx()
    us = sum(t for name, t in kernels_after_flush(fx) if "fused_gemv" in name)
    print(f"   fxfuse autotuned small-M kernel: {us:7.1f} µs {wbytes / us / 1e6:5.2f} TB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--budget", type=float, default=240.0)
    args = ap.parse_args()
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        parts = max(1, args.workers // len(STAGES))
        for line in pool.imap_unordered(_warm, [(s, i, parts) for s in STAGES for i in range(parts)]):
            print(f"   {line} at {time.time() - t0:.0f} s", flush=True)
    per = (args.budget - (time.time() - t0)) / len(STAGES)
    for stage in STAGES:
        sweep(stage, time.time() + per)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
