"""Host µs per call of each layer of an optimized module's call path, outermost to innermost.

    python3 benchmarks/probes/probe_host.py [--profile | --grad] [names...]     (default: nerf64 gpt2m_mlp_m1 gpt2_mlp)

For each workload: ``opt(x)`` (the module), ``fused_mlp`` (what the graph calls), ``_dispatch`` (checks and the
cached choice), ``_run_kernels`` (the chosen kernels), the replay key, the replay and each of its steps alone, one
``torch.empty`` and eager, each as host time per call of 50 calls issued
back to back (no synchronization inside; the GPU queue never fills at this count), best of 20 loops.
With ``--profile``, also the stage choices and the cProfile top of the module call (by own time).
With ``--grad``, the calls that record gradients instead (inference without ``torch.no_grad()``, and a training
step after the region is marked trained), against eager's, each with its cProfile top.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import ops, replay, stages, strategy  # noqa: E402


def optimized_row(name: str, m: Optional[int] = None) -> tuple:
    """``(module, input, fxfuse.optimize(module) after its first call, the op's arguments for its one region,
    the planner's measurement)`` for a benchmark row (``m`` rows instead of the row's), built without autograd."""
    w = next(w for w in WORKLOADS if w.name == name)
    mod, x = build_module(w), make_input(w, m=m)
    seen, dispatch = [], ops._dispatch

    def spy(*args):  # the region's op arguments, as its first call passes them
        seen.append(args)
        return dispatch(*args)

    with torch.no_grad():
        opt = fxfuse.optimize(mod)
        ops._dispatch = spy
        try:
            opt(x)
        finally:
            ops._dispatch = dispatch
    if not seen:
        raise RuntimeError(f"{name}: the optimized module's first call did not reach fxfuse's op "
                           f"(report: {fxfuse.report(opt)})")
    args = seen[0]
    # The planner's measurement of this region (none where a plain call made no choice)
    m = next((r for r in reversed(strategy.measurements()) if r.spec == args[-1]), None)
    return mod, x, opt, args, m


def probe(name: str, profile: bool = False) -> None:
    mod, x, opt, args, m = optimized_row(name)
    with torch.no_grad():
        chosen = strategy.cached_choice(args)
        row = {"module": host_us(lambda: opt(x)), "fused_mlp": host_us(lambda: ops.fused_mlp(*args)),
               "_dispatch": host_us(lambda: ops._dispatch(*args))}
        if chosen != strategy.ORIGINAL_OPS:
            row["_run_kernels"] = host_us(lambda: ops._run_kernels(*args, chosen))
        key = replay.replay_key(*args)
        row["replay_key"] = host_us(lambda: replay.replay_key(*args))
        run = replay.replays.get(key)
        if run is not None:  # the replay and each of its steps alone
            row["replay"] = host_us(lambda: run(x))
            h = x.reshape(-1, x.shape[-1])
            for i, step in enumerate(replay_steps(run)):
                row[f"step{i}"] = host_us(lambda step=step, h=h: step(h))
                out = step(h)
                row.update(launch_pieces(f"step{i}", step, h, out))
                h = out
        row["torch.empty"] = host_us(lambda: torch.empty_like(x))
        row["eager"] = host_us(lambda: mod(x))
        print(f"{name} ({chosen}): " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) + " us/call (host)")
        if profile:
            print("  stage choices:", stages.stage_choices())
            print(profile_top(lambda: opt(x), lines=25))


def replay_steps(run) -> list:
    """The steps of a replay (:func:`fxfuse.replay._chained`): its ``steps``, its ``first`` and ``second``, or the
    replay itself when it is its one step."""
    names = inspect.getclosurevars(run).nonlocals
    if "steps" in names:
        return list(names["steps"])
    if "first" in names and "second" in names:
        return [names["first"], names["second"]]
    return [run]


def launch_pieces(label: str, step, h, out) -> dict:
    """A bound launch's host µs with a ready output (no allocation), when the step is a small-M bound launch."""
    step_vars = inspect.getclosurevars(step).nonlocals
    bound = step_vars.get("bound")
    if bound is None or "x_block" in step_vars:  # not a bound launch, or a TMA one (its slots are descriptors)
        return {}
    return {f"{label} bound launch": host_us(lambda: bound(h, out))}


