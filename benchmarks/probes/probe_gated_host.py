"""Host µs per training step (forward + backward) of one gated MLP layer, for each way fxfuse can run it.

The layer is ``down(silu(gate(x)) * up(x))`` without biases at tiny widths (default M=8, D=64, H=128, fp32), so
the math is negligible and what is timed is the host's work: Python, autograd, dispatch, launches. Variants:

* ``eager``: the module itself;
* ``fxfuse``: ``fxfuse.optimize(module)``, trained (a first backward has run), as shipped: the original ops;
* ``product``: the same with ``FXFUSE_GATED_TRAINING=1`` and the whole-MLP node switched off
  (``fxfuse.gated_mlp_training.use_function = False``): the GEMMs as the original ops and ``act(g) * u`` through
  :class:`fxfuse.gated_training.GatedProduct` (the path before the whole-MLP node);
* ``function``: ``FXFUSE_GATED_TRAINING=1``: the whole MLP as one :class:`fxfuse.gated_mlp_training.GatedMLPFunction`.

On the CPU the Triton launches of the gated kernels are replaced by ``torch.empty_like`` (so the interpreter's cost
is not timed; a real launch costs a few µs of host more), ``torch.set_num_threads(1)``. On CUDA the kernels run
(bound launches); each timed batch of steps ends with a synchronize, the GPU being faster than the host at these
sizes. Rounds interleave the variants; each variant's figure is the median over rounds of µs per step.

    python3 benchmarks/probes/probe_gated_host.py [--m 8 --d 64 --hidden 128] [--batch B] [--rounds 15] [--steps 200]
        [--autocast]   # fp32 weights, the forward under autocast (bf16 on CUDA, fp16 on the CPU)
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

if not torch.cuda.is_available():  # the kernels' CPU path needs the interpreter on before fxfuse is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxfuse  # noqa: E402
import fxfuse.gated_mlp_training as gmt  # noqa: E402
import fxfuse.gated_training as gated_training  # noqa: E402
from benchmarks.workloads import SwiGLUMLP  # noqa: E402  (the Llama MLP of the benchmark set)
from fxfuse.gated_training import GatedProduct  # noqa: E402

VARIANTS = ("eager", "fxfuse", "product", "function")


def _stub_launches() -> None:
    """The gated kernels' launches as allocations only, where each path calls them."""
    def forward(g, u, act):
        return torch.empty_like(g)

    def backward(dh, g, u, act, overwrite_dh=False):  # (the outputs have dh's shape)
        return dh if overwrite_dh else torch.empty_like(dh), torch.empty_like(dh)

    for module in (gmt, gated_training):  # the names GatedMLPFunction and GatedProduct call
        module.run_gated_forward, module.run_gated_backward = forward, backward


def _configure(variant: str) -> None:
    if variant in ("product", "function"):
        os.environ["FXFUSE_GATED_TRAINING"] = "1"
    else:
        os.environ.pop("FXFUSE_GATED_TRAINING", None)
    gmt.use_function = variant != "product"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=0, help="x of shape [batch, m, d] (a transformer's); 0: [m, d]")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--autocast", action="store_true",
                        help="fp32 weights, forward under autocast (bf16 on CUDA, fp16 on the CPU)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)
        _stub_launches()
    torch.manual_seed(0)
    eager = SwiGLUMLP(args.d, args.hidden).to(device)
    models = {"eager": eager}
    for name in VARIANTS[1:]:
        models[name] = fxfuse.optimize(copy.deepcopy(eager))
    lead = (args.batch, args.m) if args.batch else (args.m,)
    x = torch.randn(*lead, args.d, device=device, requires_grad=True)
    dy = torch.randn(*lead, args.d, device=device)

    params = {model: list(model.parameters()) for model in models.values()}

    def autocast():
        if not args.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device, dtype=torch.bfloat16 if cuda else torch.float16)

    def step(model):
        with autocast():
            y = model(x)
        y.backward(dy)
        x.grad = None
        for p in params[model]:
            p.grad = None

    # Warm up (the first backward marks the region trained; binds the launches on CUDA) and check the paths.
    counts = {}
    for name in VARIANTS:
        _configure(name)
        for _ in range(3):
            step(models[name])
        whole = product = 0
        forward, apply = gmt.GatedMLPFunction.forward, GatedProduct.apply

        def count_whole(*a, _f=forward):
            nonlocal whole
            whole += 1
            return _f(*a)

        def count_product(*a, _f=apply):
            nonlocal product
            product += 1
            return _f(*a)

        gmt.GatedMLPFunction.forward, GatedProduct.apply = staticmethod(count_whole), count_product
        try:
            step(models[name])
        finally:
            gmt.GatedMLPFunction.forward, GatedProduct.apply = staticmethod(forward), apply
        counts[name] = (whole, product)
    expected = {"eager": (0, 0), "fxfuse": (0, 0), "product": (0, 1), "function": (1, 0)}
    assert counts == expected, counts

    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            _configure(name)
            model = models[name]
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(model)
            if cuda:
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) / args.steps * 1e6)
    _configure("fxfuse")

    where = torch.cuda.get_device_name() if cuda else "CPU, gated launches stubbed"
    print(f"host µs per forward+backward of one gated MLP layer, x {list(x.shape)}, H={args.hidden} fp32"
          f"{' under ' + ('bf16' if cuda else 'fp16') + ' autocast' if args.autocast else ''}, "
          f"{where}; median of {args.rounds} interleaved rounds of {args.steps} steps (min-max)")
    base = statistics.median(times["eager"])
    for name in VARIANTS:
        med = statistics.median(times[name])
        print(f"  {name:9s} {med:8.1f} µs  ({min(times[name]):.1f}-{max(times[name]):.1f})  {med / base:5.2f}x eager")


if __name__ == "__main__":
    main()
