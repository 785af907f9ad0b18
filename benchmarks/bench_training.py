"""Training steps on the GPU: does an optimized model train as fast as eager?

For each large-M workload (``workloads.py``), one training step (forward, backward with a random output
gradient, input gradient included, parameter gradients reset to None) is timed with
``triton.testing.do_bench`` (median, L2 flushed) for:

* eager: the module as it is;
* fxfuse: ``fxfuse.optimize(module)`` as shipped: a narrow chain (nerf rows) runs its fused forward and the
  fused chain backward kernel every step (``fxfuse.backward``); any other region's first backward marks it
  as trained, and later gradient-recording calls run the original ops (``fxfuse.ops.fused_mlp``);
* fxfuse recompute: the op's generic backward every step (``FXFUSE_FUSED_BACKWARD=0``, trained marks
  cleared: fused forward, then the original ops' forward again and their backward);
* fxfuse gated kernels (gated rows): as shipped but with ``FXFUSE_GATED_TRAINING=1``, i.e. a trained gated
  region's ``act(g) * u`` as one kernel each way instead of the original ops (:mod:`fxfuse.gated_training`);
* torch.compile default, and ``backend="fxfuse"`` (which leaves training graphs to Inductor).

Also timed: the forward alone with gradients recorded but never used (inference without ``torch.no_grad()``),
which stays fused. Variants are timed in interleaved rounds (median). Gradients are checked against eager in
float64 terms (relative error of every gradient). Peak memory of one step is the allocator's high-water mark
above what was allocated before it. Host µs per step (eager and fxfuse: 20 steps issued back to back, best of
5) says whether a step that reads slower than its kernels is host-bound, and kernels µs per step (the profiler's
device time of the step's kernels, each step after an L2 flush as in do_bench) what the GPU does whatever the
host's speed; synchronized µs per step (a
synchronize after each step, as a loop that reads its loss every step has) is what such a loop sees, host and
GPU time added.

    python3 benchmarks/bench_training.py --out DIR [--only seed_geglu,gpt2_mlp] [--rounds 3] [--m ROWS]

``--m`` overrides the rows of every selected workload (e.g. ``--only nerf128 --m 262144``, a NeRF batch).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import host_us, kernels_after_flush, synced_us  # noqa: E402
from workloads import WORKLOADS, build_module, make_input  # noqa: E402

import fxfuse  # noqa: E402
import fxfuse.ops  # noqa: E402

ROWS = ("seed_geglu", "gpt2_mlp", "llama_swiglu_4096", "nerf64", "nerf128")


def _step(module, x, grad_out, params, *, generic_backward=False, gated_kernels=False):
    """One training step; ``generic_backward``: with the fused chain backward off and no region marked trained,
    leaving fxfuse's trained marks as they were (the shipped variant's state is its own); ``gated_kernels``: with
    ``FXFUSE_GATED_TRAINING=1`` (a trained gated region's middle in one kernel each way)."""
    def run():
        if gated_kernels:
            os.environ["FXFUSE_GATED_TRAINING"] = "1"
        if generic_backward:
            saved = set(fxfuse.ops._trained)
            fxfuse.ops._trained.clear()
            os.environ["FXFUSE_FUSED_BACKWARD"] = "0"
        try:
            for p in params:
                p.grad = None
            x.grad = None
            module(x).backward(grad_out)
        finally:
            if gated_kernels:
                del os.environ["FXFUSE_GATED_TRAINING"]
            if generic_backward:
                del os.environ["FXFUSE_FUSED_BACKWARD"]
                fxfuse.ops._trained.clear()
                fxfuse.ops._trained.update(saved)

    return run


def _forward(module, x):
    def run():
        return module(x)

    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads(run, x, params):
    run()
    torch.cuda.synchronize()
    return [x.grad.clone()] + [p.grad.clone() for p in params]


def _peak_mib(run) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_row(w, rounds: int, log, m: Optional[int] = None) -> dict:
    from triton.testing import do_bench

    model = build_module(w).train()
    params = list(model.parameters())
    x = make_input(w, m=m).requires_grad_(True)
    grad_out = torch.randn_like(model(x).detach())
    fast = fxfuse.optimize(model)
    compiled = torch.compile(copy.copy(model))
    backend = torch.compile(copy.copy(model), backend="fxfuse")
    steps = {
        "eager": _step(model, x, grad_out, params),
        "fxfuse": _step(fast, x, grad_out, params),
        "fxfuse recompute": _step(fast, x, grad_out, params, generic_backward=True),
        "compile default": _step(compiled, x, grad_out, params),
        "compile fxfuse backend": _step(backend, x, grad_out, params),
    }
    gated = w.kind in ("geglu", "swiglu")
    if gated:
        steps["fxfuse gated kernels"] = _step(fast, x, grad_out, params, gated_kernels=True)
    forwards = {"eager": _forward(model, x), "fxfuse": _forward(fast, x)}
    row: dict = {"name": w.name, "m": x.shape[0], "dims": w.dims_str, "dtype": str(w.dtype).replace("torch.", "")}
    t0 = time.perf_counter()
    ref = _grads(steps["eager"], x, params)
    for name in [n for n in steps if n != "eager"]:
        steps[name]()  # first call: compile / tune / mark the region trained
        got = _grads(steps[name], x, params)
        row[f"{name} grad rel err"] = max(_rel(g, r) for g, r in zip(got, ref))
    fxfuse.ops._trained.clear()
    fxfuse.ops._walked.clear()
    fast(x)  # an untrained region's gradient-recording forward: fused
    log(f"{w.name}: built and checked in {time.perf_counter() - t0:.1f}s")
    times: dict[str, list[float]] = {k: [] for k in steps}
    fwd_times: dict[str, list[float]] = {k: [] for k in forwards}
    for _ in range(rounds):
        fxfuse.ops._trained.clear()
        fxfuse.ops._walked.clear()  # a forward whose gradients nobody asks for: no stores for the walk
        for name in forwards:  # before any backward of this round: the fxfuse forward runs fused
            fwd_times[name].append(do_bench(forwards[name], warmup=25, rep=100, return_mode="median") * 1e3)
        for name, run in steps.items():
            times[name].append(do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3)
    for name, ts in times.items():
        row[f"{name} step us"] = statistics.median(ts)
    for name, ts in fwd_times.items():
        row[f"{name} grad-recording forward us"] = statistics.median(ts)
    for name in ("eager", "fxfuse"):  # a step slower than its kernels: is it the host?
        row[f"{name} host us"] = host_us(steps[name], calls=20, loops=5)
        row[f"{name} synced us"] = synced_us(steps[name])
        row[f"{name} kernels us"] = sum(us for _, us, _ in kernels_after_flush(steps[name]))
    row["eager peak MiB"] = _peak_mib(steps["eager"])
    row["fxfuse peak MiB"] = _peak_mib(steps["fxfuse"])
    row["fxfuse recompute peak MiB"] = _peak_mib(steps["fxfuse recompute"])
    if gated:
        row["fxfuse gated kernels peak MiB"] = _peak_mib(steps["fxfuse gated kernels"])
    return row


def table(rows: list[dict]) -> str:
    head = ("| name | M | dims | dtype | eager step µs | fxfuse step µs | vs eager | fxfuse recompute step µs "
            "| fxfuse gated kernels step µs | compile default step µs | compile fxfuse backend step µs "
            "| grad-recording forward µs (eager / fxfuse) | kernels µs per step (eager / fxfuse) "
            "| peak MiB (eager / fxfuse / recompute / gated kernels) | host µs per step (eager / fxfuse) "
            "| synchronized step µs (eager / fxfuse) | max grad rel err vs eager |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        err = max(r[k] for k in r if k.endswith("grad rel err"))
        middle = r.get("fxfuse gated kernels step us")
        middle_peak = r.get("fxfuse gated kernels peak MiB")
        lines.append(
            f"| {r['name']} | {r['m']} | {r['dims']} | {r['dtype']} | {r['eager step us']:.0f} "
            f"| {r['fxfuse step us']:.0f} | {r['eager step us'] / r['fxfuse step us']:.2f}× "
            f"| {r['fxfuse recompute step us']:.0f} | {'—' if middle is None else f'{middle:.0f}'} "
            f"| {r['compile default step us']:.0f} "
            f"| {r['compile fxfuse backend step us']:.0f} "
            f"| {r['eager grad-recording forward us']:.0f} / {r['fxfuse grad-recording forward us']:.0f} "
            f"| {r['eager kernels us']:.0f} / {r['fxfuse kernels us']:.0f} "
            f"| {r['eager peak MiB']:.0f} / {r['fxfuse peak MiB']:.0f} / {r['fxfuse recompute peak MiB']:.0f} "
            f"/ {'—' if middle_peak is None else f'{middle_peak:.0f}'} "
            f"| {r['eager host us']:.0f} / {r['fxfuse host us']:.0f} "
            f"| {r['eager synced us']:.0f} / {r['fxfuse synced us']:.0f} | {err:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=",".join(ROWS), help="comma-separated workload names")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--m", type=int, default=None, help="rows per step for every selected workload")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_training.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.only.split(",")
    rows = []

    def log(msg: str) -> None:
        print(msg, flush=True)

    for w in WORKLOADS:
        if w.name in wanted:
            rows.append(bench_row(w, args.rounds, log, args.m))
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    text = (f"### Training steps, {gpu}, {time.strftime('%Y-%m-%d %H:%M')} (`python3 benchmarks/bench_training.py`)\n\n"
            f"torch {torch.__version__}; step = forward + backward (input and parameter gradients), "
            f"do_bench median (L2 flushed), median of {args.rounds} interleaved rounds.\n\n{table(rows)}\n")
    (args.out / "training.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
