"""Where the host time of a ``torch.compile(model, backend="fxfuse")`` call goes, at GPT-2-medium's MLP, one row
(other rows: the module-level layers only, with each one's do_bench time beside).

``probe_backend.py`` measured the backend's call at ~100 µs of host against ``fxfuse.optimize``'s ~17. Host µs per
call (50 back-to-back calls, best of 20 loops) of each layer, outermost first:

* the compiled module (Dynamo's guards, Inductor's wrapper, the op);
* ``torch.ops.fxfuse.mlp_infer.default`` / ``mlp_extern.default`` called directly (the ops' dispatch around fxfuse's
  runtime: a plain ``Library`` op, a ``custom_op``);
* ``torch.ops.fxfuse.mlp.default`` (the triton_op), ``fxfuse.ops.fused_mlp`` and ``fxfuse.ops._dispatch``;
* the same module compiled with ``options={"inductor": False}`` and ``fxfuse.optimize``'s module;

then a cProfile of the compiled module's calls (top functions by own time).

    python3 benchmarks/probes/probe_backend_host.py [--row gpt2m_mlp_m1]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, profile_top  # noqa: E402
from benchmarks.workloads import WORKLOADS, build_module, make_input  # noqa: E402
from fxfuse import ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="gpt2m_mlp_m1")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    w = next(w for w in WORKLOADS if w.name == args.row)
    mod, x = build_module(w), make_input(w)
    compiled = torch.compile(mod, backend="fxfuse")
    plain = torch.compile(mod, backend="fxfuse", options={"inductor": False})
    fast = fxfuse.optimize(mod)
    layers = {"compiled (backend fxfuse)": lambda: compiled(x)}
    if w.kind == "gpt2":  # (the ops' layers: their arguments spelled out for GPT-2's MLP)
        call_args = (x, [mod.fc.weight, mod.proj.weight], [mod.fc.bias, mod.proj.bias], [],
                     "1b:gelu_tanh(a0);1b:a0")
        layers.update({
            "mlp_infer op": lambda: torch.ops.fxfuse.mlp_infer.default(*call_args),
            "mlp_extern op": lambda: torch.ops.fxfuse.mlp_extern.default(*call_args),
            "mlp triton_op": lambda: torch.ops.fxfuse.mlp.default(*call_args),
            "fused_mlp": lambda: ops.fused_mlp(*call_args),
            "_dispatch": lambda: ops._dispatch(*call_args),
        })
    layers.update({"compiled, inductor off": lambda: plain(x), "fxfuse.optimize": lambda: fast(x)})
    with torch.no_grad():
        for fn in layers.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        for label, fn in layers.items():
            print(f"  {label:28s} host {host_us(fn):7.1f} µs per call", flush=True)
        # (other rows: is the compiled call's host time above its GPU time? do_bench's median, L2 flushed)
        from triton.testing import do_bench
        for label in ("compiled (backend fxfuse)", "compiled, inductor off", "fxfuse.optimize"):
            gpu = do_bench(layers[label], warmup=25, rep=100, return_mode="median") * 1e3
            print(f"  {label:28s} do_bench {gpu:7.1f} µs", flush=True)
        print(profile_top(layers["compiled (backend fxfuse)"], calls=300, lines=30), flush=True)


if __name__ == "__main__":
    main()
