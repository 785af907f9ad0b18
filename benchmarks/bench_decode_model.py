"""Greedy decoding of a transformers Llama with Llama-3-8B's layer shapes (or a MoE model: Mixtral-8x7B's or
Qwen3-30B-A3B's layers): ms per token, eager vs fxfuse.

The benchmark rows time one MLP. A user decoding with a real model sees the whole step: attention with its KV
cache, norms, rotary embeddings, the LM head, and the Python around all of it. This script builds
``LlamaForCausalLM`` with Llama-3-8B's layer shapes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads; a few
layers, a 32000-token vocabulary, random bf16 weights: nothing is downloaded), prefills a prompt, then times
greedy decode steps (``model(input_ids=next_token, past_key_values=cache)``), one token per step, batch 1:

* **wall ms per token**: ``steps`` steps between two synchronizations (what a user waits for), median of
  interleaved rounds, eager and ``fxfuse.optimize(model)`` timed alternately;
* **GPU ms per token**: the time per step during which a kernel ran (torch.profiler, one pass after the timing,
  since a profiler session slows later launches in the process); wall above GPU is host time the GPU waited for;
* the MLPs' share of eager's GPU time, and the first step's logits against eager's.

* with ``--compile``, ``torch.compile(model)`` and ``torch.compile(model, backend="fxfuse")`` beside them (for a
  MoE family also ``torch.compile(fxfuse.optimize(model))``, its experts as fxfuse's op in the graph); with
  ``--static`` as well, the path transformers documents for fast decoding: a ``StaticCache`` with explicit cache
  positions and ``mode="reduce-overhead"`` (one CUDA graph per step).

    python3 benchmarks/bench_decode_model.py --out DIR [--layers 4] [--steps 64] [--rounds 3] [--batch 1] \
        [--compile] [--static] [--family llama|mixtral|qwen3_moe|gpt_oss]

With ``--family mixtral`` / ``qwen3_moe`` / ``gpt_oss`` the model is ``MixtralForCausalLM`` /
``Qwen3MoeForCausalLM`` / ``GptOssForCausalLM`` with that model's layer shapes (every MLP a MoE layer run by
transformers' default ``grouped_mm`` experts; routers scaled up so that routing is decisive, ``ROUTER_SCALE``), and
the prefill's ms are a column too: the prompt's tokens go through the experts at once.

Writes ``DIR/decode_model.md`` (``decode_model_static.md`` with ``--static``; ``decode_<family>.md`` for a MoE
family) and prints it. On a CPU
(``TRITON_INTERPRET=1``) ``--tiny`` runs a small config for a smoke test.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():  # the interpreter must be on before fxfuse defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxfuse  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

LLAMA3_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
TINY_LAYER = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2)
# family -> (config class, model class, its layer shapes, a tiny config's)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA3_8B_LAYER, TINY_LAYER),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(LLAMA3_8B_LAYER, num_local_experts=8, num_experts_per_tok=2),
                dict(TINY_LAYER, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8),
                  dict(TINY_LAYER, moe_intermediate_size=48, head_dim=16, num_experts=8, num_experts_per_tok=2)),
    # gpt-oss-20b's layers: 32 experts of 2880 -> 2880 (biases, gate/up interleaved, a clamped SwiGLU), top 4
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                     head_dim=64, num_local_experts=32, num_experts_per_tok=4),
                dict(TINY_LAYER, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
}

ROUTER_SCALE = 20.0  # MoE families: the routers' weights times this (see build)


def layer_shape(family: str, tiny: bool) -> dict:
    return FAMILIES[family][3 if tiny else 2]


def build(layers: int, vocab: int, tiny: bool, device: str, dtype: torch.dtype,
          family: str = "llama") -> torch.nn.Module:
    """The model, initialized on ``device`` in ``dtype`` (random weights at HF's init scale)."""
    import transformers

    config_class, model_class, _, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(vocab_size=vocab, num_hidden_layers=layers,
                                                 max_position_embeddings=4096, **layer_shape(family, tiny))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(old)
    if family != "llama":
        # Random routers at HF's init scale give near-ties between experts, which bf16's rounding flips (eager
        # against the fp32 model: 0.14 rel err on Mixtral's logits): scaled up, routing is decisive and the
        # logits' error measures the layers' arithmetic.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                    param.mul_(ROUTER_SCALE)
    return model.eval()


def model_and_prompt(args, batch: int) -> tuple:
    """From the scripts' common arguments (``layers``, ``vocab``, ``prompt``, ``tiny``): (on a GPU, tiny, vocab,
    dtype, the model, a random prompt of ``batch`` rows). Off a GPU: the tiny config in fp32."""
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    tiny = args.tiny or not gpu
    vocab = 256 if tiny else args.vocab
    torch.manual_seed(0)
    model = build(args.layers, vocab, tiny, device, dtype, getattr(args, "family", "llama"))
    return gpu, tiny, vocab, dtype, model, torch.randint(3, vocab, (batch, args.prompt), device=device)


def decode(model: torch.nn.Module, prompt: torch.Tensor, steps: int, sync=None, forced=None,
           keep: int = 0, static=None, prefill: Optional[list] = None) -> tuple[list, float, list]:
    """Prefill ``prompt``, then ``steps`` greedy steps: (the ``[B, 1]`` tokens fed, seconds of the steps, logits of
    the prefill's last position and of the first ``keep`` steps, in fp32). ``forced``: feed these tokens (another
    run's list, each an argmax output like this run's own, so a compiled model sees the same strides and does not
    recompile) instead of this model's own picks, so two models see the same inputs. ``sync``: called before and
    after the timed steps (``torch.cuda.synchronize`` on a GPU). ``static``: a ``StaticCache`` to reset and decode
    into, with explicit cache positions (as ``generate`` does for a compiled model); otherwise a ``DynamicCache``.
    ``prefill``: a list that gets the prefill's seconds (with ``sync`` before and after it)."""
    from transformers import DynamicCache

    with torch.no_grad():
        if sync is not None and prefill is not None:
            sync()
        start = time.perf_counter()  # (the prefill's)
        if static is not None:
            static.reset()
            position = torch.arange(prompt.shape[1], device=prompt.device)
            out = model(input_ids=prompt, past_key_values=static, use_cache=True, cache_position=position)
            position = position[-1:] + 1
        else:
            out = model(input_ids=prompt, past_key_values=DynamicCache(), use_cache=True)
        if prefill is not None:
            if sync is not None:
                sync()
            prefill.append(time.perf_counter() - start)
        kept = [out.logits[:, -1:].float()] if keep else []
        token = out.logits[:, -1:].argmax(-1) if forced is None else forced[0]
        cache = out.past_key_values
        tokens = [token]
        if sync is not None:
            sync()
        start = time.perf_counter()
        for i in range(steps):
            if static is not None:
                out = model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position)
                position = position + 1
            else:
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
            token = out.logits[:, -1:].argmax(-1) if forced is None else forced[i + 1]
            tokens.append(token)
            if i < keep - 1:
                kept.append(out.logits.float())
        if sync is not None:
            sync()
        seconds = time.perf_counter() - start
    return tokens, seconds, kept


