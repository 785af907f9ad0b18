"""Launcher of the mixture-of-experts backward kernels (:mod:`fxfuse.kernels.moe_backward_template`), and the
autograd function that trains through :func:`fxfuse.kernels.moe_launch.moe_forward_pass`.

Example:
    >>> form = ExpertsForm("silu")
    >>> out = MoEExpertsFunction.apply(x, index, weights, gate_up, down, None, None, form)  # doctest: +SKIP
    >>> out.sum().backward()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from .launch import _input_precision
from .moe_backward_template import moe_down_backward_kernel, moe_weight_grad_kernel
from .moe_launch import ExpertsForm, MoESaved, PairLayout, _finite, _strided, moe_forward_pass
from .moe_template import ACTIVATIONS, moe_configs, moe_down_kernel

__all__ = ["MoEExpertsFunction", "MoEGradients", "run_moe_backward"]

MoEGradients = tuple[Optional[torch.Tensor], ...]  # dx, d routing weights, d gate_up, d down, d biases


def _segments(layout: PairLayout, num_experts: int) -> torch.Tensor:
    """int32 ``[E + 1]``: each expert's first block in the layout, and the end of the last (no host sync: the
    blocks of experts ``0..E-1`` come first and in order, then those held elsewhere, then unused ones)."""
    owner = layout.block_expert
    owner = torch.where(owner >= 0, owner, torch.full_like(owner, num_experts))
    bounds = torch.arange(num_experts + 1, device=owner.device, dtype=owner.dtype)
    return torch.searchsorted(owner, bounds).to(torch.int32)


def run_moe_backward(saved: MoESaved, dout: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     down_bias: Optional[torch.Tensor], needs: tuple[bool, ...]) -> MoEGradients:
    """Gradients of :func:`~fxfuse.kernels.moe_launch.moe_forward_pass`'s output for ``dout`` ``[T, H]``:
    ``(dx, d top_k_weights, d gate_up, d down, d gate_up_bias, d down_bias)``, each None unless ``needs`` (the
    same six flags) asks for it. The weight gradients come in the parameters' own layouts."""
    layout, form = saved.layout, saved.form
    w1, w2 = saved.w1, saved.w2  # [E, 2I, H] and [E, H, I] views
    E, two_i, H = w1.shape
    inter = two_i // 2
    T, top_k = top_k_index.shape
    pairs = T * top_k
    bm = layout.block_m
    blocks = layout.block_expert.numel()
    dout = dout if dout.stride(1) == 1 else dout.contiguous()
    dtype, device = saved.x.dtype, dout.device
    precision = _input_precision(dtype)
    routing = top_k_weights.reshape(-1)
    # 1. G = dout[t] @ down[e]; dgate, dup through the gate; the routing gradient's column-tile parts.
    dgu = torch.empty(layout.rows.numel(), two_i, dtype=dtype, device=device)
    tiles = triton.cdiv(inter, min(c.kwargs["BLOCK_N"] for c in moe_configs()))
    dr_parts = torch.zeros(tiles, pairs, dtype=torch.float32, device=device)
    moe_down_backward_kernel[lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        dout, w2, saved.gu, saved.h, routing, dgu, dr_parts, layout.rows, layout.block_expert, H, inter, top_k,
        pairs, dout.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), form.alpha, _finite(form.limit),
        ACT=ACTIVATIONS[form.act], INTERLEAVED=form.interleaved, INPUT_PRECISION=precision, BLOCK_M=bm)
    expert = top_k_index.reshape(-1)
    local = (expert >= 0) & (expert < E)
    safe_expert = torch.where(local, expert, torch.zeros_like(expert))
    dx = dr = d_w1 = d_w2 = d_b1 = d_b2 = None
    if needs[0]:  # 2. dx: dgu @ gate_up[e] per pair (the forward's down kernel, weights read transposed), per token
        dx_pairs = torch.empty(pairs, H, dtype=dtype, device=device)
        ones = torch.ones(pairs, dtype=torch.float32, device=device)
        moe_down_kernel[lambda meta: (blocks, triton.cdiv(H, meta["BLOCK_N"]))](
            dgu, w1, w1, dx_pairs, layout.rows, layout.block_expert, ones, two_i, H, dgu.stride(0), w1.stride(0),
            w1.stride(2), w1.stride(1), 0, dx_pairs.stride(0), HAS_BIAS=False, INPUT_PRECISION=precision, BLOCK_M=bm)
        dx = dx_pairs.view(T, top_k, H).sum(1)
    if needs[1]:
        dr = dr_parts.sum(0)
        if down_bias is not None:  # the bias is inside the routing scale: dr += dout[t] . down_bias[e]
            bias_rows = down_bias[safe_expert].float() * local[:, None]
            dr = dr + (dout.repeat_interleave(top_k, 0).float() * bias_rows).sum(-1)
        dr = dr.view(T, top_k).to(top_k_weights.dtype)
    segments = _segments(layout, E) if needs[2] or needs[3] else None
    if needs[3]:  # 3. d down[e] = sum over e's rows of (r * dout[t])^T h
        d_w2 = torch.empty_like(w2.transpose(1, 2) if form.transposed else w2)
        view = d_w2.transpose(1, 2) if form.transposed else d_w2
        moe_weight_grad_kernel[lambda meta: (E, triton.cdiv(H, meta["BLOCK_N"]), triton.cdiv(inter, meta["BLOCK_K"]))](
            dout, saved.h, routing, view, layout.rows, segments, H, inter, top_k, dout.stride(0), saved.h.stride(0),
            view.stride(0), view.stride(1), view.stride(2), A_BY_TOKEN=True, B_BY_TOKEN=False,
            INPUT_PRECISION=precision, BLOCK_M=bm)
    if needs[2]:  # 4. d gate_up[e] = sum over e's rows of dgu^T x[t]
        d_w1 = torch.empty_like(w1.transpose(1, 2) if form.transposed else w1)
        view = d_w1.transpose(1, 2) if form.transposed else d_w1
        x = saved.x
        moe_weight_grad_kernel[lambda meta: (E, triton.cdiv(two_i, meta["BLOCK_N"]), triton.cdiv(H, meta["BLOCK_K"]))](
            dgu, x, routing, view, layout.rows, segments, two_i, H, top_k, dgu.stride(0), x.stride(0),
            view.stride(0), view.stride(1), view.stride(2), A_BY_TOKEN=False, B_BY_TOKEN=True,
            INPUT_PRECISION=precision, BLOCK_M=bm)
    if needs[4]:  # the gate/up bias: each expert's sum of its rows of dgu
        row_pair = layout.rows.long()
        row_expert = layout.block_expert.repeat_interleave(bm).long()
        kept = (row_pair >= 0) & (row_expert >= 0)
        d_b1 = torch.zeros(E + 1, two_i, dtype=torch.float32, device=device)
        d_b1.index_add_(0, torch.where(kept, row_expert, torch.full_like(row_expert, E)), dgu.float() * kept[:, None])
        d_b1 = d_b1[:E].to(dtype)
    if needs[5]:  # the down bias: each expert's sum of r * dout[t] over its pairs
        d_b2 = torch.zeros(E + 1, H, dtype=torch.float32, device=device)
        scaled = dout.repeat_interleave(top_k, 0).float() * (routing.float() * local)[:, None]
        d_b2.index_add_(0, torch.where(local, expert.long(), torch.full_like(expert.long(), E)), scaled)
        d_b2 = d_b2[:E].to(dtype)
    return dx, dr, d_w1, d_w2, d_b1, d_b2


