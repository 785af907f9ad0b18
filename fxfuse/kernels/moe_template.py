"""Mixture-of-experts kernels: the experts' gated MLPs as two grouped GEMMs over tokens sorted by expert.

A MoE layer (transformers' ``MixtralExperts`` / ``Qwen3MoeExperts``) sends each token to ``top_k`` experts; each
expert ``e`` computes ``down[e] @ (act(gate[e] @ x) * (up[e] @ x))``, scaled by the token's routing weight, and
the token's output is the sum over its experts. Eager PyTorch loops over the experts (gather, three GEMMs, the
pointwise ops, index_add per expert: ~10 launches each). Here the (token, expert) pairs are sorted by expert into
blocks of ``BLOCK_M`` rows that each belong to ONE expert (an expert's rows padded to whole blocks; the layout is
built on the GPU by :func:`fxfuse.kernels.moe_launch.route_pairs`, with no host sync), and two kernels run every
block of every expert in one launch each:

* :func:`moe_gate_up_kernel`: gathers the block's token rows of x, multiplies them with its expert's gate and up
  weights (``gate_up[e]``: gate first, then up, as ``chunk(2)`` splits it; or interleaved, gate and up columns
  alternating, as gpt-oss stores them), adds the bias if any, applies ``act(g) * u`` to the fp32 accumulators and
  writes the block's rows of h (``[padded rows, I]``) once;
* :func:`moe_down_kernel`: multiplies h's block with its expert's down weight, adds the bias if any, scales each
  row by its routing weight in fp32, casts once and writes the row of its (token, expert) pair.

The weights are ``[E, out, in]`` (``F.linear``'s layout, Mixtral's) or ``[E, in, out]`` (``x @ W``, gpt-oss's):
the kernels take both through their strides.

The caller sums each token's ``top_k`` rows (one reduction, deterministic: no atomics).

Example:
    >>> "moe_gate_up_kernel" in globals() and "moe_down_kernel" in globals()
    True
"""

from __future__ import annotations

import triton
import triton.language as tl

from .template import autotune_enabled, interpreting
from .tuning import autotune

__all__ = ["ACTIVATIONS", "WEIGHT_GRAD_SMALL_TILES", "WEIGHT_GRAD_TENSOR_CORE_TILES", "gated_act", "grouped_tile",
           "moe_configs", "moe_count_kernel", "moe_down_kernel", "moe_gate_up_kernel", "moe_place_kernel",
           "moe_route_kernel", "prune_moe_configs", "store_pair_rows"]

# The gate activations the kernel applies (``ACT``): transformers' ``hidden_act`` names, and gpt-oss's clamped
# SwiGLU, ``(clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, limit)``.
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 2, "clamped_swiglu": 3}


# (BLOCK_N, BLOCK_K, warps, stages) of the 16-bit tensor-core dots, and small tiles: exact fp32's ("ieee": FMA
# loops that ptxas unrolls over the whole BLOCK_M x BLOCK_N x BLOCK_K tile; a 128 x 256 x 64 one took over a minute
# to compile on an H100 for no speed, these compile in seconds) and TF32's fallbacks (4-byte tiles at 128 rows per
# block outgrow shared memory in most of the 16-bit tiles; the autotuner drops the configs that fail to compile).
_TENSOR_CORE_TILES = ((128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3),
                      (128, 128, 8, 3))
_SMALL_TILES = ((64, 32, 4, 2), (32, 32, 4, 2))
# 16-bit tiles kept only at 16 rows per block (the decode layout: a few tokens, the experts' weights streamed from
# HBM), where a deeper K step or a narrower, deeper pipeline reads faster: Mixtral's down kernel at one token 101 ->
# 93 µs replayed on an H100 (benchmarks/probes/probe_moe_decode_tiles.py).
_DECODE_TILES = ((64, 256, 4, 3), (32, 128, 4, 5))
_DECODE_ROWS = 16
_SHARED_MEMORY_BUDGET = 200 << 10  # bytes of pipelined tiles a config may take (an H100 has 228 KB per block)


