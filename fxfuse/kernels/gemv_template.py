"""Source generator for the small-M stage kernel: one GEMM + epilogue for a few rows (M ≤ 64), split-K.

At decode sizes a stage ``epilogue(x @ W0^T + b0[, x @ W1^T + b1], v...)`` is a stream of its weights:
every weight byte is read once and each does 2·M FLOPs. The kernel is built for that stream:

* **Weights as the wide operand** ("swap AB"): each program owns ``BLOCK_N`` output columns, i.e. rows of
  ``W`` (contiguous along K), and computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T``. ``x`` (a few
  rows, L2-resident) is padded to ``BLOCK_M`` = 16 columns (what ``tl.dot`` needs; 32 or 64 for more rows); the
  weight tiles feed ``tl.dot`` directly, so Triton's software pipeliner keeps ``num_stages`` of them in flight.
* **Split-K** when the columns alone give too few programs to stream at full bandwidth (a 1024-wide
  output is 64 programs of 16 columns on 132 SMs): program ``(n, s)`` reduces K steps
  ``[s·steps/SPLIT_K, (s+1)·steps/SPLIT_K)`` (rounded down: every split gets a step when there are as many as
  splits). Each split stores its fp32 partial sums in its own slice of a
  workspace and counts itself on a per-column-tile counter; the last split of a tile adds the slices in split
  order (the same sums in the same order whichever split finishes last: the output is the same bits on every
  call, as cuBLAS's is), resets the counter, and runs the epilogue. Until session 40 the splits added into one
  slice with atomics, whose order changed from call to call (gpt2m_mlp_m8's output differed between two calls).
  With ``SPLIT_K = 1`` none of that is compiled in.
* **Register stream** (``ONE_ROW`` = R rows, M <= R <= 4): no ``tl.dot`` and no padding. Each program multiplies
  a few rows of ``W`` by each row of ``x`` on the CUDA cores and sums along K, loading the weights straight into
  registers; this streams better than the staged ``tl.dot`` tiles at one row (llama down 32.5 vs 40 µs) and, where
  K is long and N narrow, at two to four (see ``MAX_STREAM_ROWS``).
* ``N`` and ``K`` are compile-time constants (each stage shape compiles its own kernel): with them the
  loop's trip count and K mask are constants, which the one-row stream needs to keep up with a reduction
  written the same way (llama gate+up at M=1: 62.6 µs runtime-sized against 59.2 for constant sizes,
  ``benchmarks/probes/probe_stream.py``).
* The epilogue runs on the fp32 accumulators (bias, operands, pointwise math) and casts once.
* On Hopper the launch is a programmatic dependent launch (``USE_PDL``): it is scheduled while the previous
  kernel (the region's first stage) finishes and waits for it on the GPU, which hides one launch latency of
  a decode MLP's two launches.

Rows and columns past the edge are read wrapped around (in bounds, so the weight loads need no row mask)
and dropped at the store; only K is masked.

Example:
    >>> src = render_gemv(2, "mul(silu(a0),a1)")
    >>> src.count("tl.dot(") == 2 and "SPLIT_K: tl.constexpr" in src
    True
"""

from __future__ import annotations

import logging

import triton

from .. import epilogue as ep
from .template import autotune_enabled, fit_stages, next_pow2, sm_count
from .template import interpreting as _interpreting

logger = logging.getLogger(__name__)

__all__ = ["GEMV_BLOCK_M", "GEMV_MAX_ROWS", "GEMV_MAX_SPLIT", "GEMV_TEMPLATE_VERSION", "fit_gemv_config",
           "gemv_block_m", "gemv_configs", "gemv_workspace_splits",
           "gpu_gemv_configs", "prune_gemv_configs", "render_gemv"]

