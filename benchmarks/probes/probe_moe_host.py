"""Host time of the MoE experts' calls: the lean launcher against Triton's own launch path, in one process.

For each family (``benchmarks/bench_moe.py``'s shapes), at one token: wall and host µs per call of eager
(transformers' grouped_mm), the optimized module's installed forward and ``run_moe`` alone, each also with every MoE
launch through ``kernel[grid](**args)`` (the launcher swapped out); ``--train``: the wall µs of a training step at 16
tokens (``--train-tokens``) both ways, in interleaved rounds; ``--profile``: a cProfile of the installed forward (the
first family), with ``--train`` of the training step beside its wall, host and GPU time (and eager's), and the
torch ops' host time (torch.profiler, CPU).

    python3 benchmarks/probes/probe_moe_host.py [--families gpt_oss,qwen3_moe] [--train [--train-tokens 512]]
        [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.bench_moe import build, routing  # noqa: E402
from benchmarks.timing import host_us, wall_us  # noqa: E402
from fxfuse.kernels import moe_backward_launch, moe_launch  # noqa: E402
from fxfuse.kernels.moe_launch import run_moe  # noqa: E402
from fxfuse.moe import experts_form  # noqa: E402

LEAN = moe_launch.launch


def triton_path(kernel, grid, args, varying=()):
    kernel[grid](**args)


def launching(launcher, fn):
    """``fn`` with every MoE launch through ``launcher``."""
    def run():
        moe_launch.launch = moe_backward_launch.launch = launcher
        try:
            return fn()
        finally:
            moe_launch.launch = moe_backward_launch.launch = LEAN
    return run


def forward_rows(family: str, profile: bool) -> None:
    module, _, top_k = build(family, "cuda", False)
    fast = fxfuse.optimize(module)
    x, index, weights = routing(1, len(module.gate_up_proj), top_k, module.config.hidden_size, "cuda", 0)
    form = experts_form(module)
    biases = dict(gate_up_bias=module._parameters.get("gate_up_proj_bias"),
                  down_bias=module._parameters.get("down_proj_bias"))

    def kernels():
        return run_moe(x, index, weights, module.gate_up_proj, module.down_proj, form, **biases)

    with torch.no_grad():
        fast(x, index, weights)  # (its first call: the check and the bucket's timing)
        fns = {"eager": lambda: module(x, index, weights), "installed": lambda: fast(x, index, weights),
               "run_moe": kernels, "installed, Triton's launch path": launching(triton_path,
                                                                                lambda: fast(x, index, weights)),
               "run_moe, Triton's launch path": launching(triton_path, kernels)}
        for name, fn in [*fns.items()] * 2:  # (two rounds)
            print(f"{family} T=1 {name}: wall {wall_us(fn):.1f} us/call, host {host_us(fn, calls=20, loops=5):.1f}"
                  " us/call", flush=True)
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fast(x, index, weights)
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())


def train_row(family: str, tokens: int, profile: bool) -> None:
    module, _, top_k = build(family, "cuda", False)
    fast = fxfuse.optimize(module).train()
    x, index, weights = routing(tokens, len(module.gate_up_proj), top_k, module.config.hidden_size, "cuda", 0)
    x.requires_grad_()
    weights.requires_grad_()
    dout = torch.randn_like(x)
    inputs = [x, weights, *module.parameters()]

    def step():
        return torch.autograd.grad(fast(x, index, weights), inputs, dout)

    def eager_step():
        return torch.autograd.grad(module(x, index, weights), inputs, dout)

    step()
    launchers = {"lean": LEAN, "Triton's launch path": triton_path}
    times = {name: [] for name in launchers}
    hosts = {name: [] for name in launchers}
    for _ in range(3):
        for name, launcher in launchers.items():
            times[name].append(wall_us(launching(launcher, step), calls=20))
            hosts[name].append(host_us(launching(launcher, step), calls=5, loops=5))
    print(f"{family} T={tokens} training step host us/call (no sync inside): "
          + ", ".join(f"{name} {[round(t) for t in ts]}" for name, ts in hosts.items()), flush=True)
    print(f"{family} T={tokens} training step wall us/call: "
          + ", ".join(f"{name} {[round(t) for t in ts]}" for name, ts in times.items()), flush=True)
    if not profile:
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in (("fxfuse", step), ("eager", eager_step)):
        fn()
        print(f"{family} T={tokens} {name} step: wall {wall_us(fn, calls=20):.0f} us, host (no sync inside) "
              f"{host_us(fn, calls=5, loops=5):.0f} us", flush=True)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        gpu = sum(e.device_time_total for e in prof.key_averages()) / 10
        print(f"   its kernels: {gpu:.0f} us of GPU time per step", flush=True)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:  # where the fxfuse step's host time goes
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
          flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(30)
        print(text.getvalue()[-9000:], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gpt_oss,qwen3_moe")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--train-tokens", type=int, default=16, help="tokens of --train's step")
    args = ap.parse_args()
    for i, family in enumerate(args.families.split(",")):
        if args.train:
            train_row(family, args.train_tokens, args.profile)
        else:
            forward_rows(family, args.profile and i == 0)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
