"""Launcher of the mixture-of-experts backward kernels (:mod:`fxfuse.kernels.moe_backward_template`), and the
autograd function that trains through :func:`fxfuse.kernels.moe_launch.moe_forward_pass`.

The two weight gradients run on :func:`~fxfuse.kernels.moe_backward_template.moe_weight_grad_kernel` or on
``torch._grouped_mm``, whichever :mod:`fxfuse.kernels.moe_weight_grads` measured faster for the shapes.

Example:
    >>> form = ExpertsForm("silu")
    >>> out = MoEExpertsFunction.apply(x, index, weights, gate_up, down, None, None, form)  # doctest: +SKIP
    >>> out.sum().backward()  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from . import moe_launch
from .fastlaunch import launch
from .launch import _input_precision
from .moe_backward_template import (
    moe_bias_routing_grad_kernel,
    moe_down_backward_kernel,
    moe_gate_backward_kernel,
    moe_weight_grad_kernel,
)
from .moe_bias_launch import ROUTED_MAX_EXPERTS, down_bias_grad, expert_block_sums
from .moe_launch import (
    ExpertsForm,
    MoESaved,
    PairLayout,
    _finite,
    _strided,
    gather_rows,
    launch_down,
    moe_forward_pass,
)
from .moe_template import ACTIVATIONS
from .moe_weight_grads import grouped_down_grad, grouped_gate_up_grad, grouped_mm_takes, weight_grads_by
from .template import cdiv

__all__ = ["MoEExpertsFunction", "MoEGradients", "run_moe_backward"]

MoEGradients = tuple[Optional[torch.Tensor], ...]  # dx, d routing weights, d gate_up, d down, d biases
_GATE_ELEMENTS = 8192  # elements of a block's rows each gate-backward program takes (64 columns at 128 rows)
_GATE_ELEMENTS_SUMS = 4096  # the same when it also sums dgu's columns for the gate/up bias
_BIAS_PAIRS = 32  # pairs a program of the down bias's routing gradient takes


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
    routing = top_k_weights.reshape(-1).contiguous()  # (a [T, 1] slice's view would stride)
    # 1. G = dout[t] @ down[e] (summed in fp32, stored in the activations' dtype); then dgate, dup through the gate,
    # r * h with h recomputed (for d down) and the routing gradient's column-tile parts.
    grad_h = torch.empty(layout.rows.numel(), inter, dtype=dtype, device=device)
    dout_rows = None
    if moe_launch.gathered_by_tma(dout, w2.transpose(1, 2), bm):  # (by its module's name: tests force it)
        # dout's rows gathered into the layout once: G by the TMA down kernel, and grouped_mm's d down takes the
        # same rows
        dout_rows = gather_rows(dout, layout, top_k)
        launch_down(dout_rows, w2.transpose(1, 2), None, grad_h, layout, routing, precision, by_row=True)
    else:
        # (every launch by name through the lean launcher: after a signature's first, no Triton Python path)
        launch(moe_down_backward_kernel, lambda meta: (blocks, cdiv(inter, meta["BLOCK_N"])), dict(
            dout_ptr=dout, w_ptr=w2, grad_h_ptr=grad_h, rows_ptr=layout.rows, block_expert_ptr=layout.block_expert,
            K=H, N=inter, TOP_K=top_k, stride_dm=dout.stride(0), stride_we=w2.stride(0), stride_wn=w2.stride(1),
            stride_wk=w2.stride(2), INPUT_PRECISION=precision, BLOCK_M=bm), ())
    dgu = torch.empty(layout.rows.numel(), two_i, dtype=dtype, device=device)
    h = torch.empty(layout.rows.numel(), inter, dtype=dtype, device=device) if needs[3] else None
    # (with the bias's column sums: narrower tiles of 4 warps, whose sums over rows cost less; gpt-oss-20b at 4096
    # tokens on an H200, probe_moe_gate_backward.py: 273 µs without the sums, 334 with them at 64 columns and 8
    # warps, 311 at 32 and 4, against 140 for a separate pass over dgu)
    gate_n = (_GATE_ELEMENTS_SUMS if needs[4] else _GATE_ELEMENTS) // bm
    bias_part = needs[1] and down_bias is not None
    # (one row per gate column tile, and with a down bias one for dout[t] . down_bias[e])
    dr_parts = torch.zeros(cdiv(inter, gate_n) + bias_part, pairs, dtype=torch.float32, device=device)
    # the gate/up bias's gradient: each block's column sums of dgu, written by the gate kernel (dgu not read again)
    db1_parts = torch.empty(blocks, two_i, dtype=torch.float32, device=device) if needs[4] else None
    gate_grid = (blocks, cdiv(inter, gate_n))
    launch(moe_gate_backward_kernel, lambda meta: gate_grid, dict(
        grad_h_ptr=grad_h, gu_ptr=saved.gu, h_ptr=h if h is not None else dgu, routing_ptr=routing, dgu_ptr=dgu,
        dr_ptr=dr_parts, db_ptr=db1_parts if db1_parts is not None else dr_parts, rows_ptr=layout.rows,
        block_expert_ptr=layout.block_expert, N=inter, pairs=pairs, alpha=form.alpha, limit=_finite(form.limit),
        ACT=ACTIVATIONS[form.act], INTERLEAVED=form.interleaved, STORE_H=h is not None, SUM_DGU=needs[4],
        BLOCK_M=bm, BLOCK_N=gate_n, num_warps=8 if bm >= 128 and not needs[4] else 4), ("pairs",))
    del grad_h
    segments = None
    if any(needs[2:]):  # (the routing kernels wrote them; a layout built otherwise: from block_expert)
        segments = layout.segments if layout.segments is not None else _segments(layout, E)
    dx = dr = d_w1 = d_w2 = d_b1 = d_b2 = None
    if needs[0]:  # 2. dx: dgu @ gate_up[e] per pair (the forward's down kernel, weights read transposed), per token
        dx_pairs = torch.empty(pairs, H, dtype=dtype, device=device)
        ones = torch.ones(pairs, dtype=torch.float32, device=device)
        launch_down(dgu, w1.transpose(1, 2), None, dx_pairs, layout, ones, precision)
        dx = moe_launch.sum_pairs(dx_pairs, T, top_k)
    if needs[1]:
        if bias_part:  # the bias is inside the routing scale: dr += dout[t] . down_bias[e]
            bias = down_bias if down_bias.stride(1) == 1 else down_bias.contiguous()
            launch(moe_bias_routing_grad_kernel, lambda meta: (cdiv(pairs, _BIAS_PAIRS),), dict(
                dout_ptr=dout, index_ptr=top_k_index.reshape(-1).contiguous(), bias_ptr=bias, dr_ptr=dr_parts[-1],
                pairs=pairs, K=H, TOP_K=top_k, num_experts=E, stride_dm=dout.stride(0), stride_be=bias.stride(0),
                BLOCK_P=_BIAS_PAIRS, BLOCK_K=64, num_warps=4), ("pairs",))
        dr = dr_parts.sum(0).view(T, top_k).to(top_k_weights.dtype)

    def expert_sums(out: torch.Tensor, a: torch.Tensor, a_by_token: bool, b: torch.Tensor, b_by_token: bool,
                    scale_a: bool = False):
        """``out[e] = sum over e's rows of A[row]^T B[row]`` (``scale_a``: A's rows times their routing weights),
        ``out`` an ``[E, N, K]`` view (K may be 1: a bias's sum against ones)."""
        n, k = out.shape[1], out.shape[2]
        launch(moe_weight_grad_kernel, lambda meta: (
            E * cdiv(n, meta["BLOCK_N"]) * cdiv(cdiv(k, meta["BLOCK_K"]), meta["K_TILES"]),), dict(
            a_ptr=a, b_ptr=b, routing_ptr=routing, out_ptr=out, rows_ptr=layout.rows, seg_ptr=segments, N=n, K=k,
            TOP_K=top_k, stride_am=a.stride(0), stride_bm=b.stride(0), stride_oe=out.stride(0),
            stride_on=out.stride(1), stride_ok=out.stride(2), A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token,
            SCALE_A=scale_a, INPUT_PRECISION=precision, BLOCK_M=bm), ())

    routed_bias = needs[5] and E <= ROUTED_MAX_EXPERTS
    ones = torch.ones(layout.rows.numel(), 1, dtype=dtype, device=device) if needs[5] and not routed_bias else None
    grouped = grouped_mm_takes(dtype, device)

    def weight_grad(which: str, weight: torch.Tensor, a, a_by_token: bool, b, b_by_token: bool, grouped_run):
        """One weight's gradient in the parameter's layout: the Triton kernel's expert sums, or grouped_mm's
        (``grouped_run``), whichever measured faster for this weight's shape and pair bucket."""
        def triton_run():
            out = torch.empty_like(weight.transpose(1, 2) if form.transposed else weight)
            expert_sums(out.transpose(1, 2) if form.transposed else out, a, a_by_token, b, b_by_token)
            return out

        if not grouped:
            return triton_run()
        _, rows, cols = weight.shape  # ([E, out, in] views)
        return weight_grads_by(f"d {which} ({E} experts of {rows} x {cols})",
                               (which, E, two_i, H, form.transposed, bm, dtype), pairs, grouped_run, triton_run)

    # 3. d gate_up[e] = sum over e's rows of dgu^T x[t], and its bias's sums; first, so that dgu is freed before
    # the down weights' gradient is allocated (the step's peak: Mixtral's at 4096 tokens ~0.5 GB lower)
    if needs[2]:
        d_w1 = weight_grad("gate_up", w1, dgu, False, saved.x, True, functools.partial(
            grouped_gate_up_grad, layout, segments, top_k, saved.x, dgu, form.transposed))
    if needs[4]:  # each expert's sum of its rows of dgu: of its blocks' column sums
        d_b1 = expert_block_sums(torch.empty(E, two_i, dtype=dtype, device=device), db1_parts, segments)
    del dgu, db1_parts
    # 4. d down[e] = sum over e's rows of dout[t]^T (r * h), and its bias's: of r * dout[t]
    if needs[3]:
        d_w2 = weight_grad("down", w2, dout, True, h, False, functools.partial(
            grouped_down_grad, layout, segments, top_k, dout, h, form.transposed, dout_rows))
    del h, dout_rows
    if needs[5]:  # each expert's sum of its pairs' r * dout[t]: dout read once, by token
        if routed_bias:
            d_b2 = down_bias_grad(dout, top_k_index, routing, E, precision)
        else:  # (more experts than the routed GEMM's operand holds: by the expert's rows, a pair a row)
            d_b2 = torch.empty(E, H, dtype=dtype, device=device)
            expert_sums(d_b2.unsqueeze(2), dout, True, ones, False, scale_a=True)
    return dx, dr, d_w1, d_w2, d_b1, d_b2


def reference_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
                      down_bias: Optional[torch.Tensor], form: ExpertsForm) -> torch.Tensor:
    """The experts layer in torch ops, expert by expert as transformers' forward computes it (differentiable)."""
    w1, w2 = (gate_up.transpose(1, 2), down.transpose(1, 2)) if form.transposed else (gate_up, down)
    out = torch.zeros_like(hidden)
    for e in range(w1.shape[0]):
        token, pos = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        gu = F.linear(hidden[token], w1[e], None if gate_up_bias is None else gate_up_bias[e])
        g, u = (gu[..., ::2], gu[..., 1::2]) if form.interleaved else gu.chunk(2, dim=-1)
        if form.act == "clamped_swiglu":
            g, u = g.clamp(max=form.limit), u.clamp(-form.limit, form.limit)
            h = (u + 1) * g * torch.sigmoid(g * form.alpha)
        else:
            h = _GATE_ACTS[form.act](g) * u
        y = F.linear(h, w2[e], None if down_bias is None else down_bias[e])
        out = out.index_add(0, token, (y * top_k_weights[token, pos, None]).to(out.dtype))
    return out


