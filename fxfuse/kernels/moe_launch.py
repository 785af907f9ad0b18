"""Launcher of the mixture-of-experts kernels (:mod:`fxfuse.kernels.moe_template`).

:func:`run_moe` computes what transformers' ``MixtralExperts.forward(hidden_states, top_k_index, top_k_weights)``
computes (or ``GptOssExperts.forward``: weights ``[E, in, out]``, biases, gate and up interleaved, a clamped
SwiGLU; :class:`ExpertsForm` says which), in three or four launches and an add: the pairs sorted by expert
(:func:`route_pairs`, no host sync), the gate/up kernel, the down kernel, and the sum of each token's ``top_k``
rows. (``tests/test_moe.py`` builds the
same layout in torch ops, the reference the routing kernels are tested against; those ops cost ~400 µs of host
time per call on an H100's host, and ``torch.bincount`` among them waits for the GPU.)

Example:
    >>> out = run_moe(x, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, "silu")  # doctest: +SKIP
    >>> gpt_oss = ExpertsForm("clamped_swiglu", transposed=True, interleaved=True, alpha=1.702, limit=7.0)
    >>> out = run_moe(x, index, weights, experts.gate_up_proj, experts.down_proj, gpt_oss,  # doctest: +SKIP
    ...               gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias)
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .fastlaunch import launch
from .launch import _input_precision
from .measured import faster, may_time, store_times, stored_times, time_runners
from .moe_combine_template import moe_sum_pairs_kernel
from .moe_template import (
    ACTIVATIONS,
    moe_count_kernel,
    moe_down_kernel,
    moe_gate_up_kernel,
    moe_place_kernel,
    moe_route_kernel,
)
from .moe_tma_template import _GATHER_COLUMNS, moe_down_tma_kernel, moe_gate_up_tma_kernel, moe_gather_rows_kernel
from .template import cdiv, interpreting, next_pow2
from .tma_launch import (
    _INTERPRETER_SMS,
    _TMA_ALIGN,
    _cuda_props,
    _describable,
    _device_index,
    _tensor_descriptor,
    launch_with_descriptors,
    tma_supported,
)

__all__ = ["ELSEWHERE_BLOCK", "GATE_UP_CHOICES", "GATE_UP_FORM", "UNUSED_BLOCK", "ExpertsForm", "MoESaved",
           "PairLayout", "block_rows", "down_by_tma", "gather_rows", "gathered_by_tma", "gate_up_by_tma",
           "gate_up_timings", "launch_down", "layout_blocks", "moe_forward_pass", "route_pairs", "run_moe", "sum_pairs"]


logger = logging.getLogger(__name__)

# The marks in ``PairLayout.block_expert`` of blocks that run no expert.
UNUSED_BLOCK = -1  # past the last expert's blocks: the kernels return at once
ELSEWHERE_BLOCK = -2  # pairs routed to an expert outside [0, E): the down kernel writes their rows as zeros
# The one-program routing kernel: one-hot cells per step (registers of its one program), and the most steps it
# takes per pass over the pairs; above, a program per expert (H100, 129 experts' one-hot, 32 pairs a step: 4 steps
# ran 24 µs, 32 steps 142 µs). _PLACE_CHUNK: pairs per step of the program-per-expert kernels.
_ROUTE_CELLS = 8192
_ROUTE_MAX_STEPS = 8
_PLACE_CHUNK = 1024
# The routing kernels' int arguments that change with the token count (keyed by Triton's specialization of them).
_ROUTE_VARYING = ("pairs", "blocks")
_SUM_TOKENS, _SUM_COLUMNS = 2, 1024  # tokens and columns a program of moe_sum_pairs_kernel sums (H200 probe's best)


def _one_program(meta: dict) -> tuple[int]:
    return (1,)


def _per_expert_grid(programs: int, meta: dict) -> tuple[int]:
    return (programs,)


@dataclass(frozen=True)
class ExpertsForm:
    """How an experts module stores its weights and what its gate computes.

    Example:
        >>> ExpertsForm("silu")  # Mixtral, Qwen3-MoE, DeepSeek-V3, ...: gate_up [E, 2I, H], gate rows first
        ExpertsForm(act='silu', transposed=False, interleaved=False, alpha=1.0, limit=inf)
        >>> str(ExpertsForm("clamped_swiglu", transposed=True, interleaved=True, alpha=1.702, limit=7.0))
        'clamped_swiglu(alpha=1.702, limit=7), [E, in, out] weights, gate/up interleaved'
    """

    act: str  # the gate activation: a key of fxfuse.kernels.moe_template.ACTIVATIONS
    transposed: bool = False  # weights [E, in, out] (``x @ W``, gpt-oss) instead of [E, out, in] (``F.linear``)
    interleaved: bool = False  # gate and up columns alternate (``[..., ::2]``, ``[..., 1::2]``) instead of halves
    alpha: float = 1.0  # clamped_swiglu: the sigmoid's scale
    limit: float = math.inf  # clamped_swiglu: gate clamped above, up on both sides

    def __str__(self) -> str:
        act = f"{self.act}(alpha={self.alpha:g}, limit={self.limit:g})" if self.act == "clamped_swiglu" else self.act
        layout = ["[E, in, out] weights"] * self.transposed + ["gate/up interleaved"] * self.interleaved
        return ", ".join([act] + layout)


@dataclass(frozen=True)
class PairLayout:
    """The (token, expert) pairs sorted by expert, in blocks of ``block_m`` rows that each belong to one expert:
    each expert's rows padded to whole blocks, pairs in their original order within an expert. The number of blocks
    is the bound :func:`layout_blocks` (no host sync to learn the real count); blocks past the last expert's are
    marked :data:`UNUSED_BLOCK`. An index outside ``[0, num_experts)`` (transformers' marker
    of an expert held elsewhere) goes to blocks marked :data:`ELSEWHERE_BLOCK`, whose rows come out as zeros."""

    rows: torch.Tensor  # int32 [blocks * block_m]: the pair (token * top_k + slot) of each row, -1 for padding
    block_expert: torch.Tensor  # int32 [blocks]: each block's expert, UNUSED_BLOCK or ELSEWHERE_BLOCK
    block_m: int
    # int32 [num_experts + 1]: each expert's first block and the end of the last, as the routing kernels wrote it
    # (None: a layout built otherwise; the backward then derives it from block_expert)
    segments: Optional[torch.Tensor] = None


def layout_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """The blocks a :class:`PairLayout` of ``pairs`` pairs is given: a bound on what the experts' padded segments
    take, known on the host. Each used block holds at least one pair, so there are at most ``pairs`` of them; and
    each of the ``num_experts + 1`` segments (the last: pairs held elsewhere) pads at most one block, so at most
    ``cdiv(pairs, block_m) + num_experts + 1``. At one token the first is the tighter: its grids launch a program
    per used block instead of one per expert (Mixtral: 2 blocks, not 10; gpt-oss: 4, not 34).

    Example:
        >>> layout_blocks(4, 32, 16), layout_blocks(8192, 8, 128)
        (4, 73)
    """
    return min(pairs, cdiv(pairs, block_m) + num_experts + 1)


def route_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> PairLayout:
    """The :class:`PairLayout` of ``top_k_index`` ``[T, top_k]`` from Triton kernels: up to
    ``_ROUTE_MAX_STEPS`` steps over the pairs, one launch of :func:`~fxfuse.kernels.moe_template.
    moe_route_kernel` (one program: a one-hot of every expert per step); above, :func:`~fxfuse.kernels.
    moe_template.moe_count_kernel` then :func:`~fxfuse.kernels.moe_template.moe_place_kernel`, a program per
    expert each over every pair. No host synchronization, and a few µs of host time against the torch ops' ~400
    on an H100's host. The rows of unused blocks (marked :data:`UNUSED_BLOCK`) are left unwritten.
    """
    flat = top_k_index.reshape(-1).contiguous()  # (a [T, 1] slice's view would stride; the kernels read it densely)
    pairs = flat.numel()
    device = flat.device
    e_pad = next_pow2(num_experts + 1)
    chunk = max(16, _ROUTE_CELLS // e_pad)
    blocks = layout_blocks(pairs, num_experts, block_m)
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    segments = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    if cdiv(pairs, chunk) <= _ROUTE_MAX_STEPS:
        launch(moe_route_kernel, _one_program, dict(
            index_ptr=flat, rows_ptr=rows, block_expert_ptr=block_expert, seg_ptr=segments, pairs=pairs,
            num_experts=num_experts, blocks=blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=8),
            _ROUTE_VARYING)
    else:
        counts = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
        per_expert = functools.partial(_per_expert_grid, num_experts + 1)
        launch(moe_count_kernel, per_expert, dict(index_ptr=flat, counts_ptr=counts, pairs=pairs,
                                                  num_experts=num_experts, CHUNK=_PLACE_CHUNK), _ROUTE_VARYING)
        launch(moe_place_kernel, per_expert, dict(
            index_ptr=flat, counts_ptr=counts, rows_ptr=rows, block_expert_ptr=block_expert, seg_ptr=segments,
            pairs=pairs, num_experts=num_experts, blocks=blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=_PLACE_CHUNK),
            _ROUTE_VARYING)
    return PairLayout(rows, block_expert, block_m, segments)


def block_rows(pairs: int, num_experts: int) -> int:
    """Rows per block: about the pairs an expert gets, so few rows are padding (16 in the interpreter).

    Example:
        >>> interpreting() or [block_rows(p, 8) for p in (2, 200, 2000, 20000)] == [16, 32, 128, 128]
        True
    """
    if interpreting():
        return 16
    per_expert = pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 128 else 128


def run_moe(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, form: Union[str, ExpertsForm], *, gate_up_bias: Optional[torch.Tensor] = None,
            down_bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The experts' output ``[T, H]`` for ``hidden`` ``[T, H]`` routed to ``top_k_index`` ``[T, top_k]`` with
    ``top_k_weights``, experts ``gate_up`` ``[E, 2I, H]`` (gate rows first) and ``down`` ``[E, H, I]`` with the
    gate activation ``form`` (a key of :data:`fxfuse.kernels.moe_template.ACTIVATIONS`), or as ``form`` says
    (:class:`ExpertsForm`: ``[E, H, 2I]`` / ``[E, I, H]`` when transposed); biases ``[E, 2I]`` and ``[E, H]``.
    ``out_dtype`` (default: hidden's): the dtype each pair's scaled row is written in and the per-token sum is
    taken in (autocast: the fp32 input's dtype, as transformers sums in it).

    Raises:
        ValueError: shapes, dtypes or the activation do not fit.
    """
    return moe_forward_pass(hidden, top_k_index, top_k_weights, gate_up, down, form, gate_up_bias, down_bias,
                            out_dtype=out_dtype)[0]


