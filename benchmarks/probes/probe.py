"""Where does fxfuse's time go? Host overhead of the forward path and per-stage kernel speed vs cuBLAS.

    python3 benchmarks/probes/probe.py --out DIR

1. Host path: wall µs/call of 200 back-to-back calls (eager vs fxfuse) and the GPU-only time of the same
   call replayed from a CUDA graph (no host cost), plus a cProfile of the fxfuse forward (top functions).
   Graphs: gpt2m_mlp_m1 wall µs/call with ``optimize(cuda_graphs=True / "static")`` beside the above
   (``--sections graphs`` runs only this).
2. Kernels: each stage of the large-M workloads through ``run_stage`` vs the eager ops (cuBLAS GEMM +
   pointwise), with the autotuner's timing of every config it tried.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import capture_graph, profile_top, wall_us  # noqa: E402
from fxfuse.kernels import run_stage  # noqa: E402


def graph_us(fn, x, n=50):
    g = capture_graph(partial(fn, x), calls=n)
    from triton.testing import do_bench

    return do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3 / n


def bench_us(fn, *args):
    from triton.testing import do_bench

    return do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median") * 1e3


class MLP(torch.nn.Module):
    def __init__(self, d, h, bias=True, act="gelu_tanh", gated=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h, bias=bias)
        self.up = torch.nn.Linear(d, h, bias=bias) if gated else None
        self.fc2 = torch.nn.Linear(h, d, bias=bias)
        self.act = act

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else F.silu(h)
        if self.up is not None:
            h = h * self.up(x)
        return self.fc2(h)


def host_section(out):
    dt = torch.bfloat16
    for name, mod, m in [("gpt2m_m1", MLP(1024, 4096), 1), ("swiglu_m16", MLP(4096, 14336, False, "silu", True), 16),
                         ("gpt2_8192", MLP(768, 3072), 8192)]:
        mod = mod.cuda().to(dt).eval()
        x = torch.randn(m, mod.fc1.in_features, device="cuda", dtype=dt)
        opt = fxfuse.optimize(mod, example_inputs=(x,))
        opt(x)
        line = (f"{name}: wall/call eager {wall_us(partial(mod, x)):.1f} us, "
                f"fxfuse {wall_us(partial(opt, x)):.1f} us | "
                f"graph-replay GPU eager {graph_us(mod, x):.1f} us, fxfuse {graph_us(opt, x):.1f} us | "
                f"do_bench eager {bench_us(mod, x):.1f}, fxfuse {bench_us(opt, x):.1f}")
        print(line)
        out.write(line + "\n")
        if m == 1:
            out.write(profile_top(partial(opt, x), calls=300, lines=30))
            out.write(profile_top(partial(opt, x), calls=300, lines=40, sort="cumtime"))


def cuda_graphs_section(out):
    """gpt2m_mlp_m1 (1024→4096→1024 bf16, M=1): wall µs/call with ``optimize(cuda_graphs=...)`` vs without, eager
    and eager replayed from a CUDA graph (no host cost but the launch)."""
    from fxfuse import cudagraphs

    cudagraphs.keep_only_faster = False  # the graphed path itself is measured, kept even where plain calls win
    dt = torch.bfloat16
    mod = MLP(1024, 4096).cuda().to(dt).eval()
    x = torch.randn(1, 1024, device="cuda", dtype=dt)
    variants = {"eager": mod, "fxfuse": fxfuse.optimize(mod, example_inputs=(x,)),
                "fxfuse cuda_graphs=True": fxfuse.optimize(mod, example_inputs=(x,), cuda_graphs=True),
                "fxfuse cuda_graphs='static'": fxfuse.optimize(mod, example_inputs=(x,), cuda_graphs="static")}
    walls = {name: wall_us(lambda fn=fn: fn(x)) for name, fn in variants.items()}
    g = capture_graph(partial(mod, x))
    walls["eager CUDA-graph replay"] = wall_us(g.replay)
    line = "gpt2m_mlp_m1 wall us/call (200 calls, best of 5): " + ", ".join(f"{k} {v:.1f}" for k, v in walls.items())
    print(line)
    out.write(line + "\n")


def kernel_section(out):
    dt = torch.bfloat16
    cases = [
        # (name, M, K, N, gated, epilogue, bias)
        ("gpt2 fc1+gelu", 8192, 768, 3072, False, "gelu_tanh(a0)", True),
        ("gpt2 fc2", 8192, 3072, 768, False, "a0", True),
        ("geglu gate/up", 8192, 768, 3072, True, "mul(a0,gelu_tanh(a1))", False),
        ("geglu down", 8192, 3072, 768, False, "a0", False),
        ("llama gate/up", 4096, 4096, 14336, True, "mul(a0,silu(a1))", False),
        ("llama down", 4096, 14336, 4096, False, "a0", False),
        ("gpt2m m1 fc1", 1, 1024, 4096, False, "gelu_tanh(a0)", True),
        ("llama m16 gate/up", 16, 4096, 14336, True, "mul(a0,silu(a1))", False),
    ]
    from fxfuse import codegen
    from fxfuse.epilogue import evaluate, parse

    for name, m, k, n, gated, epi, bias in cases:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k**0.5 for _ in range(2 if gated else 1)]
        bs = [torch.randn(n, device="cuda", dtype=dt) if bias else None for _ in ws]
        expr = parse(epi)

        def fused(x, ws, bs, epi):
            return run_stage(x, ws, bs, [], epi)

        def eager(x, ws, bs, expr):
            return evaluate(expr, [F.linear(x, w, b) for w, b in zip(ws, bs)], [])

        fused(x, ws, bs, epi)
        tf, te = bench_us(fused, x, ws, bs, epi), bench_us(eager, x, ws, bs, expr)
        kern = codegen.generated_kernel(len(ws), epi).fused_stage_kernel
        flops = 2 * m * k * n * len(ws)
        line = (f"{name:18s} M={m} K={k} N={n}: fxfuse {tf:8.1f} us ({flops / tf / 1e6:5.0f} TFLOP/s), "
                f"eager {te:8.1f} us ({flops / te / 1e6:5.0f}) best={getattr(kern, 'best_config', '?')}")
        print(line)
        out.write(line + "\n")
        for cfg, t in sorted(getattr(kern, "configs_timings", {}).items(), key=lambda kv: kv[1]):
            out.write(f"     {t[0] * 1e3 if isinstance(t, list) else t * 1e3:8.1f} us  {cfg}\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/probe")
    p.add_argument("--sections", default="host,graphs,kernels", help="comma-separated: host, graphs, kernels")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_grad_enabled(False)
    sections = {"host": host_section, "graphs": cuda_graphs_section, "kernels": kernel_section}
    with open(os.path.join(args.out, "probe.txt"), "w") as out:
        for name in args.sections.split(","):
            sections[name](out)


if __name__ == "__main__":
    main()
