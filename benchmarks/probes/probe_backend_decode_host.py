"""Where the host time of a compiled decode step goes: ``torch.compile`` vs ``backend="fxfuse"`` (default mode).

``decode_model.md`` reads the backend's step slower on the wall than torch.compile's (both host-bound) although
its GPU time is lower. This probe decodes the same Llama (DynamicCache, as in the table) with both, times the
steps, and profiles a few of them on the CPU side: the ops with the most host time per step (the region's call is
``fxfuse::mlp_infer``), and the time inside fxfuse's runtime (``fxfuse.ops._dispatch``) per call.

    python3 benchmarks/probes/probe_backend_decode_host.py [--layers 4] [--steps 32] [--no-profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_decode_model import build, decode  # noqa: E402
from fxfuse import ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-profile", action="store_true", help="timings and replay counts only")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args.layers, 32000, False, "cuda", torch.bfloat16)
    prompt = torch.randint(3, 32000, (1, 128), device="cuda")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    variants = {"compile": torch.compile(model), "backend": torch.compile(model, backend="fxfuse")}
    spent = []
    run = ops._dispatch

    def timed_run(*a):
        start = time.perf_counter()
        try:
            return run(*a)
        finally:
            spent.append(time.perf_counter() - start)

    ops._dispatch = timed_run
    for m in variants.values():
        decode(m, prompt, args.steps, torch.cuda.synchronize)  # compile, plan, tune
    walls, per_call = {k: [] for k in variants}, float("nan")
    for _ in range(5):
        for k, m in variants.items():
            spent.clear()
            walls[k].append(decode(m, prompt, args.steps, torch.cuda.synchronize)[1] * 1e6 / args.steps)
            if k == "backend" and spent:
                per_call = statistics.median(spent) * 1e6
    from fxfuse import replay

    hits = []
    try_replay = ops._try_replay

    def counted(*a):
        key, out = try_replay(*a)
        hits.append((tuple(a[0].shape), key is not None, out is not None))
        return key, out

    ops._try_replay = counted
    decode(variants["backend"], prompt, 4, torch.cuda.synchronize)
    ops._try_replay = try_replay
    print("backend: _try_replay (x shape, key computed, replayed) over a prefill and 4 steps:", hits)
    print("replays:", [(k[0], k[1]) for k in replay.replays], "failed builds:", dict(replay._failed_builds))
    for k in variants:
        print(f"{k}: wall µs/step median {statistics.median(walls[k]):.0f} ({', '.join(f'{w:.0f}' for w in walls[k])})")
    import gc

    for label, collect in (("gc off", False), ("gc on", True), ("gc off", False)):  # (interleaved, again)
        if not collect:
            gc.collect()
            gc.disable()
        rounds = {k: [decode(m, prompt, args.steps, torch.cuda.synchronize)[1] * 1e6 / args.steps for _ in range(3)]
                  for k, m in variants.items()}
        gc.enable()
        print(f"{label}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in rounds.items()) + " µs/step")
    print(f"backend: fxfuse.ops._dispatch median {per_call:.1f} µs per call, {args.layers} calls per step")
    # One layer's region call, replayed on its own: back to back (GPU busy) and after a synchronization (GPU idle).
    captured = []
    dispatch = ops._dispatch

    def capture(*a):
        captured.append(a)
        return dispatch(*a)

    ops._dispatch = capture
    decode(variants["backend"], prompt, 1, torch.cuda.synchronize)
    ops._dispatch = dispatch
    a = next(c for c in captured if c[0].shape[1] == 1)
    for label, sync_each in (("back to back", False), ("GPU idle before each", True)):
        times = []
        for _ in range(200):
            if sync_each:
                torch.cuda.synchronize()
            start = time.perf_counter()
            ops._dispatch(*a)
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        print(f"one region's _dispatch alone, {label}: median {statistics.median(times) * 1e6:.1f} µs")
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    for k, m in variants.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode(m, prompt, args.steps, torch.cuda.synchronize)
        print(f"\n== {k}: CPU self time, top ops (µs total over {args.steps} steps + prefill)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()
