"""The kernel layer: a generated Triton GEMM + epilogue kernel per stage, and its launcher.

Example:
    >>> from fxfuse.kernels import run_stage
    >>> out = run_stage(x, [w], [b], [], "gelu_tanh(a0)")  # doctest: +SKIP
"""

from .launch import SUPPORTED_DTYPES, run_stage

__all__ = ["SUPPORTED_DTYPES", "run_stage"]
