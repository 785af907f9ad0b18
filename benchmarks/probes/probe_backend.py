"""``torch.compile(model, backend="fxfuse")`` beside ``fxfuse.optimize``, eager and Inductor, on benchmark rows.

The benchmark times ``fxfuse.optimize``; the compile backend's speed was never measured on the rows. In a
transformers Llama decode step (``bench_decode_model.py --compile``) the backend read 2.44 ms per step against
Inductor's 2.07, with the same GPU time: this probe asks where that goes, one MLP at a time.

Per row and variant: GPU µs (do_bench median, L2 flushed), wall µs per call (200 back-to-back calls), rel err
against float64, first-call seconds, and what ran on the GPU (kernel names and launches per call, profiler).

    python3 benchmarks/probes/probe_backend.py [--rows llama_swiglu_m1,gpt2m_mlp_m1,seed_geglu,nerf64] \
        [--reduce-overhead]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import kernels_after_flush, wall_us  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def variants(mod, reduce_overhead: bool = False):
    out = {
        "eager": lambda: mod,
        "compile default": lambda: torch.compile(mod),
        "fxfuse.optimize": lambda: fxfuse.optimize(mod),
        "backend fxfuse": lambda: torch.compile(mod, backend="fxfuse"),
        "backend fxfuse, no inductor": lambda: torch.compile(mod, backend="fxfuse", options={"inductor": False}),
    }
    if reduce_overhead:  # Inductor's CUDA graphs (cudagraph trees) around the whole graph, fxfuse's op included
        out["compile reduce-overhead"] = lambda: torch.compile(mod, mode="reduce-overhead")
        out["backend fxfuse reduce-overhead"] = lambda: torch.compile(mod, backend="fxfuse", mode="reduce-overhead")
    return out


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="llama_swiglu_m1,gpt2m_mlp_m1,seed_geglu,nerf64")
    ap.add_argument("--reduce-overhead", action="store_true", help="also mode='reduce-overhead' (CUDA graphs)")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    for name in args.rows.split(","):
        w = next(w for w in WORKLOADS if w.name == name)
        mod, x = build_module(w), make_input(w)
        xc = make_input(w, seed=5)
        with torch.no_grad():
            ref = mod.double()(xc.double())
            mod = mod.to(w.dtype)
        print(f"== {name}", flush=True)
        built, notes = {}, {}
        for label, make in variants(mod, args.reduce_overhead).items():
            with torch.no_grad():
                start = time.perf_counter()
                m = make()
                for _ in range(3):  # (cudagraph trees record on a later call than the first)
                    m(x)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                out = m(xc).clone()  # (a cudagraph tree's output is overwritten by its next replay)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            built[label] = m
            notes[label] = f"first {first:5.1f} s  rel err {err:.1e}"
        # (timings before any profiler session: one slows every later launch in the process)
        lines = {}
        with torch.no_grad():
            for label, m in built.items():
                fn = lambda m=m, x=x: m(x)  # noqa: E731
                gpu = sorted(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3))[1]
                wall = wall_us(fn) if w.decode else float("nan")
                lines[label] = f"  {label:28s} GPU {gpu:8.1f} µs  wall {wall:7.1f} µs/call  {notes[label]}"
            for label, m in built.items():
                kernels = kernels_after_flush(lambda m=m, x=x: m(x), calls=5)
                names = ", ".join(f"{k[:38]}×{n}" for k, _, n in kernels)
                print(f"{lines[label]}  [{names}]", flush=True)


if __name__ == "__main__":
    main()
