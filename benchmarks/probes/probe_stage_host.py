"""A region's stage choices at one benchmark row, and what each stage implementation costs the whole call.

The planner times a replayed region's stages by GPU time alone (a bound Triton launch's host time is a few µs),
but a library stage (cuBLAS / cuBLASLt) keeps its full host path in a replay (``aten::addmm`` ~20-30 µs on the
H200 machine's host). At gpt2m_mlp_m8 that made the call host-bound. For the row's module (``fxfuse.optimize``):
its stage timings (the planner's INFO log), then for each stage whose choice had rivals, the module with that stage
forced to each of them (replays dropped and recorded again): wall µs per call (200 back-to-back calls), host µs per
call and the do_bench median (L2 flushed), interleaved over ``--rounds``.

    python3 benchmarks/probes/probe_stage_host.py [--row gpt2m_mlp_m8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, wall_us  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import replay, stages  # noqa: E402


class _Timings(logging.Handler):
    """Keeps the planner's stage timing lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "stage" in message and " us" in message:
            self.lines.append(message)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="gpt2m_mlp_m8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from triton.testing import do_bench

    handler = _Timings()
    logging.getLogger("fxfuse").addHandler(handler)
    logging.getLogger("fxfuse").setLevel(logging.INFO)
    w = next(w for w in WORKLOADS if w.name == args.row)
    mod, x = build_module(w), make_input(w)
    fast = fxfuse.optimize(mod)
    with torch.no_grad():
        for _ in range(5):
            fast(x)
    torch.cuda.synchronize()
    print(f"{args.row}: stage timings at the first call")
    for line in handler.lines:
        print("  " + line)
    chosen = dict(stages._choices)
    print("  choices:", {key[1:5]: str(c) for key, c in chosen.items()})

    variants = {"as chosen": dict(chosen)}
    for key, choice in chosen.items():
        for alt in ("gemv", "tma", "triton", "torch", "cublaslt"):
            if alt != str(choice) and any(alt + " " in line and f"K={key[3]}, N={key[4]}" in line
                                          for line in handler.lines):
                variants[f"stage {key[1]} (K={key[3]}, N={key[4]}) by {alt}"] = {**chosen, key: alt}

    def use(choices):
        stages._choices.clear()
        stages._choices.update(choices)
        replay.forget_all()
        with torch.no_grad():
            for _ in range(5):  # (plan from the kept choices, record the replay, learn the shortcut)
                fast(x)
        torch.cuda.synchronize()

    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, choices in variants.items():
                use(choices)
                results[name].append((wall_us(lambda: fast(x)), host_us(lambda: fast(x)),
                                      do_bench(lambda: fast(x), warmup=25, rep=100, return_mode="median") * 1e3))
    print(f"{args.row}: wall µs per call / host µs per call / do_bench µs (median over {args.rounds} rounds)")
    for name, rows in results.items():
        med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
        print(f"  {name:45s} {med[0]:7.1f} / {med[1]:7.1f} / {med[2]:7.1f}   rounds: "
              + "; ".join(" / ".join(f"{v:.1f}" for v in r) for r in rows))


if __name__ == "__main__":
    main()
