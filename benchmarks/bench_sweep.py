#!/usr/bin/env python3
"""fxfuse across batch sizes: one optimized module per MLP shape, called at rising row counts M as a user's
model is (decode at a few rows, batched decode, prefill), beside eager and torch.compile at every M.

The workload table measures each shape at one M. A user's model sees many: fxfuse plans once per M bucket
(powers of two, and above 64 rows also 1.5x a power of two: ``fxfuse.kernels.template.choice_bucket``), at the
first M of the bucket it meets, and reuses that choice for every later M of the bucket (the stage kernels' tuned
configs per power of two). This sweep visits the M of each bucket in rising order, the low end first (3 before 4,
24 before 32, 264 before 384), so every reuse is measured at the other end of its bucket: the "no workload
anywhere slower than eager" promise checked across batch sizes, not at nine points.

    python3 benchmarks/bench_sweep.py --out DIR [--shapes llama,gpt2m] [--ms 1,2,4] [--rounds 3]

Per shape: ``fxfuse.optimize(module)`` once (default settings) and ``torch.compile(module)`` once (default
mode; Dynamo recompiles with a dynamic M as it does for users). Per M: a fresh input, each variant's first
call (fxfuse's plans and tunes at a new bucket: its seconds are in the table), the float64 reference on another
fresh input (fxfuse must be within 2e-2), then one discarded timing (the GPU back from the first calls' idle
time to its sustained clocks) and ``--rounds`` interleaved rounds of ``do_bench`` medians (L2 flushed) over eager,
compile and fxfuse; a cell is the median of its rounds. Floor = max(FLOPs / matmul rate,
minimum bytes / copy bandwidth) with the ceilings measured at the start. "slower" marks an M where fxfuse's
median and fastest round are above eager's by more than 2% (the workload table's slack), both in its rounds and
when the point is timed again after the shape's last M (:func:`slower`, :func:`recheck`: the host's slow
stretches otherwise decide such points).

Writes ``DIR/sweep.md`` and ``DIR/sweep.json``, rewritten after every shape. GPU only, except ``--cpu-smoke``
(development: the interpreter, a tiny shape, a host timer).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be on before fxfuse defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxfuse  # noqa: E402
from benchmarks.measure import Timer, cleanup, dynamo_reset, measure_ceilings, rel_err, round_order  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    BF16,
    EAGER_SLACK,
    WORKLOADS,
    Workload,
    build_module,
    count_work,
    floor_us,
    make_input,
)
from fxfuse.kernels.template import choice_bucket  # noqa: E402

TOL = 2e-2  # relative Frobenius error against float64 (bf16/fp16), as the workload table
# The shapes of the workload table, by the row that names them.
SHAPES = {"llama": "llama_swiglu_m1", "gpt2m": "gpt2m_mlp_m1", "gpt2": "gpt2_mlp", "seed": "seed_geglu",
          "nerf64": "nerf64"}
# Each bucket's low end first: the M after it reuses the choice made there.
DENSE_MS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 72, 96, 104, 128, 136, 192, 200, 256, 264, 384, 392, 512, 520,
            768, 776, 1024, 1536, 2048, 4096, 8192]
CHAIN_MS = [1, 64, 1000, 4096, 16384, 65536, 262144, 1 << 20]
VARIANTS = ("eager", "compile", "fxfuse")


def shape_ms(w: Workload, ms: list[int] | None) -> list[int]:
    if ms:
        return ms
    return CHAIN_MS if w.kind == "nerf" else DENSE_MS


def running_at(opt, m: int) -> str:
    regions = fxfuse.report(opt).regions
    return "; ".join(r.running_at(m) for r in regions) if regions else "nothing fused"


def shortcut_hits(opt) -> int:
    """Calls of ``opt``'s host methods that took their shortcut (``fxfuse.shortcut``) so far: a host-bound point whose
    timed calls did not is paying the full call path."""
    return sum(v.hits for mod in opt.modules() for k, v in vars(mod).items() if k.startswith("_fxfuse_shortcut_"))


def stage_impls(w: Workload, m: int) -> list[str]:
    """What the stages of ``w``'s per-stage strategies run at ``m``'s bucket (``fxfuse.stages``: cublaslt, torch,
    triton, tma, gemv), as ``epilogue: implementation``."""
    from fxfuse import stages

    shapes = {(k, n) for k, n, _ in w.linears}  # (a stage's key: weights, epilogue, M bucket, K, N, ...)
    return [f"{key[1]}: {impl}" for key, impl in stages.stage_choices().items()
            if key[2] == choice_bucket(m) and (key[3], key[4]) in shapes]


def planner_times(opt, m: int) -> list[dict]:
    """What the planner measured at ``m``'s bucket (at the M that decided): every candidate's µs."""
    return [{"at_m": r.m, "times": dict(r.times), "source": r.source, "top_times": dict(r.top_times),
             "split": str(r.split or "")}
            for region in fxfuse.report(opt).regions for r in region.measurements
            if r.m_bucket == choice_bucket(m) and not r.for_cuda_graph]


def running_cell(row: dict) -> str:
    stages = row.get("stages")
    hits = row.get("shortcut_hits")
    path = "" if hits is None else (" [shortcut]" if hits else " [full path]")
    return row["running"] + (f" ({'; '.join(stages)})" if stages else "") + path


def planner_cell(planned: list[dict]) -> str:
    def at(times: dict, m) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + f" (M={m})"

    return "; ".join(at(p["times"], p["at_m"])
                     + (f"; {at(p['top_times'], 'top')}" if p.get("top_times") else "")
                     + (f": {p['split']}" if p.get("split") else "") for p in planned) or "—"


def time_rounds(fns: dict, x: torch.Tensor, timer: Timer, rounds: int) -> dict[str, list[float]]:
    """``rounds`` interleaved rounds of each variant's GPU µs on ``x``, after one discarded timing of eager."""
    # The first calls (fxfuse's planning, Dynamo's compile) leave the GPU idle for seconds: the first timing after
    # them runs at clocks the later ones do not see, and it would always be eager's. One discarded timing first
    # (llama M=1024 on an H100: eager's rounds 504.6 / 542.9 / 561.1 µs without it).
    timer.gpu_us(functools.partial(fns["eager"], x))
    per_round: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in round_order(list(fns), r, rounds):
            per_round[k].append(timer.gpu_us(functools.partial(fns[k], x)))
    return per_round


