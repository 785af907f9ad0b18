"""The fused chain backward: a narrow chain's gradients in one kernel, against float64 autograd and eager."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
import triton
from models import GatedMLP, nerf_mlp, siren
from test_api import _runs_fused_op
from test_ops import TOL, rel_err

import fxfuse
from fxfuse import epilogue as ep
from fxfuse.backward import fused_backward_reason
from fxfuse.kernels import chain_backward_launch
from fxfuse.kernels.chain_backward_launch import run_chain_backward
from fxfuse.kernels.chain_backward_template import chain_backward_configs
from fxfuse.kernels.chain_walk_template import chain_walk_configs

# (epilogues, widths, which stages have a bias)
CHAINS = [
    (("relu(a0)", "relu(a0)", "relu(a0)", "a0"), (16, 32, 32, 32, 8), (True,) * 4),  # NeRF-style
    (("gelu_tanh(a0)", "silu(a0)", "sigmoid(a0)"), (12, 40, 24, 20), (True, False, True)),  # odd widths
    (("tanh(a0)", "gelu(a0)"), (3, 17, 5), (False, True)),
    # derivatives written by fxfuse.derivative: SIREN's sine, QuickGELU, a Gaussian (INRs)
    (("sin(mul(3.0,a0))", "mul(a0,sigmoid(mul(1.702,a0)))", "exp(neg(pow(a0,2.0)))", "a0"), (2, 24, 20, 16, 3),
     (True, True, False, True)),
]


def _inputs(widths, has_bias, dtype, m, device="cpu"):
    x = torch.randn(m, widths[0], dtype=dtype, device=device)
    ws = [(torch.randn(o, i, device=device) / i**0.5).to(dtype) for i, o in zip(widths, widths[1:])]
    bs = [(0.1 * torch.randn(o, device=device)).to(dtype) if b else None for o, b in zip(widths[1:], has_bias)]
    dy = torch.randn(m, widths[-1], dtype=dtype, device=device)
    return x, ws, bs, dy


def _float64_grads(x, ws, bs, dy, epilogues, dtype=torch.float64):
    """dx, dW_i, db_i of the chain by autograd in float64 (or in ``dtype``: eager's own gradients)."""
    xd = x.to(dtype).requires_grad_()
    wd = [w.to(dtype).requires_grad_() for w in ws]
    bd = [None if b is None else b.to(dtype).requires_grad_() for b in bs]
    h = xd
    for w, b, text in zip(wd, bd, epilogues):
        h = ep.evaluate(ep.parse(text), [torch.nn.functional.linear(h, w, b)], [])
    h.backward(dy.to(dtype))
    return xd.grad, [w.grad for w in wd], [None if b is None else b.grad for b in bd]


def _flat(grads):
    dx, gw, gb = grads
    return [("dx", dx)] + [(f"dW{i}", g) for i, g in enumerate(gw)] + [(f"db{i}", g) for i, g in enumerate(gb)]


def _check(got, ref, tol, eager=None):
    """Each gradient within ``tol`` of the float64 ``ref``, or (16-bit) within 1.5x eager's own error."""
    eager_flat = _flat(eager) if eager is not None else [(None, None)] * len(_flat(ref))
    for (name, g), (_, r), (_, e) in zip(_flat(got), _flat(ref), eager_flat):
        assert (g is None) == (r is None) or (name == "dx" and g is None), name
        if g is not None:
            assert g.shape == r.shape, name
            bound = tol if e is None else max(tol, 1.5 * rel_err(e, r))
            assert rel_err(g, r) < bound, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("epilogues,widths,has_bias", CHAINS)
def test_backward_kernel_matches_float64_autograd(epilogues, widths, has_bias, dtype):
    # 37 rows: a partial last block, and with the interpreter's 4 programs, programs with 2 and 3 blocks.
    x, ws, bs, dy = _inputs(widths, has_bias, dtype, 37)
    dx, gw, gb = run_chain_backward(x, ws, bs, dy, epilogues)
    assert dx.dtype == dtype and [g.dtype for g in gw] == [dtype] * len(ws)
    _check((dx, gw, gb), _float64_grads(x, ws, bs, dy, epilogues), TOL[dtype] if dtype != torch.float32 else 1e-5)


def test_backward_kernel_without_dx_and_with_strided_inputs():
    # Also the variant that holds the weights for the whole program (the interpreter's default reloads them).
    epilogues, widths, has_bias = CHAINS[0]
    x, ws, bs, dy = _inputs(widths, has_bias, torch.float32, 21)
    xt = x.t().contiguous().t()  # column-major x
    dyt = torch.randn(widths[-1], 21).t()
    held = triton.Config({"BLOCK_M": 16, "PER_SM": 1, "RELOAD_WEIGHTS": False}, num_warps=4, num_stages=1)
    dx, gw, gb = run_chain_backward(xt, ws, bs, dyt, epilogues, need_dx=False, config=held)
    assert dx is None
    _check((None, gw, gb), _float64_grads(x, ws, bs, dyt, epilogues), 1e-5)
    # The walk (what nerf128 gets) on the same strided inputs, its variant that holds the weights.
    walk_held = triton.Config({**held.kwargs, "LOOP_STAGES": 1}, num_warps=4, num_stages=1)
    for need_dx in (True, False):
        grads = run_chain_backward(xt, ws, bs, dyt, epilogues, need_dx=need_dx, config=walk_held, walk=True)
        assert (grads[0] is None) == (not need_dx)
        _check(grads, _float64_grads(x, ws, bs, dyt, epilogues), 1e-5)


def test_which_chains_take_the_fused_backward():
    assert fused_backward_reason("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0", (32, 64, 64, 64, 16)) is None
    assert fused_backward_reason("2--:mul(a0,silu(a1));1-:a0", (32, 64, 32)) == "a gated stage"
    assert fused_backward_reason("1b:mul(relu(a0),v0);1b:a0", (8, 16, 8)).startswith("epilogue operands")
    assert fused_backward_reason("1b:abs(a0);1b:a0", (8, 16, 8)) == "no derivative for abs(a0)"
    assert fused_backward_reason("1b:pow(relu(a0),2.0);1b:a0", (8, 16, 8)) == "no derivative for pow(relu(a0),2.0)"
    # smooth epilogues beyond the table: their derivative is written by fxfuse.derivative (SIREN, QuickGELU)
    assert fused_backward_reason("1b:sin(mul(30.0,a0));1b:sin(mul(30.0,a0));1b:a0", (2, 64, 64, 3)) is None
    assert fused_backward_reason("1b:mul(a0,sigmoid(mul(1.702,a0)));1b:a0", (8, 16, 8)) is None
    # nerf128's 128-wide gradients (49152 fp32 accumulators) go through memory; 256-wide layers keep the generic path.
    assert fused_backward_reason("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0", (64, 128, 128, 128, 64)) is None
    assert "wider than 128" in fused_backward_reason("1b:relu(a0);1b:a0", (64, 256, 64))
    assert "shared memory" in fused_backward_reason("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0",
                                                    (64, 128, 128, 128, 64), 4)  # fp32 nerf128


def test_report_says_which_backward_a_training_region_gets():
    notes = [n for r in fxfuse.report(fxfuse.optimize(nerf_mlp((16, 32, 32, 8)).train())).regions for n in r.notes]
    assert any("backward is one fused kernel" in n for n in notes), notes
    notes = [n for r in fxfuse.report(fxfuse.optimize(nerf_mlp((64, 128, 128, 8)).train())).regions for n in r.notes]
    assert any("a walk kernel writes the activation gradients" in n for n in notes), notes
    notes = [n for r in fxfuse.report(fxfuse.optimize(GatedMLP().train())).regions for n in r.notes]
    assert any("no fused backward: a gated stage" in n for n in notes), notes
    wide = nerf_mlp((16, 256, 8)).train()
    notes = [n for r in fxfuse.report(fxfuse.optimize(wide)).regions for n in r.notes]
    assert any("wider than 128" in n for n in notes), notes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("epilogues,widths,has_bias", CHAINS)
def test_walk_matches_float64_autograd(epilogues, widths, has_bias, dtype):
    # What nerf128 gets: the forward storing every layer's input, the walk writing each activation gradient
    # (ReLU, sigmoid, tanh from the stored output; GELU, SiLU from the pre-activation recomputed from the stored
    # input), one dW GEMM per layer.
    x, ws, bs, dy = _inputs(widths, has_bias, dtype, 37)
    grads = run_chain_backward(x, ws, bs, dy, epilogues, walk=True)
    assert grads[0].dtype == dtype and [g.dtype for g in grads[1]] == [dtype] * len(epilogues)
    _check(grads, _float64_grads(x, ws, bs, dy, epilogues), TOL[dtype] if dtype != torch.float32 else 1e-5)


def _train_steps(model, steps, x_requires_grad=True, device="cpu", dtype=torch.float32, tol=1e-5):
    """Train ``fxfuse.optimize(model)`` beside eager copies for a few steps: each gradient must be within ``tol``
    of the float64 model's, or within 1.5x the error of eager's own (same dtype). Returns whether each step's
    forward ran the fused op."""
    fast = fxfuse.optimize(model)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    runs_op = []
    for _ in range(steps):
        width = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).in_features
        x = torch.randn(45, width, device=device, dtype=dtype, requires_grad=x_requires_grad)
        inputs = [x] + [x.detach().clone().to(t).requires_grad_(x_requires_grad) for t in (dtype, torch.float64)]
        out = fast(x)
        runs_op.append(_runs_fused_op(out))
        grad = torch.randn_like(out)
        out.backward(grad)
        for net, inp in ((eager, inputs[1]), (ref, inputs[2])):
            net(inp).backward(grad.to(inp.dtype))
        named = zip(model.named_parameters(), eager.parameters(), ref.parameters())
        pairs = [("x", x.grad, inputs[1].grad, inputs[2].grad)] if x_requires_grad else []
        pairs += [(name, p.grad, e.grad, r.grad) for (name, p), e, r in named]
        for name, got, eager_grad, ref_grad in pairs:
            assert (got is None) == (ref_grad is None), name
            if got is not None:
                assert rel_err(got, ref_grad) < max(tol, 1.5 * rel_err(eager_grad, ref_grad)), name
        for net in (model, eager, ref):
            net.zero_grad()
    return runs_op


