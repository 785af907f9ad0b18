"""Measured limits of a workload row, timed like its variants (do_bench, L2 zeroed before every call).

The floor divides a row's FLOPs and minimum bytes by ceilings measured on an 8192³ matmul and a 1 GiB copy,
each in isolation. Two references measured on the row itself say how close a kernel gets to that floor under
the benchmark's own timing:

* **read once** (``read_once``): the fastest of several plain streaming reads of a buffer of the row's minimum
  bytes, in its dtype (``torch.sum`` and :func:`_read_sum_kernel` at a few block shapes, picked on the GPU by
  do_bench): what reading the weights once costs after do_bench's flush, which leaves L2 full of dirty lines
  whose write-back shares HBM with the read, with one launch's ramp and tail. The reference of the memory-bound
  (decode) rows. A kernel that overlaps its reads better than these (deeper prefetch) can read a little faster.
* **GEMMs alone** (``gemms_alone``): every linear of the module as one ``torch.mm`` (cuBLAS) of its own weight
  into a preallocated output, back to back, no bias, no activation, no elementwise kernel between them: what the
  library's mainloops take for the row's FLOPs at its shapes. A fused kernel reaches it only if its epilogue
  costs nothing and its mainloop runs at cuBLAS's speed. The reference of the compute-bound rows (for a narrow
  chain, whose GEMMs alone move every intermediate through HBM, it is what fusion saves, not a limit).

Example:
    >>> from benchmarks.workloads import WORKLOADS, build_module
    >>> w = next(w for w in WORKLOADS if w.name == "gpt2m_mlp_m8")
    >>> mod = build_module(w, device="cpu")
    >>> fns = limit_fns(mod, m=8)
    >>> sorted(fns)
    ['gemms_alone', 'read_once']
    >>> fns["gemms_alone"]()[-1].shape  # the last linear's output
    torch.Size([8, 1024])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import triton
import triton.language as tl

from benchmarks.workloads import count_work

__all__ = ["LIMITS", "GemmsAlone", "ReadOnce", "limit_fns"]

# The timed names, in the order the benchmark's rounds time them (after the row's variants).
LIMITS = ("read_once", "gemms_alone")


@triton.jit
def _read_sum_kernel(src, partial, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """``partial[pid]`` = fp32 sum of the ``BLOCK * STEPS`` elements of ``src`` from ``pid * BLOCK * STEPS``.

    src:     the buffer to read (any float dtype), ``n`` elements, each read once.
    partial: fp32, one value per program (stored so the loads cannot be optimized away).
    n:       number of elements of ``src``.
    BLOCK:   elements per load step of a program (vectorized over its threads).
    STEPS:   load steps per program, unrolled: their loads are independent, so all are in flight together.
    """
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(partial + tl.program_id(0), tl.sum(acc, axis=0))


# (BLOCK, STEPS, num_warps) of the streaming reads tried on the GPU: 8-64 KB per program in flight.
READ_CONFIGS = ((2048, 4, 4), (4096, 4, 8), (8192, 2, 8), (8192, 4, 16), (4096, 8, 8), (16384, 2, 16))


class ReadOnce:
    """A call that reads ``nbytes`` of ``dtype`` once (one kernel) and returns what it reduced them to.

    On CUDA the kernel is the fastest under do_bench of ``torch.sum`` and :func:`_read_sum_kernel` at each of
    :data:`READ_CONFIGS` (``self.choice`` names it, ``self.tried`` keeps every candidate's µs); elsewhere it is
    ``torch.sum``.
    """

    def __init__(self, nbytes: int, dtype: torch.dtype, device):
        numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        self.buf = torch.randn(numel, device=device).to(dtype)
        candidates = {"torch.sum": lambda: torch.sum(self.buf, dtype=torch.float32)}
        self.tried: dict[str, float] = {}
        if self.buf.is_cuda:
            for block, steps, warps in READ_CONFIGS:
                grid = triton.cdiv(numel, block * steps)
                partial = torch.empty(grid, device=device, dtype=torch.float32)

                def run(block=block, steps=steps, warps=warps, grid=grid, partial=partial):
                    _read_sum_kernel[(grid,)](self.buf, partial, numel, BLOCK=block, STEPS=steps, num_warps=warps)
                    return partial

                candidates[f"triton BLOCK={block} STEPS={steps} warps={warps}"] = run
            from triton.testing import do_bench

            self.tried = {name: do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3
                          for name, fn in candidates.items()}
            self.choice = min(self.tried, key=self.tried.get)
        else:
            self.choice = "torch.sum"
        self._run = candidates[self.choice]

    def __call__(self) -> torch.Tensor:
        return self._run()


class GemmsAlone:
    """A call that runs every ``nn.Linear`` of ``mod`` as ``torch.mm(a, W^T, out=o)``, in module order.

    Each linear reads its own weight (shared with ``mod``, not copied) and a random ``[m, in_features]`` operand
    (one per width); the outputs are allocated once, so the call launches the GEMMs and nothing else.
    """

    def __init__(self, mod: nn.Module, m: int):
        linears = _linears(mod)
        w0 = linears[0].weight
        operands: dict[int, torch.Tensor] = {}
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (a, weight, out) per linear
        for lin in linears:
            k = lin.in_features
            if k not in operands:
                operands[k] = torch.randn(m, k, device=w0.device).to(w0.dtype)
            out = torch.empty(m, lin.out_features, device=w0.device, dtype=w0.dtype)
            self.steps.append((operands[k], lin.weight, out))

    @torch.no_grad()  # (``out=`` takes no autograd; the weights may require grad)
    def __call__(self) -> list[torch.Tensor]:
        return [torch.mm(a, w.t(), out=o) for a, w, o in self.steps]


def _linears(mod: nn.Module) -> list[nn.Linear]:
    linears = [lin for lin in mod.modules() if isinstance(lin, nn.Linear)]
    if not linears:
        raise ValueError("the module has no nn.Linear")
    return linears


def limit_fns(mod: nn.Module, m: int) -> dict[str, Callable]:
    """``{"read_once": ReadOnce, "gemms_alone": GemmsAlone}`` for ``mod`` at ``m`` rows.

    read once reads the row's minimum bytes as :func:`benchmarks.workloads.count_work` counts them (input, every
    weight and bias, output), in the dtype of the module's first weight.
    """
    linears = _linears(mod)
    w0 = linears[0].weight
    _, nbytes = count_work(mod, m, linears[0].in_features, linears[-1].out_features, w0.element_size())
    return {"read_once": ReadOnce(nbytes, w0.dtype, w0.device), "gemms_alone": GemmsAlone(mod, m)}