GEMV_TEMPLATE_VERSION = 8
# Rows per launch, padded: tl.dot needs at least 16 along every dimension.
GEMV_BLOCK_M = 16
# The most rows one launch takes (padded to 16, 32 or 64: gemv_block_m). Above 16 rows the kernel is a timed stage
# candidate beside the GEMM kernels (fxfuse.stages), for shapes whose call is host-bound (a bound launch against
# ATen's path) or whose GEMM grids leave SMs idle.
GEMV_MAX_ROWS = 64
# The tl.dot configs tried above 16 rows, as (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, listed num_stages): few, because
# each is a compile at a stage's first call. The 64-row winner of session 24's H100 trial (llama: N64 K128, one
# split) and neighbours.
MANY_ROWS_CONFIGS = {(64, 128, 1, 4, 3), (32, 256, 1, 4, 6), (64, 128, 2, 4, 6), (128, 64, 1, 8, 4)}
# Rows the register stream (ONE_ROW) takes at most. Each program reads all of x's rows for its few weight rows, so x
# traffic from L2 is ONE_ROW / BLOCK_N times the weights'. H200, one stage in a CUDA graph after do_bench's flush
# (benchmarks/probes/probe_few_rows.py, best stream vs best tl.dot config, µs): gpt2m fc2 (K=4096, N=1024) 11.8 vs 15.1
# at M=2, 13.2 vs 15.2 at M=4, 15.3 vs 15.1 at M=8; gpt2m fc1 (K=1024) 12.4 vs 12.5 at M=2, 14.7 vs 12.5 at M=4; llama
# down 43.3 vs 44.2 at M=2; llama at M=8: 98 vs 44 (down), 235 vs 71 (gate+up). So up to 4 rows.
MAX_STREAM_ROWS = 4
# The most K splits a config takes: the workspace holds this many slices of partial sums per linear.
GEMV_MAX_SPLIT = 8

_HEADER = '''\
# Generated by fxfuse (small-M stage template version {version}). Do not edit: regenerated from
# fxfuse/kernels/gemv_template.py whenever it is missing or differs.
#
#   linears:  {num_linears}
#   epilogue: {epilogue}
#
# out[m, n] = epilogue(a0[m, n], ..., v0[n], ...), a_i = x @ W_i^T + b_i, for M <= 64 rows: each program
# streams BLOCK_N rows of W over its share of K (split-K partial sums meet in an fp32 workspace).
import triton
import triton.language as tl

from fxfuse.kernels.gemv_template import gemv_configs, prune_gemv_configs
from fxfuse.kernels.tuning import autotune

NUM_LINEARS = {num_linears}
EPILOGUE = "{epilogue}"


@autotune(configs=gemv_configs(), key=["M_BUCKET", "N", "K", "PREFETCH"], prune_configs_by=prune_gemv_configs())
@triton.jit
def fused_gemv_kernel(
'''

