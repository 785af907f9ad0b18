"""The MoE forward at decode sizes (1-16 tokens), where the experts' weights stream from HBM: the whole ``run_moe``
(do_bench after the L2 flush, and replayed from a CUDA graph) with the pair layout's block bound as it is and as it
was (a program per expert in every grid), each kernel's time (torch.profiler), then each launch of the gate/up and
down kernels replayed under each candidate config: GPU µs and the rate at which it reads its experts' weights.

    python3 benchmarks/probes/probe_moe_decode_tiles.py [--family mixtral,gpt_oss] [--tokens 1,4,16]
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_moe import GPT_OSS_20B, build, graphed_us, profile  # noqa: E402
from benchmarks.probes.probe_moe_backward_tiles import Recorder, launcher  # noqa: E402
from fxfuse.kernels import moe_launch  # noqa: E402
from fxfuse.kernels.moe_launch import run_moe  # noqa: E402
from fxfuse.kernels.template import cdiv  # noqa: E402

MIXTRAL = dict(hidden=4096, inter=14336, experts=8, top_k=2)
# (BLOCK_N, BLOCK_K, warps, stages): the tuned list's tiles, then narrower and deeper ones.
CANDIDATES = [(128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3),
              (64, 256, 4, 3), (64, 256, 8, 4), (32, 256, 4, 4), (32, 512, 4, 3), (32, 128, 4, 5), (16, 512, 4, 4),
              (64, 128, 4, 5), (128, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3)]


def old_bound(pairs: int, num_experts: int, block_m: int) -> int:
    return cdiv(pairs, block_m) + num_experts + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="mixtral,gpt_oss")
    ap.add_argument("--tokens", default="1,4,16")
    args = ap.parse_args()
    for family in args.family.split(","):
        shape = GPT_OSS_20B if family == "gpt_oss" else MIXTRAL
        torch.manual_seed(0)
        module, _, form = build(SimpleNamespace(family=family, **shape))
        del _
        biases = dict(gate_up_bias=module._parameters.get("gate_up_proj_bias"),
                      down_bias=module._parameters.get("down_proj_bias"))
        E, H, inter = shape["experts"], shape["hidden"], shape["inter"]
        print(f"{torch.cuda.get_device_name()}: {family} E={E} H={H} I={inter} top_k={shape['top_k']} ({form})")
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
            weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, device="cuda"), -1), shape["top_k"], -1)
            weights = weights.to(torch.bfloat16)
            used = index.unique().numel()
            gate_up_mb, down_mb = used * 2 * inter * H * 2 / 1e6, used * inter * H * 2 / 1e6

            def call(x=x, index=index, weights=weights, module=module, form=form, biases=biases):
                return run_moe(x, index, weights, module.gate_up_proj, module.down_proj, form, **biases)

            call()
            cells = []
            for name, bound in (("tight blocks", moe_launch.layout_blocks), ("old blocks", old_bound)):
                original, moe_launch.layout_blocks = moe_launch.layout_blocks, bound
                try:
                    gpu = do_bench(call, warmup=10, rep=50, return_mode="median") * 1e3
                    cells.append(f"{name} {gpu:7.1f} us (graph {graphed_us(call)})")
                finally:
                    moe_launch.layout_blocks = original
            print(f"  T={tokens} ({used} experts, {gate_up_mb + down_mb:.0f} MB of weights): " + "  ".join(cells),
                  flush=True)
            profile(call, tokens)
            launches: list = []
            saved = {name: getattr(moe_launch, name) for name in ("moe_gate_up_kernel", "moe_down_kernel")}
            for name, tuner in saved.items():
                setattr(moe_launch, name, Recorder(tuner, launches))
            try:
                call()
            finally:
                for name, tuner in saved.items():
                    setattr(moe_launch, name, tuner)
            torch.cuda.synchronize()
            for tuner, grid, call_args, kwargs in launches:
                name = tuner.fn.__name__
                mb = gate_up_mb if name == "moe_gate_up_kernel" else down_mb
                print(f"    {name} BLOCK_M={kwargs['BLOCK_M']} ({mb:.0f} MB)")
                for bn, bk, w, s in CANDIDATES:
                    config = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                    run = launcher(tuner, grid, call_args, kwargs, config)
                    try:
                        compiled = run()
                        us = do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3
                        print(f"      N{bn:<4d} K{bk:<4d} w{w} s{s}: {us:7.1f} us {mb / us:5.2f} TB/s "
                              f"regs {compiled.n_regs} spills {compiled.n_spills}", flush=True)
                    except Exception as exc:
                        print(f"      N{bn:<4d} K{bk:<4d} w{w} s{s}: {type(exc).__name__}: {str(exc)[:60]}",
                              flush=True)


if __name__ == "__main__":
    main()
