"""Gated MLPs in training (opt-in): ``act(g) * u`` and its gradients from one kernel each way, against float64
autograd and eager; the whole gated MLP as one autograd node (GatedMLPFunction) likewise; and a trained GatedMLP
stepping with them beside eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import GatedMLP
from test_api import _runs_fused_op
from test_ops import TOL, rel_err
from torch import nn

import fxfuse
from fxfuse import epilogue as ep
from fxfuse.gated_mlp_training import gated_mlp
from fxfuse.gated_training import GatedProduct, gated_form, gated_product
from fxfuse.kernels.gated_launch import run_gated_backward

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
    # dg written over dh: the same gradients, in dh's memory.
    dh_copy = dh.clone()
    dg, du = run_gated_backward(dh_copy, g, u, act, overwrite_dh=True)
    assert dg.data_ptr() == dh_copy.data_ptr() and torch.equal(dg, gt.grad) and torch.equal(du, ut.grad)


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


def _count_calls(monkeypatch):
    """Lists that grow by one per GatedMLPFunction forward and per GatedProduct call."""
    from fxfuse.gated_mlp_training import GatedMLPFunction

    whole, product = [], []
    forward, apply = GatedMLPFunction.forward, GatedProduct.apply
    monkeypatch.setattr(GatedMLPFunction, "forward", staticmethod(lambda *a: whole.append(1) or forward(*a)))
    monkeypatch.setattr(GatedProduct, "apply", lambda *a: product.append(1) or apply(*a))
    return whole, product


@pytest.mark.parametrize("variant", ["function", "function-bias", "product"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_a_trained_gated_mlp_steps_with_the_gated_kernels(untrained_specs, monkeypatch, act, variant):
    # From the second step (the region is then marked trained) the whole MLP runs as one GatedMLPFunction node
    # with FXFUSE_GATED_TRAINING=1 (with the internal switch off, "product": the original GEMMs and the middle
    # through GatedProduct); by default and with FXFUSE_GATED_TRAINING=0 the original ops run. Every step's
    # output and gradients match eager's.
    from fxfuse import gated_mlp_training

    model = GatedMLP(d=16, hidden=40, act=act).train()
    if variant == "function-bias":
        model.gate_proj, model.up_proj, model.down_proj = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
    if variant == "product":
        monkeypatch.setattr(gated_mlp_training, "use_function", False)
    fast = fxfuse.optimize(model)
    eager = copy.deepcopy(model)
    whole, product = _count_calls(monkeypatch)
    for step, setting in enumerate((None, "1", None, "1", "0", "1")):
        if setting is None:
            monkeypatch.delenv("FXFUSE_GATED_TRAINING", raising=False)
        else:
            monkeypatch.setenv("FXFUSE_GATED_TRAINING", setting)
        x = torch.randn(3, 5, 16, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        before = len(whole), len(product)
        out = fast(x)
        ref = eager(x_ref)
        assert _runs_fused_op(out) == (step == 0)  # the op on the first step only (then the region is trained)
        gated = setting == "1" and step > 0
        assert (len(whole) - before[0], len(product) - before[1]) == \
            ((0, int(gated)) if variant == "product" else (int(gated), 0))
        if gated and variant != "product":
            assert out.grad_fn.name() == "GatedMLPFunctionBackward"
        assert rel_err(out, ref) < 1e-5
        out.square().sum().backward()
        ref.square().sum().backward()
        assert rel_err(x.grad, x_ref.grad) < 1e-5
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) < 1e-5
            p.grad, q.grad = None, None
        with torch.no_grad():  # an optimizer step, so each step's weights differ
            for p, q in zip(model.parameters(), eager.parameters()):
                p.sub_(0.01 * p.sign())
                q.sub_(0.01 * q.sign())


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
        dg2, du2 = gated_launch.run_gated_backward(dh.clone(), g, u, "silu", overwrite_dh=True)
        assert torch.equal(dg2, dg) and torch.equal(du2, du)
        ref_h, ref_dg, ref_du = _middle_grads(g, u, dh, "silu", torch.float64)
        for got, ref in ((h, ref_h), (dg, ref_dg), (du, ref_du)):
            assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert len(gated_launch._bound_launches) == 2  # one per kernel (dg over dh or not: the same binding)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_mlp_function_on_gpu(dtype, no_tf32):
    for act in sorted(ACTS):
        for bias in (False, True):
            for lead, d, hidden in (((64,), 96, 256), ((4, 33), 64, 320)):
                _check_mlp(act, dtype, _mlp_tensors(lead, d, hidden, bias, device="cuda"), device="cuda")
    needs = (False, False, True, True, False, True, True)  # x without grad, the gate frozen
    _check_mlp("silu", dtype, _mlp_tensors((2, 40), 64, 128, True, device="cuda"), needs=needs, device="cuda")


# ---- the whole gated MLP as one autograd node (GatedMLPFunction) ----

_NAMES = ("x", "Wg", "Wu", "Wd", "bg", "bu", "bd")


def _mlp_tensors(lead, d, hidden, bias, device="cpu"):
    """x and (Wg, Wu, Wd, bg, bu, bd) in float32 (biases None without ``bias``), scaled like nn.Linear's."""
    x = torch.randn(*lead, d, device=device)
    wg, wu = (torch.randn(hidden, d, device=device) / d ** 0.5 for _ in range(2))
    wd = torch.randn(d + 3, hidden, device=device) / hidden ** 0.5
    biases = [torch.randn(n, device=device) * 0.1 if bias else None for n in (hidden, hidden, d + 3)]
    return [x, wg, wu, wd, *biases]


