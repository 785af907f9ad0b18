"""The Hopper TMA stage kernel vs the pointer stage kernel vs cuBLAS, stage by stage, on the large-M workloads.

    python3 benchmarks/probes/probe_tma.py --out DIR [--quick]

For each stage (GPT-2 fc1/fc2, seed GeGLU gate+up/down, Llama SwiGLU gate+up/down at M=4096), bf16: GPU
median µs (``triton.testing.do_bench``, L2 flushed) of ``run_stage_tma`` (autotuned), ``run_stage`` (autotuned)
and cuBLAS (``F.linear`` + the eager epilogue), TFLOP/s, relative error vs float64, the TMA config that won and
the autotuner's timing of every TMA config it tried, and the TMA kernel's time replayed from a CUDA graph (no
host overhead; do_bench flushes L2 between calls, the graph replays back to back without); then per-workload
totals against the targets.
``--quick`` gives each autotuner only three configs (about a minute of GPU time instead of three).
Writes ``DIR/probe_tma.txt`` and ``DIR/probe_tma.json``.
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

from benchmarks.timing import capture_graph  # noqa: E402
from fxfuse import codegen  # noqa: E402
from fxfuse.epilogue import evaluate, parse  # noqa: E402
from fxfuse.kernels import run_stage, run_stage_tma, tma_supported, tma_template  # noqa: E402
from fxfuse.kernels import template as ptr_template  # noqa: E402

# (workload, stage, M, K, N, gated, epilogue, bias)
CASES = [
    ("gpt2_mlp", "fc1", 8192, 768, 3072, False, "gelu_tanh(a0)", True),
    ("gpt2_mlp", "fc2", 8192, 3072, 768, False, "a0", True),
    ("seed_geglu", "gate/up", 8192, 768, 3072, True, "mul(gelu_tanh(a0),a1)", False),
    ("seed_geglu", "down", 8192, 3072, 768, False, "a0", False),
    ("llama_swiglu_4096", "gate/up", 4096, 4096, 14336, True, "mul(silu(a0),a1)", False),
    ("llama_swiglu_4096", "down", 4096, 14336, 4096, False, "a0", False),
]
TARGETS_US = {"gpt2_mlp": 118, "seed_geglu": 180, "llama_swiglu_4096": 1900}


def bench_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn, n=20) -> float:
    """GPU time per call of ``fn`` replayed from a CUDA graph: the kernel alone, without host overhead."""
    from triton.testing import do_bench

    graph = capture_graph(fn, calls=n)
    return do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3 / n


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def timings(kernel) -> list[tuple[float, str]]:
    """(µs, config) of every config the autotuner timed for the last key, fastest first."""
    found = (getattr(kernel, "configs_timings", None) or {}).items()
    return sorted(((t[0] if isinstance(t, (list, tuple)) else t) * 1e3, str(cfg)) for cfg, t in found)


def run_case(case, dtype) -> dict:
    workload, stage, m, k, n, gated, epi, bias = case
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(2 if gated else 1)]
    bs = [(torch.randn(n, device="cuda") * 0.5).to(dtype) if bias else None for _ in ws]
    expr = parse(epi)

    def cublas():
        return evaluate(expr, [F.linear(x, w, b) for w, b in zip(ws, bs)], [])

    t0 = time.perf_counter()
    out_tma = run_stage_tma(x, ws, bs, [], epi)  # autotunes
    tune_s = time.perf_counter() - t0
    if out_tma is None:
        raise RuntimeError(f"run_stage_tma did not apply to {workload} {stage}")
    out_ptr = run_stage(x, ws, bs, [], epi)
    ref = evaluate(expr, [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(ws, bs)],
                   [])
    tma_kernel = codegen.generated_tma_kernel(len(ws), epi).fused_stage_tma_kernel
    row = {
        "workload": workload, "stage": stage, "M": m, "K": k, "N": n, "gated": gated, "epilogue": epi,
        "tma_us": bench_us(lambda: run_stage_tma(x, ws, bs, [], epi, check=False)),
        "run_stage_us": bench_us(lambda: run_stage(x, ws, bs, [], epi, check=False)),
        "cublas_us": bench_us(cublas),
        "tma_graph_us": graph_us(lambda: run_stage_tma(x, ws, bs, [], epi, check=False)),
        "tma_rel_err": rel_err(out_tma, ref), "run_stage_rel_err": rel_err(out_ptr, ref),
        "cublas_rel_err": rel_err(cublas(), ref),
        "tma_best_config": str(getattr(tma_kernel, "best_config", "?")),
        "tma_tune_s": tune_s,
        "tma_config_timings": timings(tma_kernel),
    }
    flops = 2 * m * k * n * len(ws)
    for name in ("tma", "run_stage", "cublas"):
        row[f"{name}_tflops"] = flops / row[f"{name}_us"] / 1e6
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/probe_tma")
    p.add_argument("--quick", action="store_true", help="three configs per autotuner instead of all")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not tma_supported("cuda"):
        sys.exit("needs a Hopper (sm_90+) GPU and a Triton with TensorDescriptor")
    os.environ["FXFUSE_AUTOTUNE"] = "1"
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    if args.quick:
        for num_linears, epi in {(2 if c[5] else 1, c[6]) for c in CASES}:
            codegen.generated_tma_kernel(num_linears, epi).fused_stage_tma_kernel.configs = \
                tma_template.gpu_configs(quick=True)
            codegen.generated_kernel(num_linears, epi).fused_stage_kernel.configs = ptr_template.gpu_configs()[:3]

    lines, rows = [], []

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__} "
        f"quick={args.quick}")
    say(f"{'workload':18s} {'stage':8s} {'M':>5s} {'K':>6s} {'N':>6s} | {'TMA us':>8s} {'TF/s':>5s} | "
        f"{'ptr us':>8s} {'TF/s':>5s} | {'cuBLAS us':>9s} {'TF/s':>5s} | {'TMA/cuBLAS':>10s} | {'TMA graph':>9s} | "
        "rel err TMA | best")
    for case in CASES:
        r = run_case(case, torch.bfloat16)
        rows.append(r)
        say(f"{r['workload']:18s} {r['stage']:8s} {r['M']:5d} {r['K']:6d} {r['N']:6d} | {r['tma_us']:8.1f} "
            f"{r['tma_tflops']:5.0f} | {r['run_stage_us']:8.1f} {r['run_stage_tflops']:5.0f} | {r['cublas_us']:9.1f} "
            f"{r['cublas_tflops']:5.0f} | {r['cublas_us'] / r['tma_us']:9.2f}x | {r['tma_graph_us']:9.1f} | "
            f"{r['tma_rel_err']:.1e} | "
            f"{r['tma_best_config']} (tuned in {r['tma_tune_s']:.1f} s)")
        for us, cfg in r["tma_config_timings"]:
            lines.append(f"      {us:9.1f} us  {cfg}")
    say()
    for workload, target in TARGETS_US.items():
        sel = [r for r in rows if r["workload"] == workload]
        tot = {name: sum(r[f"{name}_us"] for r in sel) for name in ("tma", "run_stage", "cublas")}
        say(f"{workload:18s} total: TMA {tot['tma']:7.1f} us, run_stage {tot['run_stage']:7.1f}, "
            f"cuBLAS+eager {tot['cublas']:7.1f} | target <= {target} -> {'meets' if tot['tma'] <= target else 'no'}")
    with open(os.path.join(args.out, "probe_tma.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "probe_tma.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