_DOC = '''\
    """``BLOCK_N`` output columns of ``out = epilogue(x @ W0^T + b0[, x @ W1^T + b1], v0, ...)``, one K share.

    x_ptr:       input ``[M, K]``, any strides (``stride_xm``, ``stride_xk``), M <= BLOCK_M.
    w0_ptr, w1_ptr: weights ``[N, K]``, any strides (``stride_w*n``, ``stride_w*k``); w1 only for a gated
                 stage, which loads each x tile once for both.
    b0_ptr, b1_ptr: biases ``[N]`` (``stride_b*``), read only if ``HAS_BIAS*``; otherwise any valid pointer.
    v*_ptr:      epilogue operands, one value per column (``stride_v*`` 0 broadcasts a single element).
    out_ptr:     output ``[M, N]`` (``stride_om``, ``stride_on``), written once per element.
    ws_ptr:      fp32 workspace ``[NUM_LINEARS, WS_SPLITS, BLOCK_M, N]`` (contiguous), any contents: each split
                 writes its slice before the last one reads it; used only if ``SPLIT_K > 1``.
    counter_ptr: int32 per column tile (at least ``cdiv(N, BLOCK_N)``), ZERO on entry, left zero; read only
                 if ``SPLIT_K > 1``.
    M:           rows (at run time).
    N, K:        output width, input width: constants of the compiled kernel (its loop bounds and masks fold;
                 each stage shape compiles once, as the autotuner keys on them anyway).
    M_BUCKET:    power-of-2 bucket of M (autotuning key only).
    INPUT_PRECISION: ``tl.dot`` precision for fp32 inputs ("ieee" or "tf32").
    BLOCK_M:     rows per launch (M padded to it); BLOCK_N: output columns per program; BLOCK_K: K step;
    WS_SPLITS:   slices per linear in the workspace (``gemv_workspace_splits(BLOCK_M)``), at least SPLIT_K.
    SPLIT_K:     programs sharing one column tile's K steps (grid axis 1).
    ONE_ROW:     0: ``tl.dot`` tiles. R in 1, 2, 4: M <= R rows, multiplied and summed on the CUDA cores
                 (the register stream; BLOCK_N may be below 16), each weight tile loaded once for all R rows.
    USE_PDL:     the launch is a programmatic dependent launch (Hopper+, ``launch_pdl=True``): wait for the
                 previous kernel before reading anything, so this launch's start overlaps that kernel's tail.
    PREFETCH:    (ONE_ROW) issue the first K step's weight loads BEFORE the wait. Only for a launch whose
                 previous kernel is this kernel (the region's previous stage): with USE_PDL that one passed its
                 own wait before letting this launch start, so every earlier kernel, any writer of the weights
                 included, has finished, and it writes only x, which is still read after the wait. Without
                 USE_PDL (inside a CUDA graph capture) the launch starts after it: only the load order changes.
    """
'''


def _stream_rows(lin: range, weight: str, ks: str, mask: str) -> list[str]:
    """One K step of the register stream: each weight tile (``weight`` with ``{i}``) converted once, then multiplied
    by each of the ``ONE_ROW`` rows of x (constant conditions: the compiled kernel holds only its rows)."""
    lines = [f"wf{i} = {weight.format(i=i)}.to(tl.float32)" for i in lin]
    for r in range(MAX_STREAM_ROWS):
        lines += [f"if ONE_ROW > {r}:",
                  f"    xr = tl.load(x_ptr + ({r} % M) * stride_xm + {ks} * stride_xk, mask={mask}, other=0.0, "
                  "eviction_policy=\"evict_last\").to(tl.float32)"]
        lines += [f"    part{i}_{r} += wf{i} * xr" for i in lin]
    return lines


