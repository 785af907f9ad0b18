"""What a TMA stage's activation costs, with the hardware tanh (``FAST_MATH``, bf16) and with the exact forms.

    python3 benchmarks/probes/probe_fast_math.py [--rounds 5] [--shapes 8192x768x3072,4096x4096x14336]

For each gated shape ``MxKxN`` (bf16, two weights of ``[N, K]``), the gated TMA stage is timed with the epilogues
``mul(a0,a1)`` (no activation: the mainloop and the store alone), GeGLU and SwiGLU, each with ``FXFUSE_FAST_MATH``
on and off (``do_bench`` medians, L2 flushed, the variants in alternating order over ``--rounds`` rounds), beside
cuBLAS's two plain GEMMs; each activation's relative error against float64 is printed too. Session 27's H100
figures are in ``benchmarks/NOTES.md``.
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

EPILOGUES = ["mul(a0,a1)", "mul(gelu_tanh(a0),a1)", "mul(silu(a0),a1)"]


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def stage(x, weights, epilogue: str, fast: bool):
    """A call of the stage with FXFUSE_FAST_MATH set as asked (read by the launcher at each first launch)."""
    def run():
        os.environ["FXFUSE_FAST_MATH"] = "1" if fast else "0"
        return run_stage_tma(x, weights, [None, None], [], epilogue, check=False)

    return run


def probe(m: int, k: int, n: int, rounds: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(2)]
    g, u = (x.double() @ w.double().T for w in weights)
    refs = {"mul(gelu_tanh(a0),a1)": F.gelu(g, approximate="tanh") * u, "mul(silu(a0),a1)": F.silu(g) * u}
    fns = {f"{e}{' fast' if fast else ''}": stage(x, weights, e, fast)
           for e in EPILOGUES for fast in ((False, True) if e in refs else (False,))}
    for name, fn in fns.items():
        ref = refs.get(name.removesuffix(" fast"))
        if ref is not None:
            out = fn().double()
            print(f"  {name}: rel err {((out - ref).norm() / ref.norm()).item():.2e}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(bench_us(fns[name]))
    gemms = bench_us(lambda: [x @ w.T for w in weights])
    print(f"M={m} K={k} N={n} (gated, bf16), µs, median of {rounds} rounds; cuBLAS's two plain GEMMs {gemms:.1f}")
    for name, ts in times.items():
        print(f"  {name:28s} {statistics.median(ts):8.1f}   rounds " + " ".join(f"{t:.1f}" for t in ts), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", default="8192x768x3072,4096x4096x14336", help="gated shapes MxKxN, comma-separated")
    a = p.parse_args()
    for shape in a.shapes.split(","):
        probe(*(int(v) for v in shape.split("x")), a.rounds)


if __name__ == "__main__":
    main()
