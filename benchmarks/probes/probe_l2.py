"""L2-to-SM read bandwidth, and what it implies for the large-M stage kernels' tiles.

    python3 benchmarks/probes/probe_l2.py

A Triton kernel streams an L2-resident buffer (every program reads every byte ``passes`` times through TMA-free
``tl.load``s of ``[BLOCK_R, 128]`` tiles, sums them, writes one value), for buffers of 4-40 MiB; bytes read per
µs is the L2 read bandwidth the SMs see. Then, for each large-M stage of the benchmark with the tile its kernel
uses, the bytes its tiles read from L2 (every output tile reads its x rows and W rows once: ``tiles *
(BLOCK_M + BLOCK_N') * K * 2``) over that bandwidth: a lower bound on the kernel's time from L2 alone, beside the
matmul-rate floor. (cuBLAS's 2-CTA clusters multicast one operand to both CTAs, halving that operand's L2 reads.)
Programs per SM are swept (1-8): one 8-warp program per SM keeps too few loads in flight to reach the ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _stream(src, out, rows, passes, BLOCK_R: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_R, COLS), dtype=tl.float32)
    cols = tl.arange(0, COLS)
    tiles = rows // BLOCK_R
    for _ in range(passes):
        for t in range(tiles):  # each program reads every tile, starting at its own (spread over L2 slices)
            tile = (t + pid) % tiles
            r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            acc += tl.load(src + r[:, None] * COLS + cols[None, :]).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def l2_bandwidth(mib: int, programs: int, passes: int = 4) -> float:
    """TB/s of L2 reads: ``programs`` programs each read a ``mib`` MiB bf16 buffer ``passes`` times."""
    cols, block_r = 128, 64
    rows = (mib << 20) // (cols * 2) // block_r * block_r
    src = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(programs, device="cuda", dtype=torch.float32)

    def run():
        _stream[(programs,)](src, out, rows, passes, BLOCK_R=block_r, COLS=cols, num_warps=8)

    run()
    us = do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3  # flush, then the first pass warms L2
    return src.numel() * 2 * programs * passes / us / 1e6


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {sms} SMs")
    best = 0.0
    for mib in (4, 8, 16, 24, 32, 40):
        for programs in (sms, 2 * sms, 4 * sms, 8 * sms):  # enough loads in flight to find the ceiling
            bw = l2_bandwidth(mib, programs)
            best = max(best, bw) if mib <= 24 else best
            print(f"  buffer {mib:3d} MiB, {programs} programs: {bw:6.2f} TB/s read")
    print(f"L2 read bandwidth used below: {best:.2f} TB/s (best at <= 24 MiB)")
    # (name, M, K, N, gated, BLOCK_M, BLOCK_N of one weight)
    stages = [("seed gate/up", 8192, 768, 3072, True, 128, 128), ("seed gate/up", 8192, 768, 3072, True, 128, 64),
              ("gpt2 fc1", 8192, 768, 3072, False, 128, 256), ("llama gate/up", 4096, 4096, 14336, True, 128, 128)]
    for name, m, k, n, gated, bm, bn in stages:
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        w_rows = bn * (2 if gated else 1)
        l2_bytes = tiles * (bm + w_rows) * k * 2
        flops = 2 * m * k * n * (2 if gated else 1)
        print(f"  {name} {bm}x{w_rows} tiles: {tiles} tiles read {l2_bytes / 1e6:.0f} MB from L2 -> >= "
              f"{l2_bytes / best / 1e6:.0f} us at {best:.2f} TB/s; {flops / 1e9:.1f} GFLOP")


if __name__ == "__main__":
    main()