# The weight gradient's (BLOCK_N, BLOCK_K, BLOCK_R, K_TILES, warps, stages): output tiles of BLOCK_N x BLOCK_K
# summed over BLOCK_R rows a step, K_TILES of them a program. Each sum runs over an expert's rows only
# (~T * top_k / E), so at few rows the kernel is bound by writing its output (benchmarks/probes/
# probe_moe_weight_grad.py, H200): Qwen3-MoE at 512 tokens (32 rows an expert) ran fastest on 32-row steps, eight
# tiles a program (d gate_up 263 µs, 3.06 TB/s; one tile a program 410), gpt-oss-20b at 512 (64 rows) on 64-row steps
# (435); long sums (4096 tokens) on a tile a program, two stages, or four tiles on 4 warps.
WEIGHT_GRAD_TENSOR_CORE_TILES = ((128, 128, 32, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 4, 4, 3),
                                 (128, 128, 64, 1, 8, 2), (64, 128, 32, 8, 4, 4), (128, 128, 64, 2, 8, 4))
WEIGHT_GRAD_SMALL_TILES = ((64, 32, 32, 4, 4, 2), (32, 32, 32, 4, 4, 2))
_WEIGHT_GRAD_GROUP_N = 8  # (row tiles walked together; a config constant so that no launch has to name it)


def _tile(config: triton.Config) -> tuple[int, ...]:
    return (config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]) + (
        (config.kwargs["BLOCK_R"], config.kwargs["K_TILES"]) if "BLOCK_R" in config.kwargs else ()) + (
        config.num_warps, config.num_stages)


def _pipelined_bytes(config: triton.Config, rows: int, elem: int) -> int:
    """Shared memory a config's pipelined tiles take: for the weight gradient (``BLOCK_R`` in the config) its
    ``[BLOCK_R, BLOCK_N]`` and ``[BLOCK_R, BLOCK_K]`` tiles; else the larger of the down kernel's ``[rows,
    BLOCK_K]`` and ``[BLOCK_K, BLOCK_N]`` and the gate/up kernel's ``[rows, BLOCK_K]`` and two ``[BLOCK_K, BLOCK_N]``
    (``rows``: the layout's rows per block)."""
    bn, bk = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    if "BLOCK_R" in config.kwargs:
        return config.num_stages * config.kwargs["BLOCK_R"] * (bn + bk) * elem
    return config.num_stages * (rows * bk + 2 * bk * bn) * elem


def _fits_registers(config: triton.Config, rows: int, args: dict) -> bool:
    """Whether the config's fp32 accumulator takes at most 128 registers a thread: the gate/up kernel's is
    ``[rows, 2 * BLOCK_N]`` for gate and up in halves (one dot over both), ``[rows, BLOCK_N]`` otherwise. Past that
    it spills (Mixtral's gate/up at 4096 tokens, 128 x 256 on 4 warps: 22 ms against 3.0 ms on 8 warps)."""
    if "BLOCK_R" in config.kwargs:
        return True  # (the weight gradient's tiles are listed to fit)
    width = config.kwargs["BLOCK_N"] * (2 if args.get("INTERLEAVED") is False else 1)
    return rows * width // (32 * config.num_warps) <= 128


def moe_configs(weight_grad: bool = False) -> list[triton.Config]:
    """Tile widths, K steps, warps and pipeline depths to tune over (the rows per block, ``BLOCK_M``, are the
    caller's: the pair layout is built for them): the tensor-core tiles, then the small ones;
    :func:`prune_moe_configs` keeps those of the call's dtype and precision. ``weight_grad``: the weight gradient's
    (:data:`WEIGHT_GRAD_TENSOR_CORE_TILES`). One small config in the interpreter.

    Example:
        >>> interpreting() or len(moe_configs()) > 1
        True
    """
    if weight_grad:
        if interpreting():
            return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_R": 16, "K_TILES": 2, "GROUP_N": 2},
                                  num_warps=4, num_stages=1)]
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_R": br, "K_TILES": kt,
                               "GROUP_N": _WEIGHT_GRAD_GROUP_N}, num_warps=w, num_stages=s)
                for bn, bk, br, kt, w, s in WEIGHT_GRAD_TENSOR_CORE_TILES + WEIGHT_GRAD_SMALL_TILES]
    if interpreting():
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in _TENSOR_CORE_TILES + _SMALL_TILES + _DECODE_TILES]