def render_gemv(num_linears: int, epilogue: str) -> str:
    """The kernel module source for a small-M stage with ``num_linears`` (1 or 2) linears and ``epilogue``.

    Example:
        >>> "v0_ptr" in render_gemv(1, "mul(gelu_tanh(a0),v0)")
        True
    """
    expr = ep.parse(epilogue)
    if num_linears not in (1, 2) or ep.num_accumulators(expr) != num_linears:
        raise ValueError(f"epilogue {expr} must use exactly a0..a{num_linears - 1}")
    lin = range(num_linears)
    n_ops = ep.num_operands(expr)
    params = ["x_ptr", *(f"w{i}_ptr" for i in lin), *(f"b{i}_ptr" for i in lin), *(f"v{j}_ptr" for j in range(n_ops)),
              "out_ptr", "ws_ptr", "counter_ptr", "M", "N: tl.constexpr", "K: tl.constexpr", "M_BUCKET",
              "stride_xm", "stride_xk"]
    for i in lin:
        params += [f"stride_w{i}n", f"stride_w{i}k"]
    params += [f"stride_b{i}" for i in lin] + [f"stride_v{j}" for j in range(n_ops)]
    params += ["stride_om", "stride_on", *(f"HAS_BIAS{i}: tl.constexpr" for i in lin),
               "INPUT_PRECISION: tl.constexpr", "BLOCK_M: tl.constexpr", "WS_SPLITS: tl.constexpr",
               "BLOCK_N: tl.constexpr",
               "BLOCK_K: tl.constexpr", "SPLIT_K: tl.constexpr", "ONE_ROW: tl.constexpr", "USE_PDL: tl.constexpr",
               "PREFETCH: tl.constexpr"]

    body = [
        "pid_n = tl.program_id(0)",
        "pid_k = tl.program_id(1)",
        "if ONE_ROW:",
        "    offs_m = tl.arange(0, ONE_ROW)  # the streamed rows: the epilogue's tiles are [BLOCK_N, ONE_ROW]",
        "else:",
        "    offs_m = tl.arange(0, BLOCK_M)",
        "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "offs_k = tl.arange(0, BLOCK_K)",
        "# Padded rows / columns read real data (indices wrap around) and are dropped at the store.",
        "rows = offs_m % M",
        "cols = offs_n % N",
        "# This program's share of the K steps. N and K are constants of the compiled kernel: without a split",
        "# the loop's trip count is one too, and the K mask folds away when BLOCK_K divides K.",
        "k_steps = tl.cdiv(K, BLOCK_K)",
        "if SPLIT_K == 1:",
        "    k_first = 0",
        "    k_end = k_steps",
        "else:",
        "    k_first = pid_k * k_steps // SPLIT_K",
        "    k_end = (pid_k + 1) * k_steps // SPLIT_K",
        "xt_ptrs = x_ptr + (k_first * BLOCK_K + offs_k)[:, None] * stride_xk + rows[None, :] * stride_xm",
    ]
    body += [f"w{i}_rows = cols[:, None] * stride_w{i}n" for i in lin]
    body += [
        "if PREFETCH:",
        "    # The weights do not depend on the previous kernel (see PREFETCH): their first K step is on its way",
        "    # from memory while that kernel finishes. (Read by the ONE_ROW stream only; unused loads are dropped.)",
        "    ks_first = k_first * BLOCK_K + offs_k[None, :]",
    ]
    body += ["    first_mask = (ks_first < K) & (ks_first < k_end * BLOCK_K)  # (a split with no K step: nothing)"]
    body += [f"    w{i}_first = tl.load(w{i}_ptr + w{i}_rows + ks_first * stride_w{i}k, mask=first_mask, other=0.0, "
             "eviction_policy=\"evict_first\")" for i in lin]
    body += [
        "if USE_PDL:",
        "    # Launched early (programmatic dependent launch): wait until the previous kernel, which may write",
        "    # x, has finished, and let the next one be scheduled as this one's programs retire.",
        "    tl.extra.cuda.gdc_wait()",
        "    tl.extra.cuda.gdc_launch_dependents()",
    ]
    for i in lin:
        body += [f"w{i}_ptrs = w{i}_ptr + cols[:, None] * stride_w{i}n + (k_first * BLOCK_K + offs_k)[None, :] "
                 f"* stride_w{i}k",
                 f"acc{i} = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)"]  # (ONE_ROW sets its own)
    body += [
        "# Weights are read once: evict_first keeps x (read by every program) in L2.",
        "if ONE_ROW:",
        "    # M <= ONE_ROW (configs pruned to it): multiply and sum on the CUDA cores. The weight loads go",
        "    # straight to registers, with no shared-memory staging for tl.dot, and stream faster after a dirty",
        "    # L2; each weight tile, converted once, is multiplied by every row. Addresses from int32 offsets made",
        "    # in each step (not loop-carried pointer tiles, which hold two registers per element and cut the",
        "    # programs an SM keeps in flight). x rows are [1, BLOCK_K] tiles in the weight tile's layout (a 1-D",
        "    # load would be re-laid out through shared memory in every step); rows past M read row r % M.",
    ]
    for r in range(MAX_STREAM_ROWS):  # one fp32 partial tile per row and linear, only the compiled rows'
        body += [f"    if ONE_ROW > {r}:"]
        body += [f"        part{i}_{r} = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)" for i in lin]
    body += [
        "    k_loop = k_first",
        "    if PREFETCH:  # the first step, with the weights loaded before the wait",
    ]
    body += ["        " + line for line in _stream_rows(lin, "w{i}_first", "ks_first", "first_mask")]
    body += [
        "        k_loop = k_first + 1",
        "    for k in range(k_loop, k_end):",
        "        ks = k * BLOCK_K + offs_k[None, :]",
        "        k_mask = ks < K",
    ]
    body += [f"        w{i} = tl.load(w{i}_ptr + w{i}_rows + ks * stride_w{i}k, mask=k_mask, other=0.0, "
             "eviction_policy=\"evict_first\")" for i in lin]
    body += ["        " + line for line in _stream_rows(lin, "w{i}", "ks", "k_mask")]
    body += [f"    acc{i} = tl.zeros((BLOCK_N, ONE_ROW), dtype=tl.float32)" for i in lin]
    for r in range(MAX_STREAM_ROWS):  # each row's sums into its column of the [BLOCK_N, ONE_ROW] accumulator
        body += [f"    if ONE_ROW > {r}:"]
        body += [f"        acc{i} = tl.where(offs_m[None, :] == {r}, tl.sum(part{i}_{r}, 1)[:, None], acc{i})"
                 for i in lin]
    body += [
        "else:",
        "    for k in range(k_first, k_end):",
        "        k_mask = offs_k < K - k * BLOCK_K",
        "        xt = tl.load(xt_ptrs, mask=k_mask[:, None], other=0.0)",
    ]
    for i in lin:
        body += [f"        w{i} = tl.load(w{i}_ptrs, mask=k_mask[None, :], other=0.0, "
                 "eviction_policy=\"evict_first\")",
                 f"        acc{i} = tl.dot(w{i}, xt, acc{i}, input_precision=INPUT_PRECISION)",
                 f"        w{i}_ptrs += BLOCK_K * stride_w{i}k"]
    body += [
        "        xt_ptrs += BLOCK_K * stride_xk",
        "out_mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]",
        "if SPLIT_K > 1:",
        "    # Each split's partial sums in its own workspace slice; the tile's last split adds them up. The barrier",
        "    # puts every thread's stores before the counter's release; its acq_rel orders them before the reads.",
        "    ws_offs = offs_m[None, :] * N + offs_n[:, None]",
    ]
    body += [f"    tl.store(ws_ptr + ({i} * WS_SPLITS + pid_k) * BLOCK_M * N + ws_offs, acc{i}, mask=out_mask)"
             for i in lin]
    body += [
        "    tl.debug_barrier()",
        "    is_last = tl.atomic_add(counter_ptr + pid_n, 1, sem=\"acq_rel\") == SPLIT_K - 1",
        "else:",
        "    is_last = True",
        "if is_last:",
        "    if SPLIT_K > 1:",
        "        # In split order, whichever split came last: the same bits every call. (.cg: from L2, where the",
        "        # other splits' stores are.)",
    ]
    for i in lin:
        body += [f"        acc{i} = tl.zeros_like(acc{i})",  # ([BLOCK_N, ONE_ROW] for the register stream)
                 "        for s in tl.static_range(SPLIT_K):",
                 f"            acc{i} += tl.load(ws_ptr + ({i} * WS_SPLITS + s) * BLOCK_M * N + ws_offs, "
                 "mask=out_mask, other=0.0, cache_modifier=\".cg\")"]
    body += ["        tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch"]
    for i in lin:
        body += [f"    if HAS_BIAS{i}:",
                 f"        acc{i} += tl.load(b{i}_ptr + cols * stride_b{i}).to(tl.float32)[:, None]"]
    body += [f"    v{j} = tl.load(v{j}_ptr + cols * stride_v{j}).to(tl.float32)[:, None]" for j in range(n_ops)]
    lines, result = ep.to_triton(expr, acc_names=[f"acc{i}" for i in lin],
                                 operand_names=[f"v{j}" for j in range(n_ops)], indent="    ", prefix="_e_")
    body += lines
    body += [
        f"    out = {result}.to(out_ptr.dtype.element_ty)",
        "    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on, out, mask=out_mask)",
    ]

    src = _HEADER.format(version=GEMV_TEMPLATE_VERSION, num_linears=num_linears, epilogue=expr)
    src += "".join(f"    {p},\n" for p in params) + "):\n" + _DOC
    src += "".join(f"    {line}\n" for line in body)
    return src