@dataclass(frozen=True)
class MoESaved:
    """What a training forward keeps for :func:`fxfuse.kernels.moe_backward_launch.run_moe_backward`."""

    layout: PairLayout
    x: torch.Tensor  # the input [T, H] (last dim contiguous)
    h: Optional[torch.Tensor]  # act(g) * u [padded rows, I] (None once saved for the backward: it recomputes h)
    gu: torch.Tensor  # pre-activation gate and up [padded rows, 2I]: gate columns first
    w1: torch.Tensor  # gate_up as an [E, 2I, H] view (either layout)
    w2: torch.Tensor  # down as an [E, H, I] view
    form: ExpertsForm


def moe_forward_pass(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, form: Union[str, ExpertsForm],
                     gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                     save: bool = False, out_dtype: Optional[torch.dtype] = None
                     ) -> tuple[torch.Tensor, Optional[MoESaved]]:
    """:func:`run_moe`'s output, and with ``save`` (training) what its backward needs."""
    form = ExpertsForm(form) if isinstance(form, str) else form
    if form.act not in ACTIVATIONS:
        raise ValueError(f"fxfuse.moe: activation {form.act!r} is not one of {sorted(ACTIVATIONS)}")
    if hidden.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError("fxfuse.moe: expects hidden [T, H], gate_up [E, 2I, H] and down [E, H, I] (or both "
                         "transposed)")
    T, H = hidden.shape
    # As [E, out, in] views: the kernels read either layout through the strides.
    w1, w2 = (gate_up.transpose(1, 2), down.transpose(1, 2)) if form.transposed else (gate_up, down)
    E, two_i, H_w = w1.shape
    inter = two_i // 2
    if H_w != H or two_i % 2 or w2.shape != (E, H, inter) or top_k_index.shape[0] != T \
            or top_k_weights.shape != top_k_index.shape \
            or (gate_up_bias is not None and gate_up_bias.shape != (E, two_i)) \
            or (down_bias is not None and down_bias.shape != (E, H)):
        raise ValueError(f"fxfuse.moe: shapes do not fit: hidden {tuple(hidden.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}, top_k_index {tuple(top_k_index.shape)}, "
                         f"top_k_weights {tuple(top_k_weights.shape)}"
                         + (f", gate_up_bias {tuple(gate_up_bias.shape)}" if gate_up_bias is not None else "")
                         + (f", down_bias {tuple(down_bias.shape)}" if down_bias is not None else "")
                         + (" (transposed: [E, in, out])" if form.transposed else ""))
    if not (hidden.dtype == gate_up.dtype == down.dtype):
        raise ValueError("fxfuse.moe: hidden, gate_up and down must share a dtype")
    out_dtype = out_dtype or hidden.dtype
    if T == 0:
        return hidden.new_zeros(hidden.shape, dtype=out_dtype), None
    top_k = top_k_index.shape[1]
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w1, w2 = _strided(w1), _strided(w2)
    b1, b2 = _bias(gate_up_bias), _bias(down_bias)
    bm = block_rows(T * top_k, E)
    layout = route_pairs(top_k_index, E, bm)
    blocks = layout.block_expert.numel()
    precision = _input_precision(hidden.dtype)
    # h's padding rows: the pointer gate/up kernel leaves them unwritten and the TMA down kernel multiplies them (each
    # output row its own input row's, masked at the store). Zeros in the interpreter only: numpy warns on leftover
    # inf/NaN ("invalid value encountered in matmul"); a GPU's MMA does not, and a memset per call would cost there.
    h = (torch.zeros if interpreting() else torch.empty)(layout.rows.numel(), inter, dtype=hidden.dtype,
                                                         device=hidden.device)
    gu = torch.empty(layout.rows.numel(), 2 * inter, dtype=hidden.dtype, device=hidden.device) if save else h
    # (interleaved: BLOCK_N adjacent columns of gate_up per program, half of them gate)
    columns = 2 * inter if form.interleaved else inter
    args = dict(
        x_ptr=x, w_ptr=w1, b_ptr=b1 if b1 is not None else w1, h_ptr=h, gu_ptr=gu, rows_ptr=layout.rows,
        block_expert_ptr=layout.block_expert, K=H, N=inter, TOP_K=top_k, stride_xm=x.stride(0),
        stride_we=w1.stride(0), stride_wn=w1.stride(1), stride_wk=w1.stride(2),
        stride_be=b1.stride(0) if b1 is not None else 0, stride_hm=h.stride(0), alpha=form.alpha,
        limit=_finite(form.limit), ACT=ACTIVATIONS[form.act], INTERLEAVED=form.interleaved, HAS_BIAS=b1 is not None,
        STORE_GU=save, INPUT_PRECISION=precision, BLOCK_M=bm)

    def pointer():  # (the lean launcher: after a signature's first launch, ~3x less host time than ``kernel[grid]``)
        launch(moe_gate_up_kernel, lambda meta: (blocks, cdiv(columns, meta["BLOCK_N"])), args, ())

    if not gate_up_by_tma(x, w1, bm):
        pointer()
    else:
        key = (E, two_i, H, form, bm, save, hidden.dtype, next_pow2(T * top_k))
        # (the kept choice first: the runners are built and timed only at a key's first call)
        choice = GATE_UP_FORM["force"] or GATE_UP_CHOICES.get(key) or _gate_up_choice(key, {
            "pointer": pointer, "TMA": lambda: _launch_gate_up_tma(x, w1, h, gu if save else None, layout, args)},
            hidden.device)
        if choice == "TMA":
            _launch_gate_up_tma(x, w1, h, gu if save else None, layout, args)
        else:
            pointer()
    pairs_out = torch.empty(T * top_k, H, dtype=out_dtype, device=hidden.device)  # every row written
    launch_down(h, w2, b2, pairs_out, layout, top_k_weights.reshape(-1).contiguous(), precision)
    saved = MoESaved(layout, x, h, gu, w1, w2, form) if save else None
    return sum_pairs(pairs_out, T, top_k), saved


