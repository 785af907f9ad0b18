"""Two GEMM stages back to back against the sum of each alone: where a compute-bound region's extra µs come from.

    python3 benchmarks/probes/probe_pair_gap.py [--rounds 5]

Session 47's planner log read gpt2_mlp's region at 125.1 µs against 120.1 for its two stages timed alone (fc1 on
the TMA kernel 66.7, fc2 on cuBLAS 53.4), and seed_geglu's at 169.2 against 168.5. For gpt2's and seed's shapes
(bf16, M=8192), each of these is timed alone and as a pair (``do_bench`` medians, L2 flushed as do_bench does, the
variants in alternating order over ``--rounds`` rounds): cuBLAS's plain GEMMs (``torch.mm`` into preallocated
outputs), F.linear with bias, cuBLASLt's bias+GELU, fxfuse's TMA stage, and each pair as the region runs it. A pair
slower than its parts by the same µs for cuBLAS's GEMMs as for fxfuse's stages is the GPU's (clock, L2 write-back
of h), not the stage kernels'.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.kernels import run_stage_tma  # noqa: E402


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def variants(m: int, d: int, h: int, gated: bool) -> dict:
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, d, **kw)
    w1 = [torch.randn(h, d, **kw) * d**-0.5 for _ in range(2 if gated else 1)]
    w2 = torch.randn(d, h, **kw) * h**-0.5
    b1 = None if gated else torch.randn(h, **kw)
    b2 = None if gated else torch.randn(d, **kw)
    hid, out = torch.empty(m, h, **kw), torch.empty(m, d, **kw)
    epi = "mul(gelu_tanh(a0),a1)" if gated else "gelu_tanh(a0)"

    def mm1():
        for w in w1:
            torch.mm(x, w.t(), out=hid)
        return hid

    def mm2(a=None):
        return torch.mm(hid if a is None else a, w2.t(), out=out)

    def tma1():
        return run_stage_tma(x, w1, [b1] * len(w1), [], epi, check=False)

    def lin2(a=None):
        return F.linear(hid if a is None else a, w2, b2)

    v = {"mm fc1": mm1, "mm fc2": mm2, "mm pair": lambda: mm2(mm1()),
         "tma fc1": tma1, "linear fc2": lin2, "tma+linear pair": lambda: lin2(tma1())}
    if not gated:
        def lt1():
            return torch._addmm_activation(b1, x, w1[0].t(), use_gelu=True)
        v.update({"cublaslt fc1": lt1, "cublaslt+linear pair": lambda: lin2(lt1())})
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for name, gated in (("gpt2_mlp", False), ("seed_geglu", True)):
        v = variants(8192, 768, 3072, gated)
        for fn in v.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in v}
        for r in range(args.rounds):
            for k in (list(v) if r % 2 == 0 else list(v)[::-1]):
                times[k].append(bench_us(v[k]))
        med = {k: statistics.median(t) for k, t in times.items()}
        print(f"== {name} (M=8192, 768 -> 3072 -> 768, bf16), µs, median of {args.rounds} rounds", flush=True)
        for k, t in med.items():
            print(f"   {k:24s} {t:7.1f}   rounds " + " ".join(f"{x:.1f}" for x in times[k]), flush=True)
        for first, second, pair in (("mm fc1", "mm fc2", "mm pair"), ("tma fc1", "linear fc2", "tma+linear pair"),
                                    ("cublaslt fc1", "linear fc2", "cublaslt+linear pair")):
            if pair in med:
                print(f"   {pair}: {med[pair]:.1f} against {med[first]:.1f} + {med[second]:.1f} = "
                      f"{med[first] + med[second]:.1f} ({med[pair] - med[first] - med[second]:+.1f})", flush=True)


if __name__ == "__main__":
    main()
