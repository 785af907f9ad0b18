"""A trained gated MLP as one autograd node (opt-in, ``FXFUSE_GATED_TRAINING=1``).

A region that is exactly a gated MLP, ``down(act(gate(x)) * up(x))`` (a gated stage without operands, then one
linear with the identity epilogue; biases optional), records gradients as :class:`GatedMLPFunction` instead of
eager's autograd graph of the original ops (eight nodes on a 2-D x: three GEMMs, their weights' transposes, the
activation, the product; six views more on a 3-D x):

* forward: ``g = x @ Wg^T (+bg)`` and ``u = x @ Wu^T (+bu)`` (``F.linear``: cuBLAS, eager's own calls),
  ``h = act(g) * u`` (one kernel, :func:`fxfuse.kernels.gated_launch.run_gated_forward`), ``y = h @ Wd^T (+bd)``;
  it saves x, g, u and the parameters, not ``h``;
* backward: ``h`` again (the forward kernel) for ``dWd = dy^T h``, then freed; ``dh = dy @ Wd``; one kernel
  writes ``dg`` (over ``dh``) and ``du``; then ``dWg = dg^T x``, ``dWu = du^T x``, the biases' column sums, and
  ``dx = dg Wg`` with ``du Wu`` added in place (one ``[M, D]`` add less than eager's). At most four
  ``[M, hidden]`` tensors are alive at once (g, u, dg, du), as many as eager keeps from its forward; the
  forward keeps two (eager: four). Only the gradients autograd asks for (frozen weights, an input that does
  not require grad) are computed.

Each tensor eager rounds to the dtype (g, u, h, dh, dg, du) is rounded once to it here; the activation and the
product are computed on fp32 values. A second-order backward (``create_graph=True``) takes the original ops'
gradients (differentiable) through ``torch.func.vjp``.

Any other trained gated region, or tensors this does not take (see :func:`gated_mlp`), keeps
:class:`fxfuse.gated_training.GatedProduct` for the middle, or the original ops.

Example:
    >>> gated_region("2--:mul(a0,silu(a1));1-:a0")  # (gate, up, down weights; their biases; activation)
    (1, 0, 2, None, None, None, 'silu')
    >>> gated_region("2--:mul(a0,silu(a1));1-:relu(a0)") is None  # the down projection has an epilogue
    True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import epilogue as ep
from .autocast import any_autocast
from .gated_training import gated_form
from .kernels.gated_launch import run_gated_backward, run_gated_forward
from .kernels.launch import SUPPORTED_DTYPES
from .kernels.template import interpreting
from .spec import MLPSpec
from .transforms import transformed

__all__ = ["GatedMLPFunction", "gated_mlp", "gated_region"]

_PLAIN = (Tensor, torch.nn.Parameter)  # a Parameter disables __torch_function__: it is a plain tensor here
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead

# Internal: False leaves every trained gated region to GatedProduct (benchmarks/probes/probe_gated_host.py measures that
# path so).
use_function = True


@functools.lru_cache(maxsize=256)
def gated_region(spec: str) -> Optional[tuple[int, int, int, Optional[int], Optional[int], Optional[int], str]]:
    """For a region that is exactly ``down(act(gate(x)) * up(x))``: the indices of the gate, up and down weights
    in the op's weights, of their biases in its biases (None: no bias), and the activation; else None."""
    stages = MLPSpec.loads(spec).stages
    if len(stages) != 2 or stages[0].num_linears != 2 or stages[0].num_operands \
            or stages[1].num_linears != 1 or not stages[1].is_identity:
        return None
    form = gated_form(stages[0].expr)
    if form is None:
        return None
    gate, up, act = form
    bias_index, b = [], 0
    for flag in (*stages[0].has_bias, *stages[1].has_bias):
        bias_index.append(b if flag else None)
        b += flag
    return gate, up, 2, bias_index[gate], bias_index[up], bias_index[2], act


class GatedMLPFunction(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))``: ``apply(x, Wg, Wu, Wd, bg, bu, bd, act)`` (a bias may be None); x has any
    leading dims. See the module's docstring."""

    @staticmethod
    def forward(ctx, x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, bg: Optional[Tensor], bu: Optional[Tensor],
                bd: Optional[Tensor], act: str) -> Tensor:
        # F.linear is eager's own GEMM call (addmm with a bias, else mm, over x's rows flattened in C++: a copy only
        # where x's strides need one) and returns a fresh contiguous tensor of x's leading dims, not a view (autograd
        # forbids modifying in place a view made in a Function's forward; eager's output may be, ``out += r``).
        g = F.linear(x, wg, bg)
        u = F.linear(x, wu, bu)
        y = F.linear(run_gated_forward(g, u, act), wd, bd)
        ctx.save_for_backward(x, wg, wu, wd, bg, bu, bd, g, u)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        x, wg, wu, wd, bg, bu, bd, g, u = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that are themselves differentiable
            return _differentiable_grads(ctx, dy, (x, wg, wu, wd, bg, bu, bd))
        need_x, need_wg, need_wu, need_wd, need_bg, need_bu, need_bd, _ = ctx.needs_input_grad
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        dx = dwg = dwu = dwd = dbg = dbu = dbd = None
        if need_wd:  # first, so that h is gone before dh, dg and du exist (the backward's peak memory)
            h = run_gated_forward(g, u, ctx.act)
            dwd = torch.mm(dy2.t(), h if h.dim() == 2 else h.view(-1, h.shape[-1]))
            del h
        if need_bd:
            dbd = dy2.sum(0)
        if need_x or need_wg or need_wu or need_bg or need_bu:
            # dg is written over dh (ours, needed no more); both come out [M, hidden] whatever g's leading dims
            dg, du = run_gated_backward(torch.mm(dy2, wd), g, u, ctx.act, overwrite_dh=True)
            if need_x:
                dx = torch.mm(dg, wg)
                dx.addmm_(du, wu)
                if x.dim() != 2:
                    dx = dx.view(x.shape)
            if need_wg or need_wu:
                x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
                if need_wg:
                    dwg = torch.mm(dg.t(), x2)
                if need_wu:
                    dwu = torch.mm(du.t(), x2)
            if need_bg:
                dbg = dg.sum(0)
            if need_bu:
                dbu = du.sum(0)
        return dx, dwg, dwu, dwd, dbg, dbu, dbd, None