def sum_pairs(pairs_out: torch.Tensor, T: int, top_k: int) -> torch.Tensor:
    """``[T, H]``: each token's ``top_k`` consecutive rows of ``pairs_out`` (contiguous ``[T * top_k, H]``), summed
    in fp32 and rounded once (eager adds them one expert at a time in the hidden dtype) by
    :func:`~fxfuse.kernels.moe_combine_template.moe_sum_pairs_kernel`, one streaming pass. H200, 4096 tokens
    (``probe_moe_sum_pairs.py``): gpt-oss's top-4 38 µs against torch's ``sum(1)`` 55, Qwen3-MoE's top-8 46 against
    57, Mixtral's two rows 32 against an elementwise add's 51 (the library's until session 39)."""
    H = pairs_out.shape[1]
    if top_k == 1:
        return pairs_out
    out = torch.empty(T, H, dtype=pairs_out.dtype, device=pairs_out.device)
    launch(moe_sum_pairs_kernel, lambda meta: (cdiv(T, meta["BLOCK_T"]), cdiv(H, meta["BLOCK_H"])), dict(
        pairs_ptr=pairs_out, out_ptr=out, T=T, H=H, TOP_K=top_k, BLOCK_T=_SUM_TOKENS, BLOCK_H=_SUM_COLUMNS,
        num_warps=4), ("T",))
    return out


