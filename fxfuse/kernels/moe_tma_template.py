"""The MoE GEMMs on Hopper's TMA: operands by tensor descriptor, tiles walked in grouped order.

:func:`~fxfuse.kernels.moe_template.moe_down_kernel` multiplies each block of the pair layout's rows with its
expert's down weight, loading both tiles by pointer. Its A operand (h in the forward, the gate/up gradient for dx)
is contiguous rows of the layout, and the weights are one 3-D tensor, so both tiles can come by TMA instead
(:func:`moe_down_tma_kernel`): one descriptor load per tile, no address arithmetic or masks in the K loop. With the
tiles walked ``GROUP_M`` blocks at a time (those blocks' rows stay in L2 while every column tile passes over them),
Mixtral's down projection at 4096 tokens ran 1796 -> 1399 µs on an H200 (688 TFLOP/s; CUTLASS's grouped GEMM 1549),
Qwen3-MoE's 330 -> 252 (``benchmarks/probes/probe_moe_gemm_variants.py``). The output rows stay scattered stores
by pointer (each row is a (token, expert) pair's), scaled by the routing weight in fp32.

The gate/up GEMM's A operand is x's rows gathered by token, which TMA cannot load. :func:`moe_gather_rows_kernel`
first writes them in the layout's order (zeros at padding; one ``[padded rows, H]`` copy, a few percent of the
GEMM's time), then :func:`moe_gate_up_tma_kernel` runs as the dense gated TMA stage does
(:mod:`fxfuse.kernels.tma_template`): a persistent grid walking (block, column tile) tiles in one flattened loop
(the next tile's loads overlap this one's epilogue), gate and up tiles by one TMA load and one dot, the epilogue on
the fp32 accumulators, h stored by TMA (in training the pre-activation gate and up too, by pointer).

The launchers take them for 16-bit operands at 64 or more rows per block (:func:`fxfuse.kernels.moe_launch.
launch_down`, :func:`fxfuse.kernels.moe_launch.moe_forward_pass`); the pointer kernels keep the rest.

Example:
    >>> "moe_down_tma_kernel" in globals() and "moe_gate_up_tma_kernel" in globals()
    True
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_template import gated_act, grouped_tile, store_pair_rows
from .template import autotune_enabled, interpreting
from .tuning import autotune

__all__ = ["moe_down_tma_kernel", "moe_gate_up_tma_configs", "moe_gate_up_tma_kernel", "moe_gather_rows_kernel",
           "moe_tma_configs", "set_down_block_shapes", "set_gate_up_block_shapes"]

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


@autotune(configs=moe_tma_configs(), key=["K", "N", "BLOCK_M", "W_KN", "BY_ROW", "DTYPE", "INPUT_PRECISION"],
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
    BY_ROW: tl.constexpr,
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
                      Padding rows are multiplied too (their results masked at the store): they may hold anything
                      on a GPU; the interpreter's numpy warns on inf/NaN there, so its launcher zeroes h.
    w_desc:           descriptor of the weights: ``[E, N, K]`` (block ``[1, BLOCK_N, BLOCK_K]``), or with W_KN
                      ``[E, K, N]`` (block ``[1, BLOCK_K, BLOCK_N]``); last dim contiguous either way. TMA zero-fills
                      past N and K, so partial tiles need no masks in the K loop.
    b_ptr:            biases ``[E, N]`` (row stride ``stride_be``), read if HAS_BIAS; otherwise any valid pointer.
    out_ptr:          ``[pairs, N]`` (row stride ``stride_om``): one row per (token, expert) pair; the rows of a
                      block marked -2 (routed to an expert held elsewhere) are written as zeros. BY_ROW (the
                      backward's G, ``dout``'s gathered rows times the down weights): ``[padded rows, N]``, each
                      layout row's own, no bias or routing weight, padding rows and -2 blocks unwritten.
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
        if not BY_ROW:  # (G: no gradient through them)
            store_pair_rows(acc, expert, pairs, valid, offs_n, n_mask, b_ptr, stride_be, routing_ptr, out_ptr,
                            stride_om, False, False)
        return
    for k0 in range(0, K, BLOCK_K):
        a = h_desc.load([block * BLOCK_M, k0])
        if W_KN:
            w = w_desc.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        else:
            w = w_desc.load([expert, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w.T, acc, input_precision=INPUT_PRECISION)
    if BY_ROW:  # the backward's G: each layout row's own, unscaled (padding rows unwritten)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
    else:
        store_pair_rows(acc, expert, pairs, valid, offs_n, n_mask, b_ptr, stride_be, routing_ptr, out_ptr,
                        stride_om, HAS_BIAS, True)


# Rows of x a gather program copies, and columns per step.
_GATHER_COLUMNS = 256


@triton.jit
def moe_gather_rows_kernel(x_ptr, out_ptr, rows_ptr, block_expert_ptr, K, TOP_K, stride_xm, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[r] = x[pair r // TOP_K]`` for the rows r of one block of the pair layout (zeros at its padding rows),
    ``BLOCK_K`` columns a program: the gate/up TMA kernel's A operand. Blocks of no expert here (unused, or pairs
    held elsewhere) are left unwritten: nothing reads them.

    x_ptr:      hidden states ``[T, K]`` (last dim contiguous, row stride ``stride_xm``).
    out_ptr:    ``[padded rows, K]`` (last dim contiguous, row stride ``stride_om``), x's dtype.
    rows_ptr, block_expert_ptr: the pair layout (:class:`~fxfuse.kernels.moe_launch.PairLayout`).
    TOP_K:      experts per token; BLOCK_M: the layout's rows per block; the grid is (blocks, cdiv(K, BLOCK_K)).
    """
    block = tl.program_id(0)
    if tl.load(block_expert_ptr + block) < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c_mask = cols < K
    row = tl.load(x_ptr + tokens[:, None] * stride_xm + cols[None, :], mask=valid[:, None] & c_mask[None, :],
                  other=0.0)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + cols[None, :], row, mask=c_mask[None, :])


