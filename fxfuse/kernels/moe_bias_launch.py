"""Launchers of the MoE biases' gradient kernels (:mod:`fxfuse.kernels.moe_bias_template`), for
:func:`fxfuse.kernels.moe_backward_launch.run_moe_backward`.

Example:
    >>> routed_splits(4096), routed_splits(1024), routed_splits(512), routed_tokens(32), routed_tokens(128)
    (16, 4, 1, 128, 32)
"""

from __future__ import annotations

import torch

from .fastlaunch import launch
from .moe_bias_template import moe_block_sums_kernel, moe_routed_sums_kernel
from .template import cdiv, next_pow2

__all__ = ["ROUTED_MAX_EXPERTS", "down_bias_grad", "expert_block_sums", "routed_splits", "routed_tokens"]

ROUTED_MAX_EXPERTS = 128  # the routed GEMM up to here (its [experts, tokens] operand is built in registers)
# Runs of tokens: at least this many tokens a run, at most _MAX_SPLITS runs, and one run (no parts, no second launch:
# host time where the step is bound by it) below _SPLIT_FROM tokens. gpt-oss-20b's shapes on an H200
# (probe_moe_bias_sums.py, 64 columns a program): 4096 tokens 72 µs in one run, 21 in 8 or 16; 512 tokens 13 / 9.
TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16
_SPLIT_FROM = 1024
_ROUTED_N, _ROUTED_WARPS = 64, 8  # columns and warps a program of the routed GEMM


def routed_splits(tokens: int) -> int:
    """Runs of tokens the routed GEMM cuts ``tokens`` into."""
    return 1 if tokens < _SPLIT_FROM else max(1, min(_MAX_SPLITS, tokens // TOKENS_PER_SPLIT))


def routed_tokens(num_experts: int) -> int:
    """Tokens a step of the routed GEMM: its ``[E_PAD, BLOCK_T]`` fp32 operand at most 4096 elements."""
    return max(16, min(128, 4096 // max(16, next_pow2(num_experts))))


def expert_block_sums(out: torch.Tensor, parts: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """``out[e] = sum of parts[segments[e]:segments[e + 1]]`` (fp32 sums, out's dtype), by
    :func:`~fxfuse.kernels.moe_bias_template.moe_block_sums_kernel`; ``out`` ``[E, N]``, ``parts`` fp32 ``[*,
    N]`` contiguous."""
    E, n = out.shape
    launch(moe_block_sums_kernel, lambda meta: (E, cdiv(n, meta["BLOCK_N"])), dict(
        parts_ptr=parts, out_ptr=out, seg_ptr=segments, N=n, stride_oe=out.stride(0), BLOCK_B=8, BLOCK_N=256,
        num_warps=4), ())
    return out


def down_bias_grad(dout: torch.Tensor, top_k_index: torch.Tensor, routing: torch.Tensor, num_experts: int,
                   precision: str) -> torch.Tensor:
    """``[E, H]``: each expert's sum of ``r * dout[t]`` over the pairs routed to it (pairs at experts outside ``[0,
    E)`` left out), by the routed GEMM (``num_experts`` at most :data:`ROUTED_MAX_EXPERTS`); ``dout`` ``[T, H]``
    with a contiguous last dim, ``routing`` ``[T * top_k]``."""
    T, H = dout.shape
    top_k = top_k_index.shape[1]
    out = torch.empty(num_experts, H, dtype=dout.dtype, device=dout.device)
    splits = routed_splits(T)
    # (one split: straight into the gradient; several: fp32 parts [E, splits, H], then each expert's sum)
    parts = out if splits == 1 else torch.empty(num_experts, splits, H, dtype=torch.float32, device=dout.device)
    launch(moe_routed_sums_kernel, lambda meta: (cdiv(H, meta["BLOCK_N"]), splits), dict(
        dout_ptr=dout, index_ptr=top_k_index.reshape(-1).contiguous(), routing_ptr=routing, out_ptr=parts, T=T, N=H,
        TOP_K=top_k, num_experts=num_experts, stride_dm=dout.stride(0), stride_oe=parts.stride(0),
        stride_os=0 if splits == 1 else parts.stride(1), INPUT_PRECISION=precision,
        E_PAD=max(16, next_pow2(num_experts)), BLOCK_T=routed_tokens(num_experts), BLOCK_N=_ROUTED_N,
        num_warps=_ROUTED_WARPS),
        ("T",))
    if splits == 1:
        return out
    bounds = torch.arange(0, (num_experts + 1) * splits, splits, dtype=torch.int32, device=dout.device)
    return expert_block_sums(out, parts.view(num_experts * splits, H), bounds)