def _cfg(bn: int, bk: int, split: int, warps: int, stages: int, one_row: int = 0) -> triton.Config:
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "ONE_ROW": one_row},
                         num_warps=warps, num_stages=stages)


def gpu_gemv_configs() -> list[triton.Config]:
    """The GPU candidates, before :func:`prune_gemv_configs` keeps those that suit one launch.

    Example:
        >>> all(c.kwargs["BLOCK_N"] in (16, 32, 64, 128) for c in gpu_gemv_configs() if not c.kwargs["ONE_ROW"])
        True
        >>> max(c.kwargs["SPLIT_K"] for c in gpu_gemv_configs()) <= GEMV_MAX_SPLIT  # (the workspace's slices)
        True
    """
    # H200 sweep (benchmarks/probes/probe_gemv_sweep.py, device µs after an L2 flush): llama gate+up 63.9 (M=1, N128 K64
    # w8 s4) / 63.8 (M=16, N64 K128 w4 s3); llama down 40.0 (M=1, N64 K128 split4 w8 s3) / 37.4 (M=16, N32 K512 w4 s4);
    # gpt2m fc1 6.4 / 5.9 (N64 K128 w4 s6); gpt2m fc2 8.9 (M=1, N64 K128 split8 w4 s6) / 8.3 (M=8, N16 K512 w4 s4).
    return [
        _cfg(64, 128, 1, 4, 3),
        _cfg(128, 64, 1, 8, 4),
        _cfg(128, 64, 1, 4, 4),
        _cfg(64, 128, 1, 4, 6),
        _cfg(32, 512, 1, 4, 4),
        _cfg(64, 256, 1, 4, 4),
        _cfg(32, 256, 1, 4, 6),
        _cfg(16, 512, 1, 4, 4),
        _cfg(64, 128, 2, 4, 6),
        _cfg(64, 128, 4, 8, 3),
        _cfg(128, 64, 4, 4, 6),
        _cfg(32, 256, 4, 8, 4),
        _cfg(64, 128, 8, 4, 6),
        # The register stream (ONE_ROW; listed for one row, pruned to the call's M bucket up to MAX_STREAM_ROWS):
        # a few weight rows per program, long K runs, like Inductor's reduction kernels.
        # H200 sweep with N and K constant (probe_gemv_sweep.py --one-row, device µs after do_bench's flush):
        # llama gate+up 59.4 (N1 K2048 w16) / 60.1 (N1 K4096 w8), llama down 31.7 (N1 K1024 w16, N1 K8192 w16),
        # gpt2m fc1 4.9 (N2 K1024 w4 s3, N4 K1024 w8 s2), gpt2m fc2 4.8 (N1 K4096 w8 s2) / 4.9 (N1 K1024 w8).
        # (Runtime N and K: 63.7, 32.5, 5.5, 5.2.)
        _cfg(1, 2048, 1, 16, 1, 1),
        _cfg(1, 4096, 1, 8, 1, 1),
        _cfg(1, 1024, 1, 16, 1, 1),
        _cfg(1, 8192, 1, 16, 1, 1),
        # A whole row of K <= 16384 in one step: after a small-M stage (PREFETCH) the first wave's programs then
        # have all their weights in flight before the wait. llama m1 gate+up then down (probe_prefetch.py,
        # do_bench µs): N1 K16384 w16 92.9 -> 91.2 with PREFETCH; the shipped pick's first step only: 92.6 -> 92.3.
        _cfg(1, 16384, 1, 16, 1, 1),
        _cfg(1, 2048, 1, 8, 2, 1),
        _cfg(1, 4096, 1, 8, 2, 1),
        _cfg(1, 1024, 1, 8, 1, 1),
        _cfg(2, 1024, 1, 4, 3, 1),
        _cfg(4, 1024, 1, 8, 2, 1),
        _cfg(8, 512, 1, 8, 1, 1),
        _cfg(32, 256, 1, 4, 1, 1),
    ]


