"""The benchmark's results as markdown: the main table with its pass/fail columns, the details table, the
measured limits table, the verdict line, and the cell formatting they share (``bench_workloads.py`` measures,
this module writes what it measured).

A row is the dict ``bench_workloads.new_row`` starts and the run fills (``gpu_us``, ``wall_us``, ``derived``, ...).

Example:
    >>> fmt_us(92.034), fmt_us(2120.4), fmt_us(None), fmt_ratio(1.2345)
    ('92.0', '2120', '—', '1.23×')
"""

from __future__ import annotations

import math

from benchmarks.limits import LIMITS
from benchmarks.workloads import DECODE_CALLS, DECODE_LOOPS, TOL, target_text

__all__ = ["SKIPPED_BUDGET", "fmt_err", "fmt_ratio", "fmt_us", "is_num", "limits_table", "render_md",
           "verdict_line"]

SKIPPED_BUDGET = "skipped (budget)"  # a max-autotune cell the time bound left out (never silently empty)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt_us(v) -> str:
    if is_num(v):
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"
    if v is None:
        return "—"
    return str(v).replace("|", "/")


def fmt_ratio(v) -> str:
    return f"{v:.2f}×" if is_num(v) else "—"


def fmt_err(v) -> str:
    return f"{v:.1e}" if is_num(v) else ("—" if v is None else str(v).replace("|", "/"))


def target_str(row: dict) -> str:
    return target_text(row["target_us"], row["target_wall_us"])


def yes_no(v) -> str:
    return "—" if v is None else ("yes" if v else "no")


def meets_str(row: dict) -> str:
    return yes_no(row.get("derived", {}).get("meets_target"))


def pass_str(row: dict) -> str:
    d = row.get("derived", {})
    if "pass" not in d:
        return "—"
    return "PASS" if d["pass"] else f"FAIL: {d['why']}".replace("|", "/")


def graphs_wall_str(row: dict) -> str:
    if not row["decode"]:
        return "—"
    v = row["wall_us"].get("fxfuse_cuda_graphs")
    s = fmt_us(v)
    if is_num(v) and row["check"].get("cuda_graphs_pass") is False:
        s += " (wrong results)"
    kept = row["check"].get("cuda_graphs_kept")  # graphs the module kept (0: its replay did not beat the plain call)
    if is_num(v) and kept is not None:
        s += " (graph kept)" if kept else " (no graph: plain calls)"
    return s


def wall_str(row: dict) -> str:
    if not row["decode"]:
        return "—"
    wl = row["wall_us"]
    return " / ".join(fmt_us(wl.get(k)) for k in ("eager", "cudagraph", "compile_default", "compile_fxfuse", "fxfuse"))


def backend_cell(row: dict) -> str:
    s = fmt_us(row["gpu_us"].get("compile_fxfuse"))
    if is_num(row["gpu_us"].get("compile_fxfuse")) and row["check"].get("compile_fxfuse_pass") is False:
        s += " (wrong results)"
    return s


def err_cell(row: dict) -> str:
    e = row["rel_err"].get("fxfuse")
    if not is_num(e):
        return "—" if e is None else fmt_err(e)
    return f"{e:.1e} {'pass' if row['check'].get('pass') else 'FAIL'}"


