"""Host cost of one fused call on the GPU: is the lean launch path taken, and where does the time go?

    python3 benchmarks/probes/probe_launch.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.timing import profile_top, wall_us  # noqa: E402
from fxfuse import codegen  # noqa: E402
from fxfuse.kernels import fastlaunch, run_decode, run_stage  # noqa: E402


def gpt2m_m1_tensors() -> tuple[torch.Tensor, ...]:
    """``x, w1, b1, w2, b2`` of GPT-2 medium's MLP at one row, bf16 on the GPU (seeded)."""
    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, **d)
    w1, b1 = torch.randn(4096, 1024, **d) / 32, torch.randn(4096, **d)
    w2, b2 = torch.randn(1024, 4096, **d) / 64, torch.randn(1024, **d)
    return x, w1, b1, w2, b2


def main() -> None:
    x, w1, b1, w2, b2 = gpt2m_m1_tensors()
    print("lean enabled:", fastlaunch.lean_launch_enabled(), "hooks:",
          fastlaunch._knobs.runtime.launch_enter_hook, fastlaunch._knobs.runtime.launch_exit_hook)
    kernel = codegen.generated_kernel(1, "gelu_tanh(a0)").fused_stage_kernel
    ret = kernel[lambda meta: (1,)]  # noqa: F841  (only checks indexing works)

    def stage():
        return run_stage(x, [w1], [b1], [], "gelu_tanh(a0)", check=False)

    stage()
    stage()
    lean = getattr(kernel, "_fxfuse_lean", None)
    print("run_stage: lean entries", lean and len(lean.entries), "hits", lean and lean.hits,
          "best_config", getattr(kernel, "best_config", None))
    print(f"run_stage wall {wall_us(stage):.1f} us; F.linear+gelu wall "
          f"{wall_us(lambda: F.gelu(F.linear(x, w1, b1), approximate='tanh')):.1f} us")

    def decode():
        return run_decode(x, [w1, w2], [b1, b2], [[], []], ("gelu_tanh(a0)", "a0"), check=False)

    decode()
    decode()
    dk = codegen.generated_decode_kernel(1, "gelu_tanh(a0)", "a0").fused_decode_kernel
    lean = getattr(dk, "_fxfuse_lean", None)
    print("run_decode: lean entries", lean and len(lean.entries), "hits", lean and lean.hits)
    print(f"run_decode wall {wall_us(decode):.1f} us; eager MLP wall "
          f"{wall_us(lambda: F.linear(F.gelu(F.linear(x, w1, b1), approximate='tanh'), w2, b2)):.1f} us")
    print("== cProfile run_stage\n" + profile_top(stage)[-3500:])
    print("== cProfile run_decode\n" + profile_top(decode)[-3500:])
    module_path()


def module_path() -> None:
    """The GPT-2 MLP (M=8192) as a user runs it: module call vs the chosen kernels called directly."""
    import logging

    from triton.testing import do_bench

    import fxfuse
    from fxfuse import ops, stages, strategy

    logging.basicConfig(level=logging.WARNING)
    for name in ("fxfuse.strategy", "fxfuse.stages", "fxfuse.ops"):
        logging.getLogger(name).setLevel(logging.INFO)
    mlp = torch.nn.Sequential(torch.nn.Linear(768, 3072), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(3072, 768)).cuda().to(torch.bfloat16)
    x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fast = fxfuse.optimize(mlp)
        fast(x)
        (m,) = strategy.measurements()
        args = (x, [mlp[0].weight, mlp[2].weight], [mlp[0].bias, mlp[2].bias], [], m.spec)
        chosen = strategy.cached_choice(args)
        print(f"gpt2 M=8192: chosen {chosen}; stage choices {stages.stage_choices()}")
        print(f"  do_bench module {do_bench(lambda: fast(x), return_mode='median') * 1e3:.1f} us, "
              f"kernels direct {do_bench(lambda: ops._run_kernels(*args, chosen), return_mode='median') * 1e3:.1f}"
              f" us, eager {do_bench(lambda: mlp(x), return_mode='median') * 1e3:.1f} us, "
              f"wall module {wall_us(lambda: fast(x), 100):.1f} us, eager {wall_us(lambda: mlp(x), 100):.1f} us")
        print("== cProfile module\n" + profile_top(lambda: fast(x), 100, 16)[-3500:])


if __name__ == "__main__":
    main()
