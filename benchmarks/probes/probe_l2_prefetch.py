"""Does an L2 prefetch of a program's first-stage weights shorten the one-row grid-sync kernel?

    python3 benchmarks/probes/probe_l2_prefetch.py

The grid-sync kernel (gpt2m_mlp_m1) streams 16.8 MB in ~12 µs, ~1.4 TB/s: each program waits on two or three
dependent weight round trips (its W2 rows are loaded first, then its W1 tile in K steps). This variant makes each
program, first thing, issue ``prefetch.global.L2`` for every 128-byte line of its first W1 tile (one line per
thread: the tile is contiguous in a row-major W1), so the tile streams into L2 at once and the K steps' loads hit
L2. Variants: the plain kernel, the prefetch, the prefetch with an ``evict_last`` hint, each with every GPU
config that fits the shape; each launch is checked against the plain kernel's output and timed as a one-kernel
CUDA graph replay (no host time in it) with do_bench (L2 flushed; median of three medians).
"""

from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.probes.probe_launch import gpt2m_m1_tensors  # noqa: E402
from fxfuse import codegen  # noqa: E402
from fxfuse.kernels import grid_sync_template, run_grid_sync  # noqa: E402
from fxfuse.kernels.template import sm_count  # noqa: E402

_ANCHOR = "    offs_hh = tl.arange(0, BLOCK_HH)[None, :]\n"
_PREFETCH = '''\
    if PHASE != 2:
        # probe: every 128-byte line of this program's first W1 tile (rows contiguous), one per thread, to L2
        l2_line = tl.arange(0, BLOCK_H * K * 2 // 128)
        l2_row0 = (pid * BLOCK_H) % H
        l2_ptrs = w0_ptr + l2_row0 * stride_w0h + l2_line * 64
        l2_mask = l2_row0 * K + l2_line * 64 < H * K
        tl.inline_asm_elementwise("{{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2{hint} [$1]; }} "
                                  "mov.u32 $0, 0;", "=r,l,r", [l2_ptrs, l2_mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
'''


def variant_source(hint: str | None) -> str:
    src = grid_sync_template.render_grid_sync(1, "gelu_tanh(a0)", "a0")
    if hint is None:
        return src
    assert _ANCHOR in src
    return src.replace(_ANCHOR, _ANCHOR + _PREFETCH.format(hint=hint))


def main() -> None:
    x, w1, b1, w2, b2 = gpt2m_m1_tensors()
    args = (x, [w1, w2], [b1, b2], [[], []], ("gelu_tanh(a0)", "a0"))
    K, H, N = 1024, 4096, 1024
    sms = sm_count(x.device)
    configs = [grid_sync_template.fit_grid_sync_config(c, K, H, N, sms)
               for c in grid_sync_template.gpu_grid_sync_configs()]
    original = codegen.generated_grid_sync_kernel
    reference = None
    try:
        for name, hint in (("plain", None), ("L2 prefetch", ""), ("L2 prefetch evict_last", "::evict_last")):
            module = codegen._write_and_import(variant_source(hint), "fxfuse_grid_sync_probe")
            codegen.generated_grid_sync_kernel = lambda *a, m=module: m
            for config in configs:
                if config is None:
                    continue
                out = run_grid_sync(*args, config=config)
                torch.cuda.synchronize()
                if reference is None:
                    reference = out.clone()
                err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    run_grid_sync(*args, config=config)
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph, stream=side):
                        run_grid_sync(*args, config=config)
                torch.cuda.synchronize()
                times = sorted(do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
                               for _ in range(3))
                kw = config.kwargs
                print(f"{name}: H{kw['BLOCK_H']} K{kw['BLOCK_K']} N{kw['BLOCK_N']} prefetch {kw['PREFETCH']} "
                      f"w{config.num_warps}: {times[1]:.2f} us (rounds {', '.join(f'{t:.2f}' for t in times)}), "
                      f"rel diff vs plain {err:.1e}", flush=True)
    finally:
        codegen.generated_grid_sync_kernel = original


if __name__ == "__main__":
    main()