def render_md(env: dict, ceil: dict, rows: list[dict], args) -> str:
    L = []
    L.append("# fxfuse benchmark: workloads.md set")
    L.append("")
    L.append(f"- GPU: {env.get('gpu')} ({env.get('capability', '?')}, {env.get('sms', '?')} SMs, "
             f"{env.get('gpu_mem_gib', '?')} GiB); torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
             f"python {env['python']}; {env['date']}")
    if ceil:
        how = "measured in this run" if ceil.get("measured", True) else "NOT measured: workloads.md reference values"
        L.append(f"- Ceilings ({how}): copy {ceil['copy_Bps'] / 1e12:.2f} TB/s (1 GiB d2d, read+write), "
                 f"bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, fp16 {ceil['fp16_flops'] / 1e12:.0f} TFLOP/s "
                 f"({ceil['mm_n']}³)")
    L.append(f"- GPU times, µs: median over {args.rounds} interleaved rounds of `triton.testing.do_bench` "
             f"medians (warmup {args.warmup} ms, rep {args.rep} ms, L2 flushed). Every variant of a row is built "
             f"first, eager is timed once and the result dropped (the GPU idled while they were built), then each "
             f"round times all of them once (eager, CUDA graph, compile default, compile backend=fxfuse, fxfuse, "
             f"fxfuse CUDA graphs, the limits; each round starts further along that list, so no variant is always "
             f"timed late in a round), so drift within the run favours none; compile "
             f"max-autotune is timed in a later pass, after one discarded measurement (the GPU idles, cooler, "
             f"while it compiles), in {args.rounds} rounds beside eager. Floor = max(FLOPs / matmul rate, min bytes / "
             f"copy bandwidth). "
             f"vs eager / vs compile = speedup of fxfuse (>1 is faster). rel err = ‖fxfuse − ref‖/‖ref‖ vs float64 "
             f"on a fresh input (tol {TOL:g}).")
    L.append(f"- fxfuse = `fxfuse.optimize(model)` with default settings, timed after one warm-up call "
             f"(FXFUSE_* environment: {env.get('fxfuse_env') or 'none set'}). compile backend=fxfuse = "
             f"`torch.compile(model, backend=\"fxfuse\")` (built after fxfuse.optimize: its first call finds the "
             f"regions' choices made); each row's module is one region, whose graph skips Inductor (it would only "
             f"wrap the call): Dynamo's guards and the graph around fxfuse's call.")
    L.append(f"- Wall (decode rows) = µs per call of {DECODE_CALLS} back-to-back calls, synchronized before and after "
             f"(median of {DECODE_LOOPS} loops; median over {args.rounds} interleaved rounds as the GPU times), as "
             f"eager / CUDA-graph replay / compile default / compile backend=fxfuse / fxfuse; "
             f"'fxfuse CUDA graphs' = the same for `fxfuse.optimize(model, cuda_graphs=True)` "
             f"('n/a' where this fxfuse has no such option).")
    L.append(f"- pass = correct, fxfuse GPU median ≤ target (gpt2m_mlp_m1: also fxfuse wall ≤ its wall target), and "
             f"not slower than eager: fxfuse ≤ eager × {1 + args.eager_slack:g} on the GPU median and, on decode rows, "
             f"on the wall time. compile max-autotune: {SKIPPED_BUDGET!r} = left out by the time bound "
             f"(--deadline {args.deadline:g} s, --max-autotune-budget {args.max_autotune_budget:g} s).")
    L.append("- Rows whose kernels take only a few µs (gpt2m_mlp_*) are host-bound even under do_bench: a GPU median "
             "there can include launch gaps (compare 'eager spread' below, the CUDA-graph column and the wall column).")
    L.append(f"- Command: `{env['argv']}`")
    L.append("")
    hdr = ["name", "floor", "eager", "CUDA-graph eager", "compile default", "compile max-autotune",
           "compile backend=fxfuse", "fxfuse", "fxfuse/floor", "vs eager", "vs compile", "rel err",
           "wall µs/call (eager / graph / compile / compile backend=fxfuse / fxfuse)",
           "fxfuse CUDA graphs wall", "target", "meets target", "not slower than eager", "pass"]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "---|" * len(hdr))
    for r in rows:
        g, d = r["gpu_us"], r.get("derived", {})
        cells = [
            r["name"], fmt_us(r["floor"].get("floor_us")), fmt_us(g.get("eager")), fmt_us(g.get("cudagraph")),
            fmt_us(g.get("compile_default")), fmt_us(g.get("compile_max_autotune")), backend_cell(r),
            fmt_us(g.get("fxfuse")),
            fmt_ratio(d.get("fxfuse_over_floor")), fmt_ratio(d.get("speedup_vs_eager")),
            fmt_ratio(d.get("speedup_vs_compile")), err_cell(r), wall_str(r), graphs_wall_str(r), target_str(r),
            meets_str(r), yes_no(d.get("not_slower_than_eager")), pass_str(r),
        ]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    L.append(verdict_line(rows))
    L.append("")
    L.append("Details: first-call wall time (compile/optimize + first run), fusion report, noise (eager spread = "
             "(max − min) / min of eager's GPU rounds).")
    L.append("")
    hdr2 = ["name", "M", "dims", "dtype", "GFLOP", "min MB", "bound", "compile default s", "max-autotune s",
            "compile backend=fxfuse s", "fxfuse s (optimize + first run)", "fused regions", "strategies",
            "eager rel err", "fxfuse deterministic", "eager spread"]
    L.append("| " + " | ".join(hdr2) + " |")
    L.append("|" + "---|" * len(hdr2))
    for r in rows:
        fc, f, d, rp = r["first_call_s"], r["floor"], r.get("derived", {}), r.get("report", {})

        def s(v):
            return (f"{v:.2f}" if v < 10 else f"{v:.1f}") if is_num(v) else fmt_us(v)

        fxs = s(fc.get("fxfuse"))
        if is_num(fc.get("fxfuse_optimize")) and is_num(fc.get("fxfuse_first_run")):
            fxs += f" ({s(fc['fxfuse_optimize'])} + {s(fc['fxfuse_first_run'])})"
        strat = ", ".join(f"{k}×{v}" for k, v in rp.get("strategies", {}).items()) or "—"
        cells = [
            r["name"], str(r["m"]), r["dims"], r["dtype"],
            f"{f['flops'] / 1e9:.1f}" if "flops" in f else "—", f"{f['bytes'] / 1e6:.1f}" if "bytes" in f else "—",
            f.get("bound", "—"), s(fc.get("compile_default")), s(fc.get("compile_max_autotune")),
            s(fc.get("compile_fxfuse")), fxs,
            str(rp.get("n_regions", r["check"].get("n_regions", "—"))), strat, fmt_err(r["rel_err"].get("eager")),
            str(r["check"].get("deterministic", "—")),
            f"{d['eager_spread'] * 100:.1f}%" if is_num(d.get("eager_spread")) else "—",
        ]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    L.extend(limits_table(rows))
    return "\n".join(L)