# (BLOCK_N, BLOCK_K, warps, stages, programs per SM) of the gate/up TMA kernel: a tile is BLOCK_M rows x BLOCK_N
# columns of h, its accumulator [BLOCK_M, 2 * BLOCK_N] (gate and up). The dense gated stage's winners on the H200
# (tma_template.gpu_configs: 128 x 2x64 two per SM for Llama's and seed's gate/up, 128 x 2x128 on 8 warps).
_GATE_UP_TILES = ((64, 64, 4, 3, 2), (128, 64, 8, 3, 1), (64, 64, 8, 4, 1), (64, 128, 8, 3, 1), (128, 64, 8, 4, 1))
_SMEM_ONE_CTA = 220 << 10
_SMEM_TWO_CTAS = 228 * 1024 // 2 - 1024 - 256


def set_gate_up_block_shapes(nargs: dict) -> None:
    """Config ``pre_hook``: the gate/up kernel's descriptors' block shapes for the config about to run.

    Example:
        >>> class D:
        ...     def __init__(self, dims): self.shape, self.block_shape = [0] * dims, None
        >>> args = {"x_desc": D(2), "w_desc": D(4), "h_desc": D(2), "BLOCK_M": 128, "BLOCK_N": 64,
        ...         "BLOCK_K": 64, "W_KN": False, "INTERLEAVED": False}
        >>> set_gate_up_block_shapes(args); args["w_desc"].block_shape, args["h_desc"].block_shape
        ([1, 2, 64, 64], [128, 64])
    """
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    if nargs["INTERLEAVED"]:  # [E, 2N, K] or [E, K, 2N]: 2 * BLOCK_N adjacent columns, gate and up alternating
        nargs["w_desc"].block_shape = [1, bk, 2 * bn] if nargs["W_KN"] else [1, 2 * bn, bk]
    else:  # [E, 2, N, K] or [E, K, 2, N]: BLOCK_N columns of the gate and the same of the up projection
        nargs["w_desc"].block_shape = [1, bk, 2, bn] if nargs["W_KN"] else [1, 2, bn, bk]
    nargs["h_desc"].block_shape = [bm, bn]


