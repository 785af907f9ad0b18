"""The small-M stage at 2-8 rows: ``tl.dot`` tiles against the register stream (``ONE_ROW`` = the M bucket).

Each config the autotuner would consider (``_prune`` of the GPU list for the stage and M bucket) is launched once
inside a CUDA graph, so the host's speed does not enter, and the graph's replay is timed with ``do_bench`` (L2
flushed before each replay): device µs, median of interleaved rounds. Outputs are checked against float64.

    python3 benchmarks/probes/probe_few_rows.py [--rows 2,4,8] [--rounds 3] [--only gpt2m_fc2,llama_down]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from fxfuse.kernels import run_stage_gemv  # noqa: E402
from fxfuse.kernels.gemv_template import _prune, gpu_gemv_configs  # noqa: E402

# name: (epilogue, linears, bias, K, N)
STAGES = {
    "gpt2m_fc1": ("gelu_tanh(a0)", 1, True, 1024, 4096),
    "gpt2m_fc2": ("a0", 1, True, 4096, 1024),
    "llama_gate_up": ("mul(silu(a0),a1)", 2, False, 4096, 14336),
    "llama_down": ("a0", 1, False, 14336, 4096),
}


def _name(c: triton.Config) -> str:
    kw = c.kwargs
    kind = f"stream{kw['ONE_ROW']}" if kw["ONE_ROW"] else "dot"
    return f"{kind} N{kw['BLOCK_N']} K{kw['BLOCK_K']} split{kw['SPLIT_K']} w{c.num_warps} s{c.num_stages}"


def probe(stage: str, m: int, rounds: int) -> None:
    epilogue, n_lin, bias, k, n = STAGES[stage]
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(n_lin)]
    bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1 if bias else None for _ in range(n_lin)]
    a = [torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(ws, bs)]
    ref = {"gelu_tanh(a0)": lambda: torch.nn.functional.gelu(a[0], approximate="tanh"), "a0": lambda: a[0],
           "mul(silu(a0),a1)": lambda: torch.nn.functional.silu(a[0]) * a[1]}[epilogue]()
    args = {"x_ptr": x, "N": n, "K": k, "M_BUCKET": triton.next_power_of_2(m), **({"w1_ptr": x} if n_lin == 2 else {})}
    graphs, times = {}, {}
    for c in _prune(gpu_gemv_configs(), args):
        try:
            out = run_stage_gemv(x, ws, bs, [], epilogue, config=c)  # compiles, outside the capture
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, err
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_stage_gemv(x, ws, bs, [], epilogue, config=c)
            graphs[_name(c)] = g
            times[_name(c)] = []
        except Exception as e:  # a config that does not compile here is reported, not fatal
            print(f"   {_name(c)}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name].append(triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3)
    ranked = sorted(times, key=lambda s: statistics.median(times[s]))
    best = {kind: next((s for s in ranked if s.startswith(kind)), None) for kind in ("dot", "stream")}
    print(f"== {stage} M={m} (K={k}, N={n}): best dot {best['dot']} "
          f"{statistics.median(times[best['dot']]) if best['dot'] else float('nan'):.2f} µs, best stream "
          f"{best['stream']} {statistics.median(times[best['stream']]) if best['stream'] else float('nan'):.2f} µs")
    for s in ranked[:6]:
        print(f"   {s}: {statistics.median(times[s]):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(STAGES))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for stage in args.only.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            probe(stage, m, args.rounds)


if __name__ == "__main__":
    main()