def launch_down(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                layout: PairLayout, routing: torch.Tensor, precision: str, by_row: bool = False) -> None:
    """``out[p] = routing[p] * (a[row of p] @ w[e]^T + bias[e])`` for every pair p of ``layout``: the down kernel
    (forward: ``a`` = h) and dx (``a`` = the gate/up gradient, ``w`` = gate_up's transpose). ``a`` ``[padded rows,
    K]`` (last dim contiguous), ``w`` an ``[E, N, K]`` view (either dim of its last two contiguous), ``out``
    ``[pairs, N]``. By TMA (:mod:`fxfuse.kernels.moe_tma_template`) where :func:`down_by_tma` says, else by pointer
    (:func:`~fxfuse.kernels.moe_template.moe_down_kernel`). ``by_row`` (TMA only; the backward's G): ``out[r] = a[r]
    @ w[e]^T`` at each pair's layout row r instead, ``out`` ``[padded rows, N]``, no bias or routing weight."""
    E, N, K = w.shape
    blocks, bm = layout.block_expert.numel(), layout.block_m
    bias_args = dict(b_ptr=bias if bias is not None else w, stride_be=bias.stride(0) if bias is not None else 0,
                     HAS_BIAS=bias is not None)
    if down_by_tma(a, w, bm):
        TensorDescriptor = _tensor_descriptor()
        w_kn = w.stride(2) != 1  # stored [E, K, N] (gpt-oss's down, gate_up read for dx)
        memory = w.transpose(1, 2) if w_kn else w
        # (block shapes: placeholders that the config's pre-hook sets)
        launch_with_descriptors(moe_down_tma_kernel, lambda meta: (blocks * cdiv(N, meta["BLOCK_N"]),), dict(
            h_desc=TensorDescriptor(a, list(a.shape), list(a.stride()), [16, 16]),
            w_desc=TensorDescriptor(memory, list(memory.shape), list(memory.stride()), [1, 16, 16]),
            out_ptr=out, rows_ptr=layout.rows, block_expert_ptr=layout.block_expert, routing_ptr=routing, K=K, N=N,
            blocks=blocks, stride_om=out.stride(0), W_KN=w_kn, BY_ROW=by_row, DTYPE=str(a.dtype).removeprefix("torch."),
            INPUT_PRECISION=precision, BLOCK_M=bm, **bias_args), ("blocks",))
        return
    if by_row:
        raise ValueError("fxfuse.moe: launch_down(by_row=True) takes the TMA kernel only (down_by_tma)")
    launch(moe_down_kernel, lambda meta: (blocks, cdiv(N, meta["BLOCK_N"])), dict(
        h_ptr=a, w_ptr=w, out_ptr=out, rows_ptr=layout.rows, block_expert_ptr=layout.block_expert,
        routing_ptr=routing, K=K, N=N, stride_hm=a.stride(0), stride_we=w.stride(0), stride_wn=w.stride(1),
        stride_wk=w.stride(2), stride_om=out.stride(0), INPUT_PRECISION=precision, BLOCK_M=bm, **bias_args), ())


