"""The TMA stage's bf16 epilogue with the hardware forms of session 27 against today's (fewer instructions), A/B.

    python3 benchmarks/probes/probe_fast_forms.py [--rounds 3] [--budget 240] [case names...]

``fxfuse.epilogue.FAST_FORMS`` now writes tanh-GELU as ``h + h·tanh(x·(c0 + c1·x²))`` (``h = x/2``) and SiLU as
``h + h·tanh(h)``; session 27's forms were ``0.5·x·(1 + tanh(c0·(x + 0.044715·x³)))`` and ``x·(0.5 + 0.5·tanh(x/2))``.
For each stage of ``probe_tma.CASES`` with such an epilogue (bf16, ``FAST_MATH`` on), every config the pruning keeps
(no warp specialization: inline assembly aborts it) runs with both forms, the two in alternating order over
``--rounds`` rounds (``do_bench`` medians, L2 flushed), beside ``mul(a0,a1)`` / ``a0`` (the same stage with no
activation) and cuBLAS's plain GEMMs. Prints each config's medians, the best of each form, and both forms' errors
against float64 next to the exact value's own bf16 rounding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_tma import CASES  # noqa: E402
from benchmarks.probes.probe_tma_sweep import bench_us, describe  # noqa: E402
from fxfuse import codegen  # noqa: E402
from fxfuse import epilogue as ep  # noqa: E402
from fxfuse.kernels import run_stage_tma, tma_template  # noqa: E402

SESSION_27_FORMS = {
    "gelu_tanh": "(0.5 * {0} * (1.0 + _tanh_approx(0.7978845608028654 * ({0} + 0.044715 * {0} * {0} * {0}))))",
    "silu": "({0} * (0.5 + 0.5 * _tanh_approx(0.5 * {0})))",
}
FORMS = {"s27": {**ep.FAST_FORMS, **SESSION_27_FORMS}, "now": dict(ep.FAST_FORMS)}


def with_forms(forms: dict, fn):
    """Call ``fn`` with ``forms`` as the hardware forms, rendering the stage kernel for them (cached per form)."""
    saved_forms, saved_modules = dict(ep.FAST_FORMS), dict(codegen._modules)
    ep.FAST_FORMS.clear()
    ep.FAST_FORMS.update(forms)
    codegen._modules.clear()
    codegen._modules.update(_cache.setdefault(id(forms), {}))
    try:
        return fn()
    finally:
        _cache[id(forms)] = dict(codegen._modules)
        ep.FAST_FORMS.clear()
        ep.FAST_FORMS.update(saved_forms)
        codegen._modules.clear()
        codegen._modules.update(saved_modules)


_cache: dict[int, dict] = {}


def probe(case, rounds: int, deadline: float) -> None:
    workload, stage, m, k, n, gated, epi, bias = case
    torch.manual_seed(0)
    d = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, **d) * 2  # pre-activations of a few units: the tails matter for the error
    weights = [torch.randn(n, k, **d) * k**-0.5 for _ in range(2 if gated else 1)]
    biases = [torch.randn(n, **d) if bias else None for _ in weights]
    ref = ep.evaluate(ep.parse(epi), [F.linear(x.double(), w.double(), None if b is None else b.double())
                                      for w, b in zip(weights, biases)], [])
    rounded = ref.to(torch.bfloat16).double()
    plain = "mul(a0,a1)" if gated else "a0"
    gemms = bench_us(lambda: [F.linear(x, w, b) for w, b in zip(weights, biases)])
    print(f"== {workload} {stage}: M={m} K={k} N={n} {epi}; cuBLAS GEMMs alone {gemms:.1f} µs; exact value's bf16 "
          f"rounding: max {(rounded - ref).abs().max().item():.2e}, rel "
          f"{((rounded - ref).norm() / ref.norm()).item():.2e}", flush=True)
    from triton.tools.tensor_descriptor import TensorDescriptor

    probe_args = {"M": m, "FAST_MATH": True, "x_desc": TensorDescriptor.from_tensor(x, [16, 16]),
                  "w_desc": TensorDescriptor(weights[0], [2, n, k] if gated else [n, k],
                                             [n * k, k, 1] if gated else [k, 1], [2, 16, 16] if gated else [16, 16])}
    configs = tma_template._prune(tma_template.gpu_configs(), probe_args)
    os.environ["FXFUSE_FAST_MATH"] = "1"
    best: dict[str, tuple[float, str]] = {}
    for c in configs:
        if time.time() > deadline:
            print("   (budget reached)", flush=True)
            break
        runs = {form: (lambda c=c, f=forms: with_forms(f, lambda: run_stage_tma(x, weights, biases, [], epi,
                                                                                 check=False, config=c)))
                for form, forms in FORMS.items()}
        runs[plain] = lambda c=c: run_stage_tma(x, weights, biases, [], plain, check=False, config=c)
        try:
            errs = {}
            for form in FORMS:
                out = runs[form]().double()
                errs[form] = ((out - ref).abs().max().item(), ((out - ref).norm() / ref.norm()).item())
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(rounds):
                for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                    times[name].append(bench_us(runs[name]))
        except Exception as e:  # a config that does not compile or run here: say why, go on
            print(f"   {describe(c):40s} {type(e).__name__}: {str(e).splitlines()[0][:90]}", flush=True)
            continue
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for form in FORMS:
            if form not in best or med[form] < best[form][0]:
                best[form] = (med[form], describe(c))
        print(f"   {describe(c):40s} " + "  ".join(f"{name} {t:7.1f}" for name, t in med.items())
              + "  | err " + "  ".join(f"{f} max {a:.2e} rel {b:.2e}" for f, (a, b) in errs.items()), flush=True)
    for form, (us, name) in best.items():
        print(f"   best {form}: {us:.1f} µs ({name})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole probe")
    ap.add_argument("names", nargs="*", help="cases as 'workload:stage' (default: those with GELU or SiLU)")
    args = ap.parse_args()
    deadline = time.time() + args.budget
    for case in CASES:
        name = f"{case[0]}:{case[1]}"
        if (args.names and name not in args.names) or not ep.has_fast_forms(ep.parse(case[6])):
            continue
        probe(case, args.rounds, deadline)


if __name__ == "__main__":
    main()
