"""MoE experts: transformers' MixtralExperts (its eager loop and its default ``grouped_mm`` implementation) against
fxfuse's two grouped kernels (``run_moe``), Mixtral-8x7B shapes by default, bf16, at several token counts;
correctness against float32, GPU µs (do_bench, L2 flushed), wall µs per call (50 back-to-back calls) and GPU µs
replayed from a CUDA graph; 'installed' = the forward fxfuse.optimize installs (the faster of the kernels and
grouped_mm, timed at each token bucket's first call). ``--family gpt_oss``: transformers' GptOssExperts instead
(gpt-oss-20b's shapes by default: 32 experts of 2880 -> 2880, top 4; weights [E, in, out], biases, gate/up
interleaved, a clamped SwiGLU; transformers runs it by the same two implementations).

    python3 benchmarks/probes/probe_moe.py [--tokens 1,16,128,512,4096] [--hidden 4096] [--inter 14336] [--experts 8]
    python3 benchmarks/probes/probe_moe.py --family gpt_oss [--tokens ...]
    python3 benchmarks/probes/probe_moe.py --train [...]   # a training step's forward + backward instead
    python3 benchmarks/probes/probe_moe.py --train --weight-grads [...]  # + each weight-gradient implementation

``--train``: forward + backward (gradients of the input, the routing weights and every parameter) of transformers'
grouped_mm under autograd against fxfuse's autograd node (``MoEExpertsFunction``, what a training call
runs), GPU µs (do_bench), the gradients' error against the float32 copy's, the memory the forward keeps for the
backward (with its output) and the step's peak above what was allocated before it; with ``--profile``, each kernel of
both steps (torch.profiler) and the backward kernels' tuned configs.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxfuse.kernels.moe_launch import run_moe  # noqa: E402
from fxfuse.moe import experts_form, moe_forward  # noqa: E402

GPT_OSS_20B = dict(hidden=2880, inter=2880, experts=32, top_k=4)


def build(args):
    """(bf16 module on the GPU, its float32 copy on the GPU, the kernels' form) of the family's experts class."""
    if args.family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts

        config = GptOssConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts

        config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_local_experts=args.experts)
    module = Experts(config)
    with torch.no_grad():
        for name, param in module.named_parameters():
            fan_in = args.inter if name.startswith("down") else args.hidden
            param.normal_(0, 0.1 if name.endswith("bias") else fan_in ** -0.5)
    reference = Experts(config).to("cuda")  # float32 copy of the same weights
    reference.load_state_dict(module.state_dict())
    return module.to("cuda", torch.bfloat16), reference, experts_form(module)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["mixtral", "gpt_oss"], default="mixtral")
    ap.add_argument("--tokens", default="1,16,128,512,4096")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--inter", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--profile", action="store_true", help="also each kernel's GPU time (torch.profiler) and config")
    ap.add_argument("--train", action="store_true", help="time forward + backward instead (see the doc)")
    ap.add_argument("--weight-grads", action="store_true",
                    help="--train: also fxfuse's node with its weight gradients on grouped_mm, and on the Triton "
                         "kernel (fxfuse: the faster of the two, timed at the first backward)")
    args = ap.parse_args()
    defaults = GPT_OSS_20B if args.family == "gpt_oss" else dict(hidden=4096, inter=14336, experts=8, top_k=2)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    logging.basicConfig(format="    %(message)s")
    logging.getLogger("fxfuse.moe").setLevel(logging.INFO)  # the installed forward's choice per token bucket
    logging.getLogger("fxfuse.kernels.moe_weight_grads").setLevel(logging.INFO)  # and the weight gradients'
    torch.manual_seed(0)
    module, reference, form = build(args)
    forward = moe_forward(type(module).forward, form)
    biases = dict(gate_up_bias=module._parameters.get("gate_up_proj_bias"),
                  down_bias=module._parameters.get("down_proj_bias"))
    weight_mb = sum(p.numel() for p in module.parameters()) * 2 / 1e6
    print(f"{torch.cuda.get_device_name()}: {type(module).__name__} ({form}) E={args.experts} H={args.hidden} "
          f"I={args.inter} top_k={args.top_k}, weights {weight_mb:.0f} MB (bf16)")
    if args.train:
        return train(args, module, reference, form)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, args.experts, device="cuda")
        weights, index = torch.topk(torch.softmax(logits, -1), args.top_k, -1)
        weights = weights.to(torch.bfloat16)
        with torch.no_grad():
            ref = reference(x.float(), index, weights.float())

            def original(implementation, x=x, index=index, weights=weights):
                module.config._experts_implementation = implementation
                return module(x, index, weights)

            def installed(x=x, index=index, weights=weights):  # what fxfuse.optimize installs: timed per bucket
                module.config._experts_implementation = "grouped_mm"
                return forward(module, x, index, weights)

            variants = {"eager loop": functools.partial(original, "eager"),
                        "grouped_mm": functools.partial(original, "grouped_mm"),
                        "fxfuse": lambda x=x, index=index, weights=weights: run_moe(
                            x, index, weights, module.gate_up_proj, module.down_proj, form, **biases),
                        "installed": installed}
            cells = []
            for name, fn in variants.items():
                try:
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    gpu = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(50):
                        fn()
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - start) / 50 * 1e6
                    # (the eager loop waits on the GPU for its routing: no capture)
                    graph = "n/a" if name == "eager loop" else graphed_us(fn)
                    cells.append(f"{name} {gpu:8.1f} us (wall {wall:8.1f}, graph {graph}, err {err:.1e})")
                except Exception as exc:  # grouped_mm missing on this torch / GPU
                    cells.append(f"{name} failed: {type(exc).__name__}: {str(exc)[:80]}")
        print(f"  T={tokens:5d}  " + "  ".join(cells), flush=True)
        if args.profile:
            profile(variants["fxfuse"], tokens)


def train(args, module, reference, form) -> None:
    """Forward + backward of grouped_mm under autograd and of fxfuse's autograd node, per token count."""
    module.config._experts_implementation = "grouped_mm"
    for tokens in [int(t) for t in args.tokens.split(",")]:
        print(f"  T={tokens:5d} fwd+bwd  " + "  ".join(train_row(args, module, reference, form, tokens)), flush=True)


def train_row(args, module, reference, form, tokens: int) -> list[str]:
    from fxfuse.kernels.moe_backward_launch import MoEExpertsFunction
    from fxfuse.kernels.moe_weight_grads import GROUPED_WEIGHT_GRADS

    params = module._parameters
    x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, args.experts, device="cuda"), -1), args.top_k, -1)
    weights = weights.to(torch.bfloat16).requires_grad_()
    dout = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    inputs = [x, weights, *module.parameters()]

    def step(run):
        return torch.autograd.grad(run(), inputs, dout)

    def node(weight_grads=None):
        def run():
            GROUPED_WEIGHT_GRADS["force"] = weight_grads  # (read by this node's backward; None: the measured choice)
            return MoEExpertsFunction.apply(x, index, weights, params["gate_up_proj"], params["down_proj"],
                                            params.get("gate_up_proj_bias"), params.get("down_proj_bias"), form)
        return run

    variants = {"grouped_mm": lambda: module(x, index, weights), "fxfuse": node()}
    if args.weight_grads:
        variants["fxfuse, grouped_mm weight grads"] = node("grouped_mm")
        variants["fxfuse, Triton weight grads"] = node("triton")
    x32, w32 = x.detach().float().requires_grad_(), weights.detach().float().requires_grad_()
    ref = torch.autograd.grad(reference(x32, index, w32), [x32, w32, *reference.parameters()], dout.float())
    cells = []
    for name, run in variants.items():
        grads = step(run)
        err = max(((g.float() - r).norm() / r.norm().clamp_min(1e-30)).item() for g, r in zip(grads, ref))
        gpu = do_bench(lambda run=run: step(run), warmup=10, rep=50, return_mode="median") * 1e3
        del grads
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run()  # what the forward keeps for the backward, and the output
        kept = (torch.cuda.memory_allocated() - base) / 2**20
        torch.autograd.grad(out, inputs, dout)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        del out
        cells.append(f"{name} {gpu:8.1f} us (worst grad err {err:.1e}; kept {kept:.0f} MiB, peak {peak:.0f} MiB)")
    if args.profile:
        for name, run in variants.items():
            print(f"    {name} step at T={tokens}:")
            profile(lambda run=run: step(run), tokens, grad=True)
    return cells