# The gate/up GEMM's measured form: (E, 2I, H, form, rows per block, training, dtype, pair bucket) -> "TMA" or
# "pointer", and the µs of each where timed (for fxfuse.report: gate_up_timings).
GATE_UP_CHOICES: dict[tuple, str] = {}
_GATE_UP_TIMES: dict[tuple, dict[str, float]] = {}
# "force": None (the measured choice) or "TMA" / "pointer" wherever TMA applies (probes and tests compare the two)
GATE_UP_FORM: dict = {"force": None}


def _gate_up_choice(key: tuple, runners: dict, device: torch.device) -> str:
    """Which of ``runners`` computes the gate/up GEMM for ``key``: the pointer kernel alone where TMA does not
    apply; else the faster of the two at the key's first call, TMA by a margin (:func:`~fxfuse.kernels.measured.
    faster`; H200, 4096 tokens: Mixtral's forward 5262 -> 4844 µs by TMA; Qwen3-MoE's and gpt-oss's within a few
    percent either way, the gather of x's rows costing what the TMA kernel gains: ``benchmarks/probes/
    probe_moe_gate_up_tma.py``), logged at INFO and kept; the pointer kernel where it cannot be timed
    (``FXFUSE_AUTOTUNE=0``, a CUDA graph capture, the interpreter)."""
    if len(runners) == 1:
        return "pointer"
    choice = GATE_UP_FORM["force"] or GATE_UP_CHOICES.get(key)
    if choice is None and may_time(device):
        times = stored_times("moe gate/up", key, ("TMA", "pointer"), device)  # (an earlier process's, this GPU)
        cached = times is not None
        if not cached:
            for run in runners.values():
                run()  # (first calls compile and tune)
            times = time_runners(runners)
            store_times("moe gate/up", key, times, device)
        _GATE_UP_TIMES[key] = times
        choice = GATE_UP_CHOICES[key] = faster(times, "pointer", "TMA")
        logger.info("fxfuse.moe: experts' gate/up (%d experts of %d x %d, %s, %s), up to %d pairs: TMA %.1f us "
                    "(x's rows gathered), pointer %.1f us%s: runs %s", key[0], key[1], key[2], key[3],
                    "training" if key[5] else "inference", key[-1], times["TMA"], times["pointer"],
                    " (from the tuning cache)" if cached else "", choice)
    return choice or "pointer"


