"""Launcher of the mixture-of-experts kernels (:mod:`fxfuse.kernels.moe_template`).

:func:`run_moe` computes what transformers' ``MixtralExperts.forward(hidden_states, top_k_index, top_k_weights)``
computes, in three or four launches and an add: the pairs sorted by expert (:func:`route_pairs`, no host sync),
the gate/up kernel, the down kernel, and the sum of each token's ``top_k`` rows. (``tests/test_moe.py`` builds the
same layout in torch ops, the reference the routing kernels are tested against; those ops cost ~400 µs of host
time per call on an H100's host, and ``torch.bincount`` among them waits for the GPU.)

Example:
    >>> out = run_moe(x, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, "silu")  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .launch import _input_precision
from .moe_template import (
    ACTIVATIONS,
    moe_count_kernel,
    moe_down_kernel,
    moe_gate_up_kernel,
    moe_place_kernel,
    moe_route_kernel,
)
from .template import interpreting

__all__ = ["ELSEWHERE_BLOCK", "UNUSED_BLOCK", "PairLayout", "block_rows", "route_pairs", "run_moe"]


# The marks in ``PairLayout.block_expert`` of blocks that run no expert.
UNUSED_BLOCK = -1  # past the last expert's blocks: the kernels return at once
ELSEWHERE_BLOCK = -2  # pairs routed to an expert outside [0, E): the down kernel writes their rows as zeros
# The one-program routing kernel: one-hot cells per step (registers of its one program), and the most steps it
# takes per pass over the pairs; above, a program per expert (H100, 129 experts' one-hot, 32 pairs a step: 4 steps
# ran 24 µs, 32 steps 142 µs). _PLACE_CHUNK: pairs per step of the program-per-expert kernels.
_ROUTE_CELLS = 8192
_ROUTE_MAX_STEPS = 8
_PLACE_CHUNK = 1024


@dataclass(frozen=True)
class PairLayout:
    """The (token, expert) pairs sorted by expert, in blocks of ``block_m`` rows that each belong to one expert:
    each expert's rows padded to whole blocks, pairs in their original order within an expert. The number of blocks
    is the bound ``cdiv(T * top_k, block_m) + num_experts + 1`` (no host sync to learn the real count); blocks past
    the last expert's are marked :data:`UNUSED_BLOCK`. An index outside ``[0, num_experts)`` (transformers' marker
    of an expert held elsewhere) goes to blocks marked :data:`ELSEWHERE_BLOCK`, whose rows come out as zeros."""

    rows: torch.Tensor  # int32 [blocks * block_m]: the pair (token * top_k + slot) of each row, -1 for padding
    block_expert: torch.Tensor  # int32 [blocks]: each block's expert, UNUSED_BLOCK or ELSEWHERE_BLOCK
    block_m: int


def route_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> PairLayout:
    """The :class:`PairLayout` of ``top_k_index`` ``[T, top_k]`` from Triton kernels: up to
    ``_ROUTE_MAX_STEPS`` steps over the pairs, one launch of :func:`~fxfuse.kernels.moe_template.
    moe_route_kernel` (one program: a one-hot of every expert per step); above, :func:`~fxfuse.kernels.
    moe_template.moe_count_kernel` then :func:`~fxfuse.kernels.moe_template.moe_place_kernel`, a program per
    expert each over every pair. No host synchronization, and a few µs of host time against the torch ops' ~400
    on an H100's host. The rows of unused blocks (marked :data:`UNUSED_BLOCK`) are left unwritten.
    """
    flat = top_k_index.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    e_pad = triton.next_power_of_2(num_experts + 1)
    chunk = max(16, _ROUTE_CELLS // e_pad)
    blocks = triton.cdiv(pairs, block_m) + num_experts + 1
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    if triton.cdiv(pairs, chunk) <= _ROUTE_MAX_STEPS:
        moe_route_kernel[(1,)](flat, rows, block_expert, pairs, num_experts, blocks, BLOCK_M=block_m,
                               E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    else:
        counts = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
        moe_count_kernel[(num_experts + 1,)](flat, counts, pairs, num_experts, CHUNK=_PLACE_CHUNK)
        moe_place_kernel[(num_experts + 1,)](flat, counts, rows, block_expert, pairs, num_experts, blocks,
                                             BLOCK_M=block_m, E_PAD=e_pad, CHUNK=_PLACE_CHUNK)
    return PairLayout(rows, block_expert, block_m)


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
            down: torch.Tensor, act: str) -> torch.Tensor:
    """The experts' output ``[T, H]`` for ``hidden`` ``[T, H]`` routed to ``top_k_index`` ``[T, top_k]`` with
    ``top_k_weights``, experts ``gate_up`` ``[E, 2I, H]`` (gate rows first) and ``down`` ``[E, H, I]``, gate
    activation ``act`` (a key of :data:`fxfuse.kernels.moe_template.ACTIVATIONS`).

    Raises:
        ValueError: shapes, dtypes or the activation do not fit.
    """
    if hidden.dim() == 2 and hidden.shape[0] == 0:
        return hidden.new_zeros(hidden.shape)
    if act not in ACTIVATIONS:
        raise ValueError(f"fxfuse.moe: activation {act!r} is not one of {sorted(ACTIVATIONS)}")
    if hidden.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError("fxfuse.moe: expects hidden [T, H], gate_up [E, 2I, H] and down [E, H, I]")
    T, H = hidden.shape
    E, two_i, H_w = gate_up.shape
    inter = two_i // 2
    if H_w != H or two_i % 2 or down.shape != (E, H, inter) or top_k_index.shape[0] != T \
            or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"fxfuse.moe: shapes do not fit: hidden {tuple(hidden.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}, top_k_index {tuple(top_k_index.shape)}, "
                         f"top_k_weights {tuple(top_k_weights.shape)}")
    if not (hidden.dtype == gate_up.dtype == down.dtype):
        raise ValueError("fxfuse.moe: hidden, gate_up and down must share a dtype")
    top_k = top_k_index.shape[1]
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w1 = gate_up if gate_up.stride(2) == 1 else gate_up.contiguous()
    w2 = down if down.stride(2) == 1 else down.contiguous()
    bm = block_rows(T * top_k, E)
    layout = route_pairs(top_k_index, E, bm)
    blocks = layout.block_expert.numel()
    h = torch.empty(layout.rows.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    moe_gate_up_kernel[lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        x, w1, h, layout.rows, layout.block_expert, H, inter, top_k, x.stride(0), w1.stride(0), w1.stride(1),
        h.stride(0), ACT=ACTIVATIONS[act], INPUT_PRECISION=_input_precision(hidden.dtype), BLOCK_M=bm)
    pairs_out = torch.empty(T * top_k, H, dtype=hidden.dtype, device=hidden.device)  # every row written
    routing = top_k_weights.reshape(-1)
    moe_down_kernel[lambda meta: (blocks, triton.cdiv(H, meta["BLOCK_N"]))](
        h, w2, pairs_out, layout.rows, layout.block_expert, routing, inter, H, h.stride(0), w2.stride(0),
        w2.stride(1), pairs_out.stride(0), INPUT_PRECISION=_input_precision(hidden.dtype), BLOCK_M=bm)
    # Each token's top_k rows, summed in fp32 and rounded once (eager adds them one expert at a time in the hidden
    # dtype). Two rows: one elementwise add (fp32 inside, one rounding: the same bits), ~2.5x faster than a
    # reduction over the middle dimension.
    per_token = pairs_out.view(T, top_k, H)
    if top_k == 2:
        return per_token[:, 0] + per_token[:, 1]
    return per_token.sum(1)  # (torch accumulates 16-bit sums in fp32: one rounding, no fp32 copy)