def gemv_configs() -> list[triton.Config]:
    """The configs the autotuner chooses from (small ones under ``TRITON_INTERPRET=1``).

    Example:
        >>> all("SPLIT_K" in c.kwargs for c in gemv_configs())
        True
    """
    if _interpreting():
        # Small tiles and two K splits, so the tests' odd widths exercise the K mask, wrapped columns and the
        # workspace hand-off.
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2, "ONE_ROW": 0}, num_warps=4,
                              num_stages=1)]
    return gpu_gemv_configs()


def gemv_block_m(m: int) -> int:
    """The padded rows of a launch for ``m`` rows: 16 (what ``tl.dot`` needs), 32 or 64.

    Example:
        >>> [gemv_block_m(m) for m in (1, 16, 17, 40, 64)]
        [16, 16, 32, 64, 64]
    """
    return max(GEMV_BLOCK_M, next_pow2(m))


def gemv_workspace_splits(block_m: int) -> int:
    """Slices per linear the split-K workspace holds for launches of ``block_m`` padded rows: the most K splits their
    configs take (above 16 rows only ``MANY_ROWS_CONFIGS`` run).

    Example:
        >>> gemv_workspace_splits(16), gemv_workspace_splits(64)
        (8, 2)
    """
    return GEMV_MAX_SPLIT if block_m <= GEMV_BLOCK_M else max(split for _, _, split, _, _ in MANY_ROWS_CONFIGS)