def _is_kernel(e) -> bool:
    return e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def busy_us(events) -> float:
    """µs during which at least one kernel ran: the union of the kernels' intervals. (A sum of kernel durations
    would count twice the time a programmatic dependent launch spends waiting beside the kernel before it.)"""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if _is_kernel(e))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_ms_per_step(model, prompt, steps: int, static=None) -> float:
    """The GPU's busy ms per decode step, from one profiled pass of ``steps`` steps less a prefill-only pass."""
    from torch.profiler import ProfilerActivity, profile

    passes = []
    for n in (steps, 0):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode(model, prompt, n, torch.cuda.synchronize, static=static)
        passes.append(busy_us(prof.events()))
    return (passes[0] - passes[1]) / steps / 1e3


def rel_err(logits: list, ref: list) -> float:
    a, b = torch.cat(logits, 1).double(), torch.cat(ref, 1).double()
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write decode_model.md here")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128, help="prompt length")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile(model) and torch.compile(model, backend='fxfuse')")
    ap.add_argument("--static", action="store_true",
                    help="decode into a StaticCache with explicit cache positions; the compiled variants then use "
                         "mode='reduce-overhead' (CUDA graphs), the fast path transformers documents")
    ap.add_argument("--tiny", action="store_true", help="a small config (CPU smoke test)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                    help="the model: Llama-3-8B's layers, or a MoE model's (Mixtral-8x7B, Qwen3-30B-A3B)")
    args = ap.parse_args()
    gpu, tiny, vocab, dtype, model, prompt = model_and_prompt(args, args.batch)
    sync = torch.cuda.synchronize if gpu else None
    keep = min(args.steps, 8) + 1

    def static_cache(m):  # one per variant, reset by every decode (a compiled graph keeps its address)
        if not args.static:
            return None
        from transformers import StaticCache
        cache = StaticCache(config=m.config, max_cache_len=args.prompt + args.steps + 1)
        # Allocated now, outside any compiled code, so its tensors are marked static: a compiled graph that mutates
        # them is then still CUDA-graphed (lazily, inside a compiled prefill, they would not be).
        c = m.config
        cache.early_initialization(args.batch, c.num_key_value_heads,
                                   getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                                   next(m.parameters()).dtype, prompt.device)
        return cache

    # Accuracy first: every variant fed the fp32 model's greedy tokens, its logits against the fp32 model's.
    reference = copy.deepcopy(model).float()
    forced, _, ref_logits = decode(reference, prompt, args.steps, sync, keep=keep, static=static_cache(reference))
    del reference

    variants: dict[str, torch.nn.Module] = {"eager": model}
    start = time.perf_counter()
    variants["fxfuse"] = fxfuse.optimize(model)
    notes = [f"fxfuse.optimize {time.perf_counter() - start:.2f} s"]
    if args.compile:
        # Both compiled variants wrap the same forward, whose compiled entries Dynamo keeps in one cache per code
        # object (the prefill, then the cache lengths until it marks them dynamic): room for both.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        mode = "reduce-overhead" if args.static else None
        said = f", mode='{mode}'" if mode else ""
        variants[f"torch.compile({said[2:]})"] = torch.compile(model, mode=mode)
        variants[f"torch.compile(backend='fxfuse'{said})"] = torch.compile(model, backend="fxfuse", mode=mode)
        if args.family != "llama":
            # MoE: the optimized model compiled, its experts one op each in the graph (fxfuse.moe_op); the "fxfuse"
            # variant's eager pass, which runs first, checks its experts' kernels.
            variants[f"torch.compile(fxfuse.optimize(model){said})"] = torch.compile(variants["fxfuse"], mode=mode)
    caches = {name: static_cache(model) for name in variants}
    first_call, errors = {}, {}
    for name, m in list(variants.items()):
        start = time.perf_counter()
        try:  # the first pass plans, tunes and compiles (every cache length a compiler specializes on included)
            _, _, logits = decode(m, prompt, args.steps, sync, forced=forced, keep=keep, static=caches[name])
        except Exception as err:  # a variant that fails is reported, not fatal
            notes.append(f"{name} failed: {type(err).__name__}: {str(err)[:200]}")
            del variants[name]
            continue
        first_call[name] = time.perf_counter() - start
        errors[name] = rel_err(logits, ref_logits)

    walls = {name: [] for name in variants}
    prefills = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, m in variants.items():
            walls[name].append(decode(m, prompt, args.steps, sync, static=caches[name], prefill=prefills[name])[1]
                               * 1e3 / args.steps)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    prefill_ms = {k: statistics.median(v) * 1e3 for k, v in prefills.items() if v}
    gpu_ms = ({k: gpu_ms_per_step(m, prompt, min(args.steps, 16), caches[k]) for k, m in variants.items()}
              if gpu else {})

    shape = layer_shape(args.family, tiny)
    cache_kind = "StaticCache" if args.static else "DynamicCache"
    cmd = (f"python3 benchmarks/bench_decode_model.py --layers {args.layers} --steps {args.steps} --rounds "
           f"{args.rounds} --batch {args.batch} --prompt {args.prompt}" + (" --compile" if args.compile else "")
           + (" --static" if args.static else "") + (f" --family {args.family}" if args.family != "llama" else ""))
    experts = (f", {shape.get('num_local_experts', shape.get('num_experts'))} experts of intermediate "
               f"{shape.get('moe_intermediate_size', shape['intermediate_size'])}, top-{shape['num_experts_per_tok']}"
               if args.family != "llama" else "")
    lines = [f"### Greedy decode, `{FAMILIES[args.family][1]}` ({args.layers} layers of hidden {shape['hidden_size']}, "
             + (experts[2:] if experts else f"intermediate {shape['intermediate_size']}")
             + f", {shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV heads; vocab {vocab}; "
             f"{str(dtype).replace('torch.', '')}; batch {args.batch}, prompt {args.prompt}, {args.steps} steps, "
             f"{cache_kind})",
             "",
             f"- {torch.cuda.get_device_name() if gpu else 'CPU (Triton interpreter)'}; torch {torch.__version__}; "
             f"`{cmd}`",
             "- " + "; ".join(notes),
             "- wall = ms per decode step (one token per sequence) over all steps between two synchronizations, "
             "median of interleaved rounds; GPU = the time per step during which a kernel ran (torch.profiler); "
             f"prefill = ms of the {args.prompt}-token prefill (synchronized, median of the rounds); "
             "first pass = the first prefill + decode, planning, "
             "tuning and compiling included; rel err = the logits of the prefill and the first "
             f"{keep - 1} steps against the fp32 model's, every variant fed the fp32 model's greedy tokens",
             "", "| | wall ms / step (rounds) | tokens/s | GPU ms / step | prefill ms | first pass s | rel err |",
             "|---|---|---|---|---|---|---|"]
    for name in variants:
        g = gpu_ms.get(name)
        lines.append(f"| {name} | {wall[name]:.3f} ({', '.join(f'{t:.3f}' for t in walls[name])}) | "
                     f"{1e3 / wall[name] * args.batch:.0f} | {f'{g:.3f}' if g else 'n/a'} | "
                     f"{prefill_ms[name]:.2f} | {first_call[name]:.1f} | "
                     f"{errors[name]:.1e} |")
    summary = f"fxfuse vs eager: **{wall['eager'] / wall['fxfuse']:.2f}×** on the wall per step"
    if gpu_ms:
        summary += f", {gpu_ms['eager'] / gpu_ms['fxfuse']:.2f}× on GPU time"
    summary += f"; prefill {prefill_ms['eager'] / prefill_ms['fxfuse']:.2f}×"
    compiled = [name for name in variants if name.startswith("torch.compile(")]
    if len(compiled) == 2:  # (the default backend's, then fxfuse's)
        summary += (f"; backend='fxfuse' vs torch.compile: **{wall[compiled[0]] / wall[compiled[1]]:.2f}×** on the "
                    "wall per step")
        if gpu_ms:
            summary += f", {gpu_ms[compiled[0]] / gpu_ms[compiled[1]]:.2f}× on GPU time"
    lines += ["", summary + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "decode_model" if args.family == "llama" else f"decode_{args.family}"
        (Path(args.out) / (name + ("_static.md" if args.static else ".md"))).write_text(text)


if __name__ == "__main__":
    main()
