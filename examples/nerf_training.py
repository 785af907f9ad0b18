"""Train a NeRF-style MLP with fxfuse: fused forward and fused backward, beside the same model in eager.

    python examples/nerf_training.py                         # GPU: nerf64 widths, 2^18 rows a step, fp16
    python examples/nerf_training.py --widths 64,128,128,128,64 --dtype bf16 --steps 300

Both models start from the same weights and see the same batches (a random Fourier-feature field to fit),
trained with Adam. The script prints both losses as they go, the largest relative difference between the two
models' weights at the end, and on a GPU the median step time of each (CUDA events). Without a GPU it runs a
few small steps with the Triton interpreter (correctness only).

fxfuse fuses a chain's backward when every layer is at most 128 wide and all its parameters share one dtype.
This trains in the parameters' dtype; mixed precision (fp32 parameters under ``torch.autocast`` on CUDA) gets the
same fused forward and backward on casts of the weights (see the README's Autocast section).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():  # must be set before fxfuse defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fxfuse  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import nerf_mlp  # noqa: E402  (Linear + ReLU between every pair of widths)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def field(x: torch.Tensor, freqs: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """The target: a random Fourier-feature field of the input."""
    return torch.sin(x @ freqs) @ mix


def train(argv: list[str] | None = None) -> dict:
    """Train both models; returns the losses, the final weight difference and the step times (GPU)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="32,64,64,64,16", help="layer widths, input first")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--batch", type=int, default=None, help="rows a step (default 2^18 on a GPU, 64 on a CPU)")
    ap.add_argument("--steps", type=int, default=None, help="default 200 on a GPU, 3 on a CPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = DTYPES[args.dtype] if gpu else torch.float32  # the interpreter multiplies fp32 and fp16 only
    widths = [int(w) for w in args.widths.split(",")]
    batch = args.batch or (1 << 18 if gpu else 64)
    steps = args.steps or (200 if gpu else 3)

    torch.manual_seed(0)
    eager = nerf_mlp(widths).to(device, dtype).train()
    model = copy.deepcopy(eager)
    fast = fxfuse.optimize(model)  # shares model's parameters: the optimizer below updates both
    print(fxfuse.report(fast))
    freqs = torch.randn(widths[0], 64, device=device) * 2
    mix = torch.randn(64, widths[-1], device=device) / 8
    # Adam on fp16 parameters: its default eps (1e-8) is 0 in fp16, and a squared-gradient average that
    # underflows to 0 then divides by 0 (the first GPU run of this script went to NaN in eager and fxfuse alike).
    eps = 1e-4 if dtype == torch.float16 else 1e-8
    opts = {"eager": torch.optim.Adam(eager.parameters(), lr=args.lr, eps=eps),
            "fxfuse": torch.optim.Adam(model.parameters(), lr=args.lr, eps=eps)}
    nets = {"eager": eager, "fxfuse": fast}
    losses: dict[str, list[float]] = {name: [] for name in nets}
    times: dict[str, list[float]] = {name: [] for name in nets}
    for step in range(steps):
        x = torch.rand(batch, widths[0], device=device) * 2 - 1
        y = field(x, freqs, mix).to(dtype)
        x = x.to(dtype)
        for name, net in nets.items():
            start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if gpu \
                else (None, None)
            if gpu:
                start.record()
            opts[name].zero_grad(set_to_none=True)
            loss = (net(x).float() - y.float()).square().mean()
            loss.backward()
            opts[name].step()
            if gpu:
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3)
            losses[name].append(loss.item())
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss eager {losses['eager'][-1]:.5f}  fxfuse {losses['fxfuse'][-1]:.5f}")
    diff = max(((p - q).float().norm() / q.float().norm()).item()
               for p, q in zip(model.parameters(), eager.parameters()))
    print(f"largest relative weight difference after {steps} steps: {diff:.2e}")
    result = {"losses": losses, "weight_diff": diff}
    if gpu:
        warm = {name: statistics.median(ts[len(ts) // 4:]) for name, ts in times.items()}  # past the first calls
        print(f"step (forward, backward, Adam), median µs: eager {warm['eager']:.0f}, fxfuse {warm['fxfuse']:.0f} "
              f"({warm['eager'] / warm['fxfuse']:.2f}x)")
        result["step_us"] = warm
    return result


if __name__ == "__main__":
    train(sys.argv[1:])
