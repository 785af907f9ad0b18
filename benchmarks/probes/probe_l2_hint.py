"""Does an L2 eviction hint on a weight stream avoid the write-back of do_bench's dirty flush?

    python3 benchmarks/probes/probe_l2_hint.py

do_bench zeroes 256 MB before every timed call, so L2 starts full of dirty lines and a weight-streaming kernel's
reads evict them: HBM carries their write-back too (~8–9 µs per decode stage, ``probe_flush.py``). Triton's
``eviction_policy="evict_first"`` did not avoid it. This times one-row GEMVs (``out = W @ x``, W bf16 [28672,
4096] = llama's gate+up weights) whose 16-byte weight loads are written in PTX with different cache qualifiers,
the same arithmetic in every variant, after a dirty flush, a clean one and none; and prints which qualifiers
Triton itself emits for ``tl.load(..., eviction_policy="evict_first")``.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_flush import device_us  # noqa: E402

# Each asm loads 16 bytes (8 bf16 as 4 x b32) at $4. ``p`` is an L2 cache policy register.
_POLICY = "{{ .reg .b64 p; createpolicy.fractional.L2::{prio}.b64 p, 1.0; {ld} {{$0,$1,$2,$3}}, [$4], p; }}"
LOADS = {
    "plain ld.global": "ld.global.v4.b32 {$0,$1,$2,$3}, [$4];",
    "ld.global.nc.L1::no_allocate": "ld.global.nc.L1::no_allocate.v4.b32 {$0,$1,$2,$3}, [$4];",
    "L2 evict_first hint": _POLICY.format(prio="evict_first", ld="ld.global.nc.L1::no_allocate.L2::cache_hint.v4.b32"),
    "L2 evict_unchanged hint": _POLICY.format(prio="evict_unchanged",
                                              ld="ld.global.nc.L1::no_allocate.L2::cache_hint.v4.b32"),
}


@triton.jit
def _bf16_pair(v):
    """The two bf16 in a b32 as fp32 (a bf16 is the top half of its fp32)."""
    lo = (v << 16).to(tl.float32, bitcast=True)
    hi = (v & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def gemv_asm(w32, x, out, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ASM: tl.constexpr):
    """out[n] = sum_k W[n, k] x[k]; ``w32`` is W viewed as int32 (K / 2 per row), loaded 16 bytes at a time."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    chunks = tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_N, BLOCK_C), tl.float32)
    for c0 in tl.range(0, K // 8, BLOCK_C):
        c = c0 + chunks
        ptrs = w32 + rows[:, None] * (K // 2) + c[None, :] * 4
        v0, v1, v2, v3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,l", [ptrs],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=True, pack=1)
        xk = x + c * 8
        a, b = _bf16_pair(v0)
        acc += a * tl.load(xk)[None, :] + b * tl.load(xk + 1)[None, :]
        a, b = _bf16_pair(v1)
        acc += a * tl.load(xk + 2)[None, :] + b * tl.load(xk + 3)[None, :]
        a, b = _bf16_pair(v2)
        acc += a * tl.load(xk + 4)[None, :] + b * tl.load(xk + 5)[None, :]
        a, b = _bf16_pair(v3)
        acc += a * tl.load(xk + 6)[None, :] + b * tl.load(xk + 7)[None, :]
    tl.store(out + rows, tl.sum(acc, axis=1))


@triton.jit
def gemv_tl(w, x, out, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """The same GEMV with Triton's own loads (what fxfuse's one-row kernel does)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        ptrs = w + rows[:, None] * K + (k0 + ks)[None, :]
        if EVICT_FIRST:
            wt = tl.load(ptrs, eviction_policy="evict_first")
        else:
            wt = tl.load(ptrs)
        acc += wt.to(tl.float32) * tl.load(x + k0 + ks)[None, :]
    tl.store(out + rows, tl.sum(acc, axis=1))


@triton.jit
def gemv_tl_asm(w, x, out, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """``gemv_tl`` with its weight loads written in PTX: each asm takes 8 bf16 pointers (the first one's 16 bytes
    are loaded; the layout gives a thread 8 K-contiguous elements, checked by the result)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), 8), 8)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        ptrs = w + rows[:, None] * K + (k0 + ks)[None, :]
        wt = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,l,l,l,l,l,l,l,l", [ptrs], dtype=tl.bfloat16, is_pure=True,
                                       pack=8)
        # A load that never reads (mask all false at run time) gives the pointers the load's vectorized layout.
        anchor = tl.load(ptrs, mask=rows[:, None] < 0, other=0.0)
        acc += (wt + anchor).to(tl.float32) * tl.load(x + k0 + ks)[None, :]
    tl.store(out + rows, tl.sum(acc, axis=1))


def main() -> None:
    N, K = 28672, 4096
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(K, device="cuda", dtype=torch.float32)
    out = torch.empty(N, device="cuda", dtype=torch.float32)
    ref = w.double() @ x.double()
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    flushes = {"dirty": buf.zero_, "clean": lambda: buf.view(torch.int32).max(), "none": lambda: None}
    print(f"W {N}x{K} bf16 = {w.numel() * 2 / 1e6:.0f} MB; device µs after each flush (10 calls)", flush=True)

    def report(name, fn):
        fn()
        torch.cuda.synchronize()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        times = {f: device_us(fn, before) for f, before in flushes.items()}
        dirty_tax = times["dirty"] - times["clean"]
        print(f"  {name:52s} " + "  ".join(f"{f} {t:6.1f}" for f, t in times.items())
              + f"  (dirty - clean {dirty_tax:+5.1f}; GB/s clean {w.numel() * 2 / times['clean'] / 1e3:5.0f};"
              f" rel err {err:.1e})", flush=True)

    w32 = w.view(torch.int32)
    for name, asm in LOADS.items():
        for bn, bc, warps in ((16, 16, 8),):
            grid = (N // bn,)
            report(f"{name} [BN{bn} C{bc} w{warps}]",
                   lambda asm=asm, bn=bn, bc=bc, warps=warps, grid=grid: gemv_asm[grid](
                       w32, x, out, K=K, BLOCK_N=bn, BLOCK_C=bc, ASM=asm, num_warps=warps))
    for name, asm in LOADS.items():
        for bn, bk, warps in ((8, 256, 8), (4, 512, 8)):
            report(f"{name} in tl's layout [BN{bn} K{bk} w{warps}]",
                   lambda asm=asm, bn=bn, bk=bk, warps=warps: gemv_tl_asm[(N // bn,)](
                       w, x, out, K=K, BLOCK_N=bn, BLOCK_K=bk, ASM=asm, num_warps=warps))
    for evict in (False, True):
        for bn, bk, warps in ((8, 256, 8), (4, 512, 8)):
            report(f"tl.load evict_first={evict} [BN{bn} K{bk} w{warps}]",
                   lambda evict=evict, bn=bn, bk=bk, warps=warps: gemv_tl[(N // bn,)](
                       w, x, out, K=K, BLOCK_N=bn, BLOCK_K=bk, EVICT_FIRST=evict, num_warps=warps))
    # Which qualifiers Triton emits for its own loads.
    for evict in (False, True):
        kernel = gemv_tl[(N // 8,)](w, x, out, K=K, BLOCK_N=8, BLOCK_K=256, EVICT_FIRST=evict, num_warps=8)
        lines = sorted({ln.strip().split()[0] for ln in kernel.asm["ptx"].splitlines()
                        if "ld.global" in ln or "createpolicy" in ln})
        print(f"Triton's PTX, evict_first={evict}: {lines}", flush=True)


if __name__ == "__main__":
    main()
