"""The kernel layer: generated Triton kernels and their launchers.

* ``run_stage``: one GEMM (or a gated pair) with bias and the generated epilogue fused.
* ``run_chain``: a whole narrow Linear → act → … → Linear chain in one kernel.
* ``run_decode``: a whole two-stage MLP for a few rows (M ≤ ``DECODE_MAX_M``) in one kernel.
* ``run_grid_sync``: a whole two-stage MLP for ONE row in one launch, a grid barrier between the stages.
* ``run_stage_gemv``: ``run_stage`` for a few rows (M ≤ ``GEMV_MAX_M``): weights streamed once, split-K.
* ``run_stage_tma``: ``run_stage`` on Hopper with TMA descriptors and a persistent grid (large M), or None.

Example:
    >>> from fxfuse.kernels import run_stage
    >>> out = run_stage(x, [w], [b], [], "gelu_tanh(a0)")  # doctest: +SKIP
"""

from .chain_launch import run_chain
from .decode_launch import DECODE_MAX_M, run_decode
from .gemv_launch import GEMV_MAX_M, run_stage_gemv
from .grid_sync_launch import run_grid_sync
from .launch import SUPPORTED_DTYPES, run_stage
from .tma_launch import run_stage_tma, tma_supported

__all__ = ["DECODE_MAX_M", "GEMV_MAX_M", "SUPPORTED_DTYPES", "run_chain", "run_decode", "run_grid_sync", "run_stage",
           "run_stage_gemv", "run_stage_tma", "tma_supported"]
