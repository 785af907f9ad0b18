"""Every small-M stage-kernel config at the decode workloads' stages, and the two-launch MLP they make.

    python3 benchmarks/probes/probe_gemv_sweep.py [--budget SECONDS] [--workers N] [--wide | --one-row] [--only NAME]

For llama_swiglu m1/m16 and gpt2m_mlp m1/m8 (bf16), each stage (gate+up, down; fc1+GELU, fc2) is run with every
config of a grid (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) that suits it (``run_stage_gemv(config=...)``, no
autotuner), checked against float64 and timed as the kernel's device time from the profiler, each call after an
L2 flush. The configs are compiled first in ``--workers`` processes at once (Triton's disk cache keeps them), so
the timing loop only loads them. Then each MLP runs as the two fastest stage kernels back to back, beside eager
and the one-launch decode kernel, timed the same way and with ``triton.testing.do_bench`` (which includes the gap
between the launches).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402

from benchmarks.probes.probe_decode_sweep import COPY_TBPS, device_us  # noqa: E402
from fxfuse.kernels import run_decode, run_stage_gemv  # noqa: E402
from fxfuse.kernels.gemv_template import GEMV_BLOCK_M  # noqa: E402
from fxfuse.kernels.template import fit_stages  # noqa: E402

MLPS = [  # name, M, K, H, N, gated
    ("llama_swiglu_m1", 1, 4096, 14336, 4096, True),
    ("llama_swiglu_m16", 16, 4096, 14336, 4096, True),
    ("gpt2m_mlp_m1", 1, 1024, 4096, 1024, False),
    ("gpt2m_mlp_m8", 8, 1024, 4096, 1024, False),
]
SMS = 132


def stages_of(mlp):
    """(label, M, K, N, number of weights, has bias, epilogue) of the MLP's two stages."""
    name, m, k, h, n, gated = mlp
    if gated:
        return [(f"{name} gate+up", m, k, h, 2, False, "mul(silu(a0),a1)"), (f"{name} down", m, h, n, 1, False, "a0")]
    return [(f"{name} fc1+gelu", m, k, h, 1, True, "gelu_tanh(a0)"), (f"{name} fc2", m, h, n, 1, True, "a0")]


TILES = ((16, 256), (16, 512), (32, 256), (64, 128), (128, 64))
DEPTHS = ((4, 4), (4, 6), (8, 4))  # (warps, stages)
WIDE_TILES = ((16, 512), (32, 256), (32, 512), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64))
WIDE_DEPTHS = ((4, 3), (4, 4), (4, 6), (8, 3), (8, 4), (8, 6))


# ONE_ROW (M == 1, multiply-and-sum): a few rows of W per program, long K runs.
ONE_ROW_TILES = ((1, 1024), (1, 2048), (1, 4096), (1, 8192), (2, 1024), (2, 2048), (2, 4096),
                 (4, 1024), (4, 2048), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 256))
ONE_ROW_DEPTHS = ((4, 1), (8, 1), (16, 1), (4, 3), (8, 2))


def one_row_configs(k: int, n: int) -> list[triton.Config]:
    out = []
    for bn, bk in ONE_ROW_TILES:
        if bn > n or bk > max(64, k):
            continue
        for split in (1, 4) if bn >= 16 else (1,):
            if split > 1 and triton.cdiv(n, bn) >= SMS:
                continue
            for warps, stages in ONE_ROW_DEPTHS:
                out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "ONE_ROW": 1},
                                         num_warps=warps, num_stages=stages))
    return out


def configs_for(k: int, n: int, n_w: int, wide: bool = False, m: int = 16,
                one_row: bool = False) -> list[triton.Config]:
    if one_row:
        return one_row_configs(k, n) if m == 1 else []
    out = []
    for bn, bk in WIDE_TILES if wide else TILES:
        if bn > max(16, n) or bk > max(64, k):
            continue
        for split in (1, 2, 4) if wide else (1, 2, 4, 8):
            tiles = triton.cdiv(n, bn)
            if split > triton.cdiv(k, bk) or (split > 1 and tiles >= 2 * SMS) or tiles * split > 8 * SMS:
                continue
            for warps, stages in WIDE_DEPTHS if wide else DEPTHS:
                c = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "ONE_ROW": 0},
                                  num_warps=warps, num_stages=stages)
                fitted = fit_stages(c, (n_w * bn * bk + GEMV_BLOCK_M * bk) * 2)
                if fitted is not None and fitted.num_stages == stages:
                    out.append(fitted)
    return out


def tensors(stage, seed: int = 0):
    _, m, k, n, n_w, bias, _ = stage
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, generator=g, **d)
    ws = [torch.randn(n, k, generator=g, **d) * k**-0.5 for _ in range(n_w)]
    bs = [torch.randn(n, generator=g, **d) if bias else None for _ in range(n_w)]
    return x, ws, bs


def _epilogue(stage, accs):
    epi = stage[-1]
    if epi == "mul(silu(a0),a1)":
        return F.silu(accs[0]) * accs[1]
    if epi == "gelu_tanh(a0)":
        return F.gelu(accs[0], approximate="tanh")
    return accs[0]


def reference(stage, x, ws, bs):
    """The stage in float64."""
    return _epilogue(stage, [F.linear(x.double(), w.double(), None if b is None else b.double())
                             for w, b in zip(ws, bs)])


