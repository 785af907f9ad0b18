"""How fast is the one-launch decode kernel (``fxfuse.kernels.run_decode``) at the decode workloads?

    python3 benchmarks/probes/probe_decode.py [--quick] [--out DIR]

For llama_swiglu m1/m16 and gpt2m_mlp m1/m8 (bf16), prints per row:

* ``do_bench`` median µs (L2 flushed; a few-µs kernel can be host-bound here) of the decode kernel
  (autotuned) with the workspace adds ``acq_rel`` (default) and ``relaxed``, and of eager
  (F.linear + activation + F.linear);
* ``kernel`` µs: the decode kernel's own device time from the profiler (no host cost);
* the floor (weight bytes / 4.23 TB/s) and the achieved GB/s of the kernel time;
* wall µs/call of 200 back-to-back calls (fxfuse vs eager);
* rel. error vs float64 for both semantics, and the autotuner's choice and per-config timings.

``--quick`` autotunes over 4 configs instead of all; either way the whole run stays under ~2 minutes
of GPU time. ``--out DIR`` also writes ``probe_decode.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.timing import wall_us  # noqa: E402
from fxfuse import codegen  # noqa: E402
from fxfuse.kernels import run_decode  # noqa: E402
from fxfuse.kernels.decode_template import gpu_decode_configs  # noqa: E402

COPY_TBPS = 4.23  # measured H200 copy bandwidth (read + write), ../shared/gpu.md
SWIGLU = ("mul(silu(a0),a1)", "a0")
GPT2 = ("gelu_tanh(a0)", "a0")
# name, epilogues, (K, H, N), M, gated, biases
SHAPES = [
    ("llama_swiglu_m1", SWIGLU, (4096, 14336, 4096), 1, True, False),
    ("llama_swiglu_m16", SWIGLU, (4096, 14336, 4096), 16, True, False),
    ("gpt2m_mlp_m1", GPT2, (1024, 4096, 1024), 1, False, True),
    ("gpt2m_mlp_m8", GPT2, (1024, 4096, 1024), 8, False, True),
]


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def kernel_us(fn, name="fused_decode_kernel", n=50) -> float:
    """Mean device time of the kernels called ``name`` over ``n`` calls, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if name in e.name and e.device_time > 0]
    return sum(times) / len(times) if times else float("nan")


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_case(epilogues, dims, m, gated, bias, dtype=torch.bfloat16, dev="cuda"):
    K, H, N = dims
    x = torch.randn(m, K, device=dev, dtype=dtype)
    weights = [torch.randn(H, K, device=dev, dtype=dtype) / K ** 0.5 for _ in range(2 if gated else 1)]
    weights.append(torch.randn(N, H, device=dev, dtype=dtype) / H ** 0.5)
    biases = [torch.randn(w.shape[0], device=dev, dtype=dtype) * 0.1 if bias else None for w in weights]

    def eager():
        if gated:
            h = F.silu(F.linear(x, weights[0])) * F.linear(x, weights[1])
        else:
            h = F.gelu(F.linear(x, weights[0], biases[0]), approximate="tanh")
        return F.linear(h, weights[-1], biases[-1])

    def reference():
        xd, wd = x.double(), [w.double() for w in weights]
        bd = [None if b is None else b.double() for b in biases]
        if gated:
            h = F.silu(F.linear(xd, wd[0])) * F.linear(xd, wd[1])
        else:
            h = F.gelu(F.linear(xd, wd[0], bd[0]), approximate="tanh")
        return F.linear(h, wd[-1], bd[-1])

    def fused(sem):
        return lambda: run_decode(x, weights, biases, [[], []], epilogues, check=False, workspace_sem=sem)

    weight_bytes = sum(t.numel() * t.element_size() for t in weights + [b for b in biases if b is not None])
    return eager, reference, fused, weight_bytes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="autotune over 4 configs instead of all")
    p.add_argument("--out", default=None, help="also write probe_decode.json here")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, quick={args.quick}")
    rows = []
    t_start = time.perf_counter()
    for name, epilogues, dims, m, gated, bias in SHAPES:
        eager, reference, fused, weight_bytes = make_case(epilogues, dims, m, gated, bias)
        kernel = codegen.generated_decode_kernel(2 if gated else 1, *epilogues).fused_decode_kernel
        if args.quick:
            kernel.configs = gpu_decode_configs()[:4]
        t0 = time.perf_counter()
        ref = reference()
        err = {sem: rel_err(fused(sem)(), ref) for sem in ("acq_rel", "relaxed")}  # first call autotunes
        tune_s = time.perf_counter() - t0
        floor = weight_bytes / (COPY_TBPS * 1e12) * 1e6
        row = {
            "name": name, "floor_us": floor, "eager_us": bench_us(eager),
            "fxfuse_us": bench_us(fused("acq_rel")), "fxfuse_relaxed_us": bench_us(fused("relaxed")),
            "kernel_us": kernel_us(fused("acq_rel")), "kernel_relaxed_us": kernel_us(fused("relaxed")),
            "wall_eager_us": wall_us(eager), "wall_fxfuse_us": wall_us(fused("acq_rel")),
            "rel_err": err["acq_rel"], "rel_err_relaxed": err["relaxed"], "first_call_s": tune_s,
            "best_config": str(getattr(kernel, "best_config", "?")),
        }
        row["kernel_GBps"] = weight_bytes / row["kernel_us"] / 1e3
        timings = getattr(kernel, "configs_timings", None) or {}
        row["configs_us"] = sorted(((t[0] if isinstance(t, (list, tuple)) else t) * 1e3, str(c))
                                   for c, t in timings.items())
        rows.append(row)
        print(f"{name:17s} floor {floor:6.1f} | do_bench fxfuse {row['fxfuse_us']:6.1f} (relaxed "
              f"{row['fxfuse_relaxed_us']:6.1f}) eager {row['eager_us']:6.1f} | kernel {row['kernel_us']:6.1f} "
              f"(relaxed {row['kernel_relaxed_us']:6.1f}) = {row['kernel_GBps']:5.0f} GB/s, "
              f"{floor / row['kernel_us']:4.0%} of floor | wall fxfuse {row['wall_fxfuse_us']:5.1f} eager "
              f"{row['wall_eager_us']:5.1f} | rel err {err['acq_rel']:.1e} / {err['relaxed']:.1e} | "
              f"first call {tune_s:4.1f}s", flush=True)
        print(f"    best {row['best_config']}")
        for t, c in row["configs_us"]:
            print(f"      {t:8.1f} us  {c}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_decode.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
