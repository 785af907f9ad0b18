"""Backward kernels of the mixture-of-experts layer (:mod:`fxfuse.kernels.moe_template`'s forward), over the same
pair layout: rows sorted by expert in blocks of ``BLOCK_M`` rows of one expert.

With ``dout`` the gradient of the layer's output ``[T, H]``, each pair ``p`` (token ``t``, routing weight ``r``,
expert ``e``) gets ``G = dout[t] @ down[e]`` (``[I]``), and:

* :func:`moe_down_backward_kernel`: ``G`` for a block's rows (fp32), a grouped GEMM;
* :func:`moe_gate_backward_kernel`: ``dh = r * G`` through the gate's derivative into ``dgate`` and ``dup``
  (``dgu``, in the weights' column order), ``h = act(g) * u`` recomputed from the saved pre-activations (the
  forward keeps ``g, u`` only: a third less activation memory) and written times ``r`` for the down weights'
  gradient, and each column tile's part of the routing weight's gradient ``dr = G . h``;
* :func:`moe_bias_routing_grad_kernel`: with a down bias (inside the routing scale), ``dr``'s part ``dout[t] .
  down_bias[e]``;
* ``dx``: ``dgu @ gate_up[e]`` per pair, the forward's down kernel over the weights read transposed, summed per
  token by the caller;
* :func:`moe_weight_grad_kernel`: ``dW[e] = sum over e's rows of A[row]^T B[row]``, for ``down`` (A = ``dout[t]``,
  B = ``r * h``) and for ``gate_up`` (A = ``dgu``, B = ``x[t]``): a program per expert and a few output tiles,
  looping over the expert's rows (no atomics: deterministic).

Example:
    >>> "moe_down_backward_kernel" in globals() and "moe_weight_grad_kernel" in globals()
    True
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_template import _rows_dot, gated_act, grouped_tile, moe_configs, prune_moe_configs
from .tuning import autotune

__all__ = ["moe_bias_routing_grad_kernel", "moe_down_backward_kernel", "moe_gate_backward_kernel",
           "moe_weight_grad_kernel"]


@triton.jit
def _gate_backward(g, u, dh, alpha, limit, ACT: tl.constexpr):
    """``(d gate, d up)`` of ``act(g) * u`` (:func:`fxfuse.kernels.moe_template.gated_act`) given ``dh``, on fp32
    values. The clamped SwiGLU passes no gradient where its clamps hold (as ``torch.clamp``: none outside the
    closed range)."""
    if ACT == 0:
        s = 1.0 / (1.0 + tl.exp(-g))
        return dh * u * s * (1.0 + g * (1.0 - s)), dh * g * s
    elif ACT == 1:
        t = 2.0 / (1.0 + tl.exp(-2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g))) - 1.0  # tanh(inner)
        d_act = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        return dh * u * d_act, dh * 0.5 * g * (1.0 + t)
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        d_act = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
        return dh * u * d_act, dh * g * cdf
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = 1.0 / (1.0 + tl.exp(-alpha * gc))
        dg = dh * (uc + 1.0) * (s + gc * alpha * s * (1.0 - s))
        du = dh * gc * s
        return tl.where(g <= limit, dg, 0.0), tl.where((u >= -limit) & (u <= limit), du, 0.0)


@autotune(configs=moe_configs(), key=["K", "N", "BLOCK_M", "stride_wk", "INPUT_PRECISION"],
          prune_configs_by=prune_moe_configs())
@triton.jit
def moe_down_backward_kernel(
    dout_ptr,
    w_ptr,
    grad_h_ptr,
    rows_ptr,
    block_expert_ptr,
    K,
    N,
    TOP_K,
    stride_dm,
    stride_we,
    stride_wn,
    stride_wk,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """For the rows r (pairs p, tokens t) of one block of one expert e and BLOCK_N columns n of the intermediate:
    ``G[r, n] = dout[t] @ down[e][:, n]``, the gradient of the expert's h before the routing weight. A
    plain GEMM with a store for an epilogue: the gate's backward (:func:`moe_gate_backward_kernel`) runs apart (fused
    into this epilogue, its tiles beside the accumulator spilled ~280 registers in the 128-wide tiles, and the
    kernel ran at ~250 TFLOP/s for Mixtral's shapes on an H100; ~100 for gpt-oss's).

    dout_ptr:         the output's gradient ``[T, K]`` (last dim contiguous, row stride ``stride_dm``).
    w_ptr:            the down weights as in the forward's down kernel: element (e, column k of the hidden size,
                      input n of the intermediate) at ``e * stride_we + k * stride_wn + n * stride_wk``.
    grad_h_ptr:       out ``[padded rows, N]``: G, summed in fp32 and stored in this tensor's dtype (the
                      activations': as eager autograd rounds the gradient of h; half the bytes of fp32, written
                      and read once more) (rows of blocks of no expert here are left unwritten).
    rows_ptr, block_expert_ptr: the pair layout (:func:`fxfuse.kernels.moe_template.moe_gate_up_kernel`).
    K, N:             hidden size (the reduction) and intermediate size; TOP_K: experts per token.
    INPUT_PRECISION:  ``tl.dot`` precision; BLOCK_M: the layout's rows per block; BLOCK_N, BLOCK_K: tuned. The
                      grid is (blocks, cdiv(N, BLOCK_N)).
    """
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # unused, or pairs held elsewhere: no gradient through them
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    valid = pair >= 0
    tokens = tl.where(valid, pair // TOP_K, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    # (the down weights read transposed: the forward's input dim n is the output here, its columns k the sum)
    acc = _rows_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), dout_ptr, tokens, stride_dm, valid, w_base,
                    offs_n, n_mask, stride_wk, stride_wn, K, INPUT_PRECISION, BLOCK_K)
    tl.store(grad_h_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(grad_h_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def moe_gate_backward_kernel(
    grad_h_ptr,
    gu_ptr,
    h_ptr,
    routing_ptr,
    dgu_ptr,
    dr_ptr,
    db_ptr,
    rows_ptr,
    block_expert_ptr,
    N,
    pairs,
    alpha,
    limit,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    STORE_H: tl.constexpr,
    SUM_DGU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For the rows r (pairs p) of one block of one expert and BLOCK_N columns n of the intermediate, from G
    (:func:`moe_down_backward_kernel`): ``dgate, dup`` of ``act(g) * u`` at ``dh = routing[p] * G``; ``h = act(g) *
    u`` recomputed (as the forward rounded it); ``dr[n-tile, p] = sum_n G * h[r, n]``; ``routing[p] * h`` for the
    down weights' gradient.

    grad_h_ptr:       G ``[padded rows, N]`` (:func:`moe_down_backward_kernel`), read into fp32.
    gu_ptr:           the forward's pre-activation gate and up ``[padded rows, 2N]`` (gate columns first).
    h_ptr:            out ``[padded rows, N]`` if STORE_H: ``routing[p] * act(g) * u``, h recomputed and scaled by
                      its pair's routing weight (the down weights' gradient then reads both operands straight into
                      shared memory), in the activations' dtype.
    routing_ptr:      the routing weight of each pair ``[pairs]``.
    dgu_ptr:          out ``[padded rows, 2N]``: d gate and d up in the gate/up weights' column order (INTERLEAVED:
                      column ``2n`` gate, ``2n + 1`` up; else gate in ``[0, N)``, up in ``[N, 2N)``); zeros at
                      the block's padding rows (as h's).
    dr_ptr:           out fp32 ``[cdiv(N, BLOCK_N), pairs]``: each column tile's part of the routing gradient.
                      Pairs of experts held elsewhere are never written (zeros expected).
    db_ptr:           out fp32 ``[blocks, 2N]`` if SUM_DGU: each block's column sums of dgu (fp32, before dgu is
                      rounded), in dgu's column order: the gate/up bias's gradient per block
                      (:func:`fxfuse.kernels.moe_bias_template.moe_block_sums_kernel` adds an expert's blocks).
                      Rows of blocks of no expert are not written.
    rows_ptr, block_expert_ptr: the pair layout; N: the intermediate size; pairs: T * top_k.
    alpha, limit, ACT: the gate (:data:`fxfuse.kernels.moe_template.ACTIVATIONS`); STORE_H: write the scaled h.
    BLOCK_M:          the layout's rows per block; BLOCK_N: columns per program. The grid is (blocks,
                      cdiv(N, BLOCK_N)).
    """
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(block_expert_ptr + block) < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    valid = pair >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = valid[:, None] & (offs_n < N)[None, :]
    # Padding rows load as zeros and store zeros (dgu, h): the grouped GEMM of the weight gradients sums them.
    store_mask = (offs_m >= 0)[:, None] & (offs_n < N)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    grad = tl.load(grad_h_ptr + rows * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + rows * (2 * N) + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows * (2 * N) + N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = dgu_ptr.dtype.element_ty
    h = gated_act(g, u, alpha, limit, ACT).to(dtype).to(tl.float32)  # (rounded as the forward stored it)
    safe_pair = tl.where(valid, pair, 0)
    scale = tl.load(routing_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
    if STORE_H:
        tl.store(h_ptr + rows * N + offs_n[None, :], (h * scale[:, None]).to(dtype), mask=store_mask)
    tl.store(dr_ptr + pid_n.to(tl.int64) * pairs + safe_pair, tl.sum(grad * h, axis=1), mask=valid)
    dg, du = _gate_backward(g, u, grad * scale[:, None], alpha, limit, ACT)
    out = dgu_ptr + rows * (2 * N)
    # (padding rows: dh = 0, so dg = du = 0 there, and the column sums hold the expert's rows only)
    sums = db_ptr + block.to(tl.int64) * (2 * N)
    if INTERLEAVED:
        # One contiguous store of the pairs joined in registers: two stores at a 2-element stride (each half of
        # every sector) ran the gpt-oss-20b backward's gate kernel at ~0.35 TB/s (H200, 4096 tokens: 1.64 ms).
        cols = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        both = tl.reshape(tl.join(dg.to(dtype), du.to(dtype)), (BLOCK_M, 2 * BLOCK_N))
        tl.store(out + cols[None, :], both, mask=(offs_m >= 0)[:, None] & (cols < 2 * N)[None, :])
        if SUM_DGU:
            col_sums = tl.reshape(tl.join(tl.sum(dg, axis=0), tl.sum(du, axis=0)), (2 * BLOCK_N,))
            tl.store(sums + cols, col_sums, mask=cols < 2 * N)
    else:
        tl.store(out + offs_n[None, :], dg.to(dtype), mask=store_mask)
        tl.store(out + N + offs_n[None, :], du.to(dtype), mask=store_mask)
        if SUM_DGU:
            tl.store(sums + offs_n, tl.sum(dg, axis=0), mask=offs_n < N)
            tl.store(sums + N + offs_n, tl.sum(du, axis=0), mask=offs_n < N)


@triton.jit
def moe_bias_routing_grad_kernel(
    dout_ptr,
    index_ptr,
    bias_ptr,
    dr_ptr,
    pairs,
    K,
    TOP_K,
    num_experts,
    stride_dm,
    stride_be,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``dr[p] = dout[t] . bias[e]`` in fp32 for each pair p (token ``t = p // TOP_K``, expert ``e = index[p]``), 0
    where ``e`` is outside ``[0, num_experts)`` (an expert held elsewhere): the routing weight's gradient through a
    down bias that sits inside the routing scale (gpt-oss). One launch in place of a ``[T, E]`` matmul, a gather
    and the masks around it (about a dozen torch launches a backward).

    dout_ptr:   the output's gradient ``[T, K]`` (last dim contiguous, row stride ``stride_dm``).
    index_ptr:  the expert of each pair ``[pairs]`` (any integer dtype, contiguous).
    bias_ptr:   the down biases ``[E, K]`` (last dim contiguous, row stride ``stride_be``).
    dr_ptr:     out: fp32 ``[pairs]``.
    BLOCK_P:    pairs a program; BLOCK_K: hidden columns a step. The grid is ``(cdiv(pairs, BLOCK_P),)``.
    """
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < pairs
    expert = tl.load(index_ptr + offs_p, mask=p_mask, other=-1).to(tl.int64)
    local = p_mask & (expert >= 0) & (expert < num_experts)
    token = (offs_p // TOP_K).to(tl.int64)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = local[:, None] & (offs_k < K)[None, :]
        d = tl.load(dout_ptr + token[:, None] * stride_dm + offs_k[None, :], mask=mask, other=0.0)
        b = tl.load(bias_ptr + expert[:, None] * stride_be + offs_k[None, :], mask=mask, other=0.0)
        acc += tl.sum(d.to(tl.float32) * b.to(tl.float32), axis=1)
    tl.store(dr_ptr + offs_p, acc, mask=p_mask)


@triton.jit
def _step_rows(rows_ptr, offs_m, row_end, TOP_K, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr):
    """A row step of the weight gradient's sum: which rows are pairs (``valid``), the pair of each (``safe``: 0 at
    padding), and the rows of A and of B to read (the pair's token's, or the sorted row itself)."""
    pair = tl.load(rows_ptr + offs_m, mask=offs_m < row_end, other=-1)
    valid = pair >= 0
    safe = tl.where(valid, pair, 0)
    a_rows = (safe // TOP_K) if A_BY_TOKEN else offs_m
    b_rows = (safe // TOP_K) if B_BY_TOKEN else offs_m
    return valid, safe, a_rows, b_rows


@triton.jit
def _a_tile(a_ptr, a_rows, stride_am, offs_n, n_mask, valid, safe, routing_ptr, SCALE_A: tl.constexpr, dtype):
    """A's ``[rows, BLOCK_N]`` tile of a row step in ``dtype`` (zeros at padding), times each pair's routing weight
    (in fp32) with SCALE_A."""
    a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_n[None, :],
                mask=valid[:, None] & n_mask[None, :], other=0.0)
    if SCALE_A:
        scale = tl.load(routing_ptr + safe, mask=valid, other=0.0).to(tl.float32)
        a = a.to(tl.float32) * scale[:, None]
    return a.to(dtype)


@autotune(configs=moe_configs(weight_grad=True), prune_configs_by=prune_moe_configs(weight_grad=True),
          key=["N", "K", "BLOCK_M", "A_BY_TOKEN", "B_BY_TOKEN", "SCALE_A", "stride_on", "INPUT_PRECISION"])
@triton.jit
def moe_weight_grad_kernel(
    a_ptr,
    b_ptr,
    routing_ptr,
    out_ptr,
    rows_ptr,
    seg_ptr,
    N,
    K,
    TOP_K,
    stride_am,
    stride_bm,
    stride_oe,
    stride_on,
    stride_ok,
    A_BY_TOKEN: tl.constexpr,
    B_BY_TOKEN: tl.constexpr,
    SCALE_A: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K_TILES: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """``out[e, n, k] = sum over the rows r of expert e of A[r, n] * B[r, k]``, every element of ``out`` written.

    a_ptr, b_ptr:     A ``[*, N]`` and B ``[*, K]`` (last dims contiguous, row strides ``stride_am``, ``stride_bm``).
                      A_BY_TOKEN: A's row of a pair is its token's (``pair // TOP_K``); else the sorted row itself.
                      B_BY_TOKEN: B's row is its token's. SCALE_A: A's row times the pair's routing weight (through
                      registers: the gradients' main sums get the weight folded into a stored operand instead).
    routing_ptr:      the routing weight of each pair (read if SCALE_A).
    out_ptr:          the gradient: element (e, n, k) at ``e * stride_oe + n * stride_on + k * stride_ok`` (either
                      weight layout), the weights' dtype.
    rows_ptr:         the pair of each sorted row, -1 for padding (the forward's layout).
    seg_ptr:          int32 ``[E + 1]``: the first block of each expert, and the end of the last.
    N, K:             the gradient's two dims; TOP_K: experts per token.
    INPUT_PRECISION:  ``tl.dot`` precision; BLOCK_M: the layout's rows per block; BLOCK_N x BLOCK_K: the output
                      tile, summed BLOCK_R rows a step (any size: the rows past the expert's are masked).
    K_TILES:          output tiles a program writes: one row tile of an expert, K_TILES column tiles, walked as ONE
                      loop over (column tile, row step) so the pipeliner loads the next tile's rows while this
                      tile is summed and stored. At few rows an expert (Qwen3-MoE at 512 tokens: ~32) the sums are
                      short and the kernel is bound by its writes; a tile a program (load, a short sum, store,
                      exit) wrote 2.1 TB/s there on an H200, eight tiles 2.9 (``out.zero_()``: 3.35;
                      ``benchmarks/probes/probe_moe_weight_grad.py``). When the expert's rows fit one step, A's tile
                      is loaded once for the program's column tiles (3.06 TB/s there).
    GROUP_N:          row tiles whose programs run together over every column group (their A columns and the
                      expert's B stay in L2: long sums, Qwen3-MoE's at 4096 tokens ~10% faster than row tiles side
                      by side). The grid is ``(E * cdiv(N, BLOCK_N) * cdiv(cdiv(K, BLOCK_K), K_TILES),)``, an
                      expert's programs consecutive.
    """
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    k_groups = tl.cdiv(tiles_k, K_TILES)
    pid = tl.program_id(0)
    expert = pid // (tiles_n * k_groups)
    pid_n, k_group = grouped_tile(pid % (tiles_n * k_groups), tiles_n, k_groups, GROUP_N)
    first_k = k_group * K_TILES
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row_start = tl.load(seg_ptr + expert) * BLOCK_M
    row_end = tl.load(seg_ptr + expert + 1) * BLOCK_M
    # The expert's padding is at the end of its last block: stop at its last pair, not at the block's end (row steps
    # shorter than a block then skip the all-padding ones; Qwen3-MoE at 4096 tokens pads ~64 of ~320 rows).
    last = row_end - BLOCK_M + tl.arange(0, BLOCK_M)
    in_last = tl.load(rows_ptr + last, mask=last >= row_start, other=-1) >= 0
    row_end = tl.maximum(row_end - BLOCK_M + tl.sum(in_last.to(tl.int32), axis=0), row_start)
    steps = tl.maximum(tl.cdiv(row_end - row_start, BLOCK_R), 1)  # (an expert without rows: one step of zeros)
    out = out_ptr + expert.to(tl.int64) * stride_oe + offs_n[:, None] * stride_on
    k_count = tl.minimum(tiles_k - first_k, K_TILES)
    dtype = b_ptr.dtype.element_ty
    if steps == 1:  # the expert's rows fit one step (few rows an expert): A's tile is the same for every column tile
        offs_m = row_start + tl.arange(0, BLOCK_R)
        valid, safe, a_rows, b_rows = _step_rows(rows_ptr, offs_m, row_end, TOP_K, A_BY_TOKEN, B_BY_TOKEN)
        a_t = tl.trans(_a_tile(a_ptr, a_rows, stride_am, offs_n, n_mask, valid, safe, routing_ptr, SCALE_A, dtype))
        for j in range(0, k_count):
            offs_k = (first_k + j) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            bb = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * stride_bm + offs_k[None, :],
                         mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a_t, bb, tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), input_precision=INPUT_PRECISION)
            tl.store(out + offs_k[None, :] * stride_ok, acc.to(out_ptr.dtype.element_ty),
                     mask=n_mask[:, None] & k_mask[None, :])
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for i in range(0, k_count * steps):
            step = i % steps
            offs_k = (first_k + i // steps) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            offs_m = row_start + step * BLOCK_R + tl.arange(0, BLOCK_R)
            valid, safe, a_rows, b_rows = _step_rows(rows_ptr, offs_m, row_end, TOP_K, A_BY_TOKEN, B_BY_TOKEN)
            a = _a_tile(a_ptr, a_rows, stride_am, offs_n, n_mask, valid, safe, routing_ptr, SCALE_A, dtype)
            bb = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * stride_bm + offs_k[None, :],
                         mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), bb, acc, input_precision=INPUT_PRECISION)
            if step == steps - 1:  # this column tile's sum is complete
                tl.store(out + offs_k[None, :] * stride_ok, acc.to(out_ptr.dtype.element_ty),
                         mask=n_mask[:, None] & k_mask[None, :])
                acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