def _programs(c: triton.Config, N: int) -> int:
    return triton.cdiv(N, c.kwargs["BLOCK_N"]) * c.kwargs["SPLIT_K"]


def fit_gemv_config(c: triton.Config, num_linears: int, elem_size: int,
                    block_m: int = GEMV_BLOCK_M) -> triton.Config | None:
    """``c`` with as many pipeline stages as fit shared memory (each holds the weight tiles and an x tile).

    A register-stream (ONE_ROW) config stages its rows of x, and with one stage keeps its loads in registers (no
    shared memory): one whose stages do not fit runs with one.

    Example:
        >>> one_row = triton.Config({"BLOCK_N": 1, "BLOCK_K": 4096, "SPLIT_K": 1, "ONE_ROW": 1}, num_stages=2)
        >>> fit_gemv_config(one_row, 2, 2).num_stages  # (2 weight rows + 1 x row) x 4096 x 2 B per stage
        2
    """
    kw = c.kwargs
    if kw.get("ONE_ROW"):
        if c.num_stages == 1:
            return c
        fitted = fit_stages(c, (num_linears * kw["BLOCK_N"] + kw["ONE_ROW"]) * kw["BLOCK_K"] * elem_size)
        return fitted or triton.Config(dict(kw), num_warps=c.num_warps, num_stages=1)
    return fit_stages(c, (num_linears * kw["BLOCK_N"] * kw["BLOCK_K"] + block_m * kw["BLOCK_K"]) * elem_size)


# fp32 partial-sum registers per thread a register-stream config may hold (rows x linears x its weight tile's
# elements per thread); the one-row configs reach 128 (N32 K256, 4 warps, gated).
STREAM_PARTIAL_REGISTERS = 128


