"""Where a MoE training step's GPU time goes: every kernel of fxfuse's step and of torch.compile's, side by side.

For each family (``benchmarks/bench_moe.py``'s shapes and routing) and token count: one training step (forward, then
the gradients of the input, the routing weights and every parameter) of the optimized module and of
``torch.compile`` of the module, each profiled after an L2 flush (``benchmarks.timing.kernels_after_flush``): the
kernels by device µs per step, their launches, and the sum. The step's do_bench median beside it (kernels plus
whatever gaps the host leaves).

    python3 benchmarks/probes/probe_moe_train_kernels.py [--families gpt_oss,qwen3_moe] [--tokens 4096] [--top 14]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.bench_moe import build, routing, step_fn  # noqa: E402
from benchmarks.measure import Timer, dynamo_reset  # noqa: E402
from benchmarks.timing import kernels_after_flush  # noqa: E402


def show(name: str, kernels: list[tuple[str, float, int]], step_us: float, top: int) -> None:
    kernels = sorted(kernels, key=lambda k: -k[1])
    total = sum(us for _, us, _ in kernels)
    print(f"  {name}: do_bench {step_us:.0f} us a step, kernels {total:.0f} us in "
          f"{sum(n for _, _, n in kernels)} launches", flush=True)
    for key, us, count in kernels[:top]:
        print(f"    {us:8.1f} us {count:3d}x  {key[:110]}", flush=True)
    rest = kernels[top:]
    if rest:
        print(f"    {sum(us for _, us, _ in rest):8.1f} us {sum(n for _, _, n in rest):3d}x  ({len(rest)} others)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gpt_oss,qwen3_moe")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    timer = Timer(warmup=25, rep=100, cpu=False)
    for seed, family in enumerate(args.families.split(",")):
        torch.manual_seed(seed)
        module, _, top_k = build(family, "cuda", False)
        module.train()
        variants = {"fxfuse": fxfuse.optimize(module).train()}
        dynamo_reset()
        variants["compile"] = torch.compile(module)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x, index, weights = routing(tokens, len(module.gate_up_proj), top_k, module.config.hidden_size, "cuda",
                                        seed)
            x.requires_grad_(True)
            weights.requires_grad_(True)
            dout = torch.randn_like(x)
            inputs = [x, weights, *module.parameters()]
            print(f"== {family} T={tokens}", flush=True)
            for name, fn in variants.items():
                step = step_fn(fn, x, index, weights, inputs, dout)
                step()
                show(name, kernels_after_flush(step, calls=5), timer.gpu_us(step), args.top)
        del module, variants
        dynamo_reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
