"""Host µs of each piece of a replayed TMA stage (the LlamaModel MLP's shape by default), and Triton's launcher code.

    python3 benchmarks/probes/probe_tma_host.py [--m 2048] [--d 2048] [--h 5632] [--source FILE] [--llama]
        [--tokens 2048] [--rounds 3]

Prints host µs per call (``timing.host_us``) of: the optimized module, eager, the region's replay, each replay
step, a cuBLAS ``F.linear`` of the same shape, ``torch.empty``, one ``TensorDescriptor`` and one TMA launch through
the compiled launcher with ready descriptors; then the cProfile top of the module call. ``--source FILE`` writes
the Triton functions a TMA launch goes through (for work on the launch path). ``--llama`` also times the profile
demo's transformers LlamaModel end to end (host µs, wall µs per forward, eager beside fxfuse, ``--rounds``
interleaved rounds at ``--tokens`` tokens: a few tokens make the forward host-bound, so wall = host) and profiles it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402
from benchmarks.timing import host_us, profile_top  # noqa: E402
from benchmarks.workloads import SwiGLUMLP  # noqa: E402
from fxfuse import replay  # noqa: E402


def _closure(fn) -> dict:
    return inspect.getclosurevars(fn).nonlocals


def _steps(run) -> list:
    """A replay's steps (``fxfuse.replay._chained``: one step alone, two or three chained, or a loop over them)."""
    names = _closure(run)
    if "steps" in names:
        return list(names["steps"])
    chained = [names[k] for k in ("first", "second", "third") if k in names]
    return chained or [run]


def write_source(path: str) -> None:
    import triton
    from triton.backends.nvidia import driver as nvdriver
    from triton.tools import tensor_descriptor

    parts = [f"# triton {triton.__version__}"]
    for name in ("make_tensordesc_arg", "wrap_handle_tensordesc", "CudaLauncher"):
        obj = getattr(nvdriver, name, None)
        if obj is not None:
            parts.append(inspect.getsource(obj))
    try:
        from triton.backends import driver as base_driver
        parts.append(inspect.getsource(base_driver))
    except Exception as err:  # noqa: BLE001
        parts.append(f"# base driver: {err}")
    parts.append(inspect.getsource(tensor_descriptor))
    with open(path, "w") as f:
        f.write("\n\n".join(parts))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--h", type=int, default=5632)
    p.add_argument("--source")
    p.add_argument("--llama", action="store_true")
    p.add_argument("--tokens", type=int, default=2048, help="with --llama: the input's tokens")
    p.add_argument("--rounds", type=int, default=3, help="with --llama: interleaved rounds")
    p.add_argument("--after-profiler", action="store_true",
                   help="with --llama: time again after a torch.profiler session (does one slow launches down?)")
    a = p.parse_args()
    if a.source:
        write_source(a.source)
    torch.manual_seed(0)
    mod = SwiGLUMLP(a.d, a.h, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(a.m, a.d, device="cuda", dtype=torch.bfloat16)
    row = {}
    with torch.no_grad():
        opt = fxfuse.optimize(mod)
        for _ in range(3):
            opt(x)
        row["module"] = host_us(lambda: opt(x))
        row["eager"] = host_us(lambda: mod(x))
        runs = list(replay.replays.values())
        print(f"replays: {len(runs)}")
        if runs:
            run = runs[-1]
            row["replay"] = host_us(lambda: run(x))
            steps = _steps(run)
            h = x
            for i, step in enumerate(steps):
                row[f"step{i}"] = host_us(lambda step=step, h=h: step(h))
                h = step(h)
            tma = _closure(steps[0])
            bound = tma.get("bound")
            if bound is not None:
                TensorDescriptor = tma["TensorDescriptor"]
                xb, ob = tma["x_block"], tma["out_block"]
                out = torch.empty(a.m, a.h, device="cuda", dtype=torch.bfloat16)
                xd = TensorDescriptor(x, list(x.shape), list(x.stride()), xb)
                od = TensorDescriptor(out, list(out.shape), list(out.stride()), ob)
                row["TensorDescriptor()"] = host_us(
                    lambda: TensorDescriptor(x, list(x.shape), list(x.stride()), xb), calls=200)
                row["bound launch, ready descs"] = host_us(lambda: bound(xd, od))
        row["torch.empty"] = host_us(lambda: torch.empty(a.m, a.h, device="cuda", dtype=torch.bfloat16), calls=200)
        hid = torch.randn(a.m, a.h, device="cuda", dtype=torch.bfloat16)
        row["F.linear (down)"] = host_us(lambda: F.linear(hid, mod.down.weight))
        row["F.silu"] = host_us(lambda: F.silu(hid))
    for k, v in row.items():
        print(f"{k:>28}: {v:7.1f} us/call (host)")
    with torch.no_grad():
        print(profile_top(lambda: opt(x), lines=30))
    if a.llama:
        llama_end_to_end(a.after_profiler, a.tokens, a.rounds)


def llama_end_to_end(after_profiler: bool = False, tokens: int = 2048, rounds: int = 3) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from profile_demo import llama

    from benchmarks.timing import wall_us

    model, (ids,) = llama(shape=(1, tokens))
    with torch.no_grad():
        variants = {"eager": model, "fxfuse": fxfuse.optimize(model),
                    "fxfuse (example_inputs)": fxfuse.optimize(model, (ids,))}  # as fxfuse.profile builds it
        for m in variants.values():
            for _ in range(3):
                m(ids)
        _llama_rounds(variants, ids, wall_us, rounds)
        if after_profiler:
            from fxfuse.kernels import fastlaunch

            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]):
                for _ in range(3):
                    variants["fxfuse"](ids)
                torch.cuda.synchronize()
            print(f"after a torch.profiler session: lean launches enabled = {fastlaunch.lean_launch_enabled()}")
            _llama_rounds(variants, ids, wall_us, rounds)
        print(profile_top(lambda: model(ids), calls=50, lines=25, sort="tottime"))  # eager's, to compare
        print(profile_top(lambda: variants["fxfuse (example_inputs)"](ids), calls=50, lines=25, sort="tottime"))


def _llama_rounds(variants: dict, ids, wall_us, n: int = 3) -> None:
    rounds: dict[str, list] = {name: [] for name in variants}
    for _ in range(n):  # interleaved: the host's speed drifts
        for name, m in variants.items():
            rounds[name].append((host_us(lambda m=m: m(ids), calls=20, loops=10),
                                 wall_us(lambda m=m: m(ids), calls=50, loops=5)))
    for name, vals in rounds.items():
        print(f"LlamaModel {name}: host " + " ".join(f"{h:.0f}" for h, _ in vals) + " us, wall "
              + " ".join(f"{w:.0f}" for _, w in vals) + f" us per forward ({n} rounds; fastest host "
              f"{min(h for h, _ in vals):.0f}, median {sorted(h for h, _ in vals)[len(vals) // 2]:.0f})")


if __name__ == "__main__":
    main()
