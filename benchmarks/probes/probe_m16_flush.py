"""Is the M=16 decode stages' slower stream the write-back of do_bench's dirty flush? Tile shapes after each flush.

    python3 benchmarks/probes/probe_m16_flush.py

``probe_flush.py`` shows the one-row (M=1) gate+up stage untouched by the dirty flush (59.2 µs dirty / 59.4
clean) while the M=16 down stage loses ~8 µs to it (37.9 / 30.0): at M=16 the weight tiles stream at the copy
rate when L2 is clean. This runs ``probe_m16.py``'s swap-AB kernel (pointer weight tiles with
``evict_first``, x tiles, ``tl.dot``) over tile shapes from fxfuse's (64x128, 3 stages) to one-row-like long K
runs (16 rows x 1024-2048), 1-3 stages, after a dirty flush (do_bench's), a clean one and none, so that a
tile that keeps the dirty lines in L2 shows up as dirty ≈ clean.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.probes.probe_flush import device_us  # noqa: E402
from benchmarks.probes.probe_m16 import STAGES, launcher, tensors  # noqa: E402


@triton.jit
def prefetch_kernel(x_ptr, w0, w1, out_ptr, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
                    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``probe_m16.swap_ab_kernel`` (pointers, weights as the wide operand) with its pipeline written out in
    registers: the next K step's weight and x tiles are loaded (``evict_first`` for the weights, which a cp.async
    pipeline drops) before this step's ``tl.dot``. Launched with one stage, so Triton adds no pipeline of its own."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    per_split: tl.constexpr = K // BLOCK_K // SPLIT_K
    k_first = pid_k * per_split
    w0_ptrs = w0 + offs_n[:, None] * K + (k_first * BLOCK_K + offs_k)[None, :]
    w1_ptrs = w1 + offs_n[:, None] * K + (k_first * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * K + (k_first * BLOCK_K + offs_k)[:, None]
    wn0 = tl.load(w0_ptrs, eviction_policy="evict_first")
    wn1 = wn0
    if GATED:
        wn1 = tl.load(w1_ptrs, eviction_policy="evict_first")
    xn = tl.load(x_ptrs)
    acc0 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k in range(per_split):
        w_0, w_1, xt = wn0, wn1, xn
        more = k + 1 < per_split
        w0_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        wn0 = tl.load(w0_ptrs, mask=more, other=0.0, eviction_policy="evict_first")
        if GATED:
            wn1 = tl.load(w1_ptrs, mask=more, other=0.0, eviction_policy="evict_first")
        xn = tl.load(x_ptrs, mask=more, other=0.0)
        acc0 = tl.dot(w_0, xt, acc0)
        if GATED:
            acc1 = tl.dot(w_1, xt, acc1)
    if GATED:
        acc0 = acc0 * tl.sigmoid(acc0) * acc1
    ptrs = out_ptr + offs_m[None, :] * N + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(ptrs, acc0)
    else:
        tl.atomic_add(ptrs, acc0, sem="relaxed")


def prefetch_launcher(x, ws, out, split, bn, bk, warps):
    n, k = ws[0].shape

    def run():
        if split > 1:
            out.zero_()
        prefetch_kernel[(n // bn, split)](x, ws[0], ws[-1], out, N=n, K=k, GATED=len(ws) == 2, SPLIT_K=split,
                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=1)
        return out
    return run


PREFETCH_TILES = [(64, 128, 4), (64, 128, 8), (32, 256, 4), (64, 256, 4), (64, 256, 8), (128, 64, 8),
                  (128, 128, 8), (32, 512, 4), (16, 512, 4)]

# (block_n, block_k, warps, stages); pointer tiles, weights as tl.dot's wide operand (probe_m16's "ptr").
TILES = [(64, 128, 4, 3), (64, 256, 4, 1), (32, 512, 4, 1), (32, 512, 4, 2),
         # one stage (plain loads keep their evict_first policy) with more warps in flight (session 47)
         (64, 256, 8, 1), (128, 128, 8, 1), (64, 512, 8, 1), (32, 1024, 8, 1), (128, 256, 8, 1)]


def _line(name, run, flushes, wbytes) -> None:
    try:
        times = {f: device_us(run, before) for f, before in flushes.items()}
    except Exception as e:  # (a tile that does not fit)
        print(f"   {name}: {type(e).__name__}", flush=True)
        return
    print(f"   {name}: " + "  ".join(f"{f} {t:6.1f}" for f, t in times.items())
          + f"  (dirty - clean {times['dirty'] - times['clean']:+5.1f}; "
            f"{wbytes / times['dirty'] / 1e6:4.2f} TB/s dirty)", flush=True)


def main() -> None:
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flushes = {"dirty": buf.zero_, "clean": lambda: buf.view(torch.int32).max(), "none": lambda: None}
    for label, k, n, gated in STAGES:
        x, ws = tensors(k, n, gated)
        wbytes = sum(w.numel() for w in ws) * 2
        out = torch.empty(16, n, device="cuda", dtype=torch.float32)
        print(f"== {label}: {wbytes / 1e6:.0f} MB of weights; device µs (profiler, 10 calls)", flush=True)
        accs = [x.double() @ w.double().T for w in ws]
        ref = torch.nn.functional.silu(accs[0]) * accs[1] if gated else accs[0]
        for bn, bk, warps in PREFETCH_TILES:
            for split in ((1,) if gated else (1, 2, 4)):
                if (k // bk) % split or not 132 <= (n // bn) * split <= 8 * 132:
                    continue
                run = prefetch_launcher(x, ws, out, split, bn, bk, warps)
                try:
                    err = ((run().double() - ref).norm() / ref.norm()).item()
                except Exception as e:
                    print(f"   prefetch N{bn} K{bk} w{warps} split{split}: {type(e).__name__}", flush=True)
                    continue
                _line(f"prefetch N{bn} K{bk} w{warps} split{split} (rel err {err:.0e})", run, flushes, wbytes)
        for bn, bk, warps, stages in TILES:
            for split in ((1,) if gated else (1, 2, 4)):
                if (k // bk) % split or not 132 <= (n // bn) * split <= 8 * 132:
                    continue
                _line(f"N{bn} K{bk} w{warps} s{stages} split{split}",
                      launcher(x, ws, out, (False, True, split, bn, bk, warps, stages)), flushes, wbytes)


if __name__ == "__main__":
    main()