def _with_rows(c: triton.Config, rows: int) -> triton.Config:
    if c.kwargs["ONE_ROW"] == rows:
        return c
    return triton.Config({**c.kwargs, "ONE_ROW": rows}, num_warps=c.num_warps, num_stages=c.num_stages)


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    gated = "w1_ptr" in args
    x = args["x_ptr"]
    elem = x.element_size() if hasattr(x, "element_size") else 2
    N, K = args["N"], args["K"]
    block_m = args.get("BLOCK_M", GEMV_BLOCK_M)
    device = getattr(x, "device", None)
    sms = sm_count(device)
    if block_m > GEMV_BLOCK_M:  # more than 16 rows: a few tl.dot tiles (no stream), each keeping 64 fp32 sums a thread
        n_lin = 2 if gated else 1
        configs = [c for c in configs if not c.kwargs.get("ONE_ROW")
                   and (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"], c.num_warps,
                        c.num_stages) in MANY_ROWS_CONFIGS
                   and n_lin * c.kwargs["BLOCK_N"] * block_m <= 64 * 32 * c.num_warps]
    # Register-stream configs compute ONE_ROW rows: they take the call's M bucket as that count, up to
    # MAX_STREAM_ROWS. Split stream tiles narrower than 16 columns work but stream slower than one share (llama m1
    # down 39-109 µs against 31.6; probe_one_row_split.py).
    bucket = args.get("M_BUCKET")
    stream_rows = bucket if isinstance(bucket, int) and 1 <= bucket <= MAX_STREAM_ROWS else 0
    one_row = stream_rows == 1
    configs = [_with_rows(c, stream_rows) if c.kwargs.get("ONE_ROW") else c for c in configs
               if not c.kwargs.get("ONE_ROW")
               or (stream_rows and (c.kwargs["SPLIT_K"] == 1 or c.kwargs["BLOCK_N"] >= 16))]
    kept = []
    for c in configs:
        bn, bk, split = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if c.kwargs.get("ONE_ROW") and c.kwargs["ONE_ROW"] * (2 if gated else 1) * bn * bk > \
                STREAM_PARTIAL_REGISTERS * 32 * c.num_warps:
            continue  # its fp32 partial sums alone would crowd the registers
        # A tile much wider than its dimension only streams padding; a split needs K steps to share, and is
        # only worth its workspace traffic when the columns alone leave SMs idle.
        if bn > max(16, next_pow2(N)) or bk > max(64, next_pow2(K)) or split > triton.cdiv(K, bk) \
                or (c.kwargs.get("ONE_ROW") and bk > next_pow2(K)):
            continue
        if split > 1 and triton.cdiv(N, bn) >= 2 * sms:
            continue
        c = fit_gemv_config(c, 2 if gated else 1, elem, block_m)
        if c is not None:
            kept.append(c)
    if not kept:  # none suits the shape: the smallest tile (the narrowest of those), fitted to shared memory
        c = min(configs, key=lambda c: (c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"], c.kwargs["BLOCK_N"]))
        kept = [fit_gemv_config(c, 2 if gated else 1, elem, block_m)
                or triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=1)]
    if one_row and N >= sms and any(c.kwargs.get("ONE_ROW") for c in kept):
        # One row with a column per SM or more: the one-row stream beat every tl.dot tile on each shape measured
        # (H200, probe_gemv_sweep.py: llama gate+up 59.4 vs 63.9 µs, down 31.7 vs 40.0, gpt2m fc1 4.9 vs 6.4, fc2
        # 4.8 vs 8.9), so the tiles are not compiled and timed at a first call (about half of its configs).
        kept = [c for c in kept if c.kwargs.get("ONE_ROW")]
    if args.get("PREFETCH"):
        # A prefetching launch (see PREFETCH) gains most when its first step is the whole row: its standalone
        # timing cannot show that, so it chooses among those configs only, when there are any.
        whole_row = [c for c in kept
                     if c.kwargs.get("ONE_ROW") and c.kwargs["SPLIT_K"] == 1 and c.kwargs["BLOCK_K"] >= K]
        kept = whole_row or kept
    # First (the pick without autotuning): the fewest splits that still give every SM a program.
    kept.sort(key=lambda c: (_programs(c, N) < sms, c.kwargs["SPLIT_K"]))  # stable within each group
    if not autotune_enabled():
        kept = kept[:1]
    logger.debug("gemv N=%s K=%s gated=%s: %d of %d configs kept", N, K, gated, len(kept), len(configs))
    return kept


def prune_gemv_configs() -> dict | None:
    """``prune_configs_by`` for ``triton.autotune``: drop tiles that do not fit the shape or shared memory."""
    return None if _interpreting() else {"early_config_prune": _prune}