def prune_moe_configs(weight_grad: bool = False) -> dict | None:
    """``prune_configs_by`` for the MoE kernels (their first argument is the activations): exact fp32
    (``INPUT_PRECISION="ieee"``) gets the small tiles, fp16 / bf16 the tensor-core tiles (and at 16 rows per block
    the decode tiles), TF32 both; with
    ``FXFUSE_AUTOTUNE=0`` one of those alone, the first that fits shared memory (else the smallest of all).
    ``weight_grad``: over :func:`moe_configs`'s weight-gradient tiles.

    Example:
        >>> interpreting() or "early_config_prune" in prune_moe_configs()
        True
    """
    if interpreting():
        return None
    tensor_core, small = ((WEIGHT_GRAD_TENSOR_CORE_TILES, WEIGHT_GRAD_SMALL_TILES) if weight_grad
                          else (_TENSOR_CORE_TILES, _SMALL_TILES))

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}  # (a launch by name passes every argument in kwargs, in the kernel's order)
        activations = next((v for v in args.values() if hasattr(v, "element_size")), None)
        elem = activations.element_size() if activations is not None else 2
        exact = args.get("INPUT_PRECISION") == "ieee"
        rows = args.get("BLOCK_M", 128)
        wanted = set(small) if exact else set(tensor_core) | (set(small) if elem == 4 else set()) | (
            set(_DECODE_TILES) if elem == 2 and rows <= _DECODE_ROWS and not weight_grad else set())
        kept = [c for c in configs if _tile(c) in wanted and _fits_registers(c, rows, args)] or configs[:1]
        if autotune_enabled():
            return kept
        fits = [c for c in kept if _pipelined_bytes(c, rows, elem) <= _SHARED_MEMORY_BUDGET]
        return fits[:1] or [min(configs, key=lambda c: _pipelined_bytes(c, rows, elem))]

    return {"early_config_prune": prune}


