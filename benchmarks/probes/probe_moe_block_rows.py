"""How many rows per block should the MoE pair layout take at large token counts?

Each expert's rows are padded to whole blocks (``fxfuse.kernels.moe_launch.block_rows``: 128 rows once an expert
gets more than 128 pairs), and every GEMM of the forward and the backward runs the padding too: about half a
block an expert, so Qwen3-MoE at 4096 tokens (256 pairs an expert) computes ~25% more rows than it routes at 128
rows a block, ~12.5% at 64; torch.compile's grouped GEMMs run unpadded. Smaller blocks pad less but run smaller
tiles. For each family at each token count, with the layout's block forced to each size: the experts' forward
(``run_moe``) and a training step (``MoEExpertsFunction`` forward + backward), GPU µs (do_bench, median of
interleaved rounds), and the padded rows' share.

    python3 benchmarks/probes/probe_moe_block_rows.py [--families qwen3_moe,gpt_oss,mixtral] [--tokens 4096]
        [--blocks 64,128]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.bench_moe import build, routing  # noqa: E402
from fxfuse.kernels import moe_launch  # noqa: E402
from fxfuse.kernels.moe_backward_launch import MoEExpertsFunction  # noqa: E402
from fxfuse.kernels.moe_launch import route_pairs, run_moe  # noqa: E402
from fxfuse.moe import experts_form  # noqa: E402

DEFAULT_BLOCK_ROWS = moe_launch.block_rows


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def point(family: str, tokens: int, blocks: list[int]) -> None:
    module, _, top_k = build(family, "cuda", False)
    params = module._parameters
    E, H = len(module.gate_up_proj), module.config.hidden_size
    form = experts_form(module)
    x, index, weights = routing(tokens, E, top_k, H, "cuda", 0)
    x.requires_grad_()
    weights.requires_grad_()
    dout = torch.randn_like(x)
    inputs = [x, weights, *module.parameters()]
    biases = (params.get("gate_up_proj_bias"), params.get("down_proj_bias"))

    def forward():
        with torch.no_grad():
            return run_moe(x, index, weights, params["gate_up_proj"], params["down_proj"], form,
                           gate_up_bias=biases[0], down_bias=biases[1])

    def step():
        out = MoEExpertsFunction.apply(x, index, weights, params["gate_up_proj"], params["down_proj"], *biases, form)
        return torch.autograd.grad(out, inputs, dout)

    default = DEFAULT_BLOCK_ROWS(tokens * top_k, E)
    times: dict[int, list] = {b: [[], []] for b in blocks}
    for block in blocks:  # (first calls: the autotuning at each block size)
        moe_launch.block_rows = lambda pairs, experts, block=block: block
        forward(), step()
    for _ in range(3):
        for block in blocks:
            moe_launch.block_rows = lambda pairs, experts, block=block: block
            times[block][0].append(us(forward))
            times[block][1].append(us(step))
    moe_launch.block_rows = DEFAULT_BLOCK_ROWS
    for block in blocks:
        layout = route_pairs(index, E, block)
        used = int((layout.block_expert >= 0).sum()) * block
        padding = 1 - tokens * top_k / used
        fwd, train = (sorted(t)[len(t) // 2] for t in times[block])
        mark = " (block_rows' pick)" if block == default else ""
        print(f"{family} T={tokens} {block} rows a block{mark}: padding {padding:.1%} of the rows; forward "
              f"{fwd:.0f} us, training step {train:.0f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="qwen3_moe,gpt_oss,mixtral")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--blocks", default="64,128")
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    for family in args.families.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            point(family, tokens, blocks)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