def eager_stage(stage, x, ws, bs):
    """The stage as eager PyTorch runs it (cuBLAS, then the pointwise ops)."""
    return _epilogue(stage, [F.linear(x, w, b) for w, b in zip(ws, bs)])


def _warm(job) -> str:
    """Compile every config of ``stage`` once (a worker process): Triton's disk cache keeps the binaries."""
    stage, wide, one_row, part, parts = job
    x, ws, bs = tensors(stage)
    failed = 0
    for c in configs_for(stage[2], stage[3], stage[4], wide, stage[1], one_row)[part::parts]:
        try:
            run_stage_gemv(x, ws, bs, [], stage[-1], check=False, config=c)
        except Exception:
            failed += 1
    torch.cuda.synchronize()
    return f"{stage[0]}: compiled ({failed} failed)"


def sweep(stage, deadline: float, wide: bool = False, one_row: bool = False):
    x, ws, bs = tensors(stage)
    ref = reference(stage, x, ws, bs)
    wbytes = sum(w.numel() for w in ws) * 2
    eager_us = device_us(lambda: eager_stage(stage, x, ws, bs))
    print(f"== {stage[0]}: M={stage[1]} K={stage[2]} N={stage[3]}; floor {wbytes / COPY_TBPS / 1e6:.1f} us; "
          f"eager kernels {eager_us:.1f} us ({wbytes / eager_us / 1e6:.2f} TB/s)", flush=True)
    rows = []
    for c in configs_for(stage[2], stage[3], stage[4], wide, stage[1], one_row):
        if time.time() > deadline:
            print("   (budget reached)")
            break
        kw = c.kwargs
        desc = (f"N{kw['BLOCK_N']} K{kw['BLOCK_K']} split{kw['SPLIT_K']} w{c.num_warps} s{c.num_stages}"
                f"{' one-row' if kw['ONE_ROW'] else ''}")
        try:
            run = lambda c=c: run_stage_gemv(x, ws, bs, [], stage[-1], check=False, config=c)  # noqa: E731
            out = run()
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            us = device_us(run, "fused_gemv_kernel")
            rows.append((us, desc, c, f"{wbytes / us / 1e6:5.2f} TB/s  rel err {err:.1e}"))
        except Exception as e:
            rows.append((float("inf"), desc, c, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
    rows.sort(key=lambda r: r[0])
    for us, desc, _, note in rows[:8]:
        print(f"   {us:8.1f} us  {desc:30s} {note}", flush=True)
    print(f"   ({len(rows)} configs run)")
    return rows[0][2] if rows and rows[0][0] < float("inf") else None


def whole_mlp(mlp, best) -> None:
    from triton.testing import do_bench

    name, m, k, h, n, gated = mlp
    s0, s1 = stages_of(mlp)
    x, w0, b0 = tensors(s0, 1)
    _, w1, b1 = tensors(s1, 2)
    epis = (s0[-1], s1[-1])

    def two_launch():
        hid = run_stage_gemv(x, w0, b0, [], epis[0], check=False, config=best[0])
        return run_stage_gemv(hid, w1, b1, [], epis[1], check=False, config=best[1])

    def eager():
        return eager_stage(s1, eager_stage(s0, x, w0, b0), w1, b1)

    def decode():
        return run_decode(x, [*w0, *w1], [*b0, *b1], [[], []], epis, check=False)

    ref = eager_stage(s1, reference(s0, x, w0, b0).to(torch.bfloat16), w1, b1).double()
    wbytes = (sum(w.numel() for w in w0) + w1[0].numel()) * 2
    print(f"== {name} whole MLP (floor {wbytes / COPY_TBPS / 1e6:.1f} us)")
    for label, fn in (("two launches", two_launch), ("decode kernel", decode), ("eager", eager)):
        err = ((fn().double() - ref).norm() / ref.norm()).item()
        dev = device_us(fn)
        bench = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"   {label:14s} device {dev:7.1f} us  do_bench {bench:7.1f} us  ({wbytes / bench / 1e6:.2f} TB/s)  "
              f"rel err vs eager-rounded {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--only", default="", help="only the MLPs whose name contains this")
    ap.add_argument("--wide", action="store_true", help="a wider grid of tiles and pipeline depths")
    ap.add_argument("--one-row", action="store_true", help="ONE_ROW configs only (M=1 stages)")
    args = ap.parse_args()
    t0 = time.time()
    mlps = [mlp for mlp in MLPS if args.only in mlp[0] and (mlp[1] == 1 or not args.one_row)]
    all_stages = [s for mlp in mlps for s in stages_of(mlp)]
    if args.workers > 1:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            parts = max(1, 3 * args.workers // len(all_stages))
            jobs = [(s, args.wide, args.one_row, i, parts) for s in all_stages for i in range(parts)]
            for line in pool.imap_unordered(_warm, jobs):
                print(f"   {line} at {time.time() - t0:.0f} s", flush=True)
    per = (args.budget - (time.time() - t0)) / len(all_stages)
    best = {}
    for s in all_stages:
        best[s[0]] = sweep(s, time.time() + per, args.wide, args.one_row)
    for mlp in mlps:
        s0, s1 = stages_of(mlp)
        if best[s0[0]] is not None and best[s1[0]] is not None:
            whole_mlp(mlp, (best[s0[0]], best[s1[0]]))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
