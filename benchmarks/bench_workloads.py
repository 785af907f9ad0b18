#!/usr/bin/env python3
"""Benchmark fxfuse on the standard workload set (/work/shared/workloads.md) against eager and torch.compile.

One process, one GPU call (≈ 7 min with max-autotune, ≈ 2 min without)::

    python3 benchmarks/bench_workloads.py --out $OUT                      # everything, bounded to ~420 s
    python3 benchmarks/bench_workloads.py --out $OUT --skip-max-autotune  # ≈ 2 min

What it does, in order:

1. Ceilings: a 1 GiB device-to-device copy (read + write bytes counted) and 8192³ bf16 / fp16 matmuls,
   ``triton.testing.do_bench(..., return_mode="median")`` on random data.
2. Pass 1, for every row (``--only`` filters): build the module (random weights, ``.eval()``), then
   * correctness reference: a float64 copy of the module on a fresh random input (upcast);
   * eager, CUDA-graphed eager (graph replay of a static-input call), ``torch.compile(mod)`` default, and
     fxfuse as a user gets it: ``fxfuse.optimize(mod)`` with default settings (autotuning and the measured
     choice against the original ops on), each built first (first-call wall time for torch.compile and
     fxfuse, one warm-up call) and kept alive until the row's timing is done;
   * ``torch.compile(mod, backend="fxfuse")`` (the compile backend: fxfuse's regions as opaque calls, Inductor
     around them), built after fxfuse.optimize (so its first call finds fxfuse's choices made) and checked for
     correctness against the same reference;
   * decode rows also: ``fxfuse.optimize(mod, cuda_graphs=True)`` (opt-in CUDA graphs), built and checked
     for correctness the same way; "n/a" when this fxfuse has no such option;
   * then the timing: eager once, dropped (building the variants left the GPU idle and cool, and a first timing
     would run at clocks the others never see), then ``--rounds`` (default 3) interleaved rounds: each round times
     every variant once (eager, CUDA graph, compile default, compile backend=fxfuse, fxfuse, fxfuse CUDA graphs,
     then the limits below; each round starts further along that list: ``measure.round_order``, so no variant is
     always timed late), and a cell is the median over the rounds (``gpu_rounds`` /
     ``wall_rounds`` in results.json keep each round). GPU µs: do_bench
     median (L2 flushed); decode rows also wall µs/call of 200 back-to-back calls (median of 5 such loops).
     H200 timings drift by 3-6 % within a run (clocks, power): variants timed one after the other would get
     a bias from when they ran, interleaved rounds spread that drift over all of them;
   * fxfuse correctness: ‖opt(x) − ref‖/‖ref‖ against the float64 reference (tolerance 2e-2 for bf16/fp16),
     plus a determinism check (two calls on one input must agree bit for bit);
   * floor = max(FLOPs / matmul rate, min bytes / copy bandwidth) with the ceilings measured in step 1;
   * the row's measured limits (``benchmarks/limits.py``), timed in the same rounds after the variants: "read
     once" (the fastest plain streaming read of the row's minimum bytes) and "GEMMs alone" (its linears as plain
     cuBLAS ``torch.mm``, no epilogue); ``--skip-limits`` leaves them out;
   * ``fxfuse.report(opt)`` printed to the log (regions, strategies).
   The spread of eager's rounds ((max − min) / min, "eager spread") is the run's noise.
3. Pass 2 (max-autotune, bounded): ``torch.compile(mod, mode="max-autotune-no-cudagraphs")`` compiles take
   11–46 s per module (≈ 205 s for all 9 on a fresh H200), the bulk of the run. They run AFTER every row's
   main numbers are in, in priority order (llama_swiglu_4096, the slowest compile, last). A compile starts only
   while the max-autotune compile time so far is under ``--max-autotune-budget`` (default 300 s) and the run
   can still finish by ``--deadline`` (default 420 s): elapsed + ``--max-autotune-reserve`` (default 45 s, the
   longest compile measured, or the longest one of this run if larger) ≤ deadline. A row not reached prints
   "skipped (budget)" in its cell (the reason is in results.json). A compiled row is first timed once and the
   result dropped (the GPU idled, cooler, while Inductor compiled: a first timing would run at clocks the main
   rounds never saw), then in ``--rounds`` interleaved rounds beside eager. ``--skip-max-autotune`` turns the
   pass off; ``--max-autotune-rows a,b`` picks (and orders) the rows explicitly.
4. Verdict per row (``workloads.judge``, a pure function): correct, GPU median ≤ target (gpt2m_mlp_m1: also
   wall ≤ 15 µs), and not slower than eager (GPU median, and wall on the decode rows, within
   ``--eager-slack``, default 2%). The table's "pass" column and the summary line under it say it.

Every variant is guarded: a failure prints ``ERR: <short message>`` in its cell and the run goes on
(a CUDA fault that poisons the context cannot be recovered in-process, though: later cells then fail too).
``torch._dynamo.reset()`` runs before a row's compile and after its timing rounds; memory is cleared between rows.
results.md / results.json / log.txt under ``--out`` are rewritten after every row, so a run cut short still
leaves every finished row behind. Measured on an H200 (2026-11-21): pass 1 ≈ 60–90 s (fxfuse first call 2–6 s
per row), pass 2 ≈ 210 s.

Without a GPU the script exits with a message, except with ``--dry-run``: builds every module on the CPU,
counts FLOPs/bytes from the modules (cross-checked against the table's dims), runs each module and its float64
reference on a few rows, and prints the floor table with the reference ceilings of workloads.md
(copy 4.23 TB/s, bf16 701 TFLOP/s, fp16 707 TFLOP/s). ``--cpu-smoke`` (development only) runs the whole
pipeline on the CPU with shrunken row counts and a host timer, to exercise the code paths.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.abc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.limits import LIMITS, limit_fns  # noqa: E402
from benchmarks.measure import Timer, cleanup, dynamo_reset, measure_ceilings, rel_err, round_order  # noqa: E402
from benchmarks.results_table import (  # noqa: E402
    SKIPPED_BUDGET,
    fmt_err,
    fmt_ratio,
    fmt_us,
    graphs_wall_str,
    is_num,
    meets_str,
    pass_str,
    render_md,
    target_str,
    wall_str,
    yes_no,
)
from benchmarks.workloads import (  # noqa: E402
    DECODE_CALLS,
    DECODE_LOOPS,
    EAGER_SLACK,
    REF_CEILINGS,
    TOL,
    WORKLOADS,
    Workload,
    build_module,
    count_work,
    floor_us,
    judge,
    make_input,
    table_work,
)

ROUNDS = 3  # interleaved timing rounds per row (--rounds): each variant's cell is its median over the rounds
# max-autotune priority: rows with a reference figure in workloads.md first, the slowest compile last.
MAX_AUTOTUNE_ORDER = [
    "seed_geglu", "gpt2_mlp", "llama_swiglu_m16", "gpt2m_mlp_m1", "nerf64", "nerf128",
    "gpt2m_mlp_m8", "llama_swiglu_m1", "llama_swiglu_4096",
]
VARIANTS = ["eager", "cudagraph", "compile_default", "compile_max_autotune", "compile_fxfuse", "fxfuse"]
# The order of every timing round (the variants a row built).
TIMING_ORDER = ["eager", "cudagraph", "compile_default", "compile_fxfuse", "fxfuse", "fxfuse_cuda_graphs", *LIMITS]

T_START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T_START


# --------------------------------------------------------------------------------------------- import


class _PatternsFinder(importlib.abc.MetaPathFinder):
    """Maps ``fxfuse.patterns`` to the repo's top-level ``patterns/`` folder when fxfuse is not installed.

    pyproject.toml ships ``patterns/`` as ``fxfuse.patterns`` (setuptools package-dir); an installed or
    editable fxfuse resolves it itself. This finder sits LAST on ``sys.meta_path``, so it is used only when
    nothing else finds the name (running from a bare checkout, e.g. on the GPU machine without pip install).
    """

    def find_spec(self, name, path=None, target=None):
        if name != "fxfuse.patterns":
            return None
        folder = REPO / "patterns"
        init = folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])


def import_fxfuse():
    """(module, None) or (None, reason)."""
    if not any(isinstance(f, _PatternsFinder) for f in sys.meta_path):
        sys.meta_path.append(_PatternsFinder())
    try:
        import fxfuse as fx
    except Exception as e:
        return None, short_err(e)[5:]
    for attr in ("optimize", "report"):
        if not hasattr(fx, attr):
            return None, f"fxfuse has no '{attr}'"
    return fx, None


# --------------------------------------------------------------------------------------------- output


class Tee:
    """Write to a stream and to a log file; everything else is delegated to the stream."""

    def __init__(self, stream, fh):
        self._stream, self._fh = stream, fh

    def write(self, data):
        self._stream.write(data)
        try:
            self._fh.write(data)
        except ValueError:  # log closed
            pass
        return len(data)

    def flush(self):
        self._stream.flush()
        try:
            self._fh.flush()
        except ValueError:
            pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def short_err(e: BaseException, n: int = 70) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    s = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return "ERR: " + (s if len(s) <= n else s[: n - 1] + "…")


# --------------------------------------------------------------------------------------------- timing


def guarded(row: dict, section: str, key: str, fn):
    """Run ``fn``; store its value (or ``ERR: ...``) in ``row[section][key]`` and return it."""
    t0 = time.perf_counter()
    try:
        v = fn()
    except Exception as e:
        v = short_err(e)
        tb = traceback.format_exc().strip().splitlines()
        print(f"  [{row['name']}] {section}.{key}: {v}")
        print("    " + "\n    ".join(tb[-12:]))
        row.setdefault("errors", {})[f"{section}.{key}"] = "\n".join(tb[-40:])
        cleanup()
    row[section][key] = v
    row.setdefault("step_s", {})[f"{section}.{key}"] = round(time.perf_counter() - t0, 3)
    return v


def time_rounds(row: dict, section: str, rounds_key: str, fns: dict, measure, rounds: int):
    """Time every variant of ``fns`` (name -> callable) in ``rounds`` interleaved rounds; cell = median.

    Each round calls ``measure(fn)`` once per variant, in the order of ``fns`` rotated by the round
    (:func:`measure.round_order`). GPU timings drift by 3-6 % within a run (clocks, power state), so variants
    measured one after the other get a bias from *when* they ran; interleaving spreads the drift over all of them.
    ``row[section][name]`` gets the median over the rounds, ``row[rounds_key][name]`` the per-round values. A
    variant whose measurement fails leaves the rounds and its cell shows the error (as ``guarded``).
    """
    vals = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    for r in range(rounds):
        for name in round_order(list(fns), r, rounds):
            fn = fns[name]
            if name not in vals:  # failed in an earlier round
                continue
            v = guarded(row, section, name, lambda fn=fn: measure(fn))
            spent[name] += row["step_s"][f"{section}.{name}"]
            if is_num(v):
                vals[name].append(v)
            else:
                row[rounds_key][name] = vals.pop(name)  # the rounds before the failure, for the log
    for name, vs in vals.items():
        row[section][name] = statistics.median(vs)
        row[rounds_key][name] = vs
    for name, t in spent.items():
        row["step_s"][f"{section}.{name}"] = round(t, 3)


# --------------------------------------------------------------------------------------------- rows


def row_floor(w: Workload, mod, ceil: dict) -> dict:
    es = torch.empty((), dtype=w.dtype).element_size()
    lins = w.linears
    flops, nbytes = count_work(mod, w.m, lins[0][0], lins[-1][1], es)
    t_flops, t_bytes = table_work(w)
    if (flops, nbytes) != (t_flops, t_bytes):
        print(f"  WARNING {w.name}: module counts ({flops}, {nbytes}) != table counts ({t_flops}, {t_bytes})")
    rate = ceil["bf16_flops"] if w.dtype == torch.bfloat16 else ceil["fp16_flops"]
    fl, bound, t_c, t_m = floor_us(flops, nbytes, rate, ceil["copy_Bps"])
    return {"flops": flops, "bytes": nbytes, "floor_us": fl, "bound": bound, "compute_us": t_c, "memory_us": t_m}


def new_row(w: Workload) -> dict:
    return {
        "name": w.name, "kind": w.kind, "m": w.m, "dims": w.dims_str, "dtype": str(w.dtype).replace("torch.", ""),
        "input_shape": list(w.input_shape), "decode": w.decode,
        "target_us": w.target_us, "target_wall_us": w.target_wall_us,
        "ref": {"floor_us": w.ref_floor_us, "eager_us": w.ref_eager_us, "compile_us": w.ref_compile_us},
        "gpu_us": {}, "first_call_s": {}, "wall_us": {}, "rel_err": {}, "check": {}, "report": {}, "floor": {},
        "gpu_rounds": {}, "wall_rounds": {},  # per-round values behind the medians in gpu_us / wall_us
    }


def cuda_graph(mod, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            mod(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mod(x)
    g.replay()
    torch.cuda.synchronize()
    return g, out


def summarize_report(rep, m: Optional[int] = None) -> dict:
    """The report's facts for the results; strategies as they run at ``m`` rows (the row's M)."""
    regions = list(getattr(rep, "regions", []) or [])

    def running(r) -> str:
        if hasattr(r, "running_at"):
            return r.running_at(m if getattr(r, "m", None) is None else r.m)
        return str(getattr(r, "strategy", "?"))

    return {
        "n_regions": len(regions),
        "strategies": dict(Counter(running(r) for r in regions)),
        "patterns": dict(Counter(str(getattr(r, "pattern", "?")) for r in regions)),
        "module_paths": [str(getattr(r, "module_path", "")) for r in regions],
        "text": str(rep),
    }


def run_row_main(w: Workload, idx: int, args, timer: Timer, ceil: dict, fx, fx_import_err, row: dict):
    dev = args.device
    seed = 1000 + idx
    m_eff = w.m
    if args.cpu_smoke:
        m_eff = min(w.m, 8)
    shape = w.input_shape if m_eff == w.m else (m_eff, w.input_shape[-1])
    print(f"\n== {w.name}: {w.kind} M={w.m} dims {w.dims_str} {row['dtype']} input {tuple(shape)}  "
          f"[t={elapsed():.0f}s]")

    mod = build_module(w, device=dev, seed=seed)
    row["floor"] = row_floor(w, mod, ceil)
    f = row["floor"]
    print(f"  FLOPs {f['flops'] / 1e9:.2f} G, min bytes {f['bytes'] / 1e6:.2f} MB -> floor {f['floor_us']:.1f} µs "
          f"({f['bound']}-bound; compute {f['compute_us']:.1f}, memory {f['memory_us']:.1f})")
    x = make_input(w, device=dev, seed=seed + 1, m=None if m_eff == w.m else m_eff)

    # float64 reference on a fresh random input (before anything else touches the module)
    ref_state = {}

    def build_ref():
        xc = make_input(w, device=dev, seed=seed + 2, m=None if m_eff == w.m else m_eff)
        mod64 = copy.deepcopy(mod).double()
        ref = mod64(xc.double())
        del mod64
        cleanup()
        ref_state["xc"], ref_state["ref"] = xc, ref
        return rel_err(mod(xc), ref)

    guarded(row, "rel_err", "eager", build_ref)

    # Every variant is built first (first call, compile time, correctness) and its timing function kept in
    # ``timed``; ``keep`` holds what those functions need alive (graph, compiled module, optimized module)
    # until the interleaved timing rounds at the end of the row are done.
    timed = {"eager": lambda: mod(x)}
    keep = {}

    # CUDA-graphed eager
    if args.cpu_smoke:
        row["gpu_us"]["cudagraph"] = "ERR: no CUDA (cpu smoke)"
    else:

        def graph_capture():
            t0 = time.perf_counter()
            keep["graph"] = cuda_graph(mod, x)  # (graph, its static output)
            return time.perf_counter() - t0

        v = guarded(row, "first_call_s", "cudagraph", graph_capture)
        if "graph" in keep:
            timed["cudagraph"] = keep["graph"][0].replay
        else:
            row["gpu_us"]["cudagraph"] = v
        cleanup()

    # torch.compile default. Dynamo is reset before the compile but NOT after it: torch._dynamo.reset() drops
    # Dynamo's code caches, and the kept ``cm`` would then recompile on its next call, inside the timing rounds
    # (checked on torch 2.x: a call after the reset traces and compiles again). The reset runs after the rounds
    # instead. fxfuse.optimize traces with torch.fx, not Dynamo, so the live Dynamo cache does not affect it.
    dynamo_reset()
    guarded(row, "first_call_s", "compile_default", first_compile(mod, x, timer, keep, "cm"))
    if "cm" in keep:
        cm = keep["cm"]
        timed["compile_default"] = lambda: cm(x)
    else:
        row["gpu_us"]["compile_default"] = row["first_call_s"]["compile_default"]
    cleanup()

    # fxfuse
    if fx is None:
        msg = f"ERR: import fxfuse failed: {fx_import_err}"[:80]
        row["gpu_us"]["fxfuse"] = msg
        row["first_call_s"]["fxfuse"] = msg
    else:

        def fx_first():
            t0 = time.perf_counter()
            opt = fx.optimize(mod)  # as a user gets it: default settings, no example inputs
            t1 = time.perf_counter()
            opt(x)  # warm-up: Triton compile, autotune, measured choice against the original ops
            timer.sync()
            t2 = time.perf_counter()
            keep["opt"] = opt
            row["first_call_s"]["fxfuse_optimize"] = t1 - t0
            row["first_call_s"]["fxfuse_first_run"] = t2 - t1
            return t2 - t0

        guarded(row, "first_call_s", "fxfuse", fx_first)
        if "opt" in keep:
            opt = keep["opt"]

            def report():
                s = summarize_report(fx.report(opt), w.m)
                row["report"] = s
                print("  fxfuse.report:")
                print("    " + "\n    ".join(s["text"].splitlines()))
                print(f"  -> {s['n_regions']} fused region(s), strategies {s['strategies']}, patterns {s['patterns']}")
                return s["n_regions"]

            guarded(row, "check", "n_regions", report)

            def check():
                if "ref" not in ref_state:
                    raise RuntimeError("no float64 reference (see rel_err.eager)")
                xc, ref = ref_state["xc"], ref_state["ref"]
                o1 = opt(xc)
                o2 = opt(xc)
                timer.sync()
                row["check"]["deterministic"] = bool(torch.equal(o1, o2))
                row["check"]["dtype_ok"] = o1.dtype == w.dtype
                row["check"]["finite"] = bool(torch.isfinite(o1).all())
                e = rel_err(o1, ref)
                row["check"]["pass"] = bool(math.isfinite(e) and e <= TOL and row["check"]["finite"])
                return e

            e = guarded(row, "rel_err", "fxfuse", check)
            if not is_num(e):
                row["check"]["pass"] = False
            ee = row["rel_err"].get("eager")
            verdict = "PASS" if row["check"].get("pass") else "FAIL"
            print(f"  correctness: fxfuse rel err {fmt_err(e)} (eager {fmt_err(ee)}), tol {TOL:g} -> {verdict}; "
                  f"deterministic={row['check'].get('deterministic')}")
            timed["fxfuse"] = lambda: opt(x)
        else:
            row["gpu_us"]["fxfuse"] = row["first_call_s"]["fxfuse"]
            row["check"]["pass"] = False
    if fx is not None:
        cb = build_compile_fxfuse(w, mod, x, ref_state, timer, row)
        if cb is not None:
            keep["cb"] = cb
            timed["compile_fxfuse"] = lambda: cb(x)
    if w.decode:
        optg = build_fxfuse_cuda_graphs(w, fx, mod, x, ref_state, timer, row)
        if optg is not None:
            keep["optg"] = optg
            timed["fxfuse_cuda_graphs"] = lambda: optg(x)

    # the row's measured limits (benchmarks/limits.py), timed in the same rounds as its variants
    if not args.skip_limits:
        def build_limits():
            fns = limit_fns(mod, m_eff)
            timed.update(fns)
            read = fns["read_once"]
            row["check"]["read_once_kernel"] = read.choice
            tried = ", ".join(f"{name} {us:.1f}" for name, us in read.tried.items())
            print(f"  limits: read once by {read.choice}" + (f" (µs: {tried})" if tried else ""))
            return "built"

        guarded(row, "check", "limits", build_limits)

    # the timing: interleaved rounds over every variant that was built (GPU median; decode rows also wall)
    timed = {k: timed[k] for k in TIMING_ORDER if k in timed}
    print(f"  timing {', '.join(timed)} in {args.rounds} interleaved round(s)  [t={elapsed():.0f}s]")
    # Building the variants (compiles, tuning) left the GPU idle for seconds: a first timing runs at clocks the
    # later ones never see, and it would always be eager's. One discarded timing of eager brings the GPU back to
    # its sustained state (bench_sweep.py, llama M=1024 on an H100: eager's rounds read 504.6 / 542.9 / 561.1 µs).
    guarded(row, "check", "gpu_warmup", lambda: timer.gpu_us(timed["eager"]))
    time_rounds(row, "gpu_us", "gpu_rounds", timed, timer.gpu_us, args.rounds)
    if w.decode:  # wall per call: the model's variants only (a limit is a GPU bound)
        time_rounds(row, "wall_us", "wall_rounds", {k: f for k, f in timed.items() if k not in LIMITS},
                    lambda fn: timer.wall_us(fn)["median"], args.rounds)
    timed.clear()
    keep.clear()
    dynamo_reset()
    derive(row)
    print_row(row)
    ref_state.clear()  # the module, inputs and compiled variants go with this frame; main() then cleans up


def first_compile(mod, x, timer: Timer, keep: dict, key: str, **compile_kwargs):
    """A step for ``guarded``: ``torch.compile(mod, **compile_kwargs)`` and its first call on x; the compiled module
    is kept in ``keep[key]``, the step returns the wall seconds of both."""

    def first() -> float:
        t0 = time.perf_counter()
        compiled = torch.compile(mod, **compile_kwargs)
        compiled(x)
        timer.sync()
        keep[key] = compiled
        return time.perf_counter() - t0

    return first


def build_compile_fxfuse(w: Workload, mod, x, ref_state: dict, timer: Timer, row: dict):
    """``torch.compile(mod, backend="fxfuse")``: build (first-call wall time), check against the float64 reference
    (``rel_err["compile_fxfuse"]``, ``check["compile_fxfuse_pass"]``); the compiled module, or None if it failed."""
    keep = {}
    v = guarded(row, "first_call_s", "compile_fxfuse", first_compile(mod, x, timer, keep, "cb", backend="fxfuse"))
    if "cb" not in keep:
        row["gpu_us"]["compile_fxfuse"] = v
        return None
    cb = keep["cb"]

    def check():
        if "ref" not in ref_state:
            raise RuntimeError("no float64 reference (see rel_err.eager)")
        out = cb(ref_state["xc"])
        timer.sync()
        return rel_err(out, ref_state["ref"])

    e = guarded(row, "rel_err", "compile_fxfuse", check)
    row["check"]["compile_fxfuse_pass"] = bool(is_num(e) and e <= TOL)
    print(f"  compile backend=fxfuse: rel err {fmt_err(e)} -> "
          f"{'PASS' if row['check']['compile_fxfuse_pass'] else 'FAIL'}")
    return cb


def build_fxfuse_cuda_graphs(w: Workload, fx, mod, x, ref_state: dict, timer: Timer, row: dict):
    """Decode rows: ``fxfuse.optimize(mod, cuda_graphs=True)`` (opt-in): build, first calls, correctness.

    Returns the optimized module for the timing rounds, or None (its cells then say why). The cells read "n/a"
    when this fxfuse has no ``cuda_graphs`` option (TypeError from optimize).
    """
    key = "fxfuse_cuda_graphs"
    if fx is None:
        row["wall_us"][key] = "—"
        return None
    st = {}

    def first():
        try:
            optg = fx.optimize(mod, cuda_graphs=True)
        except TypeError as e:
            if "cuda_graphs" not in str(e):  # a TypeError from inside optimize is a real failure
                raise
            return "n/a"
        t0 = time.perf_counter()
        optg(x)  # warm-up (the measured choice; a capture may happen here or on the next call)
        optg(x)
        timer.sync()
        st["opt"] = optg
        return time.perf_counter() - t0

    v = guarded(row, "first_call_s", key, first)
    if "opt" not in st:
        row["wall_us"][key] = v  # "n/a" or ERR
        row["gpu_us"][key] = v
        return None
    optg = st.pop("opt")

    def check():
        if "ref" not in ref_state:
            raise RuntimeError("no float64 reference (see rel_err.eager)")
        out = optg(ref_state["xc"]).clone()  # clone: a graph's output buffer is overwritten by the next replay
        timer.sync()
        e = rel_err(out, ref_state["ref"])
        row["check"]["cuda_graphs_pass"] = bool(math.isfinite(e) and e <= TOL)
        # Whether the keep timing kept a graph (its replay beat the plain call) or the module runs plainly.
        row["check"]["cuda_graphs_kept"] = getattr(getattr(optg, "forward", None), "num_graphs", None)
        return e

    e = guarded(row, "rel_err", key, check)
    ok = "PASS" if row["check"].get("cuda_graphs_pass") else "FAIL"
    print(f"  fxfuse cuda_graphs=True: rel err {fmt_err(e)} -> {ok}")
    return optg


def run_row_max_autotune(w: Workload, idx: int, args, timer: Timer, row: dict):
    dev = args.device
    seed = 1000 + idx
    m_eff = min(w.m, 8) if args.cpu_smoke else w.m
    print(f"\n== {w.name}: torch.compile max-autotune-no-cudagraphs  [t={elapsed():.0f}s]")
    mod = build_module(w, device=dev, seed=seed)
    x = make_input(w, device=dev, seed=seed + 1, m=None if m_eff == w.m else m_eff)
    dynamo_reset()
    st = {}
    guarded(row, "first_call_s", "compile_max_autotune",
            first_compile(mod, x, timer, st, "cm", mode="max-autotune-no-cudagraphs"))
    if "cm" in st:
        cm = st["cm"]
        # The compile leaves the GPU idle (and cool) for seconds: a first do_bench would run at boost clocks the
        # main rounds' variants never saw (compute-bound rows read up to 10% faster). One discarded measurement
        # brings it back to the sustained state, then max-autotune is timed in rounds beside eager.
        guarded(row, "check", "max_autotune_warmup", lambda: timer.gpu_us(lambda: cm(x)))
        time_rounds(row, "gpu_us", "gpu_rounds", {"eager_beside_max_autotune": lambda: mod(x),
                                                  "compile_max_autotune": lambda: cm(x)}, timer.gpu_us, args.rounds)
    else:
        row["gpu_us"]["compile_max_autotune"] = row["first_call_s"]["compile_max_autotune"]
    st.clear()
    dynamo_reset()
    derive(row)
    print(f"  max-autotune: {fmt_us(row['gpu_us']['compile_max_autotune'])} µs (eager beside it "
          f"{fmt_us(row['gpu_us'].get('eager_beside_max_autotune'))}), "
          f"compile {fmt_us(row['first_call_s'].get('compile_max_autotune'))} s")


def derive(row: dict):
    g = row["gpu_us"]
    fl = row["floor"].get("floor_us")
    fx_t = g.get("fxfuse")
    d = {}
    if is_num(fx_t):
        if is_num(fl):
            d["fxfuse_over_floor"] = fx_t / fl
        if is_num(g.get("eager")):
            d["speedup_vs_eager"] = g["eager"] / fx_t
        if is_num(g.get("compile_default")):
            d["speedup_vs_compile"] = g["compile_default"] / fx_t
        if is_num(g.get("compile_max_autotune")):
            d["speedup_vs_max_autotune"] = g["compile_max_autotune"] / fx_t
        for limit in LIMITS:  # how far fxfuse is from the row's measured limits (benchmarks/limits.py)
            if is_num(g.get(limit)):
                d[f"fxfuse_over_{limit}"] = fx_t / g[limit]
    er = row.get("gpu_rounds", {}).get("eager") or []
    if len(er) > 1 and all(is_num(v) for v in er):  # this run's noise: the spread of eager's rounds
        d["eager_spread"] = (max(er) - min(er)) / min(er)
    wl = row["wall_us"]
    v = judge(fx_t, g.get("eager"), row["target_us"], target_wall_us=row["target_wall_us"],
              fxfuse_wall_us=wl.get("fxfuse"), eager_wall_us=wl.get("eager") if row["decode"] else None,
              correct=row["check"].get("pass") is True, eager_slack=row.get("eager_slack", EAGER_SLACK))
    d["meets_target"], d["not_slower_than_eager"], d["pass"], d["why"] = (
        v.meets_target, v.not_slower_than_eager, v.passed, v.why)
    if row.get("skipped"):
        d["why"] = f"not run: {row['skipped']}"
    row["derived"] = d


def print_row(row: dict):
    g, d = row["gpu_us"], row.get("derived", {})
    spread = d.get("eager_spread")
    print(f"  GPU median µs: floor {fmt_us(row['floor'].get('floor_us'))} | eager {fmt_us(g.get('eager'))} "
          f"(spread {f'{spread:.1%}' if is_num(spread) else '—'}) | graph {fmt_us(g.get('cudagraph'))} | compile "
          f"{fmt_us(g.get('compile_default'))} | compile backend=fxfuse {fmt_us(g.get('compile_fxfuse'))} | fxfuse "
          f"{fmt_us(g.get('fxfuse'))}")
    for key, label in (("gpu_rounds", "GPU"), ("wall_rounds", "wall")):
        if row.get(key):
            print(f"  {label} µs per round: " + "; ".join(
                f"{name} " + " ".join(fmt_us(v) for v in vs) for name, vs in row[key].items()))
    print(f"  fxfuse/floor {fmt_ratio(d.get('fxfuse_over_floor'))}, vs eager {fmt_ratio(d.get('speedup_vs_eager'))}, "
          f"vs compile {fmt_ratio(d.get('speedup_vs_compile'))}, target {target_str(row)} -> {meets_str(row)}; "
          f"not slower than eager: {yes_no(d.get('not_slower_than_eager'))} => {pass_str(row)}")
    if any(limit in g for limit in LIMITS):
        print(f"  measured limits, GPU µs: read once {fmt_us(g.get('read_once'))} (fxfuse "
              f"{fmt_ratio(d.get('fxfuse_over_read_once'))}), cuBLAS GEMMs alone {fmt_us(g.get('gemms_alone'))} "
              f"(fxfuse {fmt_ratio(d.get('fxfuse_over_gemms_alone'))})")
    if row["decode"]:
        print(f"  wall µs/call ({DECODE_CALLS} calls): {wall_str(row)}; fxfuse cuda_graphs=True: wall "
              f"{graphs_wall_str(row)}, GPU {fmt_us(g.get('fxfuse_cuda_graphs'))}")


# --------------------------------------------------------------------------------------------- results


def env_info(args) -> dict:
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "argv": " ".join(sys.argv),
        # settings that change what fxfuse does (FXFUSE_AUTOTUNE=0 is not what a user gets)
        "fxfuse_env": ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("FXFUSE_")),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:
        info["triton"] = short_err(e)
    if torch.cuda.is_available() and not args.cpu_smoke:
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = f"sm_{p.major}{p.minor}"
        info["sms"] = p.multi_processor_count
        info["gpu_mem_gib"] = round(p.total_memory / 2**30, 1)
    else:
        info["gpu"] = "none (CPU)"
    return info


def write_results(out: Path, env: dict, ceil: dict, rows: list[dict], args, final: bool = False) -> str:
    md = render_md(env, ceil, rows, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(md)
    payload = {"env": env, "ceilings": ceil, "rows": rows, "tolerance": TOL, "finished": final,
               "elapsed_s": elapsed(), "settings": {"warmup_ms": args.warmup, "rep_ms": args.rep, "rounds": args.rounds,
                                                    "decode_calls": DECODE_CALLS, "decode_loops": DECODE_LOOPS}}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    return md


# --------------------------------------------------------------------------------------------- dry run


def dry_run(selected: list[Workload]) -> int:
    """CPU: build every module, count FLOPs/bytes (module vs table), floors at the reference ceilings."""
    ceil = REF_CEILINGS
    print(f"dry run (CPU, torch {torch.__version__}); reference ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, "
          f"bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, fp16 {ceil['fp16_flops'] / 1e12:.0f} TFLOP/s")
    hdr = ["name", "M", "dims", "dtype", "input", "GFLOP", "min MB", "compute µs", "memory µs", "floor µs", "bound",
           "workloads.md floor", "target", "eager-vs-fp64 (8 rows)"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    bad = 0
    for idx, w in enumerate(WORKLOADS):
        if w not in selected:
            continue
        mod = build_module(w, device="cpu", seed=1000 + idx)
        es = torch.empty((), dtype=w.dtype).element_size()
        lins = w.linears
        flops, nbytes = count_work(mod, w.m, lins[0][0], lins[-1][1], es)
        if (flops, nbytes) != table_work(w):
            print(f"MISMATCH {w.name}: module {flops, nbytes} table {table_work(w)}")
            bad += 1
        rate = ceil["bf16_flops"] if w.dtype == torch.bfloat16 else ceil["fp16_flops"]
        fl, bound, t_c, t_m = floor_us(flops, nbytes, rate, ceil["copy_Bps"])
        if w.ref_floor_us is not None and abs(fl - w.ref_floor_us) / w.ref_floor_us > 0.05:
            print(f"FLOOR DIFFERS {w.name}: {fl:.1f} vs workloads.md {w.ref_floor_us}")
            bad += 1
        # run the module and its float64 reference on a few rows (shape, dtype, error path)
        m_small = min(w.m, 8)
        xs = make_input(w, device="cpu", seed=1, m=m_small)
        y = mod(xs)
        ref = copy.deepcopy(mod).double()(xs.double())
        assert y.shape == (m_small, lins[-1][1]) and y.dtype == w.dtype, (y.shape, y.dtype)
        e = rel_err(y, ref)
        lines.append("| " + " | ".join([
            w.name, str(w.m), w.dims_str, str(w.dtype).replace("torch.", ""), "×".join(map(str, w.input_shape)),
            f"{flops / 1e9:.2f}", f"{nbytes / 1e6:.2f}", f"{t_c:.1f}", f"{t_m:.1f}", f"{fl:.1f}", bound,
            f"{w.ref_floor_us:g}" if w.ref_floor_us is not None else "—",
            "—" if w.target_us is None else f"≤ {w.target_us:g}" + (f", wall ≤ {w.target_wall_us:g}"
                                                                     if w.target_wall_us else ""),
            f"{e:.1e}",
        ]) + " |")
        del mod, y, ref
        gc.collect()
    print("\n".join(lines))
    print("dry run OK" if not bad else f"dry run: {bad} problem(s)")
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="results folder (default $OUT)")
    p.add_argument("--only", default="", help="comma-separated row names (default: all)")
    p.add_argument("--skip-max-autotune", action="store_true", help="no torch.compile max-autotune pass")
    p.add_argument("--skip-limits", action="store_true",
                   help="do not time the rows' measured limits (read once, GEMMs alone: benchmarks/limits.py)")
    p.add_argument("--max-autotune-rows", default="",
                   help="comma-separated rows (in this order) for the max-autotune pass; default: all selected rows "
                        "in priority order " + ",".join(MAX_AUTOTUNE_ORDER))
    p.add_argument("--max-autotune-budget", type=float, default=300.0,
                   help="no new max-autotune compile starts once this many seconds were spent on them (default 300)")
    p.add_argument("--deadline", type=float, default=420.0,
                   help="the run should end by this many seconds: a max-autotune compile starts only if elapsed + "
                        "--max-autotune-reserve fits, and no new row starts after deadline+60 s (default 420; the "
                        "device allows 600 s per command)")
    p.add_argument("--max-autotune-reserve", type=float, default=45.0,
                   help="seconds one max-autotune compile + timing may take (default 45: the longest measured, "
                        "11-43 s; the longest of this run is used when larger)")
    p.add_argument("--eager-slack", type=float, default=EAGER_SLACK,
                   help=f"fxfuse may be this fraction slower than eager and still pass (default {EAGER_SLACK:g}: "
                        "about the spread of eager's own rounds)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep, ms")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"interleaved timing rounds per row; a cell is the median over them (default {ROUNDS})")
    p.add_argument("--dry-run", action="store_true", help="CPU: build modules, print FLOPs/bytes/floors only")
    p.add_argument("--cpu-smoke", action="store_true", help="development: whole pipeline on the CPU, tiny M")
    args = p.parse_args(argv)
    names = [w.name for w in WORKLOADS]
    for opt in ("only", "max_autotune_rows"):
        sel = [s.strip() for s in getattr(args, opt).split(",") if s.strip()]
        unknown = [s for s in sel if s not in names]
        if unknown:
            p.error(f"--{opt.replace('_', '-')}: unknown row(s) {unknown}; known: {names}")
        setattr(args, opt, sel)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def max_autotune_skip(args, elapsed_s: float, spent_s: float, longest_s: float) -> tuple[str | None, str | None]:
    """(cell, reason) when the next max-autotune compile must not start, else (None, None).

    It starts only if the run can still end by ``--deadline`` (elapsed + the longer of ``--max-autotune-reserve``
    and the longest compile so far) and the compiles so far stayed within ``--max-autotune-budget``.
    """
    reserve = max(args.max_autotune_reserve, longest_s)
    if args.skip_max_autotune:
        return "skipped (--skip-max-autotune)", "--skip-max-autotune"
    if elapsed_s + reserve > args.deadline:
        return SKIPPED_BUDGET, (f"deadline: {elapsed_s:.0f} s elapsed + {reserve:.0f} s reserve > "
                                f"--deadline {args.deadline:g} s")
    if spent_s > args.max_autotune_budget:
        return SKIPPED_BUDGET, (f"budget: {spent_s:.0f} s of compiles > --max-autotune-budget "
                                f"{args.max_autotune_budget:g} s")
    return None, None


def main(argv=None) -> int:
    args = parse_args(argv)
    # Inference: every variant (eager, compile, fxfuse) runs without autograd recording.
    torch.set_grad_enabled(False)
    selected = [w for w in WORKLOADS if not args.only or w.name in args.only]
    if args.dry_run:
        return dry_run(selected)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_workloads.py: no CUDA GPU available (torch.cuda.is_available() is False). "
              "Run it on the GPU machine, or use --dry-run to check the FLOP/byte/floor arithmetic on the CPU.")
        return 2
    args.device = "cpu" if args.cpu_smoke else "cuda"

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a")
    sys.stdout = Tee(sys.__stdout__, log)
    sys.stderr = Tee(sys.__stderr__, log)
    torch.set_grad_enabled(False)

    env = env_info(args)
    print(f"fxfuse workload benchmark — {env.get('gpu')}; torch {env['torch']}, triton {env['triton']}, "
          f"python {env['python']}; out={out}")
    fx, fx_err = import_fxfuse()
    print(f"fxfuse: {'imported from ' + str(getattr(fx, '__file__', '?')) if fx else 'UNAVAILABLE: ' + str(fx_err)}")

    timer = Timer(args.warmup, args.rep, args.cpu_smoke)
    try:
        ceil = measure_ceilings(timer, args.device, args.cpu_smoke)
    except Exception as e:
        print(f"ceilings failed ({short_err(e)}); using the reference ceilings of workloads.md")
        traceback.print_exc()
        ceil = dict(REF_CEILINGS, mm_n=8192, measured=False)
    if args.cpu_smoke:  # host numbers are meaningless as ceilings
        ceil.update(REF_CEILINGS, measured=False)

    rows: list[dict] = []
    by_name: dict[str, dict] = {}
    for idx, w in enumerate(WORKLOADS):
        if w not in selected:
            continue
        row = new_row(w)
        row["eager_slack"] = args.eager_slack
        rows.append(row)
        by_name[w.name] = row
        if elapsed() > args.deadline + 60:
            row["skipped"] = f"deadline ({elapsed():.0f}s)"
            for k in VARIANTS:
                row["gpu_us"][k] = SKIPPED_BUDGET
            derive(row)
            print(f"\n== {w.name}: {SKIPPED_BUDGET}: deadline ({elapsed():.0f} s)")
            continue
        try:
            run_row_main(w, idx, args, timer, ceil, fx, fx_err, row)
        except Exception as e:  # anything outside the guarded cells (e.g. building the module)
            row["row_error"] = short_err(e)
            print(f"  [{w.name}] row failed: {short_err(e)}")
            traceback.print_exc()
        cleanup()
        for k in VARIANTS:
            row["gpu_us"].setdefault(k, "skipped (not reached)" if k == "compile_max_autotune" else "—")
        write_results(out, env, ceil, rows, args)

    # pass 2: max-autotune, bounded by --max-autotune-budget and --deadline
    order = args.max_autotune_rows or [n for n in MAX_AUTOTUNE_ORDER if n in by_name]
    spent = longest = 0.0
    for name in order:
        row = by_name.get(name)
        if row is None or row.get("skipped"):
            continue
        idx = [w.name for w in WORKLOADS].index(name)
        w = WORKLOADS[idx]
        cell, why = max_autotune_skip(args, elapsed(), spent, longest)
        if why:
            row["gpu_us"]["compile_max_autotune"] = cell
            row.setdefault("skip_reason", {})["compile_max_autotune"] = why
            if cell == SKIPPED_BUDGET:
                print(f"\n== {name}: max-autotune {cell}: {why}")
            continue
        t0 = time.perf_counter()
        try:
            run_row_max_autotune(w, idx, args, timer, row)
        except Exception as e:
            row["gpu_us"]["compile_max_autotune"] = short_err(e)
            traceback.print_exc()
        cleanup()
        took = time.perf_counter() - t0
        spent += took
        longest = max(longest, took)
        write_results(out, env, ceil, rows, args)
    for row in rows:
        if row["gpu_us"].get("compile_max_autotune") == "skipped (not reached)":
            row["gpu_us"]["compile_max_autotune"] = "skipped (not in --max-autotune-rows)"
    for row in rows:
        derive(row)

    md = write_results(out, env, ceil, rows, args, final=True)
    print(f"\n== done in {elapsed():.0f}s; wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'log.txt'}\n")
    print(md)
    sys.stdout.flush()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
