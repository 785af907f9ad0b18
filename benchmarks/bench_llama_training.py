"""A real model's training step on the GPU: a 4-layer transformers Llama, eager against ``fxfuse.optimize``.

The model is ``examples/profile_demo.py``'s (TinyLlama widths: hidden 2048, MLP 5632, 32 heads; random weights).
One step = forward on a (batch, seq) batch of token ids, the loss ``(last_hidden_state.float() * R).sum()``
for a fixed random R (float64 for the reference; a loss of the final RMSNorm's output alone, like its mean
square, is nearly constant in every weight but the norm's, so its gradients would be rounding noise), backward
(parameter gradients reset to None before each step). Two set-ups:

* bf16: the model in bfloat16, no autocast (fxfuse: from the second step each MLP runs its GEMMs as the
  original ops and ``act(g) * u`` as one kernel each way, :mod:`fxfuse.gated_training`);
* fp32 + autocast: fp32 master weights under ``torch.autocast("cuda", torch.bfloat16)`` (mixed precision;
  fxfuse: the original ops under autocast with the same gated middle, :mod:`fxfuse.autocast`).

fxfuse is timed as shipped (a trained region runs its original ops: eager's kernels behind fxfuse's call path)
and with ``FXFUSE_GATED_TRAINING=1`` (the gated kernels); the gradients checked are the gated kernels'.

For each: do_bench median of the step (L2 flushed, 3 interleaved rounds), the device time of the step's kernels
(profiler), the step's peak memory above what was allocated before it, and the largest relative difference of
each parameter gradient from float64's (the same weights, no autocast): the largest over parameters and the
median, for eager and fxfuse.

    python3 benchmarks/bench_llama_training.py --out DIR [--batch 4] [--seq 1024] [--rounds 3]
    python3 benchmarks/bench_llama_training.py --out DIR --host   # where each step's host time goes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_training import _peak_mib, _rel  # noqa: E402
from timing import kernels_after_flush  # noqa: E402

import fxfuse  # noqa: E402


def _llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaModel(config).to(dtype).train()


def _step(model, ids, autocast: bool, gated_kernels: bool = False):
    params = list(model.parameters())
    gen = torch.Generator(device=ids.device).manual_seed(1)
    dtype = torch.float64 if params[0].dtype is torch.float64 else torch.float32  # the loss's (float64: reference)
    proj = torch.randn(*ids.shape, model.config.hidden_size, device=ids.device, generator=gen).to(dtype)

    def run():
        for p in params:
            p.grad = None
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        if gated_kernels:
            os.environ["FXFUSE_GATED_TRAINING"] = "1"
        try:
            with ctx:
                loss = (model(ids).last_hidden_state.to(dtype) * proj).sum()
            loss.backward()
        finally:
            if gated_kernels:
                del os.environ["FXFUSE_GATED_TRAINING"]

    return run


def bench_setup(name: str, dtype: torch.dtype, autocast: bool, ids, rounds: int) -> dict:
    from triton.testing import do_bench

    eager = _llama(dtype)
    mine = copy.deepcopy(eager)
    fast = fxfuse.optimize(mine)
    steps = {"eager": _step(eager, ids, autocast), "fxfuse": _step(fast, ids, autocast),
             "fxfuse gated": _step(fast, ids, autocast, gated_kernels=True)}
    t0 = time.perf_counter()
    for run in steps.values():
        run(), run()  # fxfuse: the first step marks the regions trained
    # The reference: the same weights in float64, no autocast (HF's norms and rotary run in fp32 inside).
    ref_model = copy.deepcopy(eager).double()
    _step(ref_model, ids, False)()
    ref = [p.grad for p in ref_model.parameters()]
    row = {"setup": name}
    for label, (run, model) in {"eager": (steps["eager"], eager), "fxfuse": (steps["fxfuse gated"], mine)}.items():
        run()
        errs = sorted(_rel(p.grad, r) for p, r in zip(model.parameters(), ref))
        row[f"{label} grad err max"], row[f"{label} grad err median"] = errs[-1], errs[len(errs) // 2]
    del ref_model, ref
    torch.cuda.empty_cache()
    print(f"{name}: built and checked in {time.perf_counter() - t0:.1f}s", flush=True)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for label, run in steps.items():
            times[label].append(do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3)
    for label, run in steps.items():
        row[f"{label} step us"] = statistics.median(times[label])
        row[f"{label} kernels us"] = sum(us for _, us, _ in kernels_after_flush(run, calls=5))
        row[f"{label} peak MiB"] = _peak_mib(run)
    return row


def host_report(name: str, dtype: torch.dtype, autocast: bool, ids) -> str:
    """``--host``: where a step's host time goes, eager against the gated kernels: µs to issue one step (no
    synchronize inside), calls that synchronize or allocate, the ops with the most host time, the kernels."""
    from torch.profiler import ProfilerActivity, profile

    eager = _llama(dtype)
    fast = fxfuse.optimize(copy.deepcopy(eager))
    steps = {"eager": _step(eager, ids, autocast), "fxfuse gated": _step(fast, ids, autocast, gated_kernels=True)}
    out = [f"## {name}"]
    for label, run in steps.items():
        run(), run()
        torch.cuda.synchronize()
        issue = []
        for _ in range(7):
            t = time.perf_counter()
            run()
            issue.append((time.perf_counter() - t) * 1e6)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        events = prof.key_averages()
        runtime = {e.key: e.count // 3 for e in events
                   if any(w in e.key for w in ("Malloc", "Free", "Synchronize", "Memcpy", "EventSynchronize"))}
        out += [f"### {label}: issue {statistics.median(issue):.0f} µs per step (median of 7); "
                f"syncing/allocating calls per step: {runtime}",
                "host self µs per step, top ops: " + ", ".join(
                    f"{e.key} {e.self_cpu_time_total / 3:.0f} (x{e.count // 3})"
                    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]),
                "kernels µs per step, top: " + ", ".join(
                    f"{e.key[:60]} {e.device_time_total / 3:.0f} (x{e.count // 3})"
                    for e in sorted((e for e in events if e.device_type.name == "CUDA"),
                                    key=lambda e: -e.device_time_total)[:14])]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host", action="store_true", help="only where the host time goes (-> llama_host.txt)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_llama_training.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    if args.host:
        text = "\n\n".join([host_report("bf16", torch.bfloat16, False, ids),
                             host_report("fp32 + bf16 autocast", torch.float32, True, ids)])
        (args.out / "llama_host.txt").write_text(text + "\n")
        print(text)
        return
    rows = [bench_setup("bf16", torch.bfloat16, False, ids, args.rounds),
            bench_setup("fp32 + bf16 autocast", torch.float32, True, ids, args.rounds)]
    lines = [f"### 4-layer Llama training step, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M')} "
             f"(`python3 benchmarks/bench_llama_training.py`, batch {args.batch} × seq {args.seq})", "",
             "| set-up | eager step µs | fxfuse step µs | vs eager | fxfuse gated kernels step µs | vs eager "
             "| kernels µs per step (eager / gated kernels) | peak MiB (eager / fxfuse / gated kernels) "
             "| grad rel err vs float64, max / median (eager) "
             "| grad rel err vs float64, max / median (gated kernels) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['eager step us']:.0f} | {r['fxfuse step us']:.0f} "
                     f"| {r['eager step us'] / r['fxfuse step us']:.2f}× | {r['fxfuse gated step us']:.0f} "
                     f"| {r['eager step us'] / r['fxfuse gated step us']:.2f}× "
                     f"| {r['eager kernels us']:.0f} / {r['fxfuse gated kernels us']:.0f} "
                     f"| {r['eager peak MiB']:.0f} / {r['fxfuse peak MiB']:.0f} / {r['fxfuse gated peak MiB']:.0f} "
                     f"| {r['eager grad err max']:.1e} / {r['eager grad err median']:.1e} "
                     f"| {r['fxfuse grad err max']:.1e} / {r['fxfuse grad err median']:.1e} |")
    text = "\n".join(lines) + "\n"
    (args.out / "llama_training.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
