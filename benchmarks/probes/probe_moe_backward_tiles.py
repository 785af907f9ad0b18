"""The MoE backward's grouped GEMMs, tile by tile: each launch of ``moe_down_backward_kernel`` and
``moe_weight_grad_kernel`` in one backward of fxfuse's experts node (Mixtral-8x7B shapes by default, bf16) is
recorded, then replayed under each candidate config: GPU µs (do_bench, median), TFLOP/s, registers and spills.
The configs beyond the tuned lists are what a change to them would add.

    python3 benchmarks/probes/probe_moe_backward_tiles.py [--tokens 4096] [--family mixtral|gpt_oss]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.kernels import moe_backward_launch  # noqa: E402
from fxfuse.kernels.moe_backward_launch import MoEExpertsFunction  # noqa: E402
from fxfuse.moe import experts_form  # noqa: E402

DOWN_BACKWARD = [(128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3),
                 (256, 64, 8, 4), (256, 128, 8, 3), (128, 256, 8, 3), (256, 32, 8, 4)]
# (BLOCK_N, BLOCK_K, BLOCK_R, K_TILES, warps, stages)
WEIGHT_GRAD = [(128, 128, 32, 8, 8, 3), (128, 128, 64, 4, 8, 3), (128, 128, 64, 1, 8, 2), (128, 128, 64, 1, 8, 4),
               (128, 256, 64, 2, 8, 3), (256, 128, 64, 2, 8, 3), (128, 128, 128, 1, 8, 3), (64, 128, 64, 4, 4, 4)]


class Recorder:
    """Stands in for an autotuned kernel: runs it, and keeps each launch's grid function and arguments."""

    def __init__(self, tuner, launches: list):
        self.tuner, self.launches = tuner, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.tuner, grid, args, kwargs))
            return self.tuner[grid](*args, **kwargs)

        return launch


def launcher(tuner, grid, call_args, kwargs, config):
    """The recorded launch under ``config``, as a no-argument callable (returns the compiled kernel)."""
    return lambda: tuner.fn[grid(config.kwargs)](*call_args, **kwargs, **config.all_kwargs())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="mixtral", choices=["mixtral", "gpt_oss"])
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    if args.family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig as Config
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts

        config = Config(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
        top_k = 4
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = Config(hidden_size=4096, intermediate_size=14336, num_local_experts=8)
        top_k = 2
    torch.manual_seed(0)
    module = Experts(config)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.02)
    form = experts_form(module)
    module = module.to("cuda", torch.bfloat16)
    params = module._parameters
    E, H = config.num_local_experts, config.hidden_size
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights, index = torch.topk(torch.softmax(torch.randn(args.tokens, E, device="cuda"), -1), top_k, -1)
    weights = weights.to(torch.bfloat16).requires_grad_()
    dout = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16)
    out = MoEExpertsFunction.apply(x, index, weights, params["gate_up_proj"], params["down_proj"],
                                   params.get("gate_up_proj_bias"), params.get("down_proj_bias"), form)
    launches: list = []
    for name in ("moe_down_backward_kernel", "moe_weight_grad_kernel"):
        setattr(moe_backward_launch, name, Recorder(getattr(moe_backward_launch, name), launches))
    torch.autograd.grad(out, [x, weights, *module.parameters()], dout)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: {args.family} T={args.tokens} top_k={top_k} E={E} bf16")
    for tuner, grid, call_args, kwargs in launches:
        named = {**dict(zip(tuner.arg_names, call_args)), **kwargs}
        name = tuner.fn.__name__
        if name == "moe_down_backward_kernel":
            K, N = named["K"], named["N"]
            flops = 2 * args.tokens * top_k * K * N
            candidates = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                          for bn, bk, w, s in DOWN_BACKWARD]
            what = f"N={N} K={K}"
        else:
            N, K = named["N"], named["K"]
            if K == 1:
                continue  # (a bias's sum)
            flops = 2 * args.tokens * top_k * N * K
            candidates = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_R": br, "K_TILES": kt, "GROUP_N": 8},
                                        num_warps=w, num_stages=s) for bn, bk, br, kt, w, s in WEIGHT_GRAD]
            what = f"N={N} K={K} A_BY_TOKEN={named['A_BY_TOKEN']} B_BY_TOKEN={named['B_BY_TOKEN']}"
        print(f"  {name} {what} BLOCK_M={kwargs['BLOCK_M']} ({flops / 1e12:.2f} TFLOP)")
        for config in candidates:
            run = launcher(tuner, grid, call_args, kwargs, config)
            try:
                compiled = run()
                us = do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
                print(f"    {str(config.kwargs):60s} w{config.num_warps} s{config.num_stages}: {us:8.1f} us "
                      f"{flops / us / 1e6:6.0f} TFLOP/s  regs {compiled.n_regs} spills {compiled.n_spills}",
                      flush=True)
            except Exception as exc:
                print(f"    {str(config.kwargs):60s} w{config.num_warps} s{config.num_stages}: "
                      f"{type(exc).__name__}: {str(exc)[:60]}", flush=True)


if __name__ == "__main__":
    main()
