"""Why a compute-bound row reads slower in the benchmark than in the planner's first-call timing.

In the 11:41 run the planner timed seed_geglu's kernels at 181 µs and gpt2_mlp's at 124 (best of two
``do_bench(rep=20)`` rounds) while the benchmark read the same module at 197 / 130 (median of three
``do_bench(rep=100)`` rounds); eager moved 1–3% between the two, the memory-bound rows not at all.

For each named row this times eager, the optimized module and its kernels called directly with
``do_bench`` at rep 20, 100 and 500 ms (two interleaved rounds each), logging the SM clock, power and
throttle reasons with ``nvidia-smi`` in a background thread and printing their means over each measurement's
window, then lists the kernels of one module call after an L2 flush (device µs each).

    python3 benchmarks/probes/probe_sustained.py [names...]   (default: seed_geglu gpt2_mlp)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.timing import kernels_after_flush  # noqa: E402
from benchmarks.workloads import optimized_row  # noqa: E402
from fxfuse import ops, strategy  # noqa: E402

REPS = (20, 100, 500)
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class ClockLog:
    """A thread polling ``nvidia-smi`` (one query every ~50 ms); :meth:`window` summarizes a time span."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, list[str]]] = []
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while self.running:
            try:
                out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), [p.strip() for p in out.splitlines()[0].split(",")]))
            except (OSError, subprocess.SubprocessError, IndexError):
                return  # no nvidia-smi here: the windows say so
            time.sleep(0.05)

    def window(self, t0: float, t1: float) -> str:
        rows = [r for t, r in list(self.samples) if t0 <= t <= t1]
        if not rows:
            return "(no samples)"
        try:
            sm = [float(r[1]) for r in rows]
            pw = [float(r[2]) for r in rows]
        except (ValueError, IndexError):
            return f"(unreadable samples: {rows[0]})"
        reasons = sorted({r[4] for r in rows})
        return (f"SM {min(sm):.0f}-{max(sm):.0f} MHz (mean {sum(sm) / len(sm):.0f}), power mean "
                f"{sum(pw) / len(pw):.0f} W, temp {rows[-1][3]} C, throttle {'/'.join(reasons)} ({len(rows)} samples)")

    def close(self) -> None:
        self.running = False


def probe(name: str, clocks: ClockLog) -> None:
    from triton.testing import do_bench

    _, mod, fast, x = optimized_row(name)
    with torch.no_grad():
        m = [r for r in strategy.measurements() if r.m == x.numel() // x.shape[-1]][-1]
        print(f"== {name}: planner {m}", flush=True)
        weights = [p for n, p in mod.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in mod.named_parameters() if n.endswith("bias")] or [None] * len(weights)
        args = (x.reshape(-1, x.shape[-1]), weights, biases, [], m.spec)
        runners = {"eager": lambda: mod(x), "module": lambda: fast(x),
                   "kernels": lambda: ops._run_kernels(*args, m.strategy)}
        for rep in REPS:
            for rnd in range(2):
                for label, fn in runners.items():
                    t0 = time.time()
                    us = do_bench(fn, warmup=5 if rep == 20 else 25, rep=rep, return_mode="median") * 1e3
                    t1 = time.time()
                    print(f"   rep {rep:3d} round {rnd} {label:8s} {us:8.1f} us   {clocks.window(t0, t1)}",
                          flush=True)
        rows = [f"      {us:8.1f} us  x{n}  {key[:90]}" for key, us, n in kernels_after_flush(lambda: fast(x))]
        print("   kernels of one module call after a flush:\n" + "\n".join(rows), flush=True)


def main() -> None:
    torch.manual_seed(0)
    clocks = ClockLog()
    try:
        time.sleep(1.0)
        print(f"idle: {clocks.window(time.time() - 1.0, time.time())}")
        for name in sys.argv[1:] or ["seed_geglu", "gpt2_mlp"]:
            probe(name, clocks)
    finally:
        clocks.close()


if __name__ == "__main__":
    main()