def test_a_trained_chain_stays_fused_with_eager_gradients(untrained_specs):
    # The generic backward would mark the region trained and run the original ops from the second step;
    # the fused backward keeps the fused op in every step, with eager's gradients.
    model = nerf_mlp((16, 32, 32, 32, 8)).train()
    assert _train_steps(model, 3) == [True, True, True]
    assert not fxfuse.ops._trained


def test_a_trained_siren_stays_fused_with_eager_gradients(untrained_specs):
    # sin(30 a) has no entry in the backward's table: fxfuse.derivative writes 30 cos(30 a), so the region keeps
    # its fused forward and backward in every step (the generic backward would run the original ops from step 2).
    model = siren().train()
    assert _train_steps(model, 3) == [True, True, True]
    assert not fxfuse.ops._trained
    notes = [n for r in fxfuse.report(fxfuse.optimize(siren().train())).regions for n in r.notes]
    assert any("backward is one fused kernel" in n for n in notes), notes


def test_a_wider_region_of_the_same_spec_trained_first_leaves_a_narrow_one_fused(untrained_specs):
    # The 256-wide chain's backward is the generic one (it marks its region trained: the original ops from then
    # on); the 32-wide chain of the same spec keeps its fused backward, and its fused forward, in every step
    # (before: the mark was per spec, so the narrow SIREN ran the original ops too).
    wide, narrow = siren((2, 256, 3)).train(), siren((2, 32, 3)).train()
    fast_wide = fxfuse.optimize(wide)
    fast_wide(torch.rand(8, 2)).sum().backward()
    assert _train_steps(narrow, 3) == [True, True, True]
    assert fxfuse.ops._trained == {("1b:sin(mul(30.0,a0));1b:a0", torch.float32, 2, 256, 3)}
    assert not _runs_fused_op(fast_wide(torch.rand(8, 2)))  # (the trained wide one: the original ops)


