"""Why Inductor's M=1 gate+up reduction streams faster than fxfuse's ONE_ROW kernel after do_bench's flush.

Session 6 measured Inductor's ``triton_red_fused_mm_t_0`` (llama gate+up at M=1: one weight row of each per
program, the whole K=4096 in one block, 16 warps) at 58 µs of device time after do_bench's 256 MB fill, and
fxfuse's ONE_ROW kernel at 63.7 µs (best config) or 88 µs with Inductor's very tile. This probe runs a
standalone kernel written like Inductor's beside fxfuse's, changing one thing at a time:

* ``rows``: Inductor's shape of kernel (N, K constexpr, XBLOCK rows per program, RBLOCK-wide K steps,
  silu(g)*u computed and stored once);
* ``rows/runtime``: the same with N and K as runtime arguments (as fxfuse's small-M kernel had them until session 9);
* ``fxfuse``: ``run_stage_gemv`` with the same tile, and with its autotuned pick.

Each: device µs after a 256 MB fill (profiler, mean of 10), do_bench median, registers, spills, rel err.
The down projection (N=4096, K=14336, one linear) gets the same treatment.

* ``persistent``: x loaded once per program and kept in registers, weight rows streamed by a persistent grid;
* fxfuse's two stages in sequence (the down projection's time after gate+up, not right after the fill).

    python3 benchmarks/probes/probe_stream.py [--quick | --persistent]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.probes.probe_inductor_decode import kernels_after_flush  # noqa: E402
from fxfuse.kernels import run_stage_gemv  # noqa: E402


@triton.jit
def rows_kernel(x_ptr, w0_ptr, w1_ptr, out_ptr, N, K, N_CONST: tl.constexpr, K_CONST: tl.constexpr,
                GATED: tl.constexpr, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr, SEQUENTIAL: tl.constexpr = False):
    """out[n] = silu(x·w0[n]) * (x·w1[n]) (GATED) or x·w0[n]; XBLOCK rows per program, K in RBLOCK steps.

    N_CONST, K_CONST > 0: the sizes as compile-time constants (then N and K are not read), as Inductor has them.
    SEQUENTIAL (gated): stream the w0 rows over all of K, then the w1 rows (one weight stream at a time per
    program) instead of a step of each in turn.
    """
    if N_CONST > 0:
        N = N_CONST
    if K_CONST > 0:
        K = K_CONST
    rows = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]
    rmask = rows < N
    r = tl.arange(0, RBLOCK)[None, :]
    acc0 = tl.zeros([XBLOCK, RBLOCK], tl.float32)
    acc1 = tl.zeros([XBLOCK, RBLOCK], tl.float32)
    for k0 in range(0, K, RBLOCK):
        ks = k0 + r
        km = ks < K
        xv = tl.load(x_ptr + ks, km, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w0 = tl.load(w0_ptr + ks + K * rows, km & rmask, other=0.0, eviction_policy="evict_first")
        acc0 += w0.to(tl.float32) * xv
        if GATED and not SEQUENTIAL:
            acc1 += tl.load(w1_ptr + ks + K * rows, km & rmask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32) * xv
    if GATED and SEQUENTIAL:
        for k0 in range(0, K, RBLOCK):
            ks = k0 + r
            km = ks < K
            xv = tl.load(x_ptr + ks, km, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc1 += tl.load(w1_ptr + ks + K * rows, km & rmask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32) * xv
    a0 = tl.sum(acc0, 1)[:, None]
    if GATED:
        a1 = tl.sum(acc1, 1)[:, None]
        a0 = a0 * tl.sigmoid(a0) * a1
    tl.store(out_ptr + rows, a0.to(out_ptr.dtype.element_ty), rmask)


@triton.jit
def persistent_rows_kernel(x_ptr, w0_ptr, w1_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
                           K_POW2: tl.constexpr, STAGES: tl.constexpr):
    """The ``rows`` kernel with a persistent grid: x is loaded once per program and kept in registers, then the
    program streams weight rows ``pid, pid + programs, ...`` (the loop pipelined ``STAGES`` deep). Cuts x's
    re-reads (one per row in ``rows``: as many bytes as the down projection's weights) to one per program.
    """
    r = tl.arange(0, K_POW2)
    km = r < K
    xv = tl.load(x_ptr + r, km, other=0.0).to(tl.float32)
    for n in tl.range(tl.program_id(0), N, tl.num_programs(0), num_stages=STAGES):
        a0 = tl.sum(tl.load(w0_ptr + n * K + r, km, other=0.0, eviction_policy="evict_first").to(tl.float32) * xv)
        if GATED:
            a1 = tl.sum(tl.load(w1_ptr + n * K + r, km, other=0.0, eviction_policy="evict_first").to(tl.float32) * xv)
            a0 = a0 * tl.sigmoid(a0) * a1
        tl.store(out_ptr + n, a0.to(out_ptr.dtype.element_ty))


def launch_persistent(x, ws, out, programs, warps, stages):
    n, k = ws[0].shape
    return persistent_rows_kernel[(programs,)](x, ws[0], ws[-1], out, N=n, K=k, GATED=len(ws) == 2,
                                               K_POW2=triton.next_power_of_2(k), STAGES=stages, num_warps=warps)


def launch_rows(constant, x, ws, out, xblock, rblock, warps, stages, sequential=False):
    """``rows_kernel`` with the sizes as constants (``constant``) or as runtime arguments."""
    n, k = ws[0].shape
    grid = (triton.cdiv(n, xblock),)
    return rows_kernel[grid](x, ws[0], ws[-1], out, n, k, N_CONST=n if constant else 0, K_CONST=k if constant else 0,
                             GATED=len(ws) == 2, XBLOCK=xblock, RBLOCK=rblock, SEQUENTIAL=sequential,
                             num_warps=warps, num_stages=stages)


def launch_separate(x, ws, g_u, xblock, rblock, warps):
    """Gate and up as two one-weight launches into fp32 ``g_u[2, N]`` (Inductor's split: silu·mul left to the
    next kernel), then ``silu(g) * u`` by torch (not counted: the probe times the ``rows_kernel`` launches)."""
    for i in range(2):
        launch_rows(True, x, ws[i:i + 1], g_u[i], xblock, rblock, warps, 1)
    return g_u


def measure(label, fn, ref, compiled=None, result=None) -> None:
    """Print ``fn``'s device and do_bench µs; ``result`` maps its return value to the output checked."""
    from triton.testing import do_bench

    out = fn() if result is None else result(fn())
    err = ((out.double() - ref).norm() / ref.norm()).item()
    bench = sorted(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3))[1]
    dev = sum(t for _, t in kernels_after_flush(fn))
    regs = f"regs {compiled.n_regs:3d} spills {compiled.n_spills}" if compiled is not None else " " * 19
    print(f"  {label:44s} device {dev:6.1f} µs  do_bench {bench:6.1f} µs  {regs}  rel err {err:.1e}", flush=True)


