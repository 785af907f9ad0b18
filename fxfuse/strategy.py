"""Which kernels run a fused region: one fused-chain kernel, or one GEMM+epilogue kernel per stage.

The choice depends only on the region's structure and widths, so the op (at run time) and the
report (at optimize time, when the widths are known) agree.

Example:
    >>> from fxfuse.spec import MLPSpec
    >>> choose_strategy(MLPSpec.loads("1b:relu(a0);1b:relu(a0);1b:a0"), (32, 64, 64, 16))
    'fused_chain'
    >>> choose_strategy(MLPSpec.loads("1b:gelu_tanh(a0);1b:a0"), (768, 3072, 768))
    'gemm_epilogue'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from .kernels.chain_template import MAX_CHAIN_WIDTH
from .kernels.template import autotune_enabled
from .spec import MLPSpec

__all__ = ["FUSED_CHAIN", "GATED_GEMM_EPILOGUE", "GEMM_EPILOGUE", "choose_strategy", "kernels_are_faster",
           "launches", "measured_choice_enabled"]

log = logging.getLogger(__name__)

FUSED_CHAIN = "fused_chain"  # the whole chain in one kernel, intermediates on chip
GEMM_EPILOGUE = "gemm_epilogue"  # one GEMM kernel per stage, bias + epilogue fused
GATED_GEMM_EPILOGUE = "gated_gemm_epilogue"  # the same, gate and up in one kernel


def choose_strategy(spec: MLPSpec, widths: Sequence[int]) -> str:
    """``widths``: the input width, then each stage's output width."""
    narrow = max(widths) <= MAX_CHAIN_WIDTH
    if narrow and all(s.num_linears == 1 for s in spec.stages):
        return FUSED_CHAIN
    return GATED_GEMM_EPILOGUE if spec.is_gated else GEMM_EPILOGUE


def launches(spec: MLPSpec, strategy: str) -> int:
    return 1 if strategy == FUSED_CHAIN else len(spec.stages)


# The original ops (cuBLAS GEMMs + eager pointwise) stay a candidate: the first time a region runs on
# the GPU at a new shape bucket, both are timed and the faster is kept, so fusing never makes a region
# slower than it was. Keyed by (spec, M bucket, widths, dtype, device).
_choices: dict[tuple, bool] = {}


def measured_choice_enabled() -> bool:
    """Off with ``FXFUSE_AUTOTUNE=0`` (then the kernels always run: what the GPU tests check)."""
    return autotune_enabled()


def kernels_are_faster(args: tuple, run_kernels: Callable[[], torch.Tensor],
                       run_reference: Callable[[], torch.Tensor]) -> bool:
    """Whether the fused kernels beat the original ops on inputs like ``args`` (measured once per key)."""
    x, weights, _, _, spec = args
    m = x.numel() // x.shape[-1]
    key = (spec, 1 << max(m - 1, 0).bit_length(), tuple(w.shape for w in weights), x.dtype, x.device)
    choice = _choices.get(key)
    if choice is not None:
        return choice
    if torch.cuda.is_current_stream_capturing():
        return True  # cannot time inside a CUDA graph capture; decide on a later eager call
    from triton.testing import do_bench

    run_kernels()  # compile and autotune outside the timing
    fused = do_bench(run_kernels, warmup=5, rep=20, return_mode="median")
    original = do_bench(run_reference, warmup=5, rep=20, return_mode="median")
    choice = _choices[key] = fused <= original
    log.info("fxfuse: %s at M~%d: fused kernels %.1f us, original ops %.1f us -> %s", spec, key[1], fused * 1e3,
             original * 1e3, "fused" if choice else "keeping the original ops")
    return choice