def test_an_fp32_region_trained_first_leaves_the_same_region_in_fp16_fused(untrained_specs):
    # nerf128's widths: fp32 weights do not fit the walk's shared memory (the generic backward marks the fp32
    # region trained), fp16 ones do: the fp16 model keeps its fused forward and backward (an fp32 step before
    # switching to half precision).
    widths = (64, 128, 128, 128, 64)
    fast32 = fxfuse.optimize(nerf_mlp(widths).train())
    fast32(torch.randn(8, 64)).sum().backward()
    assert [key[1] for key in fxfuse.ops._trained] == [torch.float32]
    assert _train_steps(nerf_mlp(widths).half().train(), 2, dtype=torch.float16, tol=TOL[torch.float16]) == \
        [True, True]


def test_siren_gradient_penalty_through_the_fused_region(untrained_specs):
    # SIREN fits derivatives too (Poisson, SDF eikonal losses): the gradient of the output with respect to the
    # coordinates, kept differentiable (create_graph=True), then a loss on it. The second-order terms come from
    # the original ops' differentiable backward; the parameters' gradients match eager's within fp32 rounding.
    model = siren((2, 32, 32, 1)).train()
    fast, eager, ref = fxfuse.optimize(model), copy.deepcopy(model), copy.deepcopy(model).double()
    coords = torch.rand(40, 2) * 2 - 1
    grads, fused = [], []
    for net, dtype in ((fast, torch.float32), (eager, torch.float32), (ref, torch.float64)):
        c = coords.to(dtype).requires_grad_()
        out = net(c)
        fused.append(_runs_fused_op(out))
        (dc,) = torch.autograd.grad(out.sum(), c, create_graph=True)
        (out.pow(2).mean() + (dc.norm(dim=-1) - 1).pow(2).mean()).backward()
        grads.append([p.grad for p in net.parameters()])
    assert fused == [True, False, False]
    for got, e, r in zip(*grads):
        assert rel_err(got, r) < max(1e-5, 1.5 * rel_err(e, r))