@triton.jit
def gated_act(g, u, alpha, limit, ACT: tl.constexpr):
    """``act(g) * u`` on fp32 values: ACT 0 SiLU, 1 tanh-GELU, 2 erf GELU, 3 gpt-oss's clamped SwiGLU (``alpha``
    and ``limit`` are read only there)."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * inner)) * u  # 0.5 * g * (1 + tanh(inner))
    elif ACT == 2:
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    else:
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)  # (NaN stays NaN, as torch.clamp keeps it)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
        return (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))


@triton.jit
def _rows_dot(acc, a_ptr, a_rows, stride_am, valid, w_base, offs_n, n_mask, stride_wn, stride_wk, K,
              INPUT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + A[a_rows, :K] @ W[:K, offs_n]`` over K in steps of BLOCK_K: the rows of A picked by ``a_rows``
    (``valid`` ones; last dim contiguous, row stride ``stride_am``), W's element (k, n) at ``w_base + n *
    stride_wn + k * stride_wk``; A's tile cast to W's dtype (a gradient may come wider than the weights)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None].to(tl.int64) * stride_am
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(a_base + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(a.to(w.dtype), w, acc, input_precision=INPUT_PRECISION)
    return acc


# Tuned per shape, rows per block, gate/up arrangement and weight layout (stride_wk: 1 for [E, out, in]).
@autotune(configs=moe_configs(), prune_configs_by=prune_moe_configs(),
          key=["K", "N", "BLOCK_M", "INTERLEAVED", "stride_wk", "STORE_GU", "INPUT_PRECISION"])
@triton.jit
def moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    gu_ptr,
    rows_ptr,
    block_expert_ptr,
    K,
    N,
    TOP_K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_hm,
    alpha,
    limit,
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_GU: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``h[r, n] = act(x[t] @ gate[e, n] + bg[e, n]) * (x[t] @ up[e, n] + bu[e, n])`` for the rows r of one block
    of one expert.

    x_ptr:            hidden states ``[T, K]`` (last dim contiguous, row stride ``stride_xm``).
    w_ptr:            stacked gate/up weights, ``2N`` output columns of ``K`` inputs per expert: element (e, column
                      c, input k) at ``e * stride_we + c * stride_wn + k * stride_wk`` (``[E, 2N, K]``: stride_wk
                      1; ``[E, K, 2N]``: stride_wn 1). Columns ``[0, N)`` are the gate, ``[N, 2N)`` the up
                      projection; INTERLEAVED: column ``2n`` is gate n, ``2n + 1`` up n.
    b_ptr:            biases ``[E, 2N]`` in the columns' order (row stride ``stride_be``), read if HAS_BIAS.
    h_ptr:            output ``[padded rows, N]`` (row stride ``stride_hm``), x's dtype; rows of padding are not
                      written.
    gu_ptr:           if STORE_GU (training), output ``[padded rows, 2N]`` (contiguous), x's dtype: the
                      pre-activation gate (columns ``[0, N)``) and up (``[N, 2N)``, whatever the weights'
                      arrangement) that the backward needs.
    rows_ptr:         int32 ``[padded rows]``: the (token, expert) pair of each sorted row (``token * TOP_K +
                      slot``), -1 for padding.
    block_expert_ptr: int32 ``[blocks]``: the expert of each block of ``BLOCK_M`` rows, or -1 (unused) or -2
                      (pairs routed to an expert held elsewhere): no work here.
    K, N:             hidden size and intermediate size; TOP_K: experts per token.
    alpha, limit:     the clamped SwiGLU's constants (ACT 3).
    ACT:              the gate activation (:data:`ACTIVATIONS`).
    INPUT_PRECISION:  ``tl.dot`` precision: "ieee" for fp32 (as eager) unless the user allows TF32, else "tf32".
    BLOCK_M:          rows per block (the pair layout's); BLOCK_N, BLOCK_K: tuned (:func:`moe_configs`). A program
                      computes BLOCK_N columns of h (INTERLEAVED: BLOCK_N // 2, from BLOCK_N adjacent columns of
                      the weights, one ``tl.dot``); the grid is (blocks, cdiv(N, columns of h per program)).
    """
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    tokens = tl.where(valid, pairs // TOP_K, 0)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if INTERLEAVED:
        # BLOCK_N adjacent columns, gate and up alternating: one dot, then the pairs split apart.
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < 2 * N
        acc = _rows_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptr, tokens, stride_xm, valid, w_base,
                        cols, c_mask, stride_wn, stride_wk, K, INPUT_PRECISION, BLOCK_K)
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + cols, mask=c_mask, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        # Gate columns then up columns as ONE [BLOCK_K, 2 * BLOCK_N] weight tile and one dot (a wider MMA reads x's
        # tile once per K step: Mixtral's gate/up at 4096 tokens 3696 -> 3094 µs on an H200 against two dots,
        # benchmarks/probes/probe_moe_gemm_variants.py), split into gate and up after the K loop.
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        both = tl.arange(0, 2 * BLOCK_N)
        col = pid_n * BLOCK_N + both % BLOCK_N
        cols = col + (both // BLOCK_N) * N  # the gate's column, then the up's (N further)
        acc = _rows_dot(tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32), x_ptr, tokens, stride_xm, valid, w_base,
                        cols, col < N, stride_wn, stride_wk, K, INPUT_PRECISION, BLOCK_K)
        g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        if HAS_BIAS:
            b_base = b_ptr + expert.to(tl.int64) * stride_be
            g += tl.load(b_base + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            u += tl.load(b_base + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    h = gated_act(g, u, alpha, limit, ACT)  # on the fp32 accumulators; cast once
    out_mask = valid[:, None] & (offs_n < N)[None, :]
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=out_mask)
    if STORE_GU:
        gu_rows = gu_ptr + offs_m[:, None].to(tl.int64) * (2 * N) + offs_n[None, :]
        tl.store(gu_rows, g.to(gu_ptr.dtype.element_ty), mask=out_mask)
        tl.store(gu_rows + N, u.to(gu_ptr.dtype.element_ty), mask=out_mask)


@autotune(configs=moe_configs(), key=["K", "N", "BLOCK_M", "stride_wk", "INPUT_PRECISION"],
          prune_configs_by=prune_moe_configs())
@triton.jit
def moe_down_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    routing_ptr,
    K,
    N,
    stride_hm,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[p, n] = routing[p] * (h[r] @ down[e, n] + b[e, n])`` for the rows r (pairs p) of one block of one
    expert.

    h_ptr:            the gate/up kernel's output ``[padded rows, K]`` (row stride ``stride_hm``).
    w_ptr:            stacked down weights: element (e, column n, input k) at ``e * stride_we + n * stride_wn +
                      k * stride_wk`` (``[E, N, K]`` or ``[E, K, N]``).
    b_ptr:            biases ``[E, N]`` (row stride ``stride_be``), read if HAS_BIAS.
    out_ptr:          ``[pairs, N]`` (row stride ``stride_om``): one row per (token, expert) pair; the rows of
                      a block marked -2 (routed to an expert held elsewhere) are written as zeros.
    rows_ptr, block_expert_ptr: as in :func:`moe_gate_up_kernel`.
    routing_ptr:      the routing weight of each pair ``[pairs]`` (any float dtype), applied in fp32.
    K, N:             intermediate size and hidden size.
    INPUT_PRECISION:  as in :func:`moe_gate_up_kernel`.
    BLOCK_M:          rows per block (the pair layout's); BLOCK_N, BLOCK_K: tuned (:func:`moe_configs`); the
                      grid is (blocks, cdiv(N, BLOCK_N)).
    """
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert == -1:  # UNUSED_BLOCK
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if expert == -2:  # ELSEWHERE_BLOCK: pairs routed to no expert here add nothing to their token
        store_pair_rows(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), expert, pairs, valid, offs_n, n_mask, b_ptr,
                        stride_be, routing_ptr, out_ptr, stride_om, False, False)
        return
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = _rows_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), h_ptr, offs_m, stride_hm, valid, w_base, offs_n,
                    n_mask, stride_wn, stride_wk, K, INPUT_PRECISION, BLOCK_K)
    store_pair_rows(acc, expert, pairs, valid, offs_n, n_mask, b_ptr, stride_be, routing_ptr, out_ptr, stride_om,
                    HAS_BIAS, True)


@triton.jit
def grouped_tile(pid, rows, cols, GROUP: tl.constexpr):
    """Program ``pid``'s (row tile, column tile) of a ``rows x cols`` grid walked GROUP row tiles at a time: the
    group's programs cover every column tile before the next group starts, so what the group's rows share (their
    A rows, or an expert's weights) stays in L2. A last group of fewer rows takes the same order."""
    width = GROUP * cols
    first = (pid // width) * GROUP
    size = tl.minimum(rows - first, GROUP)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def store_pair_rows(acc, expert, pairs, valid, offs_n, n_mask, b_ptr, stride_be, routing_ptr, out_ptr, stride_om,
                    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr):
    """The down kernels' epilogue: each valid row of the fp32 ``acc`` ``[rows, columns offs_n]`` plus its expert's
    bias (HAS_BIAS), times its pair's routing weight (SCALE; off for the zero rows of pairs held elsewhere, whose
    weights are not read), cast once and stored at its pair's row of ``out``."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SCALE:
        acc = acc * tl.load(routing_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
    safe = tl.where(valid, pairs, 0).to(tl.int64)
    tl.store(out_ptr + safe[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _expert_of(index_ptr, p, pairs, num_experts):
    """The experts of pairs ``p`` (``num_experts`` for one held elsewhere; any value past ``pairs``)."""
    e = tl.load(index_ptr + p, mask=p < pairs, other=0).to(tl.int32)
    return tl.where((e >= 0) & (e < num_experts), e, num_experts)


@triton.jit
def moe_route_kernel(
    index_ptr,
    rows_ptr,
    block_expert_ptr,
    seg_ptr,
    pairs,
    num_experts,
    blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The :class:`~fxfuse.kernels.moe_launch.PairLayout` in one launch of one program (the same layout in torch
    ops costs ~400 µs of host time per call on an H100's host).

    index_ptr:        the ``[pairs]`` expert of each (token, slot) pair (any integer dtype); outside
                      ``[0, num_experts)``: an expert held elsewhere.
    rows_ptr:         int32 ``[blocks * BLOCK_M]`` out: each row's pair, -1 for padding.
    block_expert_ptr: int32 ``[blocks]`` out: each block's expert, -2 for pairs held elsewhere, -1 unused.
    seg_ptr:          int32 ``[num_experts + 1]`` out: each expert's first block, and the end of the last (the
                      backward's expert sums walk these; torch ops for them cost ~5 launches of host time a step).
    pairs, num_experts, blocks: the counts (``blocks`` = the caller's bound).
    BLOCK_M:          rows per block; E_PAD: a power of two above ``num_experts`` (the dummy expert included);
                      CHUNK: pairs (and blocks) per step, E_PAD * CHUNK one-hot cells in registers.
    """
    experts = tl.arange(0, E_PAD)
    # Pass 1: pairs per expert (the dummy expert ``num_experts`` holds the pairs held elsewhere).
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        e = _expert_of(index_ptr, p, pairs, num_experts)
        hit = (e[None, :] == experts[:, None]) & (p < pairs)[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    tl.store(seg_ptr + experts, seg_start // BLOCK_M, mask=experts <= num_experts)  # (the dummy's start: the end)
    # Every row starts as padding; then (after the barrier: one program, its threads in step) each pair's row.
    for r0 in range(0, blocks * BLOCK_M, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + r, tl.full((CHUNK,), -1, tl.int32), mask=r < blocks * BLOCK_M)
    tl.debug_barrier()
    # Pass 2: each pair's rank within its expert (a running count carried across chunks) -> its row.
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        e = _expert_of(index_ptr, p, pairs, num_experts)
        hit = (e[None, :] == experts[:, None]) & (p < pairs)[None, :]
        hit_i = hit.to(tl.int32)
        running = tl.cumsum(hit_i, axis=1) + (before + seg_start - 1)[:, None]
        row = tl.sum(tl.where(hit, running, 0), axis=0)
        tl.store(rows_ptr + row, p, mask=p < pairs)
        before += tl.sum(hit_i, axis=1)
    # Each block's expert: how many experts' segments end at or before its first row.
    for b0 in range(0, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((seg_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner == num_experts, -2, tl.where(owner > num_experts, -1, owner))
        tl.store(block_expert_ptr + b, owner, mask=b < blocks)


@triton.jit
def moe_count_kernel(index_ptr, counts_ptr, pairs, num_experts, CHUNK: tl.constexpr):
    """``counts[e]``: the pairs routed to expert ``e`` = this program (``num_experts``: held elsewhere). With
    :func:`moe_place_kernel`, the pair layout for more pairs than :func:`moe_route_kernel`'s one program takes:
    a program per expert, each over every pair.

    index_ptr: the ``[pairs]`` expert of each pair (any integer dtype); counts_ptr: int32 ``[num_experts + 1]``
    out; CHUNK: pairs per step.
    """
    expert = tl.program_id(0)
    n = tl.zeros((CHUNK,), dtype=tl.int32)
    for p0 in range(0, pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        n += ((_expert_of(index_ptr, p, pairs, num_experts) == expert) & (p < pairs)).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(n, axis=0))


@triton.jit
def moe_place_kernel(
    index_ptr,
    counts_ptr,
    rows_ptr,
    block_expert_ptr,
    seg_ptr,
    pairs,
    num_experts,
    blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Expert ``e`` = this program's pairs, in order, at its rows; its padding rows and its blocks' expert (the
    program of ``num_experts``, pairs held elsewhere, marks its blocks -2 and every block after them -1).
    Rows of unused blocks are not written: no kernel reads them.

    index_ptr, rows_ptr, block_expert_ptr, seg_ptr, pairs, num_experts, blocks, BLOCK_M: as in
    :func:`moe_route_kernel` (this program writes ``seg[e]``: its first block; the dummy's, the local ones' end);
    counts_ptr: int32 ``[num_experts + 1]`` from :func:`moe_count_kernel`; E_PAD: a power of two above
    ``num_experts``; CHUNK: pairs (and blocks) per step.
    """
    expert = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + experts, mask=experts <= num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(seg_ptr + expert, start // BLOCK_M)
    before = tl.sum(tl.zeros((CHUNK,), dtype=tl.int32), axis=0)  # this expert's pairs in earlier steps
    for p0 in range(0, pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        hit = (_expert_of(index_ptr, p, pairs, num_experts) == expert) & (p < pairs)
        hit_i = hit.to(tl.int32)
        tl.store(rows_ptr + start + before + tl.cumsum(hit_i, axis=0) - 1, p, mask=hit)
        before += tl.sum(hit_i, axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)
    tl.store(rows_ptr + pad, tl.full((BLOCK_M,), -1, tl.int32), mask=pad < end)
    owner = tl.where(expert == num_experts, -2, expert)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + b, tl.zeros((CHUNK,), dtype=tl.int32) + owner, mask=b < end // BLOCK_M)
    if expert == num_experts:
        for b0 in range(end // BLOCK_M, blocks, CHUNK):
            b = b0 + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + b, tl.full((CHUNK,), -1, tl.int32), mask=b < blocks)