def case(name, x, ws, epilogue, tiles, fxfuse_tiles, quick) -> None:
    print(f"== {name}: N={ws[0].shape[0]} K={ws[0].shape[1]} linears={len(ws)}", flush=True)
    xd = x.double()
    accs = [xd @ w.double().T for w in ws]
    ref = torch.nn.functional.silu(accs[0]) * accs[1] if len(ws) == 2 else accs[0]
    out = torch.empty(1, ws[0].shape[0], device=x.device, dtype=x.dtype)
    for constant, kind in ((True, "rows"), (False, "rows/runtime")):
        for xblock, rblock, warps, stages in tiles:
            if quick and kind != "rows" and (xblock, rblock) != tiles[0][:2]:
                continue
            try:
                compiled = launch_rows(constant, x, ws, out, xblock, rblock, warps, stages)
                fn = functools.partial(launch_rows, constant, x, ws, out, xblock, rblock, warps, stages)
                measure(f"{kind} X{xblock} R{rblock} w{warps} s{stages}", lambda fn=fn: (fn(), out)[1], ref, compiled)
            except Exception as err:  # a tile that does not compile: say so, go on
                print(f"  {kind} X{xblock} R{rblock} w{warps}: failed: {type(err).__name__}: {str(err)[:120]}")
    if len(ws) == 2:  # one weight stream per program: sequential in one launch, or one launch per weight
        for xblock, rblock, warps, stages in tiles[:4]:
            fn = functools.partial(launch_rows, True, x, ws, out, xblock, rblock, warps, stages, True)
            measure(f"rows/sequential X{xblock} R{rblock} w{warps}", lambda fn=fn: (fn(), out)[1], ref)
            g_u = torch.empty(2, ws[0].shape[0], device=x.device, dtype=torch.float32)
            fn = functools.partial(launch_separate, x, ws, g_u, xblock, rblock, warps)
            measure(f"rows/separate fp32 X{xblock} R{rblock} w{warps}", fn, ref,
                    result=lambda gu: torch.nn.functional.silu(gu[0]) * gu[1])
    for bn, bk, warps, stages in fxfuse_tiles:
        c = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "ONE_ROW": 1}, num_warps=warps,
                          num_stages=stages)
        fn = functools.partial(run_stage_gemv, x, ws, [None] * len(ws), [], epilogue, config=c)
        measure(f"fxfuse ONE_ROW N{bn} K{bk} w{warps} s{stages}", fn, ref)
    fn = functools.partial(run_stage_gemv, x, ws, [None] * len(ws), [], epilogue)
    measure("fxfuse autotuned", fn, ref)
    persistent(x, ws, out, ref)