@pytest.mark.parametrize("last", ["a0", "sigmoid(a0)"])
def test_a_walk_chain_stores_its_layer_inputs_once_it_has_trained(untrained_specs, monkeypatch, last):
    # A chain wide enough for the walk (padded dW > 16384 elements): its first backward runs the forward again,
    # storing the layer inputs; from then on the gradient-recording forward stores them (and the output, where
    # the walk reads it: a last sigmoid) and the backward reads them. Gradients match float64 in every step.
    from fxfuse.kernels import chain_backward_launch

    recomputed = []
    run_chain = chain_backward_launch.run_chain
    monkeypatch.setattr(chain_backward_launch, "run_chain", lambda *a, **k: recomputed.append(1) or run_chain(*a, **k))
    epilogues, widths = ("relu(a0)", "relu(a0)", last), (64, 128, 128, 8)
    spec = ";".join(f"1b:{e}" for e in epilogues)
    steps = []
    for _ in range(3):
        x, ws, bs, dy = _inputs(widths, (True,) * 3, torch.float32, 21)
        dx, gw, gb = _float64_grads(x, ws, bs, dy, epilogues)
        params = [t.requires_grad_() for t in (x, *ws, *bs)]
        before = len(recomputed)
        out = fxfuse.ops.fused_mlp(x, ws, bs, [], spec)
        saved = len(out.grad_fn.saved_tensors)
        out.backward(dy)
        steps.append((len(recomputed) - before, saved))
        for got, ref in zip((p.grad for p in params), (dx, *gw, *gb)):
            assert rel_err(got, ref) < 1e-5
    # saved: x, 3 weights, 3 biases; then the two hidden layer inputs, and the output where the walk reads it
    stored = 2 + (last != "a0")
    assert steps == [(1, 7), (0, 7 + stored), (0, 7 + stored)]
    assert fxfuse.ops._walked == {(spec, torch.float32, *widths)} and not fxfuse.ops._trained
    if last == "a0":
        out = fxfuse.ops.fused_mlp(x, ws, bs, [], spec)
        out.mul_(2)  # as in eager, the output of a last linear may be modified in place before the backward
        out.backward(dy)


