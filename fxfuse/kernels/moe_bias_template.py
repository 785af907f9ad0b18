"""Backward kernels of the mixture-of-experts biases (gpt-oss's experts have one on each projection).

* ``d gate_up_bias[e]`` is the sum of ``dgu``'s rows of expert ``e``. :func:`~fxfuse.kernels.
  moe_backward_template.moe_gate_backward_kernel` writes each block's column sums while ``dgu`` is in registers
  (fp32 ``[blocks, 2I]``, a few MB), and :func:`moe_block_sums_kernel` adds each expert's blocks: ``dgu``
  (``[padded rows, 2I]``, gpt-oss's at 4096 tokens 237 MB) is not read again.
* ``d down_bias[e]`` is the sum over the pairs routed to ``e`` of ``r * dout[t]``: the GEMM ``R @ dout`` with
  ``R[e, t]`` the routing weight of token ``t`` at expert ``e`` (0 where not routed), built in registers from the
  top-k lists by :func:`moe_routed_sums_kernel`; ``dout`` is read once (not once per pair), by runs of tokens
  whose fp32 parts :func:`moe_block_sums_kernel` adds.

Both sum in a fixed order (no atomics): the gradients are deterministic.

Example:
    >>> "moe_block_sums_kernel" in globals() and "moe_routed_sums_kernel" in globals()
    True
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["moe_block_sums_kernel", "moe_routed_sums_kernel"]


@triton.jit
def moe_block_sums_kernel(
    parts_ptr,
    out_ptr,
    seg_ptr,
    N,
    stride_oe,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[e, n] = sum over expert e's blocks b of parts[b, n]``, summed in fp32 in block order, stored in out's
    dtype (0 for an expert without blocks).

    parts_ptr:  fp32 ``[blocks, N]`` (contiguous): each block's column sums; rows of blocks of no expert are never
                read (they may hold anything).
    out_ptr:    ``[E, N]``, last dim contiguous, row stride ``stride_oe``.
    seg_ptr:    int32 ``[E + 1]``: each expert's first block in the layout, and the end of the last (an expert's
                blocks are consecutive).
    N:          columns; BLOCK_B blocks summed a step; BLOCK_N columns a program. The grid is ``(E, cdiv(N,
                BLOCK_N))``.
    """
    expert = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    first = tl.load(seg_ptr + expert)
    end = tl.load(seg_ptr + expert + 1)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(first, end, BLOCK_B):
        offs_b = start + tl.arange(0, BLOCK_B)
        part = tl.load(parts_ptr + offs_b[:, None].to(tl.int64) * N + offs_n[None, :],
                       mask=(offs_b < end)[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(part, axis=0)
    tl.store(out_ptr + expert.to(tl.int64) * stride_oe + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def moe_routed_sums_kernel(
    dout_ptr,
    index_ptr,
    routing_ptr,
    out_ptr,
    T,
    N,
    TOP_K,
    num_experts,
    stride_dm,
    stride_oe,
    stride_os,
    INPUT_PRECISION: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[e, s, n] = sum over the tokens t of split s of R[e, t] * dout[t, n]``, ``R[e, t]`` the routing weight
    of the pair (t, e) or 0: each expert's sum of its pairs' ``r * dout[t]`` (the down bias's gradient), as one GEMM
    whose left operand is built in registers from the top-k lists, summed in fp32 in token order, stored in out's
    dtype. With one split, out is the gradient; with several (tokens cut in ``tl.num_programs(1)`` runs of whole
    ``BLOCK_T`` steps, so that more programs read dout at once), fp32 parts that :func:`moe_block_sums_kernel` adds
    per expert.

    dout_ptr:     ``[T, N]``, last dim contiguous, row stride ``stride_dm``.
    index_ptr:    int ``[T * TOP_K]``: each pair's expert (one outside ``[0, num_experts)``: held elsewhere, left
                  out).
    routing_ptr:  ``[T * TOP_K]``: each pair's routing weight (rounded to dout's dtype for the dot, as the
                  weight-gradient kernel rounds ``r * dout``).
    out_ptr:      ``[num_experts, splits, N]``: element (e, s, n) at ``e * stride_oe + s * stride_os + n``.
    INPUT_PRECISION: ``tl.dot``'s; E_PAD: a power of two >= num_experts and >= 16 (the dot's rows); BLOCK_T
                  tokens a step; BLOCK_N columns a program. The grid is ``(cdiv(N, BLOCK_N), splits)``: each
                  program reads its split's rows of dout for its columns (one pass over dout in all).
    """
    split = tl.program_id(1)
    run = tl.cdiv(tl.cdiv(T, tl.num_programs(1)), BLOCK_T) * BLOCK_T
    first = split * run
    end = tl.minimum(first + run, T)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    experts = tl.arange(0, E_PAD)
    dtype = dout_ptr.dtype.element_ty
    acc = tl.zeros((E_PAD, BLOCK_N), dtype=tl.float32)
    for start in range(first, end, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        t_mask = offs_t < end
        d = tl.load(dout_ptr + offs_t[:, None].to(tl.int64) * stride_dm + offs_n[None, :],
                    mask=t_mask[:, None] & n_mask[None, :], other=0.0)
        r = tl.zeros((E_PAD, BLOCK_T), dtype=tl.float32)
        for k in range(0, TOP_K):
            pair = offs_t.to(tl.int64) * TOP_K + k
            e = tl.load(index_ptr + pair, mask=t_mask, other=-1)
            w = tl.load(routing_ptr + pair, mask=t_mask, other=0.0).to(tl.float32)
            r += tl.where(experts[:, None] == e[None, :], w[None, :], 0.0)
        acc = tl.dot(r.to(dtype), d, acc, input_precision=INPUT_PRECISION)
    out = out_ptr + experts[:, None].to(tl.int64) * stride_oe + split * stride_os + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(experts < num_experts)[:, None] & n_mask[None, :])