def moe_gate_up_tma_configs() -> list[triton.Config]:
    """The gate/up TMA kernel's tiles to tune over (one small tile in the interpreter).

    Example:
        >>> all(c.pre_hook is set_gate_up_block_shapes for c in moe_gate_up_tma_configs())
        True
    """
    tiles = ((16, 16, 4, 1, 2),) if interpreting() else _GATE_UP_TILES
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PER_SM": per_sm}, num_warps=w,
                          num_stages=s, pre_hook=set_gate_up_block_shapes) for bn, bk, w, s, per_sm in tiles]


def _prune_gate_up(configs, named_args, **kwargs):
    """The tiles whose accumulator fits the registers (at most 128 fp32 values a thread, half a thread's share
    when two programs share an SM) and whose pipelined stages and h's store buffer fit shared memory (stages cut
    to what fits, at least two); with ``FXFUSE_AUTOTUNE=0`` the first of those."""
    args = {**named_args, **kwargs}
    rows, elem = args["BLOCK_M"], 2
    kept = []
    for c in configs:
        bn, bk, per_sm = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["PER_SM"]
        if rows * 2 * bn // (32 * c.num_warps) > min(128, 65536 // (per_sm * 32 * c.num_warps) // 2):
            continue
        budget = (_SMEM_ONE_CTA if per_sm == 1 else _SMEM_TWO_CTAS) - rows * bn * elem  # (h's store buffer)
        stages = min(c.num_stages, budget // ((rows + 2 * bn) * bk * elem))
        if stages >= 2:
            kept.append(triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=stages, pre_hook=c.pre_hook))
    kept = kept or configs[-1:]
    return kept if autotune_enabled() else kept[:1]


@autotune(configs=moe_gate_up_tma_configs(),
          key=["K", "N", "BLOCK_M", "W_KN", "INTERLEAVED", "HAS_BIAS", "STORE_GU", "DTYPE", "INPUT_PRECISION"],
          prune_configs_by=None if interpreting() else {"early_config_prune": _prune_gate_up})
