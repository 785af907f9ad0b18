"""Gated MLPs in training: the pointwise middle ``act(g) * u`` as one kernel each way (opt-in).

A gated region that is being trained (:data:`fxfuse.ops._trained`) runs its original ops when it records
gradients. With ``FXFUSE_GATED_TRAINING=1`` its middle ``act(gate(x)) * up(x)`` runs instead as
:class:`GatedProduct`: one kernel forward, one backward (:mod:`fxfuse.kernels.gated_template`), saving ``g`` and
``u`` only; the GEMMs stay cuBLAS's. On the H200 the two kernels take half the time of eager's five
(`benchmarks/probes/probe_gated.py`), and a step does less GPU work and keeps less memory (seed_geglu: 15% and 17%).
But the Python autograd node and launches add host time per call, and a host-bound step pays it: a 4-layer
transformers Llama trained in bf16 read 0.90-0.96x eager's step in three runs (`bench_llama_training.py`). So it
is off by default: turn it on for GPU-bound or memory-bound training.

A region that is exactly a gated MLP (``down(act(gate(x)) * up(x))``, the usual case) does not come here: it
runs as one autograd node for the whole MLP, :class:`fxfuse.gated_mlp_training.GatedMLPFunction`, which costs
less host time than GatedProduct and eager's graph on the CPU machine with the launches stubbed
(`benchmarks/probes/probe_gated_host.py`) and keeps less memory (on the H200: a 4-layer Llama's peak 31-32% lower).
GatedProduct serves the other gated stages and the tensors that node refuses.

Tensors the kernels do not take (another device, a dtype, non-contiguous, traced, under functorch transforms)
keep the original ops. A second-order backward (``create_graph=True``) takes the original ops' gradients, which
are differentiable.

Example:
    >>> from fxfuse import epilogue as ep
    >>> gated_form(ep.parse("mul(a0,silu(a1))")), gated_form(ep.parse("relu(a0)"))
    ((1, 0, 'silu'), None)
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
from torch import Tensor

from . import epilogue as ep
from .kernels.gated_launch import run_gated_backward, run_gated_forward
from .kernels.gated_template import GATED_ACTIVATIONS
from .kernels.launch import SUPPORTED_DTYPES
from .kernels.template import interpreting
from .transforms import transformed

__all__ = ["GatedProduct", "gated_form", "gated_product", "gated_training_enabled"]



def gated_training_enabled() -> bool:
    """``FXFUSE_GATED_TRAINING=1`` (read on every trained gated call, so tests and users can flip it)."""
    return os.environ.get("FXFUSE_GATED_TRAINING", "0") == "1"


@functools.lru_cache(maxsize=1024)
def gated_form(expr: ep.Expr) -> Optional[tuple[int, int, str]]:
    """``(gate accumulator, up accumulator, activation)`` when a stage's epilogue is ``mul(a_u, act(a_g))`` (in
    either order) with an activation the kernels have, else None."""
    if not (isinstance(expr, ep.Call) and expr.op == "mul"):
        return None
    for gated, up in (expr.args, expr.args[::-1]):
        if (isinstance(up, ep.Acc) and isinstance(gated, ep.Call) and gated.op in GATED_ACTIVATIONS
                and isinstance(gated.args[0], ep.Acc) and gated.args[0].index != up.index):
            return gated.args[0].index, up.index, gated.op
    return None


class GatedProduct(torch.autograd.Function):
    """``act(g) * u`` with its gradients from the gated kernels; saves ``g`` and ``u``."""

    @staticmethod
    def forward(ctx, g: Tensor, u: Tensor, act: str) -> Tensor:
        ctx.save_for_backward(g, u)
        ctx.act = act
        return run_gated_forward(g, u, act)

    @staticmethod
    def backward(ctx, dh: Tensor):
        g, u = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: gradients that are themselves differentiable
            act = ep.OPS[ctx.act].torch
            _, vjp = torch.func.vjp(lambda g, u: act(g) * u, g, u)
            dg, du = vjp(dh)
            return dg, du, None
        dg, du = run_gated_backward(dh.contiguous(), g, u, ctx.act)
        return dg, du, None


def gated_product(g: Tensor, u: Tensor, act: str) -> Optional[Tensor]:
    """``act(g) * u`` through :class:`GatedProduct` when the kernels take these tensors, else None (the caller
    runs the original ops)."""
    if type(g) is not Tensor or type(u) is not Tensor or torch.compiler.is_compiling() or transformed():
        return None
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device or g.numel() == 0:
        return None
    if g.dtype not in SUPPORTED_DTYPES or not (g.is_contiguous() and u.is_contiguous()):
        return None
    if not (g.is_cuda or (g.device.type == "cpu" and interpreting() and g.dtype != torch.bfloat16)):
        return None  # (the interpreter cannot run bf16)
    return GatedProduct.apply(g, u, act)
