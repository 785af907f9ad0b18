"""Does a persistent one-row stream with its next rows loaded into REGISTERS ahead of time beat ONE_ROW's stream?

fxfuse's one-row stage kernel (``ONE_ROW``: one weight row per program, the whole row in one or two steps) streams
llama m1's weights at ~3.97 TB/s after do_bench's dirty flush, and pays no write-back tax for it (its loads are
plain ``ld.global`` with the L2 evict_first policy). The tiled kernels stream at 4.24 TB/s after a CLEAN flush but
their cp.async pipeline drops the policy, so after the dirty one they pay ~8 µs per stage. Session 10's persistent
variant pipelined with ``tl.range(num_stages>1)`` (cp.async again) and read 62.8-89 µs for gate+up.

Here: a persistent grid (``per_sm`` programs per SM), x loaded once per program, and the loop written as a
register double buffer: the NEXT ``ROWS`` weight rows are loaded (evict_first, plain loads: ``num_stages=1``) before
this iteration's rows are reduced, so every program has a row in flight while it reduces, across the whole
stage, with no CTA turnover and no x re-reads from L2.

Prints do_bench µs (L2 flushed with the dirty 256 MB fill, median of interleaved rounds) for fxfuse's autotuned
stage and every variant, then device µs (profiler) for the best few.

    python3 benchmarks/probes/probe_register_pipeline.py [--shapes llama_gate_up,llama_down,gpt2m_fc1,gpt2m_fc2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


@triton.jit
def prefetch_rows_kernel(x_ptr, w0_ptr, w1_ptr, b_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                         K_POW2: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr):
    """out[n] = silu(x·w0[n]) * (x·w1[n]) (GATED) or x·w0[n] (+ b[n]); program p takes rows p·ROWS, (p+P)·ROWS, ...

    The next rows' weights are loaded before this iteration's rows are reduced (a register double buffer).
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    r = tl.arange(0, K_POW2)[None, :]
    km = r < K
    xv = tl.load(x_ptr + r, km, other=0.0).to(tl.float32)
    rows = pid * ROWS + tl.arange(0, ROWS)[:, None]
    nm = km & (rows < N)
    w0n = tl.load(w0_ptr + rows * K + r, nm, other=0.0, eviction_policy="evict_first")
    if GATED:
        w1n = tl.load(w1_ptr + rows * K + r, nm, other=0.0, eviction_policy="evict_first")
    for base in range(pid * ROWS, N, step):
        w0c = w0n
        if GATED:
            w1c = w1n
        nxt = base + step + tl.arange(0, ROWS)[:, None]
        nm = km & (nxt < N)  # masked-off loads fetch nothing: no row past the end is read
        w0n = tl.load(w0_ptr + nxt * K + r, nm, other=0.0, eviction_policy="evict_first")
        if GATED:
            w1n = tl.load(w1_ptr + nxt * K + r, nm, other=0.0, eviction_policy="evict_first")
        a0 = tl.sum(w0c.to(tl.float32) * xv, 1)
        if GATED:
            a1 = tl.sum(w1c.to(tl.float32) * xv, 1)
            a0 = a0 * tl.sigmoid(a0) * a1
        cur = base + tl.arange(0, ROWS)
        if HAS_BIAS:
            a0 += tl.load(b_ptr + cur, cur < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + cur, a0.to(out_ptr.dtype.element_ty), cur < N)


def launch(x, ws, b, out, per_sm, warps, rows):
    n, k = ws[0].shape
    programs = min(per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count, triton.cdiv(n, rows))
    return prefetch_rows_kernel[(programs,)](x, ws[0], ws[-1], b if b is not None else ws[0], out, N=n, K=k,
                                             K_POW2=triton.next_power_of_2(k), GATED=len(ws) == 2,
                                             HAS_BIAS=b is not None, ROWS=rows, num_warps=warps, num_stages=1)


SHAPES = {  # name: (N, K, gated, bias)
    "llama_gate_up": (14336, 4096, True, False),
    "llama_down": (4096, 14336, False, False),
    "gpt2m_fc1": (4096, 1024, False, True),
    "gpt2m_fc2": (1024, 4096, False, True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        shape(name, args.rounds)


def shape(name: str, rounds: int) -> None:
    """Every variant beside fxfuse's stage on one shape (see the module doc)."""
    from triton.testing import do_bench

    from benchmarks.timing import kernels_after_flush
    from fxfuse.kernels import run_stage_gemv

    d = dict(device="cuda", dtype=torch.bfloat16)
    n, k, gated, bias = SHAPES[name]
    x = torch.randn(1, k, **d)
    ws = [torch.randn(n, k, **d) * k ** -0.5 for _ in range(2 if gated else 1)]
    b = torch.randn(n, **d) * 0.1 if bias else None
    accs = [x.double() @ w.double().T for w in ws]
    ref = torch.nn.functional.silu(accs[0]) * accs[1] if gated else accs[0] + (b.double() if bias else 0)
    epi = "mul(silu(a0),a1)" if gated else "a0"
    out = torch.empty(1, n, **d)
    cands = {"fxfuse stage (autotuned)": lambda: run_stage_gemv(x, ws, [b] + [None] * (len(ws) - 1), [], epi)}
    grid = [(per_sm, warps, rows) for per_sm in (1, 2, 4) for warps in (8, 16) for rows in (1, 2, 4)]
    print(f"== {name}: N={n} K={k} gated={gated} bias={bias}", flush=True)
    for per_sm, warps, rows in grid:
        label = f"prefetch {per_sm}/SM w{warps} rows{rows}"
        try:
            compiled = launch(x, ws, b, out, per_sm, warps, rows)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            if err > 2e-2:
                print(f"  {label}: WRONG rel err {err:.1e}")
                continue
            if compiled.n_spills:
                print(f"  {label}: {compiled.n_spills} spills, skipped")
                continue
            cands[label] = (lambda per_sm=per_sm, warps=warps, rows=rows: launch(x, ws, b, out, per_sm, warps,
                                                                                 rows))
        except Exception as err:
            print(f"  {label}: failed: {type(err).__name__}: {str(err)[:160]}", flush=True)
    times = {c: [] for c in cands}
    for _ in range(rounds):
        for c, fn in cands.items():
            times[c].append(do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3)
    ranked = sorted(cands, key=lambda c: statistics.median(times[c]))
    for c in ranked:
        print(f"  {c:32s} do_bench {statistics.median(times[c]):7.2f} µs  (rounds "
              f"{', '.join(f'{t:.2f}' for t in times[c])})", flush=True)
    for c in ["fxfuse stage (autotuned)"] + [c for c in ranked if c.startswith("prefetch")][:3]:
        dev = sum(t for _, t, _ in kernels_after_flush(cands[c]))
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        print(f"  {c:32s} device {dev:7.2f} µs  ({nbytes / dev / 1e6:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