class MoEExpertsFunction(torch.autograd.Function):
    """The experts layer as one autograd node: the forward kernels (keeping the pre-activations), and
    :func:`run_moe_backward`. Arguments as :func:`~fxfuse.kernels.moe_launch.moe_forward_pass`'s (biases may be
    None, then the form and the output's dtype); gradients for the input, the routing weights, both weights and
    both biases."""

    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, form: ExpertsForm,
                out_dtype=None):
        out, saved = moe_forward_pass(hidden, top_k_index, top_k_weights, gate_up, down, form, gate_up_bias,
                                      down_bias, save=True, out_dtype=out_dtype)
        if saved is None:  # no tokens
            ctx.empty = True
            return out
        ctx.empty = False
        ctx.meta = (saved.layout.block_m, saved.form, gate_up.shape, down.shape)
        ctx.save_for_backward(saved.x, saved.h, saved.gu, saved.layout.rows, saved.layout.block_expert, top_k_index,
                              top_k_weights, gate_up, down, down_bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4],
                 ctx.needs_input_grad[5], ctx.needs_input_grad[6])
        if ctx.empty:
            return (None,) * 9
        x, h, gu, rows, block_expert, top_k_index, top_k_weights, gate_up, down, down_bias = ctx.saved_tensors
        block_m, form, _, _ = ctx.meta
        w1, w2 = (gate_up.transpose(1, 2), down.transpose(1, 2)) if form.transposed else (gate_up, down)
        w1, w2 = _strided(w1), _strided(w2)  # (as the forward read them)
        saved = MoESaved(PairLayout(rows, block_expert, block_m), x, h, gu, w1, w2, form)
        dx, dr, d_w1, d_w2, d_b1, d_b2 = run_moe_backward(saved, dout, top_k_index, top_k_weights, down_bias, needs)
        return dx, None, dr, d_w1, d_w2, d_b1, d_b2, None, None