def gate_up_timings(gate_up_shape: tuple[int, ...]) -> list[str]:
    """The gate/up GEMM's timed choices so far in this process for experts whose ``gate_up_proj`` has
    ``gate_up_shape`` (either layout), as :func:`fxfuse.report` lists them: ``gate/up up to 8192 pairs
    (training): TMA (3402 / 3523 µs TMA / pointer)``."""
    num, a, b = gate_up_shape
    found = sorted((key for key in _GATE_UP_TIMES if key[0] == num and {key[1], key[2]} == {a, b}),
                   key=lambda k: (k[-1], k[5]))
    return [f"gate/up up to {key[-1]} pairs ({'training' if key[5] else 'inference'}): {GATE_UP_CHOICES[key]} "
            f"({_GATE_UP_TIMES[key]['TMA']:.0f} / {_GATE_UP_TIMES[key]['pointer']:.0f} µs TMA / pointer)"
            for key in found]


# The pointer gate/up kernel's arguments the TMA kernel takes as they are.
_GATE_UP_SHARED = ("b_ptr", "stride_be", "alpha", "limit", "ACT", "INTERLEAVED", "HAS_BIAS", "STORE_GU",
                   "INPUT_PRECISION", "BLOCK_M")


def _launch_gate_up_tma(x: torch.Tensor, w1: torch.Tensor, h: torch.Tensor, gu: Optional[torch.Tensor],
                        layout: PairLayout, args: dict) -> None:
    """The gate/up GEMM by TMA (:mod:`fxfuse.kernels.moe_tma_template`): x's rows gathered into the layout's order,
    then the persistent kernel writing ``h`` (and ``gu``, the pre-activations, in training). ``args``: the pointer
    kernel's launch arguments (its activation, bias and flags are the TMA kernel's too)."""
    E, two_i, H = w1.shape
    inter = two_i // 2
    blocks = layout.block_expert.numel()
    rows = gather_rows(x, layout, args["TOP_K"])
    TensorDescriptor = _tensor_descriptor()
    w_kn = w1.stride(2) != 1  # stored [E, H, 2I] (gpt-oss)
    memory = w1.transpose(1, 2) if w_kn else w1  # last dim contiguous
    if args["INTERLEAVED"]:
        w_shape, w_strides = list(memory.shape), list(memory.stride())
    elif w_kn:  # [E, H, 2I] as [E, H, 2, I]
        w_shape, w_strides = [E, H, 2, inter], [memory.stride(0), memory.stride(1), inter, 1]
    else:  # [E, 2I, H] as [E, 2, I, H]
        w_shape, w_strides = [E, 2, inter, H], [memory.stride(0), inter * memory.stride(1), memory.stride(1), 1]
    # (block shapes: placeholders that the config's pre-hook sets)
    h_desc = TensorDescriptor(h, list(h.shape), list(h.stride()), [16, 16])
    sms = _INTERPRETER_SMS if x.device.type == "cpu" else _cuda_props(_device_index(x.device))[1]
    launch_with_descriptors(moe_gate_up_tma_kernel, lambda meta: (
        min(meta["PER_SM"] * sms, blocks * cdiv(inter, meta["BLOCK_N"])),), dict(
        x_desc=TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [16, 16]),
        w_desc=TensorDescriptor(memory, w_shape, w_strides, [1] * (len(w_shape) - 2) + [16, 16]), h_desc=h_desc,
        gu_ptr=gu if gu is not None else h, block_expert_ptr=layout.block_expert, K=H, N=inter, blocks=blocks,
        W_KN=w_kn, DTYPE=str(x.dtype).removeprefix("torch."), **{k: args[k] for k in _GATE_UP_SHARED}), ("blocks",))


