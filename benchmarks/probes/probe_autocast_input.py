"""fp32 input under autocast: cast before the region (as until session 17) or inside it (a replay step; the chain
kernel rounds it on load)? Interleaved A/B on decode rows and nerf64, fp32 weights, no gradients.

    python3 benchmarks/probes/probe_autocast_input.py [--rounds 5]

Per variant: do_bench GPU µs and the wall µs per call of 200 back-to-back calls, the autocast context around
each call; the "cast before" variant casts x in ``autocast_args`` as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxfuse  # noqa: E402
import fxfuse.ops  # noqa: E402
from benchmarks.bench_autocast import per_call  # noqa: E402
from benchmarks.measure import Timer  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import autocast as fx_autocast  # noqa: E402

_inside = fxfuse.ops.autocast_args


def _before(x, weights, biases, operands, spec):
    out = _inside(x, weights, biases, operands, spec)
    if out is not None and out[0].dtype is not out[1][0].dtype:
        return (out[0].to(out[1][0].dtype), *out[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="llama_swiglu_m1,gpt2m_mlp_m1,gpt2m_mlp_m8,nerf64")
    args = ap.parse_args()
    timer = Timer(warmup=25, rep=100, cpu=False)
    for w in (w for w in WORKLOADS if w.name in args.only.split(",")):
        mod = build_module(dataclasses.replace(w, dtype=torch.float32))
        x = make_input(dataclasses.replace(w, dtype=torch.float32))
        fast = fxfuse.optimize(mod)
        run = per_call(fast, x, w.dtype)
        res = {"cast before": ([], []), "inside": ([], [])}
        with torch.no_grad():
            for variant in res:  # plan and record each variant's replay
                fxfuse.ops.autocast_args = _before if variant == "cast before" else _inside
                run()
            for _ in range(args.rounds):
                for variant, (gpu, wall) in res.items():
                    fxfuse.ops.autocast_args = _before if variant == "cast before" else _inside
                    gpu.append(timer.gpu_us(run))
                    if w.decode:
                        wall.append(timer.wall_us(run)["median"])
        fxfuse.ops.autocast_args = _inside
        print(f"{w.name}: " + "; ".join(
            f"{v}: GPU {statistics.median(g):.1f} µs" + (f", wall {statistics.median(wl):.1f}" if wl else "")
            for v, (g, wl) in res.items()), flush=True)
        fx_autocast.weight_casts.clear()


if __name__ == "__main__":
    main()
