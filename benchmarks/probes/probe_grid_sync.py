"""The one-row decode MLP in one launch (grid barrier, W2 prefetched) against today's two small-M launches.

For gpt2m_mlp_m1 (1024 -> 4096 -> 1024, GELU-tanh, biases) and llama_swiglu_m1 (4096 -> 14336 -> 4096, gated),
bf16: every grid-sync config (checked against float64 first), the autotuned grid-sync path, its two-launch
fallback, the two small-M stage launches (``run_stage_gemv``, autotuned: the per-stage strategy), and eager.
GPU µs = ``triton.testing.do_bench`` median (L2 flushed), median of 3; wall = µs per call of 200 back-to-back
calls; the CUDA-graph line captures the cooperative launch and replays it.

    python3 benchmarks/probes/probe_grid_sync.py [--rows gpt2m,llama]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.probes.probe_inductor_decode import kernels_after_flush  # noqa: E402
from benchmarks.timing import wall_us  # noqa: E402
from fxfuse.kernels import fastlaunch, grid_sync_launch, run_grid_sync, run_stage_gemv  # noqa: E402
from fxfuse.kernels.grid_sync_template import fit_grid_sync_config, gpu_grid_sync_configs  # noqa: E402
from fxfuse.kernels.template import sm_count  # noqa: E402

ROWS = {
    "gpt2m": dict(K=1024, H=4096, N=1024, gated=False, bias=True, epilogues=("gelu_tanh(a0)", "a0")),
    "llama": dict(K=4096, H=14336, N=4096, gated=True, bias=False, epilogues=("mul(silu(a0),a1)", "a0")),
}


def _bench(fn) -> float:
    from triton.testing import do_bench

    return sorted(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3))[1]


def event_us(fn, flush: str, reps: int = 100) -> float:
    """Median µs between CUDA events around ``fn()``, each call after ``flush``: "dirty" (do_bench's 256 MB zero
    fill), "clean" (reading 256 MB) or "none" (weights may stay in L2)."""
    cache = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device="cuda")
    times = []
    for _ in range(reps):
        if flush == "dirty":
            cache.zero_()
        elif flush == "clean":
            cache.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2] * 1e3


def timeline_after_flush(fn, calls: int = 30) -> str:
    """From the profiler's device timeline, each call after do_bench's 256 MB zero fill: the median gap from the
    fill's end to the first kernel's start, the span from there to the last kernel's end, and the kernels' busy
    time (sum of durations). A span longer than the busy time is time between or inside launches."""
    from torch.profiler import ProfilerActivity, profile

    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    gaps, spans, busy = [], [], []
    fill_end, mine = None, []

    def close():
        if fill_end is not None and mine:
            gaps.append(mine[0].time_range.start - fill_end)
            spans.append(mine[-1].time_range.end - mine[0].time_range.start)
            busy.append(sum(e.time_range.end - e.time_range.start for e in mine))

    for e in kernels:
        if "fill" in e.name.lower():
            close()
            fill_end, mine = e.time_range.end, []
        else:
            mine.append(e)
    close()
    med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")  # noqa: E731
    return f"gap {med(gaps):5.1f}  span {med(spans):5.1f}  busy {med(busy):5.1f} µs"


def _rel(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="gpt2m,llama")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.rows.split(","):
        _probe_row(name, ROWS[name])


def _probe_row(name: str, r: dict) -> None:
    d = dict(device="cuda", dtype=torch.bfloat16)
    sms = sm_count(torch.device("cuda"))
    K, H, N = r["K"], r["H"], r["N"]
    x = torch.randn(1, K, **d)
    w0s = [torch.randn(H, K, **d) * K**-0.5 for _ in range(2 if r["gated"] else 1)]
    w2 = torch.randn(N, H, **d) * H**-0.5
    b0s = [torch.randn(H, **d) * 0.1 if r["bias"] else None for _ in w0s]
    b2 = torch.randn(N, **d) * 0.1 if r["bias"] else None
    weights, biases = [*w0s, w2], [*b0s, b2]
    a = [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(w0s, b0s)]
    h = F.silu(a[0]) * a[1] if r["gated"] else F.gelu(a[0], approximate="tanh")
    ref = F.linear(h, w2.double(), None if b2 is None else b2.double())
    e0, e1 = r["epilogues"]
    print(f"== {name}: K={K} H={H} N={N} ({sms} SMs)", flush=True)
    configs = {}
    for c in gpu_grid_sync_configs():
        cfg = fit_grid_sync_config(c, K, H, N, sms)
        if cfg is None:
            continue
        kw = cfg.kwargs
        label = f"H{kw['BLOCK_H']} K{kw['BLOCK_K']} N{kw['BLOCK_N']} HH{kw['BLOCK_HH']} w{c.num_warps}" + \
            (" prefetch" if kw["PREFETCH"] else "")
        fn = functools.partial(run_grid_sync, x, weights, biases, [[], []], (e0, e1), config=cfg)
        try:
            err = _rel(fn(), ref)
            torch.cuda.synchronize()
            configs[label] = fn
            print(f"  config {label:36s} rel err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            print(f"  config {label:36s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    variants = {
        "grid sync (autotuned, 1 launch)": functools.partial(run_grid_sync, x, weights, biases, [[], []], (e0, e1)),
        "grid sync (2 launches)": functools.partial(run_grid_sync, x, weights, biases, [[], []], (e0, e1),
                                                    phases=2),
        "small-M stages (2 launches)": lambda: run_stage_gemv(
            run_stage_gemv(x, w0s, b0s, [], e0), [w2], [b2], [], e1),
        "eager": lambda: F.linear(
            (F.silu(F.linear(x, w0s[0])) * F.linear(x, w0s[1])) if r["gated"]
            else F.gelu(F.linear(x, w0s[0], b0s[0]), approximate="tanh"), w2, b2),
    }
    for label, fn in variants.items():
        err = _rel(fn(), ref)
        fn()
        torch.cuda.synchronize()
        print(f"  {label:34s} GPU {_bench(fn):7.1f} µs  wall {wall_us(fn):6.1f} µs/call  rel err {err:.1e}",
              flush=True)
    # The launch options, through the replay step the region would record (its host path).
    real_pdl = grid_sync_launch._pdl_supported
    for coop in (True, False):
        for pdl in (True, False):
            grid_sync_launch.COOPERATIVE = coop
            grid_sync_launch._pdl_supported = real_pdl if pdl else (lambda x: False)
            grid_sync_launch._bound.clear()
            run = functools.partial(run_grid_sync, x, weights, biases, [[], []], (e0, e1), check=False)
            run()
            with fastlaunch.recording() as steps:
                run()
            step = steps[0]
            fn = functools.partial(step, x)
            err = _rel(fn(), ref)
            torch.cuda.synchronize()
            label = f"replay step coop={coop} pdl={pdl}"
            variants[label] = fn
            print(f"  {label:34s} GPU {_bench(fn):7.1f} µs  wall {wall_us(fn):6.1f} µs/call  rel err {err:.1e}",
                  flush=True)
    grid_sync_launch.COOPERATIVE, grid_sync_launch._pdl_supported = True, real_pdl
    gemv_steps = []
    with fastlaunch.recording() as steps:
        run_stage_gemv(run_stage_gemv(x, w0s, b0s, [], e0), [w2], [b2], [], e1)
    gemv_steps = list(steps)

    def two_steps():
        return gemv_steps[1](gemv_steps[0](x))

    variants["small-M replay steps"] = two_steps
    print(f"  {'small-M replay steps':34s} GPU {_bench(two_steps):7.1f} µs  wall {wall_us(two_steps):6.1f} µs/call",
          flush=True)
    # Each config alone as the region's replay step (the autotuner given that one config).
    from fxfuse import codegen

    kernel = codegen.generated_grid_sync_kernel(len(w0s), e0, e1).fused_grid_sync_kernel
    all_configs = kernel.configs
    for c in all_configs:
        cfg = fit_grid_sync_config(c, K, H, N, sms)
        if cfg is None:
            continue
        kernel.configs, kernel.cache = [cfg], {}  # fitted: a lone config skips the pruner
        getattr(kernel, "_fxfuse_lean", None) and kernel._fxfuse_lean.entries.clear()
        grid_sync_launch._bound.clear()
        run = functools.partial(run_grid_sync, x, weights, biases, [[], []], (e0, e1), check=False)
        run()
        with fastlaunch.recording() as steps:
            run()
        fn = functools.partial(steps[0], x)
        kw = cfg.kwargs
        label = f"H{kw['BLOCK_H']} K{kw['BLOCK_K']} N{kw['BLOCK_N']} HH{kw['BLOCK_HH']} w{c.num_warps}" + \
            (" prefetch" if kw["PREFETCH"] else "")
        print(f"  step {label:36s} GPU {_bench(fn):6.1f}  events dirty {event_us(fn, 'dirty'):6.1f}  clean "
              f"{event_us(fn, 'clean'):6.1f} µs  rel err {_rel(fn(), ref):.1e}  timeline {timeline_after_flush(fn)}",
              flush=True)
    kernel.configs, kernel.cache = all_configs, {}
    for label in ("replay step coop=True pdl=True", "replay step coop=False pdl=False", "small-M replay steps",
                  "eager"):
        print(f"  timeline {label:34s} {timeline_after_flush(variants[label])}", flush=True)
    for label in ("replay step coop=True pdl=True", "small-M replay steps", "eager"):
        fn = variants[label]
        print(f"  events {label:34s} " + "  ".join(f"{flush} {event_us(fn, flush):6.1f}"
                                                     for flush in ("dirty", "clean", "none")) + " µs", flush=True)
    # Device time after do_bench's flush (profiler: after the host-bound timings, it slows later launches).
    for label, fn in [*configs.items(), *variants.items()]:
        kernels = kernels_after_flush(fn)
        total = sum(t for _, t in kernels)
        print(f"  device {label:36s} {total:6.1f} µs  " + ", ".join(f"{k[:28]} {t:.1f}" for k, t in kernels),
              flush=True)
    # The cooperative launch inside a CUDA graph: captured, replayed, checked.
    try:
        fn = variants["grid sync (autotuned, 1 launch)"]
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = run_grid_sync(static_x, weights, biases, [[], []], (e0, e1))
        g.replay()
        torch.cuda.synchronize()
        print(f"  CUDA graph replay: rel err {_rel(y, ref):.1e}, GPU {_bench(g.replay):.1f} µs, "
              f"wall {wall_us(g.replay):.1f} µs/call", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"  CUDA graph: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
