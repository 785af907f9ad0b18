"""What a Llama MLP region runs at mid M, and its kernels against eager's, in one process.

    python3 benchmarks/probes/probe_original_ops_path.py [M ...]   (default 768 1024 512)

Written for the H100 sweep's two "slower" points (llama M=768 and 1024, where the planner kept the original ops
by ~2%): per M, what the region runs (``TORCH_LOGS=fxfuse`` shows the planner's times), three interleaved rounds
of do_bench medians for eager and fxfuse, and each one's kernels with their device µs after a flush.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.timing import kernels_after_flush  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def main() -> None:
    from triton.testing import do_bench

    import fxfuse

    torch.set_grad_enabled(False)
    w = next(w for w in WORKLOADS if w.name == "llama_swiglu_4096")
    mod = build_module(w)
    opt = fxfuse.optimize(mod)
    for m in [int(a) for a in sys.argv[1:]] or [768, 1024, 512]:
        x = make_input(w, m=m)
        opt(x)
        torch.cuda.synchronize()
        print(f"== M={m}: runs {[r.running_at(m) for r in fxfuse.report(opt).regions]}", flush=True)
        fns = {"eager": functools.partial(mod, x), "fxfuse": functools.partial(opt, x)}
        for r in range(3):
            times = {k: round(do_bench(f, warmup=25, rep=100, return_mode="median") * 1e3, 1) for k, f in fns.items()}
            print(f"  round {r}: {times}", flush=True)
        for k, f in fns.items():
            print(f"  {k}: {[(name[:60], round(us, 1), n) for name, us, n in kernels_after_flush(f)]}", flush=True)


if __name__ == "__main__":
    main()
