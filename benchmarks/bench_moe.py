"""MoE experts benchmark: transformers' experts modules beside eager, torch.compile and fxfuse, with the floor.

For each family (Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-20b shapes, bf16, transformers' own experts classes) and
token count, in ONE process on the GPU: the experts module as transformers runs it (``grouped_mm``, its default),
``torch.compile`` of it (default mode), and ``fxfuse.optimize`` of it, timed in interleaved rounds
(``triton.testing.do_bench`` medians, L2 flushed; median over the rounds), each checked against a float64 copy
(transformers' loop over experts) on the same routing. Decode counts (≤ 16 tokens) also get the wall time of 200
back-to-back calls and the GPU time replayed from a CUDA graph (no host time). ``--train``: a training step instead
(forward and the gradients of the input, the routing weights and every parameter), with each variant's peak memory
and the wall time of 20 steps back to back (as a training loop runs them: do_bench's flush before each step drains
the GPU's queue, so a step's host time ahead of its first kernel counts there).

Floor = max(FLOPs / matmul rate, bytes / copy bandwidth), the two ceilings measured in the same run: FLOPs = 2 x the
routed pairs x (H x 2I + I x H) (x3 for a training step); bytes = the input and output once, the routing, and the
weights of the experts this routing hits read once (training: also every weight's gradient written once, the
input's gradient, and the output's gradient read). Routing: softmax of random logits, top-k (balanced on average;
a real router's imbalance gives some experts more rows).

    python3 benchmarks/bench_moe.py --out DIR [--families mixtral,qwen3_moe,gpt_oss] [--tokens 1,16,256,4096]
    python3 benchmarks/bench_moe.py --out DIR --train [--tokens 512,4096]
    python3 benchmarks/bench_moe.py --cpu-smoke --out DIR   # tiny shapes, interpreter, host timer: the code path
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.measure import Timer, cleanup, dynamo_reset, measure_ceilings, rel_err, round_order  # noqa: E402
from benchmarks.workloads import EAGER_SLACK, floor_us  # noqa: E402

# (module path, experts class, config class, config kwargs, top_k)
FAMILIES = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralExperts", "MixtralConfig",
                dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8), 2),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig",
                  dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128), 8),
    "gpt_oss": ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts", "GptOssConfig",
                dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32), 4),
}
SMOKE = dict(mixtral=dict(hidden_size=32, intermediate_size=64, num_local_experts=4),
             qwen3_moe=dict(hidden_size=32, moe_intermediate_size=16, num_experts=8),
             gpt_oss=dict(hidden_size=32, intermediate_size=32, num_local_experts=4))
LABELS = {"mixtral": "Mixtral-8x7B (8 experts, 4096 → 14336, top-2)",
          "qwen3_moe": "Qwen3-30B-A3B (128 experts, 2048 → 768, top-8)",
          "gpt_oss": "gpt-oss-20b (32 experts, 2880 → 2880, top-4, biases, clamped SwiGLU)"}
VARIANTS = ("eager", "compile", "fxfuse")
DTYPE = torch.bfloat16
DECODE_TOKENS = 16  # at or below: wall time and CUDA-graph replays too
TOL = {"forward": 2e-2, "train": 3e-2}


def build(family: str, device: str, smoke: bool):
    """(bf16 experts module, its float64 copy running transformers' loop, top_k)."""
    import importlib

    path, cls, cfg_cls, kwargs, top_k = FAMILIES[family]
    mod = importlib.import_module(path)
    config = getattr(mod, cfg_cls)(**(SMOKE[family] if smoke else kwargs))
    module = getattr(mod, cls)(config)
    with torch.no_grad():
        for name, param in module.named_parameters():
            fan_in = param.shape[-1] if not getattr(module, "is_transposed", False) else param.shape[-2]
            param.normal_(0, 0.1 if name.endswith("bias") else fan_in ** -0.5)
    reference = copy.deepcopy(module).to(device, torch.float64)
    reference.config = copy.copy(config)
    reference.config._experts_implementation = "eager"  # (grouped_mm has no float64)
    module = module.to(device, DTYPE if device == "cuda" else torch.float32)  # (the interpreter: no bf16)
    module.config._experts_implementation = "eager" if device == "cpu" else "grouped_mm"
    return module, reference, min(top_k, len(module.gate_up_proj))


def routing(tokens: int, experts: int, top_k: int, hidden: int, device: str, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPE if device == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k, -1)
    return x, index.to(device), weights.to(device, dtype)


def work(module, index: torch.Tensor, train: bool) -> tuple[int, int]:
    """(FLOPs, minimum bytes) of one call (or training step) on this routing."""
    params = dict(module.named_parameters())
    per_expert = sum(p[0].numel() * p.element_size() for p in params.values())
    gate_up = params["gate_up_proj"]
    inner, hidden = gate_up.shape[1:] if not getattr(module, "is_transposed", False) else gate_up.shape[1:][::-1]
    pairs = index.numel()
    flops = 2 * pairs * (hidden * inner + inner // 2 * hidden) * (3 if train else 1)
    tokens = index.shape[0]
    activations = 2 * tokens * hidden * 2 + pairs * (8 + 2)  # x in, out; the routing (int64 index, bf16 weights)
    hit = int(index.unique().numel())
    nbytes = hit * per_expert + activations
    if train:  # + every gradient of a weight written, dx written, dout read, d(routing weights) written
        nbytes += len(gate_up) * per_expert + 2 * tokens * hidden * 2 + pairs * 2
    return flops, nbytes


def step_fn(fn, x, index, weights, inputs, dout):
    """A training step: the forward, then the gradients of ``inputs``."""
    def step():
        return torch.autograd.grad(fn(x, index, weights), inputs, dout)
    return step


def peak_mib(step, sync) -> float:
    sync()
    if not torch.cuda.is_available():
        step()
        return float("nan")
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def graphed_us(fn, timer: Timer) -> float | str:
    """GPU µs of ``fn`` replayed from a CUDA graph, or why it could not be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timer.gpu_us(graph.replay)
    except Exception as exc:
        torch.cuda.synchronize()
        return f"n/a ({type(exc).__name__})"


def run_point(family: str, variants: dict, module, reference, tokens: int, top_k: int, args, timer: Timer,
              ceil: dict, seed: int) -> dict:
    """Every variant at one token count: correctness, then the interleaved timing rounds."""
    experts, hidden = len(module.gate_up_proj), module.config.hidden_size
    x, index, weights = routing(tokens, experts, top_k, hidden, args.device, seed)
    flops, nbytes = work(module, index, args.train)
    rate = ceil.get("bf16_flops", 1e12)
    floor, bound, _, _ = floor_us(flops, nbytes, rate, ceil.get("copy_Bps", 1e11))
    row = dict(family=family, tokens=tokens, floor=floor, bound=bound, gflop=flops / 1e9, mb=nbytes / 1e6,
               us={}, rounds={}, err={}, first_s={}, wall={}, graph={}, peak_mib={})
    params = list(module.parameters())
    if args.train:
        x.requires_grad_(True)
        weights.requires_grad_(True)
        dout = torch.randn_like(x)
        inputs = [x, weights, *params]
        x64, w64 = x.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
        want = torch.autograd.grad(reference(x64, index, w64), [x64, w64, *reference.parameters()], dout.double())
        fns = {name: step_fn(fn, x, index, weights, inputs, dout) for name, fn in variants.items()}
    else:
        with torch.no_grad():
            want = reference(x.double(), index, weights.double())
        fns = {name: (lambda fn=fn: fn(x, index, weights)) for name, fn in variants.items()}
    grad_mode = contextlib.nullcontext() if args.train else torch.no_grad()
    with grad_mode:
        for name, fn in list(fns.items()):
            start = time.perf_counter()
            try:
                got = fn()  # the first call here: compiles, checks, tunes, times its choice
                timer.sync()
                row["first_s"][name] = time.perf_counter() - start
                got = got if args.train else [got]
                wants = want if args.train else [want]
                row["err"][name] = max(rel_err(g.float(), w) for g, w in zip(got, wants))
                del got
            except Exception as exc:  # a variant this torch / GPU cannot run: its cells say why
                row["us"][name] = f"ERR: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                fns.pop(name)
                cleanup()
        for name in fns:
            row["rounds"][name] = []
        for r in range(args.rounds):
            for name in round_order(list(fns), r, args.rounds):
                row["rounds"][name].append(timer.gpu_us(fns[name]))
        for name in fns:
            row["us"][name] = statistics.median(row["rounds"][name])
            if args.train:
                row["peak_mib"][name] = peak_mib(fns[name], timer.sync)
                # steps back to back, as a training loop runs them (do_bench's flush before each step drains the
                # queue: a step whose host time runs ahead of its GPU time is charged its launch latency there)
                loops = {"calls": 1, "loops": 1} if timer.cpu else {"calls": 20, "loops": 3}  # (cpu: the path only)
                row["wall"][name] = timer.wall_us(fns[name], **loops)["median"]
            elif tokens <= DECODE_TOKENS:
                loops = {"calls": 2, "loops": 1} if timer.cpu else {}  # (the interpreter: the code path only)
                row["wall"][name] = timer.wall_us(fns[name], **loops)["median"]
                if not timer.cpu:
                    row["graph"][name] = graphed_us(fns[name], timer)
    row["fxfuse_choice"] = choice_of(variants.get("fxfuse"), tokens, args.train)
    # (whether the optimized module's kernels agreed with its own forward at their first call: False keeps its
    # forward for good, None: they never ran)
    row["kernels_agreed"] = vars(variants["fxfuse"]).get("_fxfuse_moe") if "fxfuse" in variants else None
    print_point(row)
    return row


def choice_of(fast, tokens: int, train: bool) -> str:
    """What the optimized module's installed forward runs at this token count (its measured choice), with the two
    times it measured: 'kernels (x / y µs)' or 'grouped_mm (...)'."""
    from fxfuse.moe import experts_timings

    if fast is None:
        return "—"
    for timing in experts_timings(type(fast), tuple(fast.gate_up_proj.shape)):
        if timing.tokens[0] <= tokens <= timing.tokens[1] and timing.training == train:
            runs = "kernels" if timing.runs == "kernels" else "its own forward"
            return f"{runs} ({timing.kernels_us:.0f} / {timing.original_us:.0f})"
    return "— (not timed)"


def fmt(v, digits: int = 1) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v < 1000 else f"{v:.0f}"
    return "—" if v is None else str(v)


def print_point(row: dict) -> None:
    cells = "  ".join(f"{n} {fmt(row['us'].get(n))}" for n in VARIANTS if n in row["us"])
    print(f"  {row['family']:9s} T={row['tokens']:5d}  floor {row['floor']:.1f} ({row['bound']})  {cells}  "
          f"err {', '.join(f'{n} {e:.1e}' for n, e in row['err'].items())}  fxfuse runs: {row['fxfuse_choice']}",
          flush=True)


def markdown(rows: list[dict], env: dict, ceil: dict, args) -> str:
    what = "training step (forward + backward)" if args.train else "forward (inference, no_grad)"
    lines = [f"## {env['gpu']}, {what}, {env['date']}", "",
             f"- torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
             f"ceilings measured in this run: copy {ceil.get('copy_Bps', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{ceil.get('bf16_flops', 0) / 1e12:.0f} TFLOP/s",
             f"- Command: `{env['argv']}` at {env['commit']} (FXFUSE_* environment: {env['fxfuse_env'] or 'none'})",
             "- GPU µs: median over the rounds of do_bench medians (L2 flushed), variants interleaved; eager = "
             "transformers' default experts implementation (`grouped_mm`); compile = `torch.compile(experts)`, "
             "default mode; fxfuse = `fxfuse.optimize(experts)` (its installed forward: the kernels or grouped_mm, "
             "whichever its first call in the token bucket measured faster; 'runs' says which, with the kernels' and "
             "grouped_mm's µs as that call timed them). rel err: the worst "
             f"{'gradient' if args.train else 'output'} against float64 (tolerance "
             f"{TOL['train' if args.train else 'forward']}).", ""]
    extra = " | wall µs/step, back to back (eager / compile / fxfuse) | peak MiB (eager / compile / fxfuse)" \
        if args.train else \
        " | wall µs/call (eager / compile / fxfuse) | CUDA-graph replay µs (eager / compile / fxfuse)"
    lines.append("| experts | tokens | GFLOP | min MB | floor µs | bound | eager | compile | fxfuse | fxfuse/floor | "
                 "vs eager | vs compile | fxfuse runs | rel err (eager / compile / fxfuse) | first call s "
                 f"(compile / fxfuse){extra} | not slower than eager |")
    lines.append("|" + "---|" * lines[-1].count(" | ") + "---|")
    for row in rows:
        us = row["us"]
        fx, eager, comp = us.get("fxfuse"), us.get("eager"), us.get("compile")
        num = all(isinstance(v, float) for v in (fx, eager))
        ratio = (lambda a, b: f"{a / b:.2f}×" if isinstance(a, float) and isinstance(b, float) else "—")
        trio = (lambda d, digits=1: " / ".join(fmt(d.get(n), digits) for n in VARIANTS))
        errs = " / ".join(f"{row['err'][n]:.1e}" if n in row["err"] else "—" for n in VARIANTS)
        first = " / ".join(fmt(row["first_s"].get(n), 2) for n in ("compile", "fxfuse"))
        if args.train:
            more = f"{trio(row['wall'])} | {trio(row['peak_mib'], 0)}"
        elif row["wall"]:
            more = f"{trio(row['wall'])} | {trio(row['graph'])}"
        else:
            more = "— | —"
        slower = "yes" if num and fx <= eager * (1 + EAGER_SLACK) else ("no" if num else "—")
        lines.append(f"| {LABELS[row['family']] if not args.cpu_smoke else row['family']} | {row['tokens']} | "
                     f"{row['gflop']:.1f} | {row['mb']:.0f} | {row['floor']:.1f} | {row['bound']} | {fmt(eager)} | "
                     f"{fmt(comp)} | {fmt(fx)} | {ratio(fx, row['floor'])} | {ratio(eager, fx)} | {ratio(comp, fx)} | "
                     f"{row['fxfuse_choice']} | {errs} | {first} | {more} | {slower} |")
    lines.append("")
    return "\n".join(lines)


def env_info(args) -> dict:
    import datetime
    import os
    import subprocess

    import transformers
    import triton

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True).stdout.strip()
    return dict(date=datetime.datetime.now().isoformat(timespec="minutes"), torch=torch.__version__,
                triton=triton.__version__, transformers=transformers.__version__,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreter)",
                argv="python3 benchmarks/bench_moe.py " + " ".join(sys.argv[1:]),
                commit=commit or "?",
                fxfuse_env=", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("FXFUSE_")))


def write(args, rows: list[dict], env: dict, ceil: dict) -> str:
    """Write the table and the raw rows under ``args.out``; return the table."""
    text = markdown(rows, env, ceil, args)
    name = "moe_train" if args.train else "moe"
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps(dict(env=env, ceilings=ceil, rows=rows), indent=1,
                                                      default=str))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tokens", help="token counts (default 1,16,256,4096; --train 512,4096)")
    ap.add_argument("--train", action="store_true", help="a training step (forward + backward) instead")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the interpreter, a host timer")
    ap.add_argument("--commit", help="the commit to name in the table (a copied working tree's git may differ)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke else "cuda"
    tokens = [int(t) for t in (args.tokens or ("512,4096" if args.train else "1,16,256,4096")).split(",")]
    if args.cpu_smoke:
        tokens = sorted({min(t, 8) for t in tokens})
    import fxfuse

    logging.basicConfig(format="    %(name)s: %(message)s")
    for name in ("fxfuse.moe", "fxfuse.kernels.moe_launch", "fxfuse.kernels.moe_weight_grads"):
        logging.getLogger(name).setLevel(logging.INFO)  # each bucket's measured choices (kernels, gate/up, grads)
    timer = Timer(warmup=2 if args.cpu_smoke else 25, rep=2 if args.cpu_smoke else 100, cpu=args.cpu_smoke)
    ceil = measure_ceilings(timer, args.device, args.cpu_smoke)
    env = env_info(args)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for seed, family in enumerate(args.families.split(",")):
        torch.manual_seed(seed)
        module, reference, top_k = build(family, args.device, args.cpu_smoke)
        fast = fxfuse.optimize(module)
        if args.train:
            module.train()
            fast.train()
        variants = {"eager": module, "fxfuse": fast}
        if not args.no_compile:
            dynamo_reset()
            variants["compile"] = torch.compile(module)
        variants = {name: variants[name] for name in VARIANTS if name in variants}
        print(f"== {family}: {type(module).__name__}, {sum(p.numel() for p in module.parameters()) * 2 / 1e6:.0f} "
              f"MB of bf16 weights, top-{top_k}", flush=True)
        for t in tokens:
            rows.append(run_point(family, variants, module, reference, t, top_k, args, timer, ceil, seed))
            write(args, rows, env, ceil)  # after every row: a run cut short keeps what it measured
            cleanup()
        del module, reference, fast, variants
        dynamo_reset()
        cleanup()
    print(write(args, rows, env, ceil))
    bad = [r for r in rows if any(not (e <= TOL["train" if args.train else "forward"]) for e in r["err"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
