"""Where the host time of a ``torch.compile(model, backend="fxfuse")`` call goes, at GPT-2-medium's MLP, one row
(other rows: the module-level layers only, with each one's do_bench time beside).

``probe_backend.py`` measured the backend's call at ~100 µs of host against ``fxfuse.optimize``'s ~17. Host µs per
call (50 back-to-back calls, best of 20 loops) of each layer, outermost first:

* the compiled module (Dynamo's guards, Inductor's wrapper, the op);
* ``torch.ops.fxfuse.mlp_infer.default`` / ``mlp_extern.default`` called directly (the ops' dispatch around fxfuse's
  runtime: a plain ``Library`` op, a ``custom_op``);
* ``torch.ops.fxfuse.mlp.default`` (the triton_op), ``fxfuse.ops.fused_mlp`` and ``fxfuse.ops._dispatch``;
* the same module compiled with ``options={"inductor": False}`` and ``fxfuse.optimize``'s module;

then a cProfile of the compiled module's calls (top functions by own time), and the CUDA kernels the compiled
module, the compiled module without Inductor and ``fxfuse.optimize``'s module each run (torch.profiler).

    python3 benchmarks/probes/probe_backend_host.py [--row gpt2m_mlp_m1]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, kernels_after_flush, profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import ops  # noqa: E402


def cpu_ops_table(fn, calls: int, rows: int) -> str:
    """torch.profiler's table of the host ops ``fn`` calls, by own CPU time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)


def behind_busy_gpu_us(fn, busy: bool, loops: int = 10) -> float:
    """Best host µs of one call of ``fn`` issued right after a synchronize, with (``busy``) ~2 ms of
    ``torch.cuda._sleep`` queued before it: a call that waits for the GPU reads ~2000 more when busy."""
    import time
    best = float("inf")
    for _ in range(loops):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(4_000_000)  # (cycles: ~2 ms at the H200's ~1.9 GHz)
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="gpt2m_mlp_m1")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    w = next(w for w in WORKLOADS if w.name == args.row)
    mod, x = build_module(w), make_input(w)
    compiled = torch.compile(mod, backend="fxfuse")
    plain = torch.compile(mod, backend="fxfuse", options={"inductor": False})
    fast = fxfuse.optimize(mod)
    layers = {"compiled (backend fxfuse)": lambda: compiled(x)}
    if w.kind == "gpt2":  # (the ops' layers: their arguments spelled out for GPT-2's MLP)
        call_args = (x, [mod.fc.weight, mod.proj.weight], [mod.fc.bias, mod.proj.bias], [],
                     "1b:gelu_tanh(a0);1b:a0")
        layers.update({
            "mlp_infer op": lambda: torch.ops.fxfuse.mlp_infer.default(*call_args),
            "mlp_extern op": lambda: torch.ops.fxfuse.mlp_extern.default(*call_args),
            "mlp triton_op": lambda: torch.ops.fxfuse.mlp.default(*call_args),
            "fused_mlp": lambda: ops.fused_mlp(*call_args),
            "_dispatch": lambda: ops._dispatch(*call_args),
        })
    layers.update({"compiled, inductor off": lambda: plain(x), "fxfuse.optimize": lambda: fast(x)})
    with torch.no_grad():
        for fn in layers.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        for label, fn in layers.items():
            # (5 calls as well as 50: at the large rows 50 calls can fill the launch queue, which then blocks
            # the host at the GPU's pace)
            print(f"  {label:28s} host {host_us(fn):7.1f} µs per call of 50, {host_us(fn, calls=5):7.1f} of 5",
                  flush=True)
        # (does a call wait for the GPU? its host time behind ~2 ms of queued GPU work against behind none)
        for label, fn in layers.items():
            print(f"  {label:28s} host {behind_busy_gpu_us(fn, busy=False):7.1f} µs per call after a sync, "
                  f"{behind_busy_gpu_us(fn, busy=True):7.1f} behind a busy GPU", flush=True)
        # (other rows: is the compiled call's host time above its GPU time? do_bench's median, L2 flushed)
        from triton.testing import do_bench
        for label in ("compiled (backend fxfuse)", "compiled, inductor off", "fxfuse.optimize"):
            gpu = do_bench(layers[label], warmup=25, rep=100, return_mode="median") * 1e3
            print(f"  {label:28s} do_bench {gpu:7.1f} µs", flush=True)
        print(profile_top(layers["compiled (backend fxfuse)"], calls=300, lines=30), flush=True)
        # (what each runs on the GPU, after the timings: a profiler session slows later launches)
        for label in ("compiled (backend fxfuse)", "compiled, inductor off", "fxfuse.optimize"):
            print(f"  {label}: kernels (device µs per call, launches per call), each call after an L2 flush")
            for name, us, count in kernels_after_flush(layers[label]):
                print(f"    {us:8.1f} µs x{count}  {name[:110]}")
        for label in ("compiled (backend fxfuse)", "fxfuse.optimize"):
            print(f"  {label}: host ops by own CPU time (torch.profiler, {20} calls)")
            print(cpu_ops_table(layers[label], calls=20, rows=14), flush=True)


if __name__ == "__main__":
    main()
