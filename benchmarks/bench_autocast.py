"""fp32 weights under autocast: eager, torch.compile and fxfuse on the benchmark's rows, inference or training.

    python3 benchmarks/bench_autocast.py --out DIR [--only ROW,...] [--skip-compile]
    python3 benchmarks/bench_autocast.py --out DIR --training [--only nerf64,nerf128]

Each row's module is built in fp32 (the row's widths; its input in fp32, as a LayerNorm under autocast gives it)
and run with no gradients under ``torch.autocast("cuda", <the row's dtype>)``, two ways:

* **per call**: the context entered around every call (an evaluation loop; timm's ``validate.py --amp``). Eager
  casts every weight on each call: autocast's cache lives for one context.
* **one context** around all calls (``generate`` under autocast): eager's casts are cached after the first call.

fxfuse keeps its casts (``fxfuse.autocast.weight_casts``) as autocast's cache keeps its own, for one context: each
new context casts them again, into the same memory (since session 49; before, they were kept across contexts,
which missed writes through ``.data`` between them). GPU µs: do_bench
median (L2 flushed before each call); floor: the row's floor in its dtype (narrow weights read once); torch.compile
default with the context inside the compiled function (per call); decode rows also get the wall µs per call of 200
back-to-back calls (per call). rel err: against float64 of the cast model. Writes ``DIR/autocast.md``.

``--training``: mixed precision, one step = zero the gradients, forward under autocast, backward of a fixed
random output gradient (input gradient included); do_bench median of the step for eager, fxfuse and
torch.compile default, the largest relative difference of fxfuse's fp32 gradients from eager's, and the peak
memory of a step. Writes ``DIR/autocast_training.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_training import _peak_mib, _rel  # noqa: E402
from bench_workloads import fmt_us, row_floor  # noqa: E402
from workloads import WORKLOADS, build_module, make_input  # noqa: E402

import fxfuse  # noqa: E402
from benchmarks.measure import Timer, cleanup, measure_ceilings, rel_err  # noqa: E402
from fxfuse import autocast as fx_autocast  # noqa: E402


def per_call(mod, x, dtype):
    def run():
        with torch.autocast("cuda", dtype=dtype):
            return mod(x)
    return run


def bench_row(w, timer: Timer, ceil: dict, compile_too: bool) -> dict:
    row = {"name": w.name, "m": w.m, "dtype": str(w.dtype).replace("torch.", "")}
    row["floor_us"] = row_floor(w, build_module(w, device="meta"), ceil)["floor_us"]
    mod = build_module(dataclasses.replace(w, dtype=torch.float32))
    x = make_input(dataclasses.replace(w, dtype=torch.float32))
    dtype = w.dtype
    with torch.no_grad():
        exact = copy.deepcopy(mod).to(dtype).double()(x.to(dtype).double())
        fast = fxfuse.optimize(mod)
        eager_out = per_call(mod, x, dtype)()
        fast_out = per_call(fast, x, dtype)()  # plans and tunes the region on the casts
        row["rel_err"] = {"eager": rel_err(eager_out, exact), "fxfuse": rel_err(fast_out, exact)}
        row["kept_MB"] = fx_autocast.weight_casts.nbytes / 1e6
        gpu = row["gpu_us"] = {}
        gpu["eager per call"] = timer.gpu_us(per_call(mod, x, dtype))
        gpu["fxfuse per call"] = timer.gpu_us(per_call(fast, x, dtype))
        with torch.autocast("cuda", dtype=dtype):
            gpu["eager one context"] = timer.gpu_us(lambda: mod(x))
            gpu["fxfuse one context"] = timer.gpu_us(lambda: fast(x))
        if compile_too:
            torch._dynamo.reset()
            compiled = torch.compile(per_call(mod, x, dtype))
            compiled()
            gpu["compile per call"] = timer.gpu_us(compiled)
        if w.decode:
            row["wall_us"] = {name: timer.wall_us(per_call(m, x, dtype))["median"]
                              for name, m in (("eager", mod), ("fxfuse", fast))}
    print(f"  {w.name}: " + ", ".join(f"{k} {fmt_us(v)}" for k, v in gpu.items())
          + f"; rel err eager {row['rel_err']['eager']:.1e} fxfuse {row['rel_err']['fxfuse']:.1e}"
          + (f"; wall {row['wall_us']}" if "wall_us" in row else ""), flush=True)
    mod = fast = x = exact = None  # (freed before the next row)
    fx_autocast.weight_casts.clear()
    cleanup()
    return row


def train_row(w, timer: Timer, compile_too: bool) -> dict:
    """One mixed-precision training step of the row's fp32 module (see the module doc)."""
    mod = build_module(dataclasses.replace(w, dtype=torch.float32)).train()
    x = make_input(dataclasses.replace(w, dtype=torch.float32)).requires_grad_(True)
    params = list(mod.parameters())
    with torch.autocast("cuda", dtype=w.dtype):
        grad_out = torch.randn_like(mod(x).detach())
    variants = {"eager": mod, "fxfuse": fxfuse.optimize(mod)}
    if compile_too:
        torch._dynamo.reset()
        variants["compile"] = torch.compile(mod)

    def step(m):
        def run():
            for p in params:
                p.grad = None
            x.grad = None
            with torch.autocast("cuda", dtype=w.dtype):
                out = m(x)
            out.backward(grad_out)
        return run

    grads = {}
    for name, m in variants.items():
        step(m)()  # first call: plan / compile
        step(m)()
        grads[name] = [x.grad.clone()] + [p.grad.clone() for p in params]
    row = {"name": w.name, "m": w.m, "dtype": str(w.dtype).replace("torch.", ""),
           "grad_err": {n: max(_rel(g, r) for g, r in zip(gs, grads["eager"])) for n, gs in grads.items()
                        if n != "eager"},
           "step_us": {n: timer.gpu_us(step(m)) for n, m in variants.items()},
           "peak_MiB": {n: _peak_mib(step(m)) for n, m in variants.items() if n != "compile"}}
    print(f"  {w.name} training: " + ", ".join(f"{k} {fmt_us(v)}" for k, v in row["step_us"].items())
          + f"; grad rel err vs eager {row['grad_err']}; peak {row['peak_MiB']}", flush=True)
    fx_autocast.weight_casts.clear()
    cleanup()
    return row