def slower(per_round: dict[str, list[float]]) -> bool:
    """fxfuse above eager by more than the workload table's slack, in the median of the rounds and in the fastest
    round: the host's slow stretches only add time, and one that covers most of a point's rounds moves its
    medians by 2-4x (gpt2m M=32 on an H100: eager 23.8 / 39.3 / 38.4 / 76.6 / 40.0, fxfuse 21.3 / 41.9 / 66.5 /
    149.5 / 56.8 µs), while a slower kernel is slower in every round.

    >>> slower({"eager": [100.0, 100.0, 250.0], "fxfuse": [102.0, 102.0, 102.0]})
    False
    >>> slower({"eager": [100.0, 300.0, 250.0], "fxfuse": [105.0, 300.0, 300.0]})
    True
    >>> slower({"eager": [26.0, 26.1, 26.2], "fxfuse": [34.9, 35.0, 35.3]})  # slower in every round
    True
    >>> slower({"eager": [24.0, 39.0, 40.0], "fxfuse": [21.0, 42.0, 57.0]})  # a stretch over most rounds
    False
    """
    limit = 1 + EAGER_SLACK
    return all(pick(per_round["fxfuse"]) > pick(per_round["eager"]) * limit for pick in (statistics.median, min))


def recheck(row: dict, fns: dict, w: Workload, timer: Timer, rounds: int, device: str) -> None:
    """Time a point read slower than eager again, after the shape's last M (fresh input, the same modules and
    choices), and keep the verdict of the second timing; both are in ``row``.

    The GPU machine's host has slow periods of seconds in which every variant's do_bench median doubles or
    triples (gpt2m on an H100: eager's rounds 26.1 / 57.5 / 47.2 / 52.3 / 50.7 µs, compile's 58 → 220 µs),
    and a period that covers one variant's rounds more than another's decides the point. A real slowdown is
    slower both times."""
    m = row["m"]
    x = make_input(w, device=device, seed=m + 200_000, m=m)
    with torch.no_grad():
        per_round = time_rounds(fns, x, timer, rounds)
    us = {k: statistics.median(v) for k, v in per_round.items()}
    row["recheck"] = {"us": us, "rounds": per_round, "slower": slower(per_round)}
    row["slower"] = row["recheck"]["slower"]
    print(f"  recheck M={m:<7} eager {us['eager']:8.1f}  compile {us['compile']:8.1f}  fxfuse {us['fxfuse']:8.1f}"
          f"  ({us['eager'] / us['fxfuse']:.2f}x eager){'  SLOWER' if row['slower'] else ''}", flush=True)


