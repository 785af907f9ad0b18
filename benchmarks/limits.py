"""Measured limits of a workload row, timed like its variants (do_bench, L2 zeroed before every call).

The floor divides a row's FLOPs and minimum bytes by ceilings measured on an 8192³ matmul and a 1 GiB copy.
Two bounds measured on the row itself say how close a kernel can come to that floor under the benchmark's own
timing:

* **read once** (``read_once``): one ``torch.sum`` over a buffer of the row's minimum bytes, in its dtype. A
  kernel that reads the row's weights and input cannot take less: after do_bench's flush, L2 is full of dirty
  lines whose write-back shares HBM with the read, and a launch's ramp and tail are in this time too. It is the
  limit of the memory-bound (decode) rows.
* **GEMMs alone** (``gemms_alone``): every linear of the module as one ``torch.mm`` (cuBLAS) of its own weight
  into a preallocated output, back to back, no bias, no activation, no elementwise kernel between them: what the
  library's mainloops take for the row's FLOPs at its shapes. A fused kernel reaches it only if its epilogue
  costs nothing and its mainloop runs at cuBLAS's speed. It is the reference of the compute-bound rows (for a
  narrow chain, whose GEMMs alone move every intermediate through HBM, it is what fusion saves, not a limit).

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

from benchmarks.workloads import count_work

__all__ = ["LIMITS", "GemmsAlone", "ReadOnce", "limit_fns"]

# The timed names, in the order the benchmark's rounds time them (after the row's variants).
LIMITS = ("read_once", "gemms_alone")


class ReadOnce:
    """A call that reads ``nbytes`` of ``dtype`` once (one reduction kernel) and returns their fp32 sum."""

    def __init__(self, nbytes: int, dtype: torch.dtype, device):
        numel = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
        self.buf = torch.randn(numel, device=device).to(dtype)

    def __call__(self) -> torch.Tensor:
        return torch.sum(self.buf, dtype=torch.float32)


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