def graphed_us(fn) -> str:
    """GPU µs of ``fn`` replayed from a CUDA graph (no host time), or why it could not be captured."""
    try:
        for _ in range(2):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return f"{do_bench(graph.replay, warmup=10, rep=50, return_mode='median') * 1e3:7.1f}"
    except Exception as exc:
        torch.cuda.synchronize()
        return f"n/a ({type(exc).__name__})"


def profile(fn, tokens: int, grad: bool = False) -> None:
    """Each GPU kernel's mean time over 20 calls of ``fn`` (``grad``: with autograd on, a training step), and the
    tuned configs of the MoE kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from fxfuse.kernels.moe_backward_template import moe_down_backward_kernel, moe_weight_grad_kernel
    from fxfuse.kernels.moe_template import moe_down_kernel, moe_gate_up_kernel

    with torch.set_grad_enabled(grad), torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:12 if grad else 8]:
        print(f"      {e.device_time_total / 20:9.1f} us/call  x{e.count / 20:.0f}  {e.key[:90]}")
    kernels = (moe_gate_up_kernel, moe_down_kernel) + ((moe_down_backward_kernel, moe_weight_grad_kernel) if grad
                                                       else ())
    for kernel in kernels:
        for key, config in getattr(kernel, "cache", {}).items():
            print(f"      {kernel.fn.__name__} {key}: {config}")


if __name__ == "__main__":
    main()