def sweep_shape(w: Workload, ms: list[int], timer: Timer, ceil: dict, rounds: int, device: str) -> list[dict]:
    print(f"== {w.name}: {w.kind} {w.dims_str}", flush=True)
    mod = build_module(w, device=device, seed=7)
    mod64 = copy.deepcopy(mod).double()
    opt = fxfuse.optimize(mod)
    dynamo_reset()
    cm = torch.compile(mod)
    es = torch.empty((), dtype=w.dtype).element_size()
    lins = w.linears
    rate = ceil["bf16_flops"] if w.dtype == BF16 else ceil["fp16_flops"]
    fns = {"eager": mod, "compile": cm, "fxfuse": opt}
    rows = []
    for m in ms:
        x = make_input(w, device=device, seed=m, m=m)
        first = {}
        with torch.no_grad():
            for name, fn in (("compile", cm), ("fxfuse", opt)):
                t0 = time.perf_counter()
                fn(x)
                timer.sync()
                first[name] = time.perf_counter() - t0
            xc = make_input(w, device=device, seed=m + 100_000, m=m)
            ref = mod64(xc.double())
            err = {"eager": rel_err(mod(xc), ref), "fxfuse": rel_err(opt(xc), ref)}
            hits = shortcut_hits(opt)
            per_round = time_rounds(fns, x, timer, rounds)
            hits = shortcut_hits(opt) - hits
        us = {k: statistics.median(v) for k, v in per_round.items()}
        flops, nbytes = count_work(mod, m, lins[0][0], lins[-1][1], es)
        fl, bound, _, _ = floor_us(flops, nbytes, rate, ceil["copy_Bps"])
        row = {"m": m, "floor_us": fl, "bound": bound, "us": us, "rounds": per_round, "rel_err": err,
               "correct": bool(math.isfinite(err["fxfuse"]) and err["fxfuse"] <= TOL),
               "slower": slower(per_round), "first_call_s": first,
               "running": running_at(opt, m), "stages": stage_impls(w, m), "planner": planner_times(opt, m),
               "shortcut_hits": hits}
        rows.append(row)
        print(f"  M={m:<7} floor {fl:8.1f}  eager {us['eager']:8.1f}  compile {us['compile']:8.1f}  "
              f"fxfuse {us['fxfuse']:8.1f}  ({us['eager'] / us['fxfuse']:.2f}x eager)  err {err['fxfuse']:.1e}  "
              f"first {first['fxfuse']:.2f}s  {row['running']}  shortcut hits {hits}"
              f"{'  SLOWER' if row['slower'] else ''}", flush=True)
    for row in rows:
        if row["slower"]:
            recheck(row, fns, w, timer, rounds, device)
    dynamo_reset()
    cleanup()
    return rows