def persistent(x, ws, out, ref) -> None:
    for per_sm, warps, stages in ((4, 16, 1), (4, 16, 2), (2, 16, 2), (8, 8, 1), (8, 8, 2), (4, 8, 3), (16, 4, 2),
                                  (3, 16, 1), (6, 8, 2)):
        programs = per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count
        try:
            compiled = launch_persistent(x, ws, out, programs, warps, stages)
            fn = functools.partial(launch_persistent, x, ws, out, programs, warps, stages)
            measure(f"persistent {per_sm}/SM w{warps} s{stages}", lambda fn=fn: (fn(), out)[1], ref, compiled)
        except Exception as err:
            print(f"  persistent {per_sm}/SM w{warps} s{stages}: failed: {type(err).__name__}: {str(err)[:120]}")


def in_sequence(x, gate_up, down) -> None:
    """fxfuse's two llama stages back to back after a 256 MB fill: each kernel's device time, in order (the
    down projection runs after gate+up has pushed the fill's dirty lines out of L2)."""
    from torch.profiler import ProfilerActivity, profile

    def mlp():
        h = run_stage_gemv(x, gate_up, [None, None], [], "mul(silu(a0),a1)")
        return run_stage_gemv(h, down, [None], [], "a0")

    mlp()
    fill = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fill.zero_()
            mlp()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "fused_gemv" in e.name]
    kernels.sort(key=lambda e: e.time_range.start)
    first = [e.device_time for e in kernels[0::2]]
    second = [e.device_time for e in kernels[1::2]]
    print(f"== fxfuse llama M=1 in sequence: gate+up {sum(first) / len(first):.1f} µs, then down "
          f"{sum(second) / len(second):.1f} µs (device, mean of {len(first)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer runtime-shape variants")
    ap.add_argument("--persistent", action="store_true", help="only the in-sequence and persistent-grid variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, **d)
    gate_up = [torch.randn(14336, 4096, **d) * 4096**-0.5 for _ in range(2)]
    tiles = [(1, 4096, 16, 1), (1, 4096, 8, 1), (1, 2048, 8, 1), (2, 2048, 8, 1), (2, 4096, 16, 1),
             (4, 1024, 8, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (8, 512, 4, 1), (1, 1024, 4, 1), (2, 1024, 4, 1)]
    h = torch.randn(1, 14336, **d)
    down = [torch.randn(4096, 14336, **d) * 14336**-0.5]
    in_sequence(x, gate_up, down)
    if args.persistent:
        xd, hd = x.double(), h.double()
        out = torch.empty(1, 14336, **d)
        persistent(x, gate_up, out, torch.nn.functional.silu(xd @ gate_up[0].double().T) * (xd @ gate_up[1].double().T))
        persistent(h, down, out[:, :4096], hd @ down[0].double().T)
        return
    case("llama gate+up M=1", x, gate_up, "mul(silu(a0),a1)", tiles,
         [(1, 4096, 16, 1), (32, 256, 4, 1), (4, 1024, 8, 1)], args.quick)
    del gate_up
    tiles = [(1, 8192, 16, 1), (1, 4096, 16, 1), (1, 2048, 8, 1), (2, 2048, 8, 1), (4, 2048, 4, 1), (4, 2048, 8, 1),
             (4, 1024, 4, 1), (2, 4096, 8, 1), (8, 1024, 8, 1)]
    case("llama down M=1", h, down, "a0", tiles, [(4, 2048, 4, 1), (1, 8192, 16, 1)], args.quick)


if __name__ == "__main__":
    main()
