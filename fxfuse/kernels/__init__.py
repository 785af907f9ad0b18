"""The kernel layer: generated Triton kernels and their launchers.

* ``run_stage``: one GEMM (or a gated pair) with bias and the generated epilogue fused.
* ``run_chain``: a whole narrow Linear → act → … → Linear chain in one kernel.

Example:
    >>> from fxfuse.kernels import run_stage
    >>> out = run_stage(x, [w], [b], [], "gelu_tanh(a0)")  # doctest: +SKIP
"""

from .chain_launch import run_chain
from .launch import SUPPORTED_DTYPES, run_stage

__all__ = ["SUPPORTED_DTYPES", "run_chain", "run_stage"]
