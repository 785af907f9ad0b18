"""Launcher of the mixture-of-experts kernels (:mod:`fxfuse.kernels.moe_template`).

:func:`run_moe` computes what transformers' ``MixtralExperts.forward(hidden_states, top_k_index, top_k_weights)``
computes, in three launches and a sum: the pairs sorted by expert (:func:`sort_pairs`, torch ops on the GPU, no
host sync), the gate/up kernel, the down kernel, and the sum of each token's ``top_k`` rows.

Example:
    >>> out = run_moe(x, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, "silu")  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .launch import _input_precision
from .moe_template import ACTIVATIONS, moe_down_kernel, moe_gate_up_kernel
from .template import interpreting

__all__ = ["PairLayout", "block_rows", "run_moe", "sort_pairs"]


@dataclass(frozen=True)
class PairLayout:
    """The (token, expert) pairs sorted by expert, in blocks of ``block_m`` rows that each belong to one expert."""

    rows: torch.Tensor  # int32 [blocks * block_m]: the pair (token * top_k + slot) of each row, -1 for padding
    block_expert: torch.Tensor  # int32 [blocks]: the expert of each block, -1 for an unused block
    block_m: int


def sort_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> PairLayout:
    """Sort the ``[T, top_k]`` expert choices by expert into blocks of ``block_m`` rows, each expert's rows padded
    to whole blocks. The number of blocks is the bound ``cdiv(T * top_k, block_m) + num_experts`` (no host sync
    to learn the real count); blocks past the last expert's are marked unused. An index outside ``[0,
    num_experts)`` (transformers' marker of an expert held elsewhere) is routed nowhere.

    Example:
        >>> layout = sort_pairs(torch.tensor([[1, 0], [1, 2]]), num_experts=3, block_m=2)
        >>> layout.rows.tolist(), layout.block_expert.tolist()
        ([1, -1, 0, 2, 3, -1, -1, -1, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1])
    """
    flat = top_k_index.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    # Experts outside [0, E) go to a dummy expert E, whose blocks are marked unused.
    expert = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    counts = torch.bincount(expert, minlength=num_experts + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    order = torch.sort(expert, stable=True).indices  # pairs, expert by expert
    sorted_expert = expert[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in ``order``
    position = seg_start[sorted_expert] + torch.arange(pairs, device=device) - first_of_expert[sorted_expert]
    blocks = triton.cdiv(pairs, block_m) + num_experts + 1  # bound: every expert (and the dummy) may pad a block
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=device)
    rows[position] = order.to(torch.int32)
    block_start = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(seg_end, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, torch.full_like(block_expert, -1))
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
    layout = sort_pairs(top_k_index, E, bm)
    blocks = layout.block_expert.numel()
    h = torch.empty(layout.rows.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    moe_gate_up_kernel[lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        x, w1, h, layout.rows, layout.block_expert, H, inter, top_k, x.stride(0), w1.stride(0), w1.stride(1),
        h.stride(0), ACT=ACTIVATIONS[act], INPUT_PRECISION=_input_precision(hidden.dtype), BLOCK_M=bm)
    pairs_out = torch.zeros(T * top_k, H, dtype=hidden.dtype, device=hidden.device)
    routing = top_k_weights.reshape(-1)
    moe_down_kernel[lambda meta: (blocks, triton.cdiv(H, meta["BLOCK_N"]))](
        h, w2, pairs_out, layout.rows, layout.block_expert, routing, inter, H, h.stride(0), w2.stride(0),
        w2.stride(1), pairs_out.stride(0), INPUT_PRECISION=_input_precision(hidden.dtype), BLOCK_M=bm)
    # Each token's top_k rows, summed in fp32 (eager adds them one expert at a time in the hidden dtype).
    return pairs_out.view(T, top_k, H).sum(1, dtype=torch.float32).to(hidden.dtype)