def probe_grad(name: str) -> None:
    """Host µs of the calls that record gradients: the forward alone (fused, before any backward), then the
    training step (forward and backward; fused chain backward, or the original ops once marked trained)."""
    mod, x, opt, args, m = optimized_row(name)
    params = list(mod.parameters())
    go = torch.randn_like(mod(x).detach())

    def step(module):
        def run():
            for p in params:
                p.grad = None
            module(x).backward(go)
        return run

    ops._trained.clear()
    ops._walked.clear()
    row = {"forward eager": host_us(lambda: mod(x)), "forward fxfuse": host_us(lambda: opt(x))}
    fwd_profile = profile_top(lambda: opt(x), lines=20)
    step(opt)()  # marks the region trained, or a walk chain walked
    row["step eager"] = host_us(step(mod), calls=20, loops=5)
    row["step fxfuse"] = host_us(step(opt), calls=20, loops=5)
    row["forward fxfuse after backward"] = host_us(lambda: opt(x))
    print(f"{name} (grad; trained={sorted(ops._trained)}, walked={sorted(ops._walked)}): "
          + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) + " us/call (host)")
    if ops._walked:
        walk_pieces(name, args)
    print("  forward fxfuse, untrained:\n" + fwd_profile)
    print("  step fxfuse:\n" + profile_top(step(opt), calls=50, lines=25))


def walk_pieces(name: str, args: tuple) -> None:
    """Host µs of each piece of a walk chain's training step (:mod:`fxfuse.backward`), at the row's M and at
    M/4 (the whole step there, GPU median beside host, for eager and fxfuse)."""
    from triton.testing import do_bench

    from fxfuse import backward
    from fxfuse.kernels import chain_backward_launch as launch
    from fxfuse.kernels.chain_launch import run_chain
    from fxfuse.spec import MLPSpec

    x, weights, biases, _, spec = args
    biases = ops.expand_biases(biases, MLPSpec.loads(spec))
    epilogues = backward._epilogues(spec)
    m, widths = x.shape[0], (x.shape[1], *(w.shape[0] for w in weights))
    dy = torch.randn(m, widths[-1], dtype=x.dtype, device=x.device)
    hidden = [torch.empty(m, d, dtype=x.dtype, device=x.device) for d in widths[1:-1]]
    _, stored = backward.forward_for_walk(spec, x, weights, biases)
    grads = [torch.empty(m, d, dtype=x.dtype, device=x.device) for d in widths[1:-1]]
    with torch.no_grad():
        row = {
            "forward_for_walk": host_us(lambda: backward.forward_for_walk(spec, x, weights, biases)),
            "run_chain storing": host_us(lambda: run_chain(x, weights, biases, [[] for _ in weights], epilogues,
                                                           hidden=hidden)),
            "torch.empty": host_us(lambda: torch.empty(m, widths[1], dtype=x.dtype, device=x.device)),
            "fused_chain_gradients": host_us(lambda: backward.fused_chain_gradients(
                spec, x, weights, biases, dy, need_dx=True, stored=stored)),
            "run_chain_backward": host_us(lambda: launch.run_chain_backward(x, weights, biases, dy, epilogues,
                                                                            saved=stored)),
            "one dW mm": host_us(lambda: torch.mm(grads[0].t(), stored[0])),
        }
    print(f"{name} walk pieces: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) + " us/call (host)")
    mod = build_module(next(w for w in WORKLOADS if w.name == name))
    opt = fxfuse.optimize(mod)
    small = make_input(next(w for w in WORKLOADS if w.name == name), m=m // 4).requires_grad_(True)
    go = torch.randn(m // 4, widths[-1], dtype=x.dtype, device=x.device)
    params = list(mod.parameters())

    def step(module):
        def run():
            for p in params:
                p.grad = None
            small.grad = None
            module(small).backward(go)
        return run

    step(opt)()
    for label, module in (("eager", mod), ("fxfuse", opt)):
        gpu = do_bench(step(module), warmup=25, rep=100, return_mode="median") * 1e3
        print(f"{name} step at M={m // 4} {label}: GPU median {gpu:.0f} us, host {host_us(step(module), 20, 5):.0f}"
              " us/step")


def main() -> None:
    args = sys.argv[1:]
    profile, grad = "--profile" in args, "--grad" in args
    for name in [a for a in args if not a.startswith("--")] or ["nerf64", "gpt2m_mlp_m1", "gpt2_mlp"]:
        probe_grad(name) if grad else probe(name, profile)


if __name__ == "__main__":
    main()
