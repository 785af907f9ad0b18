"""Would fxfuse's MoE GEMMs be faster on ``torch._grouped_mm``? Each grouped GEMM of the experts' forward and backward
timed both ways on the same pair layout, and a forward built from grouped_mm with torch glue beside fxfuse's kernels
and ``torch.compile(experts)``.

torch.compile runs transformers' ``grouped_mm`` path with the glue fused and beat fxfuse's training step at most sizes
on the H200 (session 35, ``benchmarks/moe.md``); the weight gradients already run on grouped_mm where it measured
faster. This probe measures, per family and token count (bf16, ``benchmarks/bench_moe.py``'s shapes and routing):

* each GEMM alone on fxfuse's pair layout (sorted rows, padded to blocks; K split at each expert's end row):
  gate/up ``x_rows @ W1^T`` and down ``h @ W2^T`` (forward), ``G = dout_rows @ W2`` and ``dx_rows = dgu @ W1``
  (backward), by ``torch._grouped_mm`` against the profile's time of fxfuse's Triton kernel for the same product
  (``--profile``: every kernel of ``run_moe`` and of the node's backward, torch.profiler, per call);
* whole forwards: fxfuse's ``run_moe``; the grouped_mm forward (fxfuse's routing kernel, the gathered rows, grouped_mm,
  ``act(g) * u`` and the per-token weighted sum in torch ops); ``torch.compile`` of transformers' forward.

    python3 benchmarks/probes/probe_moe_grouped.py [--families mixtral,qwen3_moe,gpt_oss] [--tokens 512,4096]
        [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.bench_moe import build, routing  # noqa: E402
from fxfuse.kernels.moe_backward_launch import MoEExpertsFunction, _segments  # noqa: E402
from fxfuse.kernels.moe_launch import block_rows, route_pairs, run_moe  # noqa: E402
from fxfuse.kernels.moe_weight_grads import _sorted_rows  # noqa: E402
from fxfuse.moe import experts_form  # noqa: E402


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def views(module, form):
    """The weights as [E, out, in] views (either layout), as the kernels read them."""
    w1, w2 = module.gate_up_proj, module.down_proj
    return (w1.transpose(1, 2), w2.transpose(1, 2)) if form.transposed else (w1, w2)


def grouped_forward(module, form, x, index, weights):
    """The experts' forward from grouped_mm GEMMs over fxfuse's pair layout, the glue in torch ops (no biases, gate
    and up in halves: the Mixtral / Qwen3 form)."""
    w1, w2 = views(module, form)
    E, two_i, _ = w1.shape
    T, top_k = index.shape
    layout = route_pairs(index, E, block_rows(T * top_k, E))
    offs = (_segments(layout, E)[1:] * layout.block_m).to(torch.int32)
    gu = torch._grouped_mm(_sorted_rows(x, layout.rows, top_k), w1.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=1)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)
    # each pair's row: the inverse of the layout's rows (padding rows to a spare slot), no host sync
    pairs = T * top_k
    owner = layout.block_expert.repeat_interleave(layout.block_m)  # (unused blocks' rows are left unwritten)
    slot = torch.where((owner >= 0) & (layout.rows >= 0), layout.rows, pairs).long()
    row_of = torch.empty(pairs + 1, dtype=torch.long, device=x.device).scatter_(
        0, slot, torch.arange(slot.numel(), device=x.device))[:pairs]
    return (y.index_select(0, row_of) * weights.reshape(-1, 1)).view(T, top_k, -1).sum(1)


def gemms(module, form, x, index):
    """Each grouped GEMM of the forward and backward alone, by grouped_mm on the layout's rows: name -> (µs, GFLOP)."""
    w1, w2 = views(module, form)
    E, two_i, H = w1.shape
    T, top_k = index.shape
    layout = route_pairs(index, E, block_rows(T * top_k, E))
    offs = (_segments(layout, E)[1:] * layout.block_m).to(torch.int32)
    x_rows = _sorted_rows(x, layout.rows, top_k)
    rows = x_rows.shape[0]
    h = torch.randn(rows, two_i // 2, dtype=x.dtype, device=x.device)
    dgu = torch.randn(rows, two_i, dtype=x.dtype, device=x.device)
    pairs = T * top_k
    cases = {"gate/up x @ W1^T": (lambda: torch._grouped_mm(x_rows, w1.transpose(1, 2), offs=offs), two_i * H),
             "down h @ W2^T": (lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), two_i // 2 * H),
             "G dout @ W2": (lambda: torch._grouped_mm(x_rows, w2, offs=offs), two_i // 2 * H),
             "dx dgu @ W1": (lambda: torch._grouped_mm(dgu, w1, offs=offs), two_i * H)}
    return {name: (us(fn), 2 * pairs * work / 1e9) for name, (fn, work) in cases.items()}


def profile(fn, calls: int = 10) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    return [(e.key[:70], e.device_time_total / calls) for e in sorted(events, key=lambda e: -e.device_time_total)]


def point(module, form, fast, compiled, tokens: int, top_k: int, with_profile: bool) -> None:
    """Every measurement at one token count."""
    biases = dict(gate_up_bias=module._parameters.get("gate_up_proj_bias"),
                  down_bias=module._parameters.get("down_proj_bias"))
    x, index, weights = routing(tokens, len(module.gate_up_proj), top_k, module.config.hidden_size, "cuda", 0)
    for name, (t, gflop) in gemms(module, form, x, index).items():
        print(f"   grouped_mm {name:18s} {t:9.1f} us  ({gflop / t * 1e3:5.0f} TFLOP/s)", flush=True)

    def kernels():
        return run_moe(x, index, weights, module.gate_up_proj, module.down_proj, form, **biases)

    forwards = {"fxfuse kernels": kernels, "compile": lambda: compiled(x, index, weights),
                "installed": lambda: fast(x, index, weights)}
    if form.act == "silu" and not form.interleaved and biases["gate_up_bias"] is None:
        forwards["grouped_mm + torch glue"] = lambda: grouped_forward(module, form, x, index, weights)
    with torch.no_grad():
        ref = kernels().float()
        for name, fn in forwards.items():
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            print(f"   forward {name:24s} {us(fn):9.1f} us  (rel diff to the kernels {err:.1e})", flush=True)
        if with_profile:
            for name in ("fxfuse kernels", "grouped_mm + torch glue"):
                if name in forwards:
                    print(f"   {name} forward, its kernels:")
                    for key, t in profile(forwards[name])[:8]:
                        print(f"      {t:9.1f} us  {key}")
    if with_profile:  # the node's backward: G, the gate, dx, the weight gradients
        xg, wg = x.detach().requires_grad_(), weights.detach().requires_grad_()
        params = module._parameters
        wanted = [xg, wg, *module.parameters()]

        def step():
            out = MoEExpertsFunction.apply(xg, index, wg, params["gate_up_proj"], params["down_proj"],
                                           params.get("gate_up_proj_bias"), params.get("down_proj_bias"), form)
            return torch.autograd.grad(out, wanted, torch.ones_like(out))

        step()
        print("   fxfuse training step, its kernels:")
        for key, t in profile(step)[:12]:
            print(f"      {t:9.1f} us  {key}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="mixtral,qwen3_moe,gpt_oss")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for family in args.families.split(","):
        module, _, top_k = build(family, "cuda", False)
        form = experts_form(module)
        fast, compiled = fxfuse.optimize(module), torch.compile(module)
        for tokens in (int(t) for t in args.tokens.split(",")):
            print(f"== {family} T={tokens}", flush=True)
            point(module, form, fast, compiled, tokens, top_k, args.profile)
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
