"""Gated MLPs in training (opt-in): ``act(g) * u`` and its gradients from one kernel each way, against float64
autograd and eager, and a trained GatedMLP stepping with them beside eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import GatedMLP
from test_api import _runs_fused_op
from test_ops import TOL, rel_err

import fxfuse
from fxfuse import epilogue as ep
from fxfuse.gated_training import GatedProduct, gated_form, gated_product

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _middle_grads(g, u, dh, act, dtype):
    """h, dg, du of ``act(g) * u`` by autograd in ``dtype`` (float64: the reference; the inputs' dtype: eager)."""
    gd, ud = g.to(dtype, copy=True).requires_grad_(), u.to(dtype, copy=True).requires_grad_()
    h = ACTS[act](gd) * ud
    h.backward(dh.to(dtype))
    return h.detach(), gd.grad, ud.grad


def _check_middle(act, dtype, device):
    g, u, dh = (torch.randn(7, 333, device=device).to(dtype) * 2 for _ in range(3))
    ref = _middle_grads(g, u, dh, act, torch.float64)
    eager = _middle_grads(g, u, dh, act, dtype)
    gt, ut = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = gated_product(gt, ut, act)
    assert h is not None and "GatedProduct" in h.grad_fn.name()
    h.backward(dh)
    for name, got, r, e in zip(("h", "dg", "du"), (h.detach(), gt.grad, ut.grad), ref, eager):
        assert got.dtype == dtype, name
        assert rel_err(got, r) < max(TOL[dtype], 1.5 * rel_err(e, r)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_gated_kernels_match_float64(act, dtype):
    _check_middle(act, dtype, "cpu")


def test_gated_form_reads_both_orders_and_rejects_the_rest():
    assert gated_form(ep.parse("mul(a0,gelu_tanh(a1))")) == (1, 0, "gelu_tanh")
    assert gated_form(ep.parse("mul(silu(a0),a1)")) == (0, 1, "silu")
    for text in ("mul(a0,relu(a1))", "mul(a0,a1)", "add(a0,silu(a1))", "mul(a0,silu(a0))", "silu(a0)"):
        assert gated_form(ep.parse(text)) is None, text


def test_tensors_the_kernels_do_not_take_keep_the_original_ops():
    g, u = torch.randn(4, 6), torch.randn(4, 6)
    assert gated_product(g.t(), u.t(), "silu") is None  # not contiguous
    assert gated_product(g, u[:, :3].contiguous(), "silu") is None  # shapes differ
    assert gated_product(g.bfloat16(), u.bfloat16(), "silu") is None  # bf16: not in the interpreter
    assert gated_product(g.double(), u.double(), "silu") is None


def test_a_second_order_backward_is_eagers():
    # A gradient penalty differentiates the gradients: with create_graph=True the backward takes the original
    # ops' gradients (differentiable), so the penalty's gradients are eager's.
    def penalty_grads(middle):
        g, u = (torch.randn(3, 8, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in (1, 2))
        h = middle(g, u)
        dg, du = torch.autograd.grad((h * h).sum(), (g, u), create_graph=True)
        ((dg * dg).sum() + (du * du).sum() + h.sum()).backward()
        return g.grad, u.grad

    got = penalty_grads(lambda g, u: gated_product(g, u, "silu"))
    ref = penalty_grads(lambda g, u: F.silu(g) * u)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_a_trained_gated_mlp_steps_with_the_gated_kernels(untrained_specs, monkeypatch, act):
    # From the second step (the region is then marked trained) the middle runs through GatedProduct with
    # FXFUSE_GATED_TRAINING=1; by default and with FXFUSE_GATED_TRAINING=0 the original ops run. Every step's
    # gradients match eager's.
    model = GatedMLP(d=16, hidden=40, act=act).train()
    fast = fxfuse.optimize(model)
    eager = copy.deepcopy(model)
    used = []
    apply = GatedProduct.apply
    monkeypatch.setattr(GatedProduct, "apply", lambda *a: used.append(1) or apply(*a))
    for step, setting in enumerate((None, "1", None, "1", "0")):
        if setting is None:
            monkeypatch.delenv("FXFUSE_GATED_TRAINING", raising=False)
        else:
            monkeypatch.setenv("FXFUSE_GATED_TRAINING", setting)
        x = torch.randn(3, 5, 16, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        before = len(used)
        out = fast(x)
        assert _runs_fused_op(out) == (step == 0)  # the op on the first step only (then the region is trained)
        assert len(used) - before == int(setting == "1" and step > 0)
        out.square().sum().backward()
        eager(x_ref).square().sum().backward()
        assert rel_err(x.grad, x_ref.grad) < 1e-5
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) < 1e-5
            p.grad, q.grad = None, None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_kernels_on_gpu(dtype):
    for act in sorted(ACTS):
        _check_middle(act, dtype, "cuda")


@pytest.mark.gpu
def test_gated_launches_are_bound_after_the_first():
    # The second launch of a kind goes through the binding; each call's tensors are its own.
    from fxfuse.kernels import gated_launch

    gated_launch._bound_launches.clear()
    for _ in range(3):
        g, u, dh = (torch.randn(5, 1000, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        h = gated_launch.run_gated_forward(g, u, "silu")
        dg, du = gated_launch.run_gated_backward(dh, g, u, "silu")
        ref_h, ref_dg, ref_du = _middle_grads(g, u, dh, "silu", torch.float64)
        for got, ref in ((h, ref_h), (dg, ref_dg), (du, ref_du)):
            assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert len(gated_launch._bound_launches) == 2  # one per kernel