def render(env: dict, ceil: dict, results: dict[str, dict]) -> str:
    out = ["# fxfuse across batch sizes", "",
           f"- {env['gpu']}; torch {env['torch']}, triton {env['triton']}; {env['when']}",
           f"- Ceilings (this run): copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} "
           f"TFLOP/s, fp16 {ceil['fp16_flops'] / 1e12:.0f} TFLOP/s",
           f"- Command: `{env['command']}`",
           f"- GPU µs: median of {env['rounds']} interleaved rounds of `do_bench` medians (L2 flushed), after one "
           "discarded timing of eager (the first calls leave the GPU idle and cool). One "
           "`fxfuse.optimize(module)` and one `torch.compile(module)` per shape, called at rising M (each planner "
           "bucket's low end first, so later M reuse the choice made there: `fxfuse.kernels.template.choice_bucket`). "
           "first s = fxfuse's first call at "
           "that M (planning and tuning at a new bucket); planner's µs = what the planner measured for each "
           "candidate at the M that decided the bucket (the larger of GPU median and host time, see "
           "`fxfuse.strategy.time_candidates`; above 64 rows also at the bucket's largest M, 'top', and where the "
           "two ends' fastest differ, the M from which the second runs: `fxfuse.strategy.decide`); [shortcut] / "
           "[full path]: whether fxfuse's timed calls took the module's shortcut to the region's replay "
           "(`fxfuse.shortcut`) or the whole call path. "
           "slower = fxfuse above eager × "
           f"{1 + EAGER_SLACK:.2f} in the median and in the fastest of the rounds; a point read slower is timed "
           "again after the shape's last M (fresh input, same modules) and the second reading decides: the host "
           "has slow stretches of seconds that double every variant's times (`bench_sweep.slower`, `recheck`); "
           "both readings are in the last column.", ""]
    total = n_slower = cleared = wrong = 0
    for name, shape in results.items():
        rows = shape["rows"]
        out += [f"## {name}: {shape['title']}", "",
                "| M | floor | eager | torch.compile | fxfuse | vs eager | vs compile | rel err | first s | "
                "runs | planner's µs | |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            us = r["us"]
            flag = "**slower**" if r["slower"] else ""
            rounds = r.get("rounds", {})
            if not r["slower"] and "recheck" not in r and rounds and us["fxfuse"] > us["eager"] * (1 + EAGER_SLACK):
                flag = (f"median above eager, fastest round not ({min(rounds['eager']):.1f} / "
                        f"{min(rounds['fxfuse']):.1f}): the host's slow stretch")
            again = r.get("recheck")
            if again is not None:
                flag += (" " if flag else "") + (
                    f"first read {us['eager']:.1f} / {us['fxfuse']:.1f} (eager / fxfuse), rechecked "
                    f"{again['us']['eager']:.1f} / {again['us']['fxfuse']:.1f}")
                cleared += not r["slower"]
            if not r["correct"]:
                flag = "**WRONG** " + flag
            out.append(f"| {r['m']} | {r['floor_us']:.1f} | {us['eager']:.1f} | {us['compile']:.1f} | "
                       f"{us['fxfuse']:.1f} | {us['eager'] / us['fxfuse']:.2f}× | "
                       f"{us['compile'] / us['fxfuse']:.2f}× | "
                       f"{r['rel_err']['fxfuse']:.1e} | {r['first_call_s']['fxfuse']:.2f} | {running_cell(r)} | "
                       f"{planner_cell(r['planner'])} | {flag} |")
            total += 1
            n_slower += r["slower"]
            wrong += not r["correct"]
        out.append("")
    out.insert(6, f"**{total} points: fxfuse correct at {total - wrong}, slower than eager at {n_slower}**"
               + (f" ({cleared} more read slower at first and not when timed again)" if cleared else "") + ".\n")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write sweep.md and sweep.json here")
    ap.add_argument("--shapes", default="llama,gpt2m,gpt2,seed,nerf64", help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--ms", default=None, help="comma list of row counts (default: a dense list per shape)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=50, help="do_bench rep, ms")
    ap.add_argument("--cpu-smoke", action="store_true", help="development: the interpreter, tiny shapes")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not gpu and not args.cpu_smoke:
        print("bench_sweep: no CUDA device (use --cpu-smoke for a code-path check)")
        return 2
    device = "cuda" if gpu else "cpu"
    timer = Timer(args.warmup, args.rep, cpu=not gpu)
    ceil = measure_ceilings(timer, device, cpu_smoke=not gpu)
    ms = [int(v) for v in args.ms.split(",")] if args.ms else None
    import triton

    env = {"gpu": torch.cuda.get_device_name() if gpu else "CPU (interpreter)", "torch": torch.__version__,
           "triton": triton.__version__, "when": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
           "command": "python3 benchmarks/bench_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    results: dict[str, dict] = {}
    for name in args.shapes.split(","):
        w = next(w for w in WORKLOADS if w.name == SHAPES[name])
        if not gpu:  # a small stand-in with the row's structure
            small = (16, 32, 8) if w.kind == "nerf" else (32, 64)
            w = dataclasses.replace(w, dims=small, dtype=torch.float32, input_shape=(4, small[0]))
        title = f"{w.kind} {w.dims_str}, {str(w.dtype).replace('torch.', '')}"
        results[name] = {"title": title, "rows": sweep_shape(w, shape_ms(w, ms), timer, ceil, args.rounds, device)}
        text = render(env, ceil, results)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "sweep.md").write_text(text + "\n")
            (out / "sweep.json").write_text(json.dumps({"env": env, "ceilings": ceil, "shapes": results}, indent=1))
    print(render(env, ceil, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