def test_backward_launches_bound_once_per_layout_give_the_same_gradients(monkeypatch):
    # On the GPU, a backward kernel's later launches at a layout go through a binding (fastlaunch.bind: the C
    # launcher with all but the per-call tensors fixed). Here the binding is the interpreter's launch with those
    # tensors replaced, so what surrounds it (the key, the slots' order, the program count, the partial sums) is
    # checked for both kernels: each binds once, later steps reuse it, every step's gradients match float64.
    from fxfuse.kernels import fastlaunch

    launched = []

    def interpreted_bind(kernel, grid, args, slots, varying=("M",)):
        grid({**args, **kernel.best_config.kwargs})  # as bind does: the grid of the config the launch chose

        def launch(*values):
            launched.append(kernel)
            kernel[grid](**{**args, **dict(zip(slots, values))})

        return launch

    monkeypatch.setattr(fastlaunch, "may_bind", lambda x: True)
    monkeypatch.setattr(fastlaunch, "bind", interpreted_bind)
    bound = chain_backward_launch._bound_launches
    bound.clear()
    chains = [(("relu(a0)", "a0"), (16, 32, 8), (True, True), True),  # one kernel
              (("relu(a0)", "relu(a0)", "a0"), (64, 128, 128, 8), (True, True, True), True),  # the walk
              (("relu(a0)", "silu(a0)", "a0"), (64, 128, 128, 8), (True, False, True), False)]  # no dx, a bias less
    for epilogues, widths, has_bias, need_dx in chains:
        _, ws, bs, _ = _inputs(widths, has_bias, torch.float32, 21)
        for _ in range(3):  # fresh x and dy each step, the same weights
            x, dy = torch.randn(21, widths[0]), torch.randn(21, widths[-1])
            got = run_chain_backward(x, ws, bs, dy, epilogues, need_dx=need_dx)
            assert (got[0] is None) == (not need_dx)
            _check(got, _float64_grads(x, ws, bs, dy, epilogues), 1e-5)
    assert len(bound) == 3 and len(launched) == 6  # one binding per chain, launched by its second and third steps
    bound.clear()


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A mode that watches torch calls (as profilers and tracers do): the optimized model then calls the op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("watched", [False, True])
def test_a_fused_output_may_be_modified_in_place_as_in_eager(untrained_specs, watched):
    # ``out += residual`` after an MLP: eager allows it (a linear's output is not saved); so must fxfuse, through
    # its gradient-recording Function and through the op's own autograd (under a watching mode).
    model = nerf_mlp((16, 32, 32, 8)).train()
    eager = copy.deepcopy(model)
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 7, 16)
    outs = []
    for net in (fast, eager):
        with _PassThrough() if watched else contextlib.nullcontext():
            out = net(x)
            out += 1.0
            out.square().sum().backward()
        outs.append(out)
    assert _runs_fused_op(outs[0])
    assert rel_err(outs[0], outs[1]) < 1e-5
    for p, q in zip(model.parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5


def test_fused_backward_with_frozen_layers_and_no_input_gradient(untrained_specs):
    model = nerf_mlp((16, 32, 32, 8)).train()
    model[0].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    assert _train_steps(model, 2, x_requires_grad=False) == [True, True]
    assert model[0].weight.grad is None and model[2].bias.grad is None


def test_fused_backward_can_be_turned_off(untrained_specs, monkeypatch):
    monkeypatch.setenv("FXFUSE_FUSED_BACKWARD", "0")
    model = nerf_mlp((16, 32, 32, 8)).train()
    assert _train_steps(model, 2) == [True, False]  # the generic backward: original ops after the first step
    assert fxfuse.ops._trained


def test_double_backward_uses_the_differentiable_path(untrained_specs):
    model = nerf_mlp((6, 16, 16, 4)).double().train()  # float64 runs the reference ops...
    fast = fxfuse.optimize(nerf_mlp((6, 16, 16, 4)).train())  # ...so check float32 against float64
    fast.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    x = torch.randn(9, 6, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    for net, inp in ((fast, x), (model, xd)):
        (g,) = torch.autograd.grad(torch.tanh(net(inp)).sum(), inp, create_graph=True)
        g.square().sum().backward()
    assert rel_err(x.grad, xd.grad) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backward_kernel_on_gpu(dtype, no_tf32):
    # NeRF widths, a ragged M; every config of the kernel in fp16 (the GPU tests run one config per call
    # otherwise, and each config compiles for seconds: it spills).
    epilogues, widths = ("relu(a0)", "relu(a0)", "relu(a0)", "a0"), (32, 64, 64, 64, 16)
    x, ws, bs, dy = _inputs(widths, (True,) * 4, dtype, 3001, "cuda")
    ref, eager = _float64_grads(x, ws, bs, dy, epilogues), _float64_grads(x, ws, bs, dy, epilogues, dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for config in chain_backward_configs() if dtype == torch.float16 else [None]:
        _check(run_chain_backward(x, ws, bs, dy, epilogues, config=config), ref, tol, eager)
    # nerf128's widths take the walk (walks: the forward storing, the walk kernel, the dW GEMMs), every walk
    # config in fp16; 16-bit only (its fp32 weights do not fit on chip: backward_fits).
    epilogues, widths = ("relu(a0)", "relu(a0)", "relu(a0)", "a0"), (64, 128, 128, 128, 64)
    x, ws, bs, dy = _inputs(widths, (True,) * 4, dtype, 3001, "cuda")
    ref, eager = _float64_grads(x, ws, bs, dy, epilogues), _float64_grads(x, ws, bs, dy, epilogues, dtype)
    for config in {torch.float16: chain_walk_configs(), torch.bfloat16: [None]}.get(dtype, []):
        _check(run_chain_backward(x, ws, bs, dy, epilogues, config=config), ref, tol, eager)
    for epilogues, widths, has_bias in CHAINS[1:]:
        x, ws, bs, dy = _inputs(widths, has_bias, dtype, 777, "cuda")
        _check(run_chain_backward(x, ws, bs, dy, epilogues), _float64_grads(x, ws, bs, dy, epilogues), tol,
               _float64_grads(x, ws, bs, dy, epilogues, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_training_on_gpu(dtype, untrained_specs, no_tf32):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # dW in registers / through memory (bf16; in fp32 nerf128 keeps the generic backward, and the original ops
    # from its second step).
    # Later steps launch bound (the backward kernel from the second step; a walk chain's storing forward from
    # the third): one binding per kernel and layout, reused, and the gradients are checked at every step.
    storing, launches = fxfuse.backward._storing_steps, chain_backward_launch._bound_launches
    storing.clear()
    launches.clear()
    for widths in ((32, 64, 64, 64, 16), (64, 128, 128, 128, 64)):
        model = nerf_mlp(widths).cuda().to(dtype).train()
        fused = [True] * 3 if dtype != torch.float32 or widths[1] < 128 else [True, False, False]
        assert _train_steps(model, 3, device="cuda", dtype=dtype, tol=tol) == fused
    walked = dtype != torch.float32  # (fp32 nerf128 keeps the generic backward)
    assert (len(storing), len(launches)) == (int(walked), 1 + walked)


@pytest.mark.gpu
@pytest.mark.parametrize("widths,dtype", [((2, 64, 64, 3), torch.float32), ((2, 128, 128, 3), torch.float16),
                                          ((2, 128, 128, 3), torch.bfloat16)], ids=["one kernel", "walk", "walk bf16"])
def test_siren_training_on_gpu(widths, dtype, untrained_specs, no_tf32):
    # The sines' derivative written by fxfuse.derivative, in the one-kernel backward and in the walk.
    model = siren(widths).cuda().to(dtype).train()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _train_steps(model, 3, device="cuda", dtype=dtype, tol=tol) == [True] * 3


@pytest.mark.parametrize("width", [48, 128], ids=["one kernel", "walk"])
def test_bf16_chains_on_the_cpu_train_through_the_reference_ops(width):
    """The interpreter's tl.dot cannot multiply bf16, so the forward runs the reference ops on the CPU: so must the
    backward (its kernels, and the walk's storing forward from the second step, gave garbage)."""
    torch.manual_seed(0)
    model = nerf_mlp((16, width, width, width, 8)).to(torch.bfloat16).train()
    eager = copy.deepcopy(model)
    fast = fxfuse.optimize(model)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    for _ in range(2):  # (the second step after the first backward marked the region)
        outs = []
        for m in (fast, eager):
            m.zero_grad()
            y = m(x)
            y.float().square().sum().backward()
            outs.append((y, [p.grad for p in m.parameters()]))
        (y, grads), (y_eager, grads_eager) = outs
        torch.testing.assert_close(y, y_eager)
        for g, want in zip(grads, grads_eager):
            torch.testing.assert_close(g, want)


def _eager_and_fused_grads(model, x):
    """Gradients of ``model``'s parameters and ``x`` from eager, then from ``fxfuse.optimize(model)``."""
    fast = fxfuse.optimize(model)
    out = []
    for m in (model, fast):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        m(xi).square().sum().backward()
        out.append([xi.grad] + [p.grad.clone() for p in model.parameters()])
    return out


class _NumpyBounds(torch.nn.Module):
    def forward(self, h):
        return torch.nn.functional.hardtanh(h, np.float64(0.0), np.float64(6.0))  # (bounds read from an array)


@pytest.mark.parametrize("act", [torch.nn.ReLU6(), torch.nn.Hardtanh(-1.0, 2.0), _NumpyBounds()])
def test_clamping_activations_have_no_gradient_at_their_bounds(act, untrained_specs):
    # ReLU6 / Hardtanh pass no gradient at exactly their bounds (clamp passes it): pre-activations of exactly 0 and
    # 6 come from zero rows (zero-padded batches) and biases set at the bounds.
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), act, torch.nn.Linear(6, 4))
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([0.0, 6.0, -1.0, 2.0, 0.5, 3.0]))
    x = torch.randn(5, 8)
    x[1:3] = 0.0
    eager, fused = _eager_and_fused_grads(model, x)
    for g, want in zip(fused, eager):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def test_a_nan_through_relu_reaches_the_gradients_as_in_eager(untrained_specs):
    # A NaN pre-activation passes ReLU's gradient in eager (threshold_backward: h <= 0 ? 0 : g, false for NaN), so
    # a diverged step shows in the gradients; the fused backward must not make them finite.
    model = nerf_mlp((8, 16, 16, 4))
    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    eager, fused = _eager_and_fused_grads(model, x)
    for g, want in zip(fused, eager):
        assert torch.equal(g.isnan(), want.isnan())
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_the_report_says_when_a_region_runs_the_original_ops_after_a_gradient_penalty(untrained_specs):
    # A create_graph backward is the original ops' (differentiable); from then on the region's gradient-recording
    # calls run the original ops, and the report says so in the strategy column (before: "fused_chain" alone).
    fast = fxfuse.optimize(siren((2, 16, 3)).train(), (torch.rand(8, 2),))
    assert "trained" not in str(fxfuse.report(fast))
    c = torch.rand(8, 2).requires_grad_()
    (dc,) = torch.autograd.grad(fast(c).sum(), c, create_graph=True)
    dc.square().sum().backward()
    text = str(fxfuse.report(fast))
    assert "fused_chain (1 launch); trained (float32): calls that record gradients run the original ops" in text
    assert "create_graph=True for a gradient penalty" in text
    assert not _runs_fused_op(fast(torch.rand(8, 2)))
