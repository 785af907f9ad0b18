"""Host µs of the pieces of one bound launch (a replay step), and of the launch attributes it carries.

    python3 benchmarks/probes/probe_launch_pieces.py

For gpt2m_mlp_m1's one-launch grid-sync kernel (cooperative, PDL) and a one-row small-M stage (PDL): the bound
launch as a replay calls it, Triton's C launcher called with every argument ready, the same launch without the
cooperative attribute, without PDL and without both, a trivial two-argument kernel through the same launcher,
and the output allocation (``torch.empty`` and ``empty_like``). Tells whether a replay step's host time is
Python, argument parsing or the driver.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_launch import gpt2m_m1_tensors  # noqa: E402
from benchmarks.timing import host_us, wall_us  # noqa: E402
from fxfuse.kernels import fastlaunch, grid_sync_launch, run_grid_sync  # noqa: E402


@triton.jit
def _tiny(x_ptr, n):
    pid = tl.program_id(0)
    if pid == n:
        tl.store(x_ptr, 0)


def _cells(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


def _best(fn, rounds: int = 5) -> float:
    """Host µs per call, a few calls after a synchronize (the GPU queue stays short: a launch behind a long queue
    of slower kernels costs the host more than one behind an idle GPU), best of many."""
    return min(host_us(fn, calls=4, loops=100) for _ in range(rounds))


def pieces(label: str, bound, x: torch.Tensor, out: torch.Tensor) -> None:
    cells = _cells(bound)
    fn, head, ordered, positions = cells["fn"], cells["head"], cells["ordered"], cells["positions"]
    g0, g1, g2 = cells["g0"], cells["g1"], cells["g2"]
    dev = cells["device_index"]
    a = list(ordered)
    for i, v in zip(positions, (x, out)):
        a[i] = v
    stream = fastlaunch._raw_stream(dev)
    row = {"bound(x, out)": _best(lambda: bound(x, out)),
           "C launcher, args ready": _best(lambda: fn(g0, g1, g2, stream, *head, *a))}
    if fn is not None and len(head) == 9:  # (function, coop, pdl, ...): the raw C launcher
        function, coop, pdl = head[0], head[1], head[2]
        rest = head[3:]
        for c, p in ((False, pdl), (coop, False), (False, False)):
            if (c, p) != (coop, pdl):
                row[f"C launcher coop={c} pdl={p}"] = _best(lambda c=c, p=p: fn(g0, g1, g2, stream, function, c, p,
                                                                                 *rest, *a))
    row["args"] = len(a)
    print(label, " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
          flush=True)


def main() -> None:
    x, w1, b1, w2, b2 = gpt2m_m1_tensors()
    d = dict(device="cuda", dtype=torch.bfloat16)
    epis = ("gelu_tanh(a0)", "a0")
    for _ in range(3):
        run_grid_sync(x, [w1, w2], [b1, b2], [[], []], epis)
    torch.cuda.synchronize()
    bound = next(iter(grid_sync_launch._bound.values()))
    out = torch.empty(1, 1024, **d)
    pieces("grid sync (cooperative, PDL):", bound, x, out)
    walls = {"PDL": wall_us(lambda: bound(x, out))}
    grid_sync_launch._bound.clear()
    pdl_supported = grid_sync_launch._pdl_supported
    grid_sync_launch._pdl_supported = lambda x: False
    try:
        for _ in range(3):
            run_grid_sync(x, [w1, w2], [b1, b2], [[], []], epis)
        torch.cuda.synchronize()
        no_pdl = next(iter(grid_sync_launch._bound.values()))
        pieces("grid sync (cooperative, no PDL):", no_pdl, x, out)
        walls["no PDL"] = wall_us(lambda: no_pdl(x, out))
    finally:
        grid_sync_launch._pdl_supported = pdl_supported
    print("grid sync bound launch, wall µs per call of 200:", walls, flush=True)

    t = torch.zeros(1, device="cuda", dtype=torch.int32)
    compiled = _tiny[(132,)](t, -1)
    torch.cuda.synchronize()
    compiled._init_handles()
    direct = fastlaunch._direct_launch(compiled.run)
    raw = getattr(direct, "raw", None)
    if raw is not None:
        launch, coop, pdl = raw
        stream, fn, packed, ptr = fastlaunch._raw_stream(0), compiled.function, compiled.packed_metadata, t.data_ptr()
        def tiny(c: bool, p: bool) -> float:
            return _best(lambda: launch(132, 1, 1, stream, fn, c, p, None, None, packed, None, None, None, ptr, -1))

        print(f"tiny kernel, C launcher with 2 args: {tiny(coop, pdl):.2f}; cooperative: {tiny(True, pdl):.2f}; "
              f"PDL: {tiny(coop, True):.2f}; both: {tiny(True, True):.2f}", flush=True)
    print(f"tiny kernel via Triton's launch path: {_best(lambda: _tiny[(132,)](t, -1)):.2f}", flush=True)

    print(f"torch.empty(1, 1024): {_best(lambda: torch.empty(1, 1024, **d)):.2f}  "
          f"empty_like(x): {_best(lambda: torch.empty_like(x)):.2f}  "
          f"_raw_stream: {_best(lambda: fastlaunch._raw_stream(0)):.2f}  "
          f"is_current_stream_capturing: {_best(torch.cuda.is_current_stream_capturing):.2f}", flush=True)


if __name__ == "__main__":
    main()
