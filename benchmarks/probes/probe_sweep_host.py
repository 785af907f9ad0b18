"""Host µs per call of gpt2m's MLP at the sweep's host-bound rows, eager against fxfuse, before and after
torch.compile has run in the process (as in ``bench_sweep.py``), then with the GC frozen and disabled.

    python3 benchmarks/probes/probe_sweep_host.py [--ms 40,64,128]

One ``fxfuse.optimize`` of the row's module, planned at each M (two calls each), timed as host µs per call
(``benchmarks.timing.host_us``: 50 calls back to back, best of 20 loops) in 5 interleaved rounds; the cProfile
top of fxfuse's call at the largest M before and after. Then ``torch.compile(module)`` is called at 1-32 rows and
at each M (Dynamo recompiles with a dynamic M, as in the sweep), and the same timing runs again.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def measure(tag: str, mod, opt, xs: dict) -> None:
    for m, x in xs.items():
        hs = {"eager": [], "fxfuse": []}
        for r in range(5):
            order = (("eager", mod), ("fxfuse", opt)) if r % 2 == 0 else (("fxfuse", opt), ("eager", mod))
            for k, f in order:
                hs[k].append(host_us(lambda f=f, x=x: f(x)))
        e, o = statistics.median(hs["eager"]), statistics.median(hs["fxfuse"])
        print(f"[{tag}] M={m}: host eager {e:.1f} fxfuse {o:.1f} ratio {o / e:.3f}  running "
              f"{[r.running_at(m) for r in fxfuse.report(opt).regions]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="40,64,128")
    ms = [int(a) for a in p.parse_args().ms.split(",")]
    w = next(w for w in WORKLOADS if w.name == "gpt2m_mlp_m1")
    mod = build_module(w, seed=7)
    opt = fxfuse.optimize(mod)
    torch.set_grad_enabled(False)
    xs = {m: make_input(w, seed=m, m=m) for m in ms}
    for m in ms:
        opt(xs[m])
        opt(make_input(w, seed=m + 1, m=m))
        mod(xs[m])
    last = xs[ms[-1]]
    measure("before compile", mod, opt, xs)
    print(profile_top(lambda: opt(last), calls=2000, lines=25), flush=True)
    cm = torch.compile(mod)
    for m in [1, 2, 4, 8, 16, 24, 32] + ms:
        x = make_input(w, seed=m, m=m)
        cm(x)
        cm(x)
    print("gc objects", len(gc.get_objects()), "counts", gc.get_count(), flush=True)
    measure("after compile", mod, opt, xs)
    print(profile_top(lambda: opt(last), calls=2000, lines=25), flush=True)
    print(profile_top(lambda: mod(last), calls=2000, lines=12), flush=True)
    gc.freeze()
    measure("after gc.freeze", mod, opt, xs)
    gc.unfreeze()
    gc.disable()
    measure("gc disabled", mod, opt, xs)
    gc.enable()


if __name__ == "__main__":
    main()
