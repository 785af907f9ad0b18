"""What torch.compile max-autotune runs for the decode rows, kernel by kernel, beside fxfuse.

In the 07:36 benchmark max-autotune took llama_swiglu_m1 to 95.3 µs where fxfuse's two small-M launches took
103. This probe compiles each row with ``mode="max-autotune-no-cudagraphs"``, times it and fxfuse with do_bench
(L2 flushed), lists every kernel of one call after do_bench's flush with its device time (torch.profiler, mean
of 10 calls), and prints Inductor's generated code for the row, so its kernels can be read.

    python3 benchmarks/probes/probe_inductor_decode.py [--rows llama_swiglu_m1,llama_swiglu_m16] [--code]
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path

import torch
import torch._inductor.codecache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxfuse  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def kernels_after_flush(fn, calls: int = 10) -> list[tuple[str, float]]:
    """(kernel name, mean device µs per call) for ``fn`` run after a 256 MB zero fill, as do_bench does."""
    from torch.profiler import ProfilerActivity, profile

    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "fill" not in e.name.lower():
            total[e.name] += e.device_time / calls
    return sorted(total.items(), key=lambda kv: -kv[1])


def inductor_configs(modules) -> dict[str, dict]:
    """Inductor's autotuned config of each generated Triton kernel (its launcher after the first call), printed."""
    out = {}
    for mod in modules:
        for name in dir(mod):
            launchers = getattr(getattr(mod, name), "launchers", None)
            if name.startswith("triton_") and launchers:
                c = launchers[0].config
                out[name] = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                print(f"    inductor config {name}: {out[name]}")
    return out


def same_tiles(model, x, configs) -> None:
    """fxfuse's ONE_ROW gate+up kernel with the tile Inductor chose for its gate+up reduction, timed the same way."""
    import triton

    from fxfuse.kernels import run_stage_gemv

    cfg = next((c for n, c in configs.items() if "mm_t_0" in n), None)
    if cfg is None:
        return
    ws = [model.gate.weight, model.up.weight]
    for stages in sorted({1, cfg.get("num_stages", 1)}):
        c = triton.Config({"BLOCK_N": cfg["XBLOCK"], "BLOCK_K": cfg.get("R0_BLOCK", cfg.get("RBLOCK")), "SPLIT_K": 1,
                           "ONE_ROW": 1}, num_warps=cfg["num_warps"], num_stages=stages)
        fn = functools.partial(run_stage_gemv, x, ws, [None, None], [], "mul(silu(a0),a1)", config=c)
        for kname, t in kernels_after_flush(fn):
            print(f"    fxfuse ONE_ROW with Inductor's tile ({c}): {t:7.1f} µs  {kname[:60]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="llama_swiglu_m1,llama_swiglu_m16")
    ap.add_argument("--code", action="store_true", help="print Inductor's generated code")
    args = ap.parse_args()
    from triton.testing import do_bench

    for w in WORKLOADS:
        if w.name not in args.rows.split(","):
            continue
        model, x = build_module(w), make_input(w)
        with torch.no_grad():
            before = {id(m) for m in torch._inductor.codecache.PyCodeCache.modules}
            compiled = torch.compile(model, mode="max-autotune-no-cudagraphs")
            compiled(x)
            new_code = [m for m in torch._inductor.codecache.PyCodeCache.modules if id(m) not in before]
            fast = fxfuse.optimize(model)
            fast(x)
            for name, mod in (("eager", model), ("max-autotune", compiled), ("fxfuse", fast)):
                fn = functools.partial(mod, x)
                us = [do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3)]
                print(f"{w.name} {name}: do_bench {sorted(us)[1]:.1f} µs (rounds {', '.join(f'{u:.1f}' for u in us)})")
                for kname, t in kernels_after_flush(fn):
                    print(f"    {t:7.1f} µs  {kname[:140]}")
        configs = inductor_configs(new_code)
        if w.kind == "swiglu" and w.m == 1:
            same_tiles(model, x, configs)
        if args.code:
            for mod in new_code:
                path = getattr(mod, "__file__", None)
                if path and Path(path).exists():
                    print(f"---- {w.name}: {path}")
                    print(Path(path).read_text())
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