def render_training(rows: list[dict]) -> str:
    lines = ["| row | autocast | eager step µs | torch.compile step µs | fxfuse step µs | fxfuse vs eager "
             "| fxfuse grad rel err vs eager | peak MiB eager / fxfuse |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["step_us"]
        lines.append(f"| {r['name']} | {r['dtype']} | {fmt_us(t['eager'])} | {fmt_us(t.get('compile'))} | "
                     f"{fmt_us(t['fxfuse'])} | {t['eager'] / t['fxfuse']:.2f}× | {r['grad_err']['fxfuse']:.1e} | "
                     f"{r['peak_MiB']['eager']:.0f} / {r['peak_MiB']['fxfuse']:.0f} |")
    return "\n".join(lines) + "\n"


def render(rows: list[dict], ceil: dict) -> str:
    cols = ["eager per call", "compile per call", "fxfuse per call", "eager one context", "fxfuse one context"]
    lines = [f"Ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, "
             f"fp16 {ceil['fp16_flops'] / 1e12:.0f} TFLOP/s.", "",
             "| row | autocast | floor | " + " | ".join(cols) + " | fxfuse vs eager (per call / one context) "
             "| wall per call, eager / fxfuse | rel err eager / fxfuse | casts kept |",
             "|---|---|---|" + "---|" * len(cols) + "---|---|---|---|"]
    for r in rows:
        g = r["gpu_us"]
        wall = r.get("wall_us")
        lines.append(
            f"| {r['name']} | {r['dtype']} | {fmt_us(r['floor_us'])} | "
            + " | ".join(fmt_us(g.get(c)) for c in cols)
            + f" | {g['eager per call'] / g['fxfuse per call']:.2f}× / "
              f"{g['eager one context'] / g['fxfuse one context']:.2f}× | "
            + (f"{fmt_us(wall['eager'])} / {fmt_us(wall['fxfuse'])}" if wall else "—")
            + f" | {r['rel_err']['eager']:.1e} / {r['rel_err']['fxfuse']:.1e} | {r['kept_MB']:.0f} MB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--training", action="store_true")
    args = ap.parse_args()
    timer = Timer(warmup=25, rep=100, cpu=False)
    only = set(filter(None, args.only.split(",")))
    if args.training:
        rows = [train_row(w, timer, not args.skip_compile) for w in WORKLOADS
                if (w.name in only if only else w.m >= 4096)]
        text = render_training(rows)
        print(text)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "autocast_training.md").write_text(text)
        return
    ceil = measure_ceilings(timer, "cuda", cpu_smoke=False)
    rows = [bench_row(w, timer, ceil, not args.skip_compile) for w in WORKLOADS if not only or w.name in only]
    text = render(rows, ceil)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "autocast.md").write_text(text)


if __name__ == "__main__":
    main()