def gather_rows(src: torch.Tensor, layout: PairLayout, top_k: int) -> torch.Tensor:
    """``[padded rows, H]``: each row of the layout's experts' blocks holds its pair's token's row of ``src`` ``[T,
    H]`` (last dim contiguous), zeros at padding rows; blocks of no expert here are left unwritten (no kernel reads
    them). One launch of :func:`~fxfuse.kernels.moe_tma_template.moe_gather_rows_kernel`: the TMA GEMMs' A operand
    and grouped_mm's weight-gradient operand."""
    H = src.shape[1]
    blocks, bm = layout.block_expert.numel(), layout.block_m
    out = torch.empty(layout.rows.numel(), H, dtype=src.dtype, device=src.device)
    launch(moe_gather_rows_kernel, lambda meta: (blocks, cdiv(H, _GATHER_COLUMNS)), dict(
        x_ptr=src, out_ptr=out, rows_ptr=layout.rows, block_expert_ptr=layout.block_expert, K=H, TOP_K=top_k,
        stride_xm=src.stride(0), stride_om=out.stride(0), BLOCK_M=bm, BLOCK_K=_GATHER_COLUMNS, num_warps=4), ())
    return out


def gathered_by_tma(src: torch.Tensor, w: torch.Tensor, block_m: int) -> bool:
    """Whether :func:`launch_down` takes the TMA kernel for ``src``'s rows gathered into the layout
    (:func:`gather_rows`: contiguous, so only the row's size counts, not ``src``'s strides) and the weights ``w``:
    the backward's G."""
    return src.shape[1] * src.element_size() % _TMA_ALIGN == 0 and _weights_by_tma(w, src.dtype, block_m)