_GATE_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def _recorded_backward(form: ExpertsForm, dout: torch.Tensor, hidden, top_k_index, top_k_weights, gate_up, down,
                       gate_up_bias, down_bias, needs: tuple) -> tuple:
    """:class:`MoEExpertsFunction`'s gradients as a graph autograd can differentiate again (a double backward: the
    kernels' gradients would drop every second-order term), from :func:`reference_experts` on the saved inputs."""
    inputs = (hidden, None, top_k_weights, gate_up, down, gate_up_bias, down_bias)
    wanted = [i for i, t in enumerate(inputs) if t is not None and needs[i]]
    out = reference_experts(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, form)
    grads = torch.autograd.grad(out, [inputs[i] for i in wanted], dout.to(out.dtype), create_graph=True,
                                allow_unused=True)
    result: list = [None] * 9
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)


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
        # (not h: the backward recomputes it from gu, so a step keeps a third less of the layer's activations;
        # hidden and gate_up_bias: for a backward that records gradients, see below)
        ctx.save_for_backward(saved.x, saved.gu, saved.layout.rows, saved.layout.block_expert,
                              saved.layout.segments, top_k_index, top_k_weights, gate_up, down, down_bias, hidden,
                              gate_up_bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3], ctx.needs_input_grad[4],
                 ctx.needs_input_grad[5], ctx.needs_input_grad[6])
        if ctx.empty:
            return (None,) * 9
        (x, gu, rows, block_expert, segments, top_k_index, top_k_weights, gate_up, down, down_bias, hidden,
         gate_up_bias) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True (a gradient penalty): gradients that are differentiable
            return _recorded_backward(ctx.meta[1], dout, hidden, top_k_index, top_k_weights, gate_up, down,
                                      gate_up_bias, down_bias, ctx.needs_input_grad)
        block_m, form, _, _ = ctx.meta
        w1, w2 = (gate_up.transpose(1, 2), down.transpose(1, 2)) if form.transposed else (gate_up, down)
        w1, w2 = _strided(w1), _strided(w2)  # (as the forward read them)
        saved = MoESaved(PairLayout(rows, block_expert, block_m, segments), x, None, gu, w1, w2, form)
        dx, dr, d_w1, d_w2, d_b1, d_b2 = run_moe_backward(saved, dout, top_k_index, top_k_weights, down_bias, needs)
        return dx, None, dr, d_w1, d_w2, d_b1, d_b2, None, None