def _spec(bias: bool) -> str:
    flag = "b" if bias else "-"
    return f"2{flag}{flag}:mul(silu(a0),a1);1{flag}:a0"  # (the activation is replaced per test)


def _original(act):
    def run(x, wg, wu, wd, bg, bu, bd):
        return F.linear(ACTS[act](F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)
    return run


def _gated(act):
    def run(x, wg, wu, wd, bg, bu, bd):
        bias = bg is not None
        spec = _spec(bias).replace("silu", act)
        y = gated_mlp(x, [wg, wu, wd], [bg, bu, bd] if bias else [], spec)
        assert y is not None and y.grad_fn.name() == "GatedMLPFunctionBackward"
        return y
    return run


def _output_and_grads(run, tensors, dy, dtype, needs, make_x=None):
    """run's output and the gradient of every tensor (None where it needs none, or is None) in ``dtype``."""
    leaves = [None if t is None else t.to(dtype, copy=True).requires_grad_(need) for t, need in zip(tensors, needs)]
    x = leaves[0] if make_x is None else make_x(leaves[0])
    y = run(x, *leaves[1:])
    y.backward(dy.to(dtype))
    return [y.detach()] + [None if t is None else t.grad for t in leaves]


def _check_mlp(act, dtype, tensors, needs=(True,) * 7, make_x=None, device="cpu"):
    lead = (tensors[0] if make_x is None else make_x(tensors[0])).shape[:-1]
    dy = torch.randn(*lead, tensors[3].shape[0], device=device)
    ref = _output_and_grads(_original(act), tensors, dy, torch.float64, needs, make_x)
    eager = _output_and_grads(_original(act), tensors, dy, dtype, needs, make_x)
    got = _output_and_grads(_gated(act), tensors, dy, dtype, needs, make_x)
    for name, g, r, e in zip(("y", *_NAMES), got, ref, eager):
        if r is None:
            assert g is None, name  # frozen (or absent): no gradient computed
            continue
        assert g.dtype == dtype and g.shape == r.shape, name
        assert rel_err(g, r) < max(TOL[dtype], 1.5 * rel_err(e, r)), name
        assert rel_err(g, e) < 2 * TOL[dtype], name


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty_like fills with NaN (the kernels' outputs): an element a kernel does not write shows."""
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_gated_mlp_function_matches_float64_and_eager(act, bias, dtype, poisoned):
    # 2-D (one kernel block) and 3-D (two blocks: 15 x 80 > 1024) inputs.
    for lead, d, hidden in (((6,), 8, 40), ((3, 5), 12, 80)):
        _check_mlp(act, dtype, _mlp_tensors(lead, d, hidden, bias))


def test_gated_mlp_function_takes_a_non_contiguous_input(poisoned):
    tensors = _mlp_tensors((5, 3), 8, 24, bias=True)
    tensors[0] = tensors[0].transpose(0, 1).contiguous().transpose(0, 1)  # [5, 3, 8], strides of a transpose
    _check_mlp("silu", torch.float32, tensors, make_x=lambda x: x.transpose(0, 1))  # [3, 5, 8], not contiguous


@pytest.mark.parametrize("needs", [
    (True, False, False, False, False, False, False),  # frozen weights, x trains (LoRA-style base)
    (False, True, True, True, True, True, True),  # x without grad
    (False, False, False, True, False, False, True),  # only the down projection trains: no gated backward
    (True, False, True, False, False, True, False),  # gate and down frozen
], ids=["x-only", "weights-only", "down-only", "gate-down-frozen"])
def test_gated_mlp_function_computes_only_the_gradients_asked_for(needs, poisoned, monkeypatch):
    from fxfuse import gated_mlp_training

    calls = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(gated_mlp_training, "run_gated_forward",
                        counted("forward", gated_mlp_training.run_gated_forward))
    monkeypatch.setattr(gated_mlp_training, "run_gated_backward",
                        counted("backward", gated_mlp_training.run_gated_backward))
    _check_mlp("gelu", torch.float32, _mlp_tensors((2, 3), 8, 24, bias=True), needs=needs)
    upstream = any(needs[i] for i in (0, 1, 2, 4, 5))
    assert calls["backward"] == upstream  # the gated backward only for gradients above the middle
    assert calls["forward"] == 1 + needs[3]  # the forward, and h again only for dWd


def test_gated_mlp_function_second_order_is_eagers():
    # A gradient penalty through the whole MLP: with create_graph=True the backward takes the original ops'
    # gradients (differentiable), so the penalty's gradients are eager's.
    base = _mlp_tensors((3, 4), 8, 16, bias=True)

    def penalty_grads(run):
        leaves = [t.clone().requires_grad_() for t in base]
        y = run(*leaves)
        grads = torch.autograd.grad((y * y).sum(), leaves, create_graph=True)
        (sum((g * g).sum() for g in grads) + y.sum()).backward()
        return [t.grad for t in leaves]

    for act in ("silu", "gelu_tanh"):
        for name, a, b in zip(_NAMES, penalty_grads(_gated(act)), penalty_grads(_original(act))):
            assert rel_err(a, b) < 1e-5, (act, name)


def test_gated_mlp_function_is_for_exact_gated_mlps_and_tensors_it_takes():
    from fxfuse.gated_mlp_training import gated_region

    assert gated_region("2-b:mul(a1,gelu(a0));1b:a0") == (0, 1, 2, None, 0, 1, "gelu")
    for spec in ("2--:mul(a0,silu(a1))", "2--:mul(a0,silu(a1));1-:relu(a0)", "2--:mul(a0,relu(a1));1-:a0",
                 "2--:mul(a0,silu(a1));1-:a0;1-:a0", "1-:relu(a0);1-:a0", "2--:mul(mul(a0,silu(a1)),v0);1-:a0"):
        assert gated_region(spec) is None, spec
    x, wg, wu, wd, *_ = _mlp_tensors((4,), 8, 16, bias=False)
    spec = "2--:mul(silu(a0),a1);1-:a0"
    assert gated_mlp(x, [wg, wu, wd], [], spec) is not None
    assert gated_mlp(x.bfloat16(), [w.bfloat16() for w in (wg, wu, wd)], [], spec) is None  # not interpreted
    assert gated_mlp(x.double(), [w.double() for w in (wg, wu, wd)], [], spec) is None
    assert gated_mlp(x.half(), [wg, wu, wd], [], spec) is None  # mixed dtypes
    assert gated_mlp(x, [wg, wu, wd.t()], [], spec) is None  # shapes do not chain: eager's error
    assert gated_mlp(x, [wg, wu[:8], wd], [], spec) is None
    assert gated_mlp(x[:0], [wg, wu, wd], [], spec) is None  # empty
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gated_mlp(x, [wg, wu, wd], [], spec) is None  # bf16 (autocast's dtype here): not interpreted
    with torch.autocast("cpu", dtype=torch.float16):
        assert gated_mlp(x.double(), [wg, wu, wd], [], spec) is None  # autocast leaves float64 alone


def test_gated_mlp_function_under_autocast_casts_like_eager():
    # fp32 master weights under fp16 autocast (CPU; bf16 on the GPU test): the node runs in fp16 on inputs cast as
    # autocast casts a Linear's, and the fp32 leaves get fp32 gradients close to eager's under the same autocast.
    base = _mlp_tensors((3, 5), 16, 48, bias=True)
    spec = _spec(True)

    def run(use_gated):
        leaves = [t.clone().requires_grad_() for t in base]
        x, wg, wu, wd, bg, bu, bd = leaves
        with torch.autocast("cpu", dtype=torch.float16):
            y = gated_mlp(x, [wg, wu, wd], [bg, bu, bd], spec) if use_gated else _original("silu")(*leaves)
        assert y.dtype == torch.float16
        if use_gated:
            assert y.grad_fn.name() == "GatedMLPFunctionBackward"
        y.float().square().sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    ref = [None if t is None else t.double() for t in base]
    ref_leaves = [t.requires_grad_() for t in ref]
    y64 = _original("silu")(*ref_leaves)
    y64.square().sum().backward()
    for name, got, eager, r in zip(("y", *_NAMES), run(True), run(False), [y64.detach()] + [t.grad for t in ref]):
        assert got.dtype == eager.dtype, name
        assert rel_err(got, r) < max(TOL[torch.float16], 1.5 * rel_err(eager, r)), name


@pytest.mark.parametrize("setting", [None, "1"])
def test_the_report_says_what_a_trained_gated_mlp_runs(monkeypatch, setting):
    # By default a trained gated MLP's gradient-recording calls run the original ops (the note says so and how to
    # opt in); with FXFUSE_GATED_TRAINING=1 they run as one autograd node, and the note must not say otherwise.
    if setting is None:
        monkeypatch.delenv("FXFUSE_GATED_TRAINING", raising=False)
    else:
        monkeypatch.setenv("FXFUSE_GATED_TRAINING", setting)
    (note,) = [n for r in fxfuse.report(fxfuse.optimize(GatedMLP().train())).regions for n in r.notes
               if n.startswith("training")]
    if setting is None:
        assert "run the original ops (no fused backward: a gated stage)" in note and "=1 runs" in note
    else:
        assert "original ops" not in note and "one autograd node" in note