@triton.jit
def moe_gate_up_tma_kernel(
    x_desc,
    w_desc,
    b_ptr,
    h_desc,
    gu_ptr,
    block_expert_ptr,
    K,
    N,
    blocks,
    stride_be,
    alpha,
    limit,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    W_KN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_GU: tl.constexpr,
    DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PER_SM: tl.constexpr,
):
    """Persistent ``h[r, n] = act(xr[r] @ gate[e, n] + bg[e, n]) * (xr[r] @ up[e, n] + bu[e, n])`` for the rows r of
    every block of an expert, each program walking (block, column tile) tiles ``pid, pid + programs, ...``.

    x_desc:     descriptor of x's rows in the layout's order ``[padded rows, K]`` (:func:`moe_gather_rows_kernel`;
                zeros at padding rows), block ``[BLOCK_M, BLOCK_K]``.
    w_desc:     descriptor of the gate/up weights, last dim contiguous: in halves ``[E, 2, N, K]`` (block
                ``[1, 2, BLOCK_N, BLOCK_K]``) or with W_KN ``[E, K, 2, N]`` (block ``[1, BLOCK_K, 2, BLOCK_N]``);
                INTERLEAVED (gate column 2n, up 2n + 1) ``[E, 2N, K]`` or ``[E, K, 2N]`` (2 * BLOCK_N adjacent
                columns). TMA zero-fills past N and K: partial tiles need no masks.
    b_ptr:      biases ``[E, 2N]`` in the weights' column order (row stride ``stride_be``), read if HAS_BIAS.
    h_desc:     descriptor of the output h ``[padded rows, N]``, block ``[BLOCK_M, BLOCK_N]``. Padding rows get
                the value of a zero row (finite: the backward's sums multiply them by zeros).
    gu_ptr:     STORE_GU (training): the pre-activation gate and up ``[padded rows, 2N]`` (contiguous; gate columns
                first, whatever the weights' arrangement); else unused.
    block_expert_ptr: each block's expert (the layout's; its blocks of experts come first, in order): the
                programs walk those blocks only, counting them first.
    K, N:       hidden size and intermediate size; blocks: the layout's blocks (a bound on the experts' blocks).
    alpha, limit, ACT: the gate activation (:func:`~fxfuse.kernels.moe_template.gated_act`).
    DTYPE:      the operands' dtype name: only an autotuning key (descriptors carry none Triton keys on).
    INPUT_PRECISION: ``tl.dot`` precision ("ieee" for exact fp32, "tf32"; 16-bit operands ignore it).
    BLOCK_M:    rows per block (the layout's); BLOCK_N, BLOCK_K: tuned; GROUP_M: blocks whose column tiles are
                walked together (their x rows stay in L2); PER_SM: programs per SM in the launcher's grid.
    """
    start_pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    # The experts' blocks come first in the layout: count them (blocks past them hold no expert's rows).
    used = 0
    for b0 in range(0, blocks, 256):
        b = b0 + tl.arange(0, 256)
        used += tl.sum((tl.load(block_expert_ptr + b, mask=b < blocks, other=-1) >= 0).to(tl.int32))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = used * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from a counter of its own (as the persistent-matmul tutorial does): a value
    # used both before and after the K loop hinders the pipeliner of the flattened loop.
    tile_id_c = start_pid - num_programs
    for tile_id in tl.range(start_pid, num_tiles, num_programs, flatten=True):
        block, pid_n = grouped_tile(tile_id, used, num_pid_n, GROUP_M)
        expert = tl.load(block_expert_ptr + block)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            x = x_desc.load([block * BLOCK_M, off_k])
            if INTERLEAVED:
                if W_KN:
                    w = w_desc.load([expert, off_k, 2 * pid_n * BLOCK_N]).reshape(BLOCK_K, 2 * BLOCK_N)
                    acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
                else:
                    w = w_desc.load([expert, 2 * pid_n * BLOCK_N, off_k]).reshape(2 * BLOCK_N, BLOCK_K)
                    acc = tl.dot(x, w.T, acc, input_precision=INPUT_PRECISION)
            else:
                if W_KN:
                    w = w_desc.load([expert, off_k, 0, pid_n * BLOCK_N]).reshape(BLOCK_K, 2 * BLOCK_N)
                    acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
                else:
                    w = w_desc.load([expert, 0, pid_n * BLOCK_N, off_k]).reshape(2 * BLOCK_N, BLOCK_K)
                    acc = tl.dot(x, w.T, acc, input_precision=INPUT_PRECISION)

        tile_id_c += num_programs
        block_c, pid_n_c = grouped_tile(tile_id_c, used, num_pid_n, GROUP_M)
        offs_n = pid_n_c * BLOCK_N + tl.arange(0, BLOCK_N)
        if INTERLEAVED:
            g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        else:
            g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        if HAS_BIAS:
            b_base = b_ptr + tl.load(block_expert_ptr + block_c).to(tl.int64) * stride_be
            n_mask = offs_n < N
            if INTERLEAVED:
                g += tl.load(b_base + 2 * offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                u += tl.load(b_base + 2 * offs_n + 1, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g += tl.load(b_base + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                u += tl.load(b_base + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        h = gated_act(g, u, alpha, limit, ACT)  # on the fp32 accumulators; cast once
        off_m = block_c * BLOCK_M
        h_desc.store([off_m, pid_n_c * BLOCK_N], h.to(h_desc.dtype))
        if STORE_GU:  # (by pointer: three TMA stores' staging buffers cost a pipeline stage, and ran slower)
            gu_rows = gu_ptr + (off_m + tl.arange(0, BLOCK_M))[:, None].to(tl.int64) * (2 * N) + offs_n[None, :]
            tl.store(gu_rows, g.to(gu_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])
            tl.store(gu_rows + N, u.to(gu_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])
