"""The MoE gate/up GEMM by pointer against by TMA (x's rows gathered first), in one process.

For each family (``benchmarks/bench_moe.py``'s shapes and routing) and token count, with the gate/up kernel forced
to each form (``moe_launch.GATE_UP_FORM``; the down projections as the launcher picks): the forward's GPU µs
(do_bench), a training step's (forward and every gradient, ``MoEExpertsFunction``), the gate/up kernels' own device
µs after an L2 flush (the gather included for TMA; forward and training forward, whose kernel also stores the
pre-activations), and each form's output against the pointer form's.

    python3 benchmarks/probes/probe_moe_gate_up_tma.py [--families mixtral,qwen3_moe,gpt_oss] [--tokens 512,4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.bench_moe import build, routing  # noqa: E402
from benchmarks.timing import kernels_after_flush  # noqa: E402
from fxfuse.kernels import moe_launch  # noqa: E402
from fxfuse.kernels.moe_backward_launch import MoEExpertsFunction  # noqa: E402
from fxfuse.moe import experts_form  # noqa: E402


def gate_up_us(fn) -> str:
    kernels = [(k, us) for k, us, _ in kernels_after_flush(fn, calls=5) if "gate_up" in k or "gather" in k]
    return " + ".join(f"{us:.0f} ({k.removeprefix('moe_').removesuffix('_kernel')})" for k, us in kernels)


def point(module, top_k: int, tokens: int, seed: int) -> None:
    """Both forms at one token count."""
    form = experts_form(module)
    p = module._parameters
    weights_args = (p["gate_up_proj"], p["down_proj"], p.get("gate_up_proj_bias"), p.get("down_proj_bias"))
    x, index, weights = routing(tokens, len(p["gate_up_proj"]), top_k, module.config.hidden_size, "cuda", seed)
    dout = torch.randn_like(x)
    inputs = [x.requires_grad_(), weights.requires_grad_(), *module.parameters()]

    def forward():
        with torch.no_grad():
            return moe_launch.run_moe(x, index, weights, *weights_args[:2], form, gate_up_bias=weights_args[2],
                                      down_bias=weights_args[3])

    def step():
        return torch.autograd.grad(MoEExpertsFunction.apply(x, index, weights, *weights_args, form), inputs, dout)

    def train_forward():
        with torch.no_grad():
            return moe_launch.moe_forward_pass(x, index, weights, *weights_args[:2], form, *weights_args[2:],
                                               save=True)

    outs, steps = {}, {}
    for name in ("pointer", "TMA"):
        moe_launch.GATE_UP_FORM["force"] = name
        outs[name] = forward()
        step()
        fwd, train = do_bench(forward) * 1e3, do_bench(step) * 1e3
        err = ((outs[name].float() - outs["pointer"].float()).norm() / outs["pointer"].float().norm()).item()
        print(f"  {name:8s} forward {fwd:8.1f} us  step {train:8.1f} us  (against pointer {err:.1e})", flush=True)
        print(f"           gate/up kernels: forward {gate_up_us(forward)}; training forward "
              f"{gate_up_us(train_forward)}", flush=True)
        steps[name] = {k: us for k, us, _ in kernels_after_flush(step, calls=3)}
    moe_launch.GATE_UP_FORM["force"] = None
    names = sorted(set().union(*steps.values()), key=lambda k: -max(t.get(k, 0) for t in steps.values()))
    print("  step's kernels, device us after a flush (" + " / ".join(steps) + "):")
    for k in names[:12]:
        print("    " + " / ".join(f"{t.get(k, 0):7.0f}" for t in steps.values()) + f"  {k[:90]}")
    print("    " + " / ".join(f"{sum(t.values()):7.0f}" for t in steps.values()) + "  (all)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="mixtral,qwen3_moe,gpt_oss")
    ap.add_argument("--tokens", default="512,4096")
    args = ap.parse_args()
    for seed, family in enumerate(args.families.split(",")):
        module, _, top_k = build(family, "cuda", False)
        for tokens in (int(t) for t in args.tokens.split(",")):
            print(f"== {family} T={tokens}", flush=True)
            point(module, top_k, tokens, seed)
        del module
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
