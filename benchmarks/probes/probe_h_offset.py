"""Does the address of the down stage's input (the intermediate h) change how fast llama m1's down stage streams?

    python3 benchmarks/probes/probe_h_offset.py [--rounds 3]

Every program of the one-row down stage reads all of h (28 KB) from L2: 4096 programs read the same ~220 lines.
llama_swiglu_m1 read +0.4 µs after an unrelated CUDA-graph variant had been built in the process (the caching
allocator then hands out other addresses). This times the down stage alone (``run_stage_gemv``, do_bench, L2
flushed) with h copied to byte offsets 0, 128, 256, ... into one buffer, median of rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton.testing  # noqa: E402

from fxfuse.kernels import run_stage_gemv  # noqa: E402

OFFSETS = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 65536, 1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    d, hdim = 4096, 14336
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, d, **bf)
    wg, wu = (torch.randn(hdim, d, **bf) / d ** 0.5 for _ in range(2))
    wd = torch.randn(d, hdim, **bf) / hdim ** 0.5
    h = run_stage_gemv(x, [wg, wu], [None, None], [], "mul(silu(a0),a1)")
    slot = 2 << 20  # one 2 MiB slot per offset (the views must not overlap)
    pool = torch.empty(slot * (len(OFFSETS) + 1), dtype=torch.uint8, device="cuda")
    base = pool.data_ptr() + (-pool.data_ptr()) % slot  # slots start 2 MiB-aligned
    print(f"pool base address mod 2 MiB: {pool.data_ptr() % slot}")
    views = {}
    for i, off in enumerate(OFFSETS):
        start = base - pool.data_ptr() + i * slot + off
        v = pool[start:start + hdim * 2].view(torch.bfloat16).view(1, hdim)
        v.copy_(h)
        views[off] = v
    ref = run_stage_gemv(h, [wd], [None], [], "a0")
    for off, v in views.items():
        out = run_stage_gemv(v, [wd], [None], [], "a0").double()
        assert ((out - ref.double()).norm() / ref.double().norm()).item() < 1e-2, off
    times: dict[int, list[float]] = {off: [] for off in OFFSETS}
    for _ in range(args.rounds):
        for off, v in views.items():
            times[off].append(triton.testing.do_bench(lambda v=v: run_stage_gemv(v, [wd], [None], [], "a0"),
                                                      warmup=25, rep=100, return_mode="median") * 1e3)
    print("down stage alone, do_bench µs by h's byte offset (median of rounds; rounds):")
    for off, ts in times.items():
        print(f"  +{off:8d} (address mod 4096: {off % 4096:4d})  {statistics.median(ts):6.2f}  "
              f"({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
