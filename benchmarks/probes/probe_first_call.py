"""Where a first call's seconds go: ``fxfuse.optimize(m)(x)`` at a new shape, with fxfuse's INFO log timestamped.

    TRITON_CACHE_DIR=$(mktemp -d) FXFUSE_CACHE_DIR=$(mktemp -d) python3 benchmarks/probes/probe_first_call.py [names...]

(fresh caches: otherwise Triton's disk cache serves the compiled configs and tuning results). Prints each log
line of the tuner (tuning / compiled / tuned) with the seconds since the call began, then the call's total.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402


def main() -> None:
    start = [time.perf_counter()]
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda r: setattr(r, "msg", f"  {time.perf_counter() - start[0]:6.2f} s  {r.msg}") or True)
    tuner_log = logging.getLogger("fxfuse.kernels.tuning")
    tuner_log.setLevel(logging.INFO)
    tuner_log.addHandler(handler)
    tuner_log.propagate = False
    for name in sys.argv[1:] or ["seed_geglu", "gpt2m_mlp_m1"]:
        w = next(w for w in WORKLOADS if w.name == name)
        mod, x = build_module(w), make_input(w)
        with torch.no_grad():
            opt = fxfuse.optimize(mod)
            print(f"{name}:")
            start[0] = time.perf_counter()
            opt(x)
            torch.cuda.synchronize()
            print(f"  {time.perf_counter() - start[0]:6.2f} s  first call done")


if __name__ == "__main__":
    main()
