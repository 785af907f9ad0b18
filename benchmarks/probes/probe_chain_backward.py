"""Every config of the fused chain backward kernel at a NeRF row, beside eager's backward.

For the nerf64 chain (fp16, M = 2^20, 32 → 64 → 64 → 64 → 16, ReLU) or nerf128's (64 → 128 → 128 → 128 → 64),
times with ``triton.testing.do_bench`` (median, L2 flushed): each config of ``run_chain_backward`` (input
gradient included) on the path the widths get (one kernel, or the walk: ``walks``), at nerf64 the walk's two
leading configs too, the autotuned launch, and eager's backward alone (autograd from the saved activations of
one forward, ``retain_graph``). Prints the FLOPs (forward recomputed + dW + dh) as TFLOP/s, and the gradients'
error against eager's; for the walk, its neighbours (the forward storing every layer's input, the dW GEMMs)
alone; then a training step of ``fxfuse.optimize(model)`` and its profile.

    python3 benchmarks/probes/probe_chain_backward.py [--row nerf64|nerf128] [--m 1048576] [--grid | --quick]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fxfuse.kernels import chain_walk_template as walk  # noqa: E402
from fxfuse.kernels.chain_backward_launch import run_chain_backward  # noqa: E402
from fxfuse.kernels.chain_backward_template import _config, chain_backward_configs, walks  # noqa: E402

ROWS = {"nerf64": (32, 64, 64, 64, 16), "nerf128": (64, 128, 128, 128, 64)}
EPILOGUES = ("relu(a0)", "relu(a0)", "relu(a0)", "a0")
# --grid: block shapes beyond the shipped configs, of the one-kernel backward and of the walk.
GRID = [(128, 4, 1, True), (64, 8, 1, True), (64, 8, 1, False), (128, 4, 1, False), (64, 4, 3, True),
        (32, 4, 4, True), (128, 8, 2, True)]
WALK_GRID = [(64, 4, 2, False, 2), (64, 4, 3, False), (32, 4, 4, False), (32, 4, 4, False, 2), (32, 4, 6, False, 2),
             (64, 8, 2, False), (64, 8, 1, False, 2), (128, 4, 1, False), (32, 2, 8, False), (16, 4, 8, False, 2)]


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", choices=sorted(ROWS), default="nerf64")
    ap.add_argument("--m", type=int, default=1 << 20)
    ap.add_argument("--grid", action="store_true", help="time GRID's configs too")
    ap.add_argument("--quick", action="store_true", help="the autotuned launch only, then the training step")
    args = ap.parse_args()
    WIDTHS = ROWS[args.row]
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).cuda().half()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    ws, bs = [m.weight.detach() for m in linears], [m.bias.detach() for m in linears]
    x = torch.randn(args.m, WIDTHS[0], device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.randn(args.m, WIDTHS[-1], device="cuda", dtype=torch.float16)
    out = model(x)
    out.backward(dy, retain_graph=True)
    ref = [x.grad.clone()] + [p.grad.clone() for m in linears for p in (m.weight, m.bias)]

    def eager_backward():
        x.grad = None
        model.zero_grad(set_to_none=True)
        out.backward(dy, retain_graph=True)

    macs = sum(a * b for a, b in zip(WIDTHS, WIDTHS[1:]))
    flops = 2 * args.m * (3 * macs - WIDTHS[-2] * WIDTHS[-1])  # the last (identity) layer is not recomputed
    print(f"{args.row} backward, M={args.m}: {flops / 1e9:.1f} GFLOP in the fused kernel", flush=True)
    eager_us = do_bench(eager_backward, warmup=25, rep=100, return_mode="median") * 1e3
    print(f"  eager backward (autograd, saved activations): {eager_us:8.1f} µs", flush=True)
    logging.basicConfig(format="    %(message)s")
    logging.getLogger("fxfuse.kernels.tuning").setLevel(logging.INFO)  # the autotuner's pick
    def label(c, use_walk):
        kw = c.kwargs
        stages = f" s{kw['LOOP_STAGES']}" if "LOOP_STAGES" in kw else ""
        return (f"{'walk' if use_walk else 'one kernel'} BLOCK_M {kw['BLOCK_M']} w{c.num_warps} {kw['PER_SM']}/SM"
                f"{' reload' if kw['RELOAD_WEIGHTS'] else ''}{stages}")

    def configs(use_walk, grid=False):
        if use_walk:
            return [walk._config(*g) for g in WALK_GRID] if grid else walk.chain_walk_configs()
        return [_config(*g) for g in GRID] if grid else chain_backward_configs()

    shipped = walks(WIDTHS)
    variants = [] if args.quick else [(label(c, shipped), c, shipped) for c in configs(shipped)]
    if args.grid:
        variants += [(label(c, shipped), c, shipped) for c in configs(shipped, grid=True)]
    if not args.quick and not shipped:  # nerf128's gradients do not fit the one kernel's registers
        variants += [(label(c, True), c, True) for c in configs(True)[:2]]
    variants.append((f"autotuned, {'walk' if shipped else 'one kernel'}", None, shipped))
    for name, config, use_walk in variants:
        try:
            fn = lambda config=config, use_walk=use_walk: run_chain_backward(  # noqa: E731
                x.detach(), ws, bs, dy, EPILOGUES, config=config, walk=use_walk)
            logging.getLogger("fxfuse.kernels.chain_backward_launch").setLevel(logging.DEBUG)  # registers, spills
            dx, gw, gb = fn()
            logging.getLogger("fxfuse.kernels.chain_backward_launch").setLevel(logging.INFO)
            got = [dx] + [g for pair in zip(gw, gb) for g in pair]
            err = max(((g.double() - r.double()).norm() / r.double().norm()).item() for g, r in zip(got, ref))
            us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            print(f"  fused {name:40s} {us:8.1f} µs  {flops / us / 1e6:6.1f} TFLOP/s  {eager_us / us:5.2f}x eager  "
                  f"max grad rel err vs eager {err:.1e}", flush=True)
        except Exception as e:
            print(f"  fused {name:40s} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
    from fxfuse import codegen

    tuner = (codegen.generated_chain_walk_kernel(EPILOGUES).chain_backward_walk_kernel if shipped
             else codegen.generated_chain_backward_kernel(EPILOGUES).fused_chain_backward_kernel)
    for c, t in (getattr(tuner, "configs_timings", None) or {}).items():
        print(f"    autotuner timed {label(c, shipped)}: {t}")
    if shipped:  # the walk's neighbours: the forward storing every layer's input, and the dW GEMMs
        from fxfuse.kernels.chain_launch import run_chain

        hidden = [torch.empty(args.m, d, device="cuda", dtype=torch.float16) for d in WIDTHS[1:-1]]
        inputs = [x.detach(), *hidden]
        grads = [torch.randn(args.m, d, device="cuda", dtype=torch.float16) for d in WIDTHS[1:]]
        parts = {"forward alone": lambda: run_chain(x.detach(), ws, bs, [[]] * len(ws), EPILOGUES),
                 "forward storing h_i": lambda: run_chain(x.detach(), ws, bs, [[]] * len(ws), EPILOGUES,
                                                          hidden=hidden),
                 "dW GEMMs": lambda: [torch.mm(g.t(), h) for g, h in zip(grads, inputs)]}
        for name, fn in parts.items():
            print(f"  {name:32s} {do_bench(fn, warmup=25, rep=100, return_mode='median') * 1e3:8.1f} µs", flush=True)
    # The same inside a training step of fxfuse.optimize(model): the op's forward, then its fused backward.
    import fxfuse

    fast = fxfuse.optimize(model)
    xs = x.detach().requires_grad_()

    def forward():
        return fast(xs)

    def step():
        xs.grad = None
        model.zero_grad(set_to_none=True)
        fast(xs).backward(dy)

    step()
    for label, fn in (("fxfuse grad-recording forward", forward), ("fxfuse training step", step)):
        print(f"  {label:32s} {do_bench(fn, warmup=25, rep=100, return_mode='median') * 1e3:8.1f} µs", flush=True)
    from benchmarks.timing import host_us, profile_top

    print(f"  host µs per training step: {host_us(step, calls=20, loops=5):.1f}; cProfile of 50 steps:")
    print(profile_top(step, 50, 25)[-5000:])
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print("  where a training step's time goes (5 steps):")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
