"""Where the time of a CUDA-graphed call goes (``fxfuse.optimize(m, cuda_graphs=...)``), at decode sizes.

    python3 benchmarks/probes/probe_graphs.py [--pdl-in-capture] [names...]     (default: gpt2m_mlp_m1 gpt2m_mlp_m8)

Per workload, host µs per call (``timing.host_us``) and wall µs per call (``timing.wall_us``, 200 back-to-back
calls) of: eager, a raw ``CUDAGraph.replay`` of eager (the benchmark's CUDA-graph column), fxfuse without graphs,
``cuda_graphs=True`` (outputs cloned) and ``cuda_graphs="static"``; then the pieces of the graphed call path:
the input copy, the output clone, ``replay()`` of fxfuse's own graph, and the Python before the replay; then the
kernels of one replay of each graph (torch.profiler). ``--pdl-in-capture`` lets the small-M kernel keep its
programmatic dependent launch inside the capture (an experiment: fxfuse turns it off there).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import capture_graph, host_us, profile_top, wall_us  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import cudagraphs  # noqa: E402


def probe(name: str) -> None:
    cudagraphs.keep_only_faster = False  # the graphed path itself is probed, kept even where plain calls win
    w = next(w for w in WORKLOADS if w.name == name)
    mod, x = build_module(w), make_input(w)
    rows = {}
    with torch.no_grad():
        g = capture_graph(lambda: mod(x))
        plain = fxfuse.optimize(mod)
        cloned = fxfuse.optimize(mod, cuda_graphs=True)
        static = fxfuse.optimize(mod, cuda_graphs="static")
        for fn in (plain, cloned, static):
            for _ in range(4):
                fn(x)
        variants = {"eager": lambda: mod(x), "eager graph replay": g.replay, "fxfuse": lambda: plain(x),
                    "fxfuse graphs (clone)": lambda: cloned(x), "fxfuse graphs (static)": lambda: static(x)}
        forward = static.forward
        entry = next(e for e in forward._graphs.values() if e is not None)
        out = entry.leaves[0]
        variants.update({
            "  input copy_": lambda: entry.inputs[0].copy_(x),
            "  output clone": lambda: out.clone(),
            "  fxfuse graph replay": entry.graph.replay,
            "  _state + call_key": lambda: cudagraphs.call_key((x,), {}, cudagraphs._state(static)),
            "  parameter watch": lambda: forward._watch.changed(static),
        })
        for label, fn in variants.items():
            rows[label] = (host_us(fn), wall_us(fn))
    print(f"{name}: host us/call, wall us/call (200 back-to-back calls)")
    for label, (h, wl) in rows.items():
        print(f"  {label:>26}: host {h:6.1f}  wall {wl:6.1f}")
    with torch.no_grad():
        print(profile_top(lambda: static(x), lines=20))
        from fxfuse import stages

        print("  stage choices:", stages.stage_choices())
        for label, fn in (("eager graph replay", g.replay), ("fxfuse graph replay", entry.graph.replay)):
            print(f"  kernels of {label} (20 back-to-back replays, µs per replay):")
            print(kernel_table(fn))


def kernel_table(fn, calls: int = 20) -> str:
    """Each CUDA kernel's device µs per call of ``fn`` (torch.profiler), and the span of the calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_kernel: dict[str, float] = {}
    for e in events:
        per_kernel[e.name[:70]] = per_kernel.get(e.name[:70], 0.0) + e.device_time / calls
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / calls
    lines = [f"    {us:6.2f}  {name}" for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines + [f"    {span:6.2f}  span per call (first kernel start to last kernel end)"])


def main() -> None:
    args = sys.argv[1:]
    if "--pdl-in-capture" in args:
        from fxfuse.kernels import gemv_launch

        args.remove("--pdl-in-capture")
        gemv_launch._pdl_supported = lambda x: x.is_cuda and gemv_launch._capability(x.device.index or 0) >= 9
    for name in args or ["gpt2m_mlp_m1", "gpt2m_mlp_m8"]:
        probe(name)


if __name__ == "__main__":
    main()