# ``Function.apply`` less its Python wrapper (functorch dispatch, dead-wrapper unwrapping over every argument; see
# ``_FusedMLPFunction.apply`` in ops.py): ``gated_mlp`` calls it only outside functorch transforms.
_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, GatedMLPFunction)


def _differentiable_grads(ctx, dy: Tensor, inputs: tuple[Optional[Tensor], ...]) -> tuple[Optional[Tensor], ...]:
    """The original ops' gradients by ``torch.func.vjp``, differentiable (a backward with ``create_graph=True``)."""
    wanted = [i for i in range(7) if ctx.needs_input_grad[i]]
    act = ep.OPS[ctx.act].torch

    def original(*diff):
        args = list(inputs)
        for i, t in zip(wanted, diff):
            args[i] = t
        x, wg, wu, wd, bg, bu, bd = args
        return F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    grads: list[Optional[Tensor]] = [None] * 8
    if wanted:
        _, vjp = torch.func.vjp(original, *[inputs[i] for i in wanted])
        for i, grad in zip(wanted, vjp(dy)):
            grads[i] = grad
    return tuple(grads)


def gated_mlp(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], spec: str) -> Optional[Tensor]:
    """The region ``spec`` on these tensors through :class:`GatedMLPFunction` when it is exactly a gated MLP
    (:func:`gated_region`) and the kernels take the tensors, else None (the caller runs GatedProduct or the original
    ops).

    They take: plain tensors (or Parameters) outside functorch transforms and forward AD; CUDA, or the
    CPU under the Triton interpreter except bf16; fp16, bf16 or fp32, one dtype and device for all, or under
    autocast any of those (cast to autocast's dtype, as its Linear layers would be); shapes that chain. Runs on
    every trained call: attribute reads only.
    """
    region = gated_region(spec)
    if region is None or not use_function or len(weights) != 3:
        return None
    if type(x) is not Tensor or transformed():
        return None  # (the caller, fused_mlp, runs the op itself while anything traces)
    cuda = x.is_cuda
    # Under autocast to another dtype (fp32 master weights, bf16 autocast) the Linear layers run in that dtype:
    # every tensor is cast to it first, as autocast casts F.linear's inputs (each weight once per forward;
    # autograd's cast nodes return fp32 gradients), and the node runs in it.
    autocasting = any_autocast() and torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocasting else x.dtype
    if dtype not in SUPPORTED_DTYPES or x.dim() == 0 or x.numel() == 0:
        return None
    if not cuda and not (x.is_cpu and interpreting() and dtype is not torch.bfloat16):
        return None  # (the interpreter's tl.dot cannot multiply bf16)
    index = x.get_device()  # -1 on the CPU
    gw, uw, dw, gb, ub, db, act = region
    wg, wu, wd = weights[gw], weights[uw], weights[dw]
    bg = bu = bd = None
    tensors: tuple[Tensor, ...] = (x, wg, wu, wd)
    if gb is not None or ub is not None or db is not None:
        bg = None if gb is None else biases[gb]
        bu = None if ub is None else biases[ub]
        bd = None if db is None else biases[db]
        tensors += tuple(b for b in (bg, bu, bd) if b is not None)
    cast = False
    for t in tensors:
        if type(t) not in _PLAIN or t.is_cuda is not cuda or t.get_device() != index:
            return None
        if t.dtype is not dtype:
            if not autocasting or t.dtype not in SUPPORTED_DTYPES:
                return None  # mixed dtypes outside autocast, or float64 (autocast leaves it): the original ops
            cast = True
    hidden = wg.shape[0]
    if wg.shape != (hidden, x.shape[-1]) or wu.shape != wg.shape or wd.dim() != 2 or wd.shape[1] != hidden \
            or (bg is not None and bg.shape != (hidden,)) or (bu is not None and bu.shape != (hidden,)) \
            or (bd is not None and bd.shape != (wd.shape[0],)):
        return None  # the original ops raise eager's error
    if cast:
        x, wg, wu, wd, bg, bu, bd = (None if t is None else t.to(dtype) for t in (x, wg, wu, wd, bg, bu, bd))
    return _apply(_unwrap_if_dead(x), wg, wu, wd, bg, bu, bd, act)
