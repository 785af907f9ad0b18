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

from collections.abc import Sequence

from .kernels.chain_template import MAX_CHAIN_WIDTH
from .spec import MLPSpec

__all__ = ["FUSED_CHAIN", "GATED_GEMM_EPILOGUE", "GEMM_EPILOGUE", "choose_strategy", "launches"]

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
