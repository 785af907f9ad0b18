"""Does running torch.compile in the same process slow an fxfuse module down? (hooks, modes, timing)

    python3 benchmarks/probes/probe_after_compile.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import ops  # noqa: E402
from fxfuse.kernels import fastlaunch  # noqa: E402


def state(tag: str, x) -> None:
    from triton import knobs

    print(f"[{tag}] lean={fastlaunch.lean_launch_enabled()} enter={knobs.runtime.launch_enter_hook!r} "
          f"exit={knobs.runtime.launch_exit_hook!r} traced_or_watched={ops._traced_or_watched(x)} "
          f"fn_mode={torch._C._is_torch_function_mode_enabled()} grad={torch.is_grad_enabled()}")


def main() -> None:
    from triton.testing import do_bench

    w = next(w for w in WORKLOADS if w.name == "nerf64")
    mod, x = build_module(w), make_input(w)
    with torch.no_grad():
        opt = fxfuse.optimize(mod)
        opt(x)
        state("before compile", x)
        print(f"fxfuse before: {do_bench(lambda: opt(x), return_mode='median') * 1e3:.1f} us")
        cm = torch.compile(mod)
        cm(x)
        state("after compile", x)
        print(f"fxfuse after: {do_bench(lambda: opt(x), return_mode='median') * 1e3:.1f} us")
        torch._dynamo.reset()
        state("after reset", x)
        print(f"fxfuse after reset: {do_bench(lambda: opt(x), return_mode='median') * 1e3:.1f} us")
        print(profile_top(lambda: opt(x), 100, 25))


if __name__ == "__main__":
    main()