def limits_table(rows: list[dict]) -> list[str]:
    """The rows' measured limits (benchmarks/limits.py) beside the floor, fxfuse and the target."""
    if not any(limit in r["gpu_us"] for r in rows for limit in LIMITS):
        return []
    L = ["Measured limits, timed in the same interleaved rounds as the variants (GPU median µs; "
         "`benchmarks/limits.py`): **read once** = the fastest plain streaming read of a buffer of the row's minimum "
         "bytes (`torch.sum` or a Triton read kernel at six block shapes, picked by do_bench): what reading the "
         "weights once costs under do_bench's flush, whose dirty lines are written back while it reads (a kernel that "
         "prefetches deeper can be a few % faster); **GEMMs alone** = the row's linears as plain `torch.mm` (cuBLAS) "
         "into preallocated outputs, no bias, no activation: what cuBLAS's mainloops take for the row's FLOPs (for a "
         "narrow chain it is what fusion saves, not a limit).", ""]
    hdr = ["name", "bound", "floor", "read once", "GEMMs alone (cuBLAS)", "fxfuse", "fxfuse / read once",
           "fxfuse / GEMMs alone", "target"]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "---|" * len(hdr))
    for r in rows:
        g, d = r["gpu_us"], r.get("derived", {})
        cells = [r["name"], r["floor"].get("bound", "—"), fmt_us(r["floor"].get("floor_us")),
                 fmt_us(g.get("read_once")), fmt_us(g.get("gemms_alone")), fmt_us(g.get("fxfuse")),
                 fmt_ratio(d.get("fxfuse_over_read_once")), fmt_ratio(d.get("fxfuse_over_gemms_alone")),
                 target_str(r)]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    return L


def verdict_line(rows: list[dict]) -> str:
    """One line: how many rows pass, meet their target, are not slower than eager."""
    ds = [r.get("derived", {}) for r in rows]
    n_pass = sum(bool(d.get("pass")) for d in ds)
    with_target = [d for r, d in zip(rows, ds) if r["target_us"] is not None]
    n_target = sum(bool(d.get("meets_target")) for d in with_target)
    n_eager = sum(bool(d.get("not_slower_than_eager")) for d in ds)
    every = "yes" if rows and n_pass == len(rows) else "no"
    return (f"**Verdict: {n_pass}/{len(rows)} rows pass** (targets met {n_target}/{len(with_target)}, "
            f"not slower than eager {n_eager}/{len(rows)}); every row passes: {every}.")
