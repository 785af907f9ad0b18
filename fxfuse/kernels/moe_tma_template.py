"""The MoE down kernel on Hopper's TMA: both operands by tensor descriptor, tiles walked in grouped order.

:func:`~fxfuse.kernels.moe_template.moe_down_kernel` multiplies each block of the pair layout's rows with its
expert's down weight, loading both tiles by pointer. Its A operand (h in the forward, the gate/up gradient for dx)
is contiguous rows of the layout, and the weights are one 3-D tensor, so both tiles can come by TMA instead: one
descriptor load per tile, no address arithmetic or masks in the K loop. With the tiles walked ``GROUP_M`` blocks
at a time (those blocks' rows stay in L2 while every column tile passes over them), Mixtral's down projection at
4096 tokens ran 1796 -> 1399 µs on an H200 (688 TFLOP/s; CUTLASS's grouped GEMM 1549), Qwen3-MoE's 330 -> 252
(``benchmarks/probes/probe_moe_gemm_variants.py``). The launcher takes it for 16-bit operands at 64 or more rows
per block (:func:`fxfuse.kernels.moe_launch.launch_down`); the pointer kernel keeps the rest.

The output rows stay scattered stores by pointer (each row is a (token, expert) pair's), scaled by the routing
weight in fp32, as the pointer kernel writes them.

Example:
    >>> "moe_down_tma_kernel" in globals()
    True
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_template import grouped_tile, store_pair_rows
from .template import autotune_enabled, interpreting
from .tuning import autotune

__all__ = ["moe_down_tma_kernel", "moe_tma_configs", "set_down_block_shapes"]

# (BLOCK_N, BLOCK_K, warps, stages); 256 x 64 on 8 warps won both shapes measured (Mixtral, Qwen3-MoE at 4096 tokens).
_TILES = ((256, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 4, 3))
_SHARED_MEMORY_BUDGET = 200 << 10


def set_down_block_shapes(nargs: dict) -> None:
    """Config ``pre_hook``: the descriptors' block shapes for the config about to run.

    Example:
        >>> class D: block_shape = None
        >>> args = {"h_desc": D(), "w_desc": D(), "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "W_KN": False}
        >>> set_down_block_shapes(args); args["h_desc"].block_shape, args["w_desc"].block_shape
        ([128, 64], [1, 256, 64])
    """
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["h_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [1, bk, bn] if nargs["W_KN"] else [1, bn, bk]


def moe_tma_configs() -> list[triton.Config]:
    """The tiles to tune over (one small tile in the interpreter).

    Example:
        >>> all(c.pre_hook is set_down_block_shapes for c in moe_tma_configs())
        True
    """
    tiles = ((16, 16, 4, 1),) if interpreting() else _TILES
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s,
                          pre_hook=set_down_block_shapes) for bn, bk, w, s in tiles]


def _prune(configs, named_args, **kwargs):
    """The tiles whose pipelined stages fit shared memory and whose accumulator fits the registers (at most 128
    fp32 values a thread); with ``FXFUSE_AUTOTUNE=0`` the first of those."""
    args = {**named_args, **kwargs}
    rows = args["BLOCK_M"]
    kept = [c for c in configs
            if c.num_stages * (rows + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 2 <= _SHARED_MEMORY_BUDGET
            and rows * c.kwargs["BLOCK_N"] // (32 * c.num_warps) <= 128] or configs[-1:]
    return kept if autotune_enabled() else kept[:1]


@autotune(configs=moe_tma_configs(), key=["K", "N", "BLOCK_M", "W_KN", "DTYPE", "INPUT_PRECISION"],
          prune_configs_by=None if interpreting() else {"early_config_prune": _prune})
@triton.jit
def moe_down_tma_kernel(
    h_desc,
    w_desc,
    b_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    routing_ptr,
    K,
    N,
    blocks,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    W_KN: tl.constexpr,
    DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out[p, n] = routing[p] * (h[r] @ W[e, n] + b[e, n])`` for the rows r (pairs p) of one block of one
    expert, one (block, column tile) per program.

    h_desc:           descriptor of the A rows ``[padded rows, K]`` (last dim contiguous), block
                      ``[BLOCK_M, BLOCK_K]``: the layout's block ``b`` is rows ``[b * BLOCK_M, (b + 1) * BLOCK_M)``.
    w_desc:           descriptor of the weights: ``[E, N, K]`` (block ``[1, BLOCK_N, BLOCK_K]``), or with W_KN
                      ``[E, K, N]`` (block ``[1, BLOCK_K, BLOCK_N]``); last dim contiguous either way. TMA zero-fills
                      past N and K, so partial tiles need no masks in the K loop.
    b_ptr:            biases ``[E, N]`` (row stride ``stride_be``), read if HAS_BIAS; otherwise any valid pointer.
    out_ptr:          ``[pairs, N]`` (row stride ``stride_om``): one row per (token, expert) pair; the rows of a
                      block marked -2 (routed to an expert held elsewhere) are written as zeros.
    rows_ptr, block_expert_ptr: the pair layout (:class:`~fxfuse.kernels.moe_launch.PairLayout`).
    routing_ptr:      the routing weight of each pair ``[pairs]`` (any float dtype), applied in fp32.
    K, N:             the reduced size (intermediate size; dx: 2 x it) and the output columns (hidden size).
    blocks:           the layout's blocks; the grid is ``blocks * cdiv(N, BLOCK_N)`` programs.
    DTYPE:            the operands' dtype name: only an autotuning key (descriptors carry none Triton keys on).
    INPUT_PRECISION:  ``tl.dot`` precision ("ieee" for exact fp32, "tf32"; 16-bit operands ignore it).
    BLOCK_M:          rows per block (the layout's); BLOCK_N, BLOCK_K: tuned; GROUP_M: blocks whose column tiles
                      are walked together (their A rows stay in L2 while the weights' tiles pass).
    """
    block, pid_n = grouped_tile(tl.program_id(0), blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    if expert == -1:  # UNUSED_BLOCK
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert == -2:  # ELSEWHERE_BLOCK: pairs routed to no expert here add nothing to their token
        store_pair_rows(acc, expert, pairs, valid, offs_n, n_mask, b_ptr, stride_be, routing_ptr, out_ptr, stride_om,
                        False, False)
        return
    for k0 in range(0, K, BLOCK_K):
        a = h_desc.load([block * BLOCK_M, k0])
        if W_KN:
            w = w_desc.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        else:
            w = w_desc.load([expert, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w.T, acc, input_precision=INPUT_PRECISION)
    store_pair_rows(acc, expert, pairs, valid, offs_n, n_mask, b_ptr, stride_be, routing_ptr, out_ptr, stride_om,
                    HAS_BIAS, True)
