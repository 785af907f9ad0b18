"""Split-K for the one-row (M = 1) stage kernel: do narrow row tiles stream faster in two or four K shares?

llama_swiglu_m1's down projection (N=4096, K=14336) streams at 3.70 TB/s with one weight row per program
(31.7 µs) against 3.95 for gate+up (N=28672 rows of 4096); cuBLAS reads it in 29.5 µs with split-K and a
1.5 µs reduce kernel. Here each config runs directly (``run_stage_gemv(config=...)``), checked against float64
and timed as device µs after an L2 flush; then the two-launch MLP with the best down config against the
shipped pick, by ``do_bench``.

    python3 benchmarks/probes/probe_one_row_split.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402

from benchmarks.probes.probe_decode_sweep import COPY_TBPS, device_us  # noqa: E402
from benchmarks.probes.probe_gemv_sweep import reference, stages_of, tensors  # noqa: E402
from fxfuse.kernels import run_stage_gemv  # noqa: E402

LLAMA_M1 = ("llama_swiglu_m1", 1, 4096, 14336, 4096, True)
GPT2M_M1 = ("gpt2m_mlp_m1", 1, 1024, 4096, 1024, False)
# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)
DOWN = [(1, 1024, 1, 16, 1), (1, 8192, 1, 16, 1), (1, 2048, 1, 16, 1),
        (1, 1024, 2, 16, 1), (1, 2048, 2, 16, 1), (1, 1024, 2, 8, 1), (1, 2048, 2, 8, 1),
        (1, 1024, 4, 16, 1), (1, 1024, 4, 8, 1), (1, 512, 4, 8, 1), (1, 1024, 7, 8, 1), (1, 2048, 7, 16, 1),
        (2, 1024, 2, 16, 1), (2, 1024, 4, 8, 1), (4, 1024, 4, 8, 1), (2, 512, 2, 8, 2)]
GATE_UP = [(1, 2048, 1, 16, 1), (1, 2048, 2, 16, 1), (1, 1024, 2, 8, 1), (1, 1024, 4, 8, 1)]
FC = [(1, 4096, 1, 8, 2), (1, 1024, 1, 8, 1), (1, 1024, 2, 8, 1), (1, 512, 2, 8, 1), (1, 256, 4, 8, 1),
      (2, 1024, 1, 4, 3), (2, 512, 2, 4, 1), (4, 256, 4, 4, 1)]


def _config(bn, bk, split, warps, stages) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "ONE_ROW": 1},
                         num_warps=warps, num_stages=stages)


def sweep(stage, grid):
    x, ws, bs = tensors(stage)
    ref = reference(stage, x, ws, bs)
    wbytes = sum(w.numel() for w in ws) * 2
    rows = []
    for cfg in grid:
        c = _config(*cfg)
        run = lambda c=c: run_stage_gemv(x, ws, bs, [], stage[-1], check=False, config=c)  # noqa: E731
        try:
            for _ in range(3):  # the workspace and counters must be left zero: run several times, then check
                out = run()
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            us = device_us(run, "fused_gemv_kernel")
            rows.append((us, cfg, f"{wbytes / us / 1e6:5.2f} TB/s  rel err {err:.1e}"))
        except Exception as e:  # a config that does not compile here is reported, not fatal
            rows.append((float("inf"), cfg, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
    print(f"== {stage[0]}: K={stage[2]} N={stage[3]}, floor {wbytes / COPY_TBPS / 1e6:.1f} us", flush=True)
    for us, cfg, note in sorted(rows, key=lambda r: r[0]):
        print(f"   {us:8.2f} us  N{cfg[0]} K{cfg[1]} split{cfg[2]} w{cfg[3]} s{cfg[4]}  {note}", flush=True)
    return min(rows, key=lambda r: r[0])[1]


def whole(mlp, first, second_grid) -> None:
    from triton.testing import do_bench

    s0, s1 = stages_of(mlp)
    x, w0, b0 = tensors(s0, 1)
    _, w1, b1 = tensors(s1, 2)
    c0 = _config(*first)

    def two(c1):
        hid = run_stage_gemv(x, w0, b0, [], s0[-1], check=False, config=c0)
        return run_stage_gemv(hid, w1, b1, [], s1[-1], check=False, config=c1)

    cands = {f"down N{c[0]} K{c[1]} split{c[2]} w{c[3]}": _config(*c) for c in second_grid}
    for fn in cands.values():
        two(fn)
    torch.cuda.synchronize()
    res = {k: [] for k in cands}
    for _ in range(3):
        for k, c in cands.items():
            res[k].append(do_bench(lambda c=c: two(c), warmup=25, rep=200, return_mode="median") * 1e3)
    for k, v in res.items():
        rounds = ", ".join(f"{t:.2f}" for t in v)
        print(f"   {mlp[0]} two launches, {k}: do_bench {sorted(v)[1]:.2f} us (rounds {rounds})", flush=True)


def main() -> None:
    torch.manual_seed(0)
    s_gate, s_down = stages_of(LLAMA_M1)
    best_gu = sweep(s_gate, GATE_UP)
    best_down = sweep(s_down, DOWN)
    whole(LLAMA_M1, best_gu, [DOWN[0], best_down])
    f1, f2 = stages_of(GPT2M_M1)
    b1 = sweep(f1, FC)
    b2 = sweep(f2, FC)
    whole(GPT2M_M1, b1, [(1, 4096, 1, 8, 2), b2])


if __name__ == "__main__":
    main()
