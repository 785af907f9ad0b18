"""Host µs per call of the gpt2m decode rows' fxfuse module against eager, with fxfuse imported from ROOT: run it
once per tree to compare two versions' host paths on one machine.

    git archive <rev> fxfuse patterns benchmarks | tar -x -C /tmp/old
    python3 benchmarks/probes/probe_host_versions.py /tmp/old [--profile]
    python3 benchmarks/probes/probe_host_versions.py . [--profile]

Per row (gpt2m_mlp_m8, gpt2m_mlp_m1): ``fxfuse.optimize`` of the row's module, three warm-up calls, then host µs
per call (``benchmarks.timing.host_us``) of eager and fxfuse in 7 interleaved rounds (medians); ``--profile``
adds the cProfile top of 2000 fxfuse calls at 8 rows. Give each tree its own ``FXFUSE_CACHE_DIR``.
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")

import torch  # noqa: E402

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def main() -> None:
    print("fxfuse from", fxfuse.__file__, flush=True)
    torch.set_grad_enabled(False)
    for name, m in (("gpt2m_mlp_m8", 8), ("gpt2m_mlp_m1", 1)):
        w = next(w for w in WORKLOADS if w.name == name)
        mod = build_module(w, seed=7)
        opt = fxfuse.optimize(mod)
        x = make_input(w, seed=1, m=m)
        for _ in range(3):
            opt(x)
        torch.cuda.synchronize()
        hs = {"eager": [], "fxfuse": []}
        for _ in range(7):
            for k, f in (("eager", mod), ("fxfuse", opt)):
                hs[k].append(host_us(lambda f=f, x=x: f(x)))
        print(f"{name}: running {[r.running_at(m) for r in fxfuse.report(opt).regions]} host eager "
              f"{statistics.median(hs['eager']):.1f} fxfuse {statistics.median(hs['fxfuse']):.1f}", flush=True)
        if m == 8 and "--profile" in sys.argv:
            print(profile_top(lambda opt=opt, x=x: opt(x), calls=2000, lines=22), flush=True)


if __name__ == "__main__":
    main()