def gate_up_by_tma(x: torch.Tensor, w1: torch.Tensor, block_m: int) -> bool:
    """Whether the gate/up GEMM takes the TMA kernel (:func:`_launch_gate_up_tma`): the weights as
    :func:`down_by_tma` asks of its own (``w1`` the ``[E, 2I, H]`` view), and rows of H and of I 16-byte multiples
    (x's rows are gathered into a contiguous copy; the halves' split is a stride of the weights' TMA view)."""
    return w1.shape[1] // 2 * x.element_size() % _TMA_ALIGN == 0 and gathered_by_tma(x, w1, block_m)


def down_by_tma(a: torch.Tensor, w: torch.Tensor, block_m: int) -> bool:
    """Whether :func:`launch_down` takes the TMA kernel: a Hopper GPU (or the interpreter, which emulates TMA),
    ``a`` and ``w`` of one dtype, TMA-describable (last dim contiguous, 16-byte aligned base and strides), and on
    a GPU 16-bit operands at 64 or more rows per block (where it was measured faster; decode-size blocks keep the
    pointer kernel's tuned tiles, fp32 its exact-precision ones)."""
    return _describable(a) and _weights_by_tma(w, a.dtype, block_m)


def _weights_by_tma(w: torch.Tensor, dtype: torch.dtype, block_m: int) -> bool:
    """:func:`down_by_tma`'s rule for the weights ``w`` ``[E, N, K]`` against operands of ``dtype``."""
    if not tma_supported(w.device) or w.dtype != dtype or not (w.stride(2) == 1 or w.stride(1) == 1):
        return False
    elem = w.element_size()
    if not interpreting() and (elem != 2 or block_m < 64):
        return False
    # the weight's strides but the contiguous one, by position (a size-1 dim may have stride 1)
    strides = (w.stride(0), w.stride(2) if w.stride(2) != 1 else w.stride(1))
    return w.data_ptr() % _TMA_ALIGN == 0 and all(s * elem % _TMA_ALIGN == 0 for s in strides)


def _finite(limit: float) -> float:
    """The clamp's limit as a kernel argument (an unclamped form's inf as fp32's largest)."""
    return limit if math.isfinite(limit) else 3.0e38


def _strided(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[E, out, in]`` as is when one of its last two dims is contiguous (either layout), else a copy."""
    return w if w.stride(2) == 1 or w.stride(1) == 1 else w.contiguous()


def _bias(b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return b if b is None or b.stride(-1) == 1 else b.contiguous()
