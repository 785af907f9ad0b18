"""fxfuse demo: optimize three MLPs, show the report, the agreement with eager and (on a GPU) the speed.

    make demo          # or: python examples/demo.py

Without a GPU the generated Triton kernels run in the Triton interpreter on small shapes: the
numbers then show correctness only.
"""

from __future__ import annotations

import copy
import os
import time

import torch

if not torch.cuda.is_available():  # must be set before fxfuse defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fxfuse  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


class GeGLUMLP(nn.Module):
    """The seed workload: gate/up without bias, gelu(tanh)(gate) * up, down."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class GPT2MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(d, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


def nerf_mlp(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def median_us(fn, x) -> float:
    from triton.testing import do_bench

    return do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median") * 1e3


def main() -> None:
    if GPU:
        cases = [
            ("seed GeGLU MLP", GeGLUMLP(768, 3072), (64, 128, 768), torch.bfloat16),
            ("GPT-2 MLP", GPT2MLP(768, 3072), (8192, 768), torch.bfloat16),
            ("NeRF chain", nerf_mlp([32, 64, 64, 64, 16]), (1 << 20, 32), torch.float16),
        ]
    else:
        cases = [
            ("seed GeGLU MLP", GeGLUMLP(32, 96), (2, 8, 32), torch.float32),
            ("GPT-2 MLP", GPT2MLP(32, 128), (16, 32), torch.float32),
            ("NeRF chain", nerf_mlp([16, 32, 32, 32, 8]), (64, 16), torch.float32),
        ]
        print("No GPU: the generated Triton kernels run in the Triton interpreter (small shapes, no timings).\n")

    for name, model, shape, dtype in cases:
        model = model.to(DEVICE, dtype).eval()
        x = torch.randn(shape, device=DEVICE, dtype=dtype)
        t0 = time.perf_counter()
        fast = fxfuse.optimize(model, example_inputs=(x,))
        t_opt = time.perf_counter() - t0
        print(f"=== {name}: input {tuple(shape)} {dtype}, optimize() took {t_opt * 1e3:.0f} ms")
        print(fxfuse.report(fast))
        with torch.no_grad():
            ref = copy.deepcopy(model).double()(x.double())
            out = fast(x)
        ok = rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)
        print(f"agreement with float64 eager: rel err {rel_err(out, ref):.2e} ({'ok' if ok else 'MISMATCH'}); "
              f"eager {dtype}: {rel_err(model(x), ref):.2e}")
        if GPU:
            with torch.no_grad():
                compiled = torch.compile(model)
                compiled(x)
                t_eager, t_compile, t_fx = median_us(model, x), median_us(compiled, x), median_us(fast, x)
            print(f"GPU median: eager {t_eager:.1f} us, torch.compile {t_compile:.1f} us, fxfuse {t_fx:.1f} us "
                  f"-> {t_eager / t_fx:.2f}x vs eager, {t_compile / t_fx:.2f}x vs torch.compile")
        print()


if __name__ == "__main__":
    main()
