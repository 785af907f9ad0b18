"""fxfuse.profile demo: the seed GeGLU MLP of the benchmark, and a transformers Llama model.

    python examples/profile_demo.py                    # GPU: writes docs/roofline.png, docs/profile_report.html,
                                                       #      docs/roofline_llama.png, docs/profile_report_llama.html
    python examples/profile_demo.py --bench R.json     # also compare with a bench_workloads.py results.json

On a GPU each model is run as it is and optimized, under torch.profiler; traces go to ``--traces``.
Without a GPU the structural report (FLOPs, bytes, kernel counts, regime predicted for an H200) is made
on ``meta`` tensors, at full size (the Llama on the CPU, at 256 tokens: its code cannot run on ``meta``), and
written to ``--out`` (default ``profile-demo/``, not docs/).

The factories work with the command line too::

    python -m fxfuse profile examples/profile_demo.py:seed_geglu --device cuda
    python -m fxfuse profile examples/profile_demo.py:llama --device cuda --dtype bf16 --shape 1,4096
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.workloads import WORKLOADS, build_module, make_input, table_work  # noqa: E402
from fxfuse.profile import profile  # noqa: E402

GPU = torch.cuda.is_available()
SEED = next(w for w in WORKLOADS if w.name == "seed_geglu")


def seed_geglu(shape=None, device=None):
    """The benchmark's seed_geglu row: gate/up (no bias), gelu_tanh(g)·u, down; 768 → 3072 → 768, bf16."""
    device = device or ("cuda" if GPU else "meta")
    if device == "meta":
        with torch.device("meta"):
            model = build_module(SEED, device="meta")
        return model, (torch.empty(shape or SEED.input_shape, device="meta", dtype=SEED.dtype),)
    model = build_module(SEED, device=device, seed=1000)  # the benchmark's seeds
    x = make_input(SEED, device=device, seed=1001)
    if shape:
        x = torch.randn(shape, device=device, dtype=SEED.dtype)
    return model, (x,)


def llama(shape=None, device=None):
    """A 4-layer Llama (TinyLlama widths: 2048 → 5632, 32 heads), random weights, bf16; input (1, 2048) ids
    on a GPU, (1, 256) on the CPU."""
    from transformers import LlamaConfig, LlamaModel

    device = device or ("cuda" if GPU else "cpu")  # HF code reads mask values: it cannot run on meta
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, shape or ((1, 2048) if device == "cuda" else (1, 256)), device=device)
    return model, (ids,)


def compare_with_benchmark(rep, bench: Path) -> list[str]:
    """The profile's figures beside a bench_workloads.py run of the same row (same module, input, method)."""
    rows = {r["name"]: r for r in json.loads(bench.read_text())["rows"]}
    row = rows.get("seed_geglu")
    if row is None:
        return [f"{bench} has no seed_geglu row"]
    (r,) = rep.regions
    lines = [f"seed_geglu: profile vs benchmark ({bench}):"]
    pairs = [("FLOPs", r.flops, row["floor"]["flops"], 0.0), ("min bytes", r.min_bytes, row["floor"]["bytes"], 0.0),
             ("floor µs", r.floor_us, row["floor"]["floor_us"], 0.05)]
    if rep.timed:
        pairs += [("eager µs (do_bench)", rep.before_us, row["gpu_us"].get("eager"), 0.10),
                  ("fxfuse µs (do_bench)", rep.after_us, row["gpu_us"].get("fxfuse"), 0.10),
                  ("eager region kernels µs", r.before.gpu_us, row["gpu_us"].get("eager"), 0.10),
                  ("fxfuse region kernels µs", r.after.gpu_us, row["gpu_us"].get("fxfuse"), 0.10)]
    for what, mine, theirs, tol in pairs:
        if not isinstance(theirs, (int, float)) or mine is None:
            lines.append(f"  {what}: profile {mine}, benchmark {theirs}")
            continue
        diff = (mine - theirs) / theirs
        verdict = "agrees" if abs(diff) <= tol else f"DIFFERS by more than {tol:.0%}"
        lines.append(f"  {what}: profile {mine:.4g}, benchmark {theirs:.4g} ({diff:+.1%}, {verdict})")
    return lines


def publish(rep, name: str, out: Path, traces: Path) -> None:
    """Traces and the full set under ``traces/name``; the PNG and the HTML page into ``out``."""
    written = rep.save(traces / name)
    suffix = "" if name == "seed_geglu" else f"_{name}"
    out.mkdir(parents=True, exist_ok=True)
    if "png" in written:
        shutil.copyfile(written["png"], out / f"roofline{suffix}.png")
    shutil.copyfile(written["html"], out / f"profile_report{suffix}.html")
    print(f"wrote {out / f'roofline{suffix}.png'}, {out / f'profile_report{suffix}.html'}; traces in {traces / name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / ("docs" if GPU else "profile-demo"))
    p.add_argument("--traces", type=Path, default=Path(os.environ.get("OUT", "profile-traces")) / "profile")
    p.add_argument("--bench", type=Path, default=REPO / "benchmarks" / "results.json",
                   help="results.json of bench_workloads.py to compare with (default: the committed one)")
    p.add_argument("--skip-llama", action="store_true")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {'GPU ' + torch.cuda.get_device_name() if GPU else 'no GPU: structure only'}")

    # The host-bound Llama first: a torch.profiler session leaves every later launch in the process ~11% slower on
    # the host (benchmarks/probes/probe_tma_host.py --llama --after-profiler), which a host-bound model's end-to-end
    # times would show; the GPU-bound seed MLP does not notice.
    if not args.skip_llama:
        profile_llama(args)
    model, inputs = seed_geglu()
    rep = profile(model, inputs)
    print(rep, "\n")
    (r,) = rep.regions
    assert (r.flops, r.min_bytes) == table_work(SEED), "FLOPs/bytes differ from the benchmark's count"
    if args.bench.exists():
        print("\n".join(compare_with_benchmark(rep, args.bench)), "\n")
    publish(rep, "seed_geglu", args.out, args.traces)


def profile_llama(args) -> None:
    try:
        import transformers
    except ImportError:
        print("\ntransformers is not installed: skipping the Llama profile (pip install transformers)")
        return
    print(f"\n== transformers {transformers.__version__}: LlamaModel (random weights)")
    model, inputs = llama()
    rep = profile(model, inputs)
    print(rep, "\n")
    publish(rep, "llama", args.out, args.traces)

if __name__ == "__main__":
    main()
