"""The gated training kernels (``FXFUSE_GATED_TRAINING=1``) against eager's pointwise ops, alone and in a step.

For each gated row of ``bench_training.py`` (seed_geglu, llama_swiglu_4096):

1. the middle ``act(g) * u`` alone, do_bench median (L2 flushed): forward, eager's two kernels against
   ``run_gated_forward``; backward, eager's autograd of the middle against ``run_gated_backward``; with the
   bytes each moves at the copy ceiling;
2. a training step of ``fxfuse.optimize(model)``, as shipped (the original ops) and with
   ``FXFUSE_GATED_TRAINING=1`` (the gated kernels), beside eager: do_bench median, the device time of the
   step's kernels (profiler, each step after an L2 flush), host µs per step, peak MiB; and the top kernels of
   each variant.

With ``--host``, instead: host µs per step of the three variants in interleaved rounds, a step of each under
``torch.cuda.set_sync_debug_mode("warn")`` (a synchronizing call would warn), and the cProfile top of the shipped
step.

    python3 benchmarks/probes/probe_gated.py [--only seed_geglu,llama_swiglu_4096] [--m ROWS] [--host]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxfuse  # noqa: E402
import fxfuse.ops  # noqa: E402
from benchmarks.bench_training import _peak_mib, _step  # noqa: E402
from benchmarks.timing import host_us, kernels_after_flush, profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import epilogue as ep  # noqa: E402
from fxfuse.kernels.gated_launch import run_gated_backward, run_gated_forward  # noqa: E402

ACTS = {"seed_geglu": "gelu_tanh", "llama_swiglu_4096": "silu"}
COPY_BPS = 4.23e12


def _workload(name: str):
    return next(w for w in WORKLOADS if w.name == name)


def _bench(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def middle_alone(name: str, m: int, hidden: int, dtype: torch.dtype) -> None:
    act = ep.OPS[ACTS[name]].torch
    g, u, dh = (torch.randn(m, hidden, device="cuda", dtype=dtype) for _ in range(3))
    gr, ur = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    h = act(gr) * ur
    mib = m * hidden * g.element_size()

    def eager_backward():
        torch.autograd.grad(h, (gr, ur), dh, retain_graph=True)

    rows = [("forward eager", _bench(lambda: act(g) * u), 5 * mib),  # act: r g w a; mul: r a u w h
            ("forward kernel", _bench(lambda: run_gated_forward(g, u, ACTS[name])), 3 * mib),
            ("backward eager", _bench(eager_backward), 9 * mib),  # du: r dh a w; da: r dh u w; dg: r da g w
            ("backward kernel", _bench(lambda: run_gated_backward(dh, g, u, ACTS[name])), 5 * mib)]
    print(f"\n{name}: the middle alone, [{m}, {hidden}] {dtype}")
    for label, us, nbytes in rows:
        print(f"  {label:16s} {us:8.1f} µs   {nbytes / 2**20:6.0f} MiB moved, {nbytes / COPY_BPS * 1e6:7.1f} µs "
              f"at the copy ceiling")


def _device_us(run) -> tuple[float, str]:
    """Device µs per step of the step's kernels (each step after an L2 flush) and the top kernels as text."""
    kernels = sorted(kernels_after_flush(run), key=lambda k: -k[1])
    lines = "\n".join(f"      {us:8.1f} µs  x{count:<3d} {name[:90]}" for name, us, count in kernels[:8])
    return sum(us for _, us, _ in kernels), lines


def step_probe(name: str, m, host_only: bool = False) -> None:
    w = _workload(name)
    model = build_module(w).train()
    params = list(model.parameters())
    x = make_input(w, m=m).requires_grad_(True)
    grad_out = torch.randn_like(model(x).detach())
    fast = fxfuse.optimize(model)
    variants = {"eager": _step(model, x, grad_out, params),
                "fxfuse": _step(fast, x, grad_out, params),
                "fxfuse gated": _step(fast, x, grad_out, params, gated_kernels=True)}
    for run in variants.values():  # first calls: tune, mark the region trained
        run(), run()
    torch.cuda.synchronize()
    print(f"\n{name}: training step, x {tuple(x.shape)}")
    if host_only:
        host_probe(variants)
        return
    for label, run in variants.items():
        dev, top = _device_us(run)
        host = host_us(run, 20, 5)
        print(f"  {label:19s} do_bench {_bench(run):7.0f} µs   kernels {dev:7.0f} µs/step   host {host:6.0f} µs/step"
              f"   peak {_peak_mib(run):5.0f} MiB")
        print(top)


def host_probe(variants: dict) -> None:
    rounds: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(3):
        for label, run in variants.items():
            rounds[label].append(host_us(run, 20, 5))
    for label, ts in rounds.items():
        print(f"  {label:19s} host µs/step, 3 rounds: " + " ".join(f"{t:6.0f}" for t in ts))
    for label, run in variants.items():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            import warnings
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"  {label:19s} synchronizing calls in a step: {len(caught)} "
              + "; ".join(str(c.message)[:80] for c in caught[:3]))
    print("  fxfuse gated step, cProfile:\n" + profile_top(variants["fxfuse gated"], calls=50, lines=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(ACTS))
    ap.add_argument("--m", type=int, default=None)
    ap.add_argument("--host", action="store_true", help="host time, synchronizing calls and cProfile only")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in args.only.split(","):
        w = _workload(name)
        rows = args.m or w.m
        hidden = w.dims[1]
        if not args.host:
            middle_alone(name, rows, hidden, w.dtype)
        step_probe(name, args.m, args.host)


if __name__ == "__main__":
    main()
