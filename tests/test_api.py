"""fxfuse.optimize / register_pattern / report, end to end (kernels in the interpreter on the CPU)."""

from __future__ import annotations

import copy
import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F
from models import GPT2MLP, Block, ControlFlowModel, GatedMLP, Stack, nerf_mlp
from real_models import fused_calls
from torch import nn

import fxfuse
from fxfuse.ops import is_fused_call

FUSED_OP = torch.ops.fxfuse.mlp.default


def count_fused(module: nn.Module) -> int:
    """Calls to the fxfuse op in the fused graph of every module of ``module`` that runs one."""
    return sum(
        1
        for m in module.modules()
        for gm in getattr(type(m), "_fxfuse_graphs", {}).values()
        for n in gm.graph.nodes
        if is_fused_call(n)
    )


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_same_function(model, fast, x, tol=1e-5):
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        out = fast(x)
    assert out.dtype == x.dtype
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize(
    "make_model,regions",
    [
        (lambda: GPT2MLP(), 1),
        (lambda: GatedMLP(act="silu"), 1),
        (lambda: GatedMLP(act="gelu", up_first=True), 1),
        (lambda: nerf_mlp(), 1),
        (lambda: Block(), 1),
    ],
)
def test_optimize_fuses_and_matches_eager(make_model, regions):
    model = make_model().eval()
    x = torch.randn(2, 5, model_in(model))
    fast = fxfuse.optimize(model)
    assert count_fused(fast) == regions
    check_same_function(model, fast, x)
    # A second input shape runs without re-optimizing (no tracing on the forward path).
    check_same_function(model, fast, torch.randn(7, model_in(model)))


def model_in(model: nn.Module) -> int:
    return next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features


def test_model_is_not_modified_params_shared_state_dict_same():
    model = Stack(blocks=2).eval()
    before = {k: v for k, v in model.state_dict().items()}
    modules_before = dict(model.named_modules())
    fast = fxfuse.optimize(model)
    assert count_fused(fast) == 2
    # The original is untouched: same modules, same forward, same state.
    assert dict(model.named_modules()) == modules_before
    assert type(model).forward is Stack.forward
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or after[k].equal(before[k]) for k in before)
    # The optimized module has the same state_dict keys, backed by the same storage.
    fast_sd = fast.state_dict()
    assert list(fast_sd) == list(before)
    assert all(fast_sd[k].data_ptr() == before[k].data_ptr() for k in before)
    assert {id(p) for p in fast.parameters()} == {id(p) for p in model.parameters()}
    fast.load_state_dict(model.state_dict())


class CountingModel(nn.Module):
    """A training-mode model whose forward changes state: BatchNorm's running statistics, a dropout's draws and a
    counting buffer. ``inline``: the MLP is written in the forward, which hosts it (the shape propagation of its
    fused graph runs all of that); else it is a GPT-2 MLP (its own dropout) and the forward sets a Python attribute
    and assigns the buffer (so it hosts nothing)."""

    def __init__(self, inline: bool):
        super().__init__()
        self.inline = inline
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.25)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        if inline:
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        else:
            self.mlp = GPT2MLP(16, 32)

    def forward(self, x):
        if self.inline:
            self.steps.add_(1)  # (in the fused graph; ``self.steps += 1`` would assign the buffer: no host)
        else:
            self.steps += 1
        h = self.drop(self.bn(x))
        if self.inline:
            return self.fc2(F.gelu(self.fc1(h)))
        self.rows = x.shape[0]
        return self.mlp(h)


@pytest.mark.parametrize("inline", [True, False])
def test_example_inputs_leave_a_training_model_as_it_was(inline):
    model = CountingModel(inline).train()
    x = torch.randn(6, 16) + 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attributes = {m: dict(vars(m)) for m in model.modules()}
    rng = torch.get_rng_state()
    fast = fxfuse.optimize(model, example_inputs=(x,))
    # The example run (and the shape propagation of each fused graph) changed nothing of the model's.
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype for k in before)
    assert all(vars(m).keys() == attrs.keys() and all(vars(m)[k] is v for k, v in attrs.items())
               for m, attrs in attributes.items())
    # ... and it still recorded the shapes: the region's cost is predicted at the example's M.
    report = fxfuse.report(fast)
    assert [r.host_path for r in report.regions] == ["" if inline else "mlp"] and count_fused(fast) == 1
    assert "at M=6" in str(report)
    # The optimized model computes what the model computes, training-mode dropout draws included.
    ref = copy.deepcopy(model).double()
    x = torch.randn(5, 16)
    torch.manual_seed(1)
    with torch.no_grad():
        out = fast(x)
    torch.manual_seed(1)
    with torch.no_grad():
        expected = ref(x.double())
    assert rel_err(out, expected) < 1e-5
    assert model.steps.item() == 1 and model.bn.num_batches_tracked.item() == 1  # (state shared with the model)


def test_example_inputs_that_do_not_fit_print_nothing_and_the_report_says_why(capfd):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()
    fast = fxfuse.optimize(model, example_inputs=(torch.randn(4, 8),))  # 8 features: the model takes 16
    assert capfd.readouterr().err == ""  # (torch's shape propagation printed the failing node's traceback)
    (rejection,) = fxfuse.report(fast).rejections
    assert "input has 8" in rejection.reason, rejection.reason
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_control_flow_outside_the_mlp_falls_back_to_submodules():
    model = ControlFlowModel().eval()
    fast = fxfuse.optimize(model, example_inputs=(torch.randn(3, 32),))
    report = fxfuse.report(fast)
    assert [f.module_path for f in report.capture_failures] == [""]
    assert [r.module_path for r in report.regions] == ["mlp"]
    assert isinstance(fast, ControlFlowModel) and fast is not model
    assert isinstance(model.mlp, GPT2MLP)  # the original keeps its own submodule
    assert count_fused(fast) == 1
    for sign in (1, -1):  # both sides of the branch
        check_same_function(model, fast, sign * (torch.rand(3, 32) + 0.1))
    assert "whole model" in str(report)


def test_report_lists_fused_and_unfused_with_reasons():
    class TwoMLPs(nn.Module):
        def __init__(self):
            super().__init__()
            self.good = GPT2MLP()
            self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return self.good(x) + self.fc2(h) + h.sum(-1, keepdim=True)  # h used twice

    fast = fxfuse.optimize(TwoMLPs().eval())
    report = fxfuse.report(fast)
    assert [(r.module_path, r.strategy) for r in report.regions] == [("good", "fused_chain (1 launch)")]
    assert all(os.path.exists(k) for r in report.regions for k in r.kernels)
    assert len(report.rejections) >= 1
    assert any("used" in r.reason for r in report.rejections)
    text = str(report)
    assert "good" in text and "not fused" in text


def test_negative_cases_stay_unfused_and_correct(caplog):
    class Unsupported(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(torch.erfinv(torch.tanh(self.fc1(x)) * 0.5))

    model = Unsupported().eval()
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        fast = fxfuse.optimize(model)
    assert count_fused(fast) == 0
    assert any("erfinv" in r.reason for r in fxfuse.report(fast).rejections)
    assert any("erfinv" in r.getMessage() for r in caplog.records)  # the matcher says why (TORCH_LOGS=+fxfuse)
    check_same_function(model, fast, torch.randn(4, 16))
    model64 = GPT2MLP().double().eval()
    fast64 = fxfuse.optimize(model64)
    assert count_fused(fast64) == 0
    assert any("float64" in r.reason for r in fxfuse.report(fast64).rejections)
    x = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(fast64(x), model64(x))


@pytest.mark.parametrize("first", ["torch", "fxfuse"])
def test_torch_logs_prints_each_line_once(first):
    # TORCH_LOGS=+fxfuse: torch's parser imports fxfuse itself when torch comes first; either order, one handler.
    import subprocess
    import sys

    code = (f"import {first}, logging, torch, fxfuse; "
            "print(len(logging.getLogger('fxfuse').handlers), logging.getLogger('fxfuse').getEffectiveLevel())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TORCH_LOGS": "+fxfuse"}).stdout.split()
    assert out == ["1", str(logging.DEBUG)]


def test_weights_computed_in_the_forward_stay_unfused_and_say_why():
    class Scaled(nn.Module):  # equalized learning rate: the weight is an op's output
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(32, 16)), nn.Parameter(torch.randn(16, 32))

        def forward(self, x):
            return F.linear(torch.relu(F.linear(x, self.w1 * 0.25)), self.w2 * 0.25)

    normed = GPT2MLP().eval()
    torch.nn.utils.parametrizations.weight_norm(normed.c_fc)
    for model, x, what in [(Scaled(), torch.randn(4, 16), "weight mul "),
                           (normed, torch.randn(4, 32), "c_fc.weight (a parametrization")]:
        fast = fxfuse.optimize(model)
        report = fxfuse.report(fast)
        assert count_fused(fast) == 0 and not report.regions
        assert any("computed on every call" in r.reason and what in r.reason for r in report.rejections), report
        check_same_function(model, fast, x)


def test_user_pattern_with_generated_epilogue_and_with_replacement():
    class ScaledMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(24, 40), nn.Linear(40, 24)
            self.scale = nn.Parameter(torch.rand(40) + 0.5)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)) * self.scale)

    def relu_scale(x, w1, b1, scale, w2, b2):
        return F.linear(torch.relu(F.linear(x, w1, b1)) * scale, w2, b2)

    model = ScaledMLP().eval()
    x = torch.randn(6, 24)
    fxfuse.register_pattern(relu_scale, name="relu_scale")
    try:
        fast = fxfuse.optimize(model)
        assert [r.pattern for r in fxfuse.report(fast).regions] == ["relu_scale"]
        assert count_fused(fast) == 1
        check_same_function(model, fast, x)
    finally:
        fxfuse.unregister_pattern("relu_scale")

    calls = []

    def my_impl(x, w1, b1, scale, w2, b2):
        calls.append(x.shape)
        return F.linear(torch.relu(F.linear(x, w1, b1)) * scale, w2, b2)

    fxfuse.register_pattern(relu_scale, name="relu_scale_custom", replacement=my_impl)
    try:
        fast = fxfuse.optimize(model)
        assert fxfuse.report(fast).regions[0].strategy == "user replacement"
        check_same_function(model, fast, x)
        assert calls == [x.shape]
    finally:
        fxfuse.unregister_pattern("relu_scale_custom")


def test_training_gradients_match_eager():
    model = GatedMLP().train()
    fast = fxfuse.optimize(model)
    assert count_fused(fast) == 1
    assert any("backward" in n for r in fxfuse.report(fast).regions for n in r.notes)
    x = torch.randn(4, 32, requires_grad=True)
    ref_model = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(True)
    fast(x).square().sum().backward()
    ref_model(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def _runs_fused_op(out: torch.Tensor, depth: int = 3) -> bool:
    """Whether the fused op is among the last ``depth`` autograd nodes that made ``out`` (dropout may follow)."""
    nodes = [out.grad_fn]
    for _ in range(depth):
        if any(n is not None and ("fxfuse_mlp" in n.name() or "FusedMLP" in n.name()) for n in nodes):
            return True
        nodes = [f for n in nodes if n is not None for f, _ in n.next_functions]
    return False


def test_torch_func_grad_over_an_optimized_model(untrained_specs):
    # Inside torch.func transforms a region runs its original ops: per-parameter gradients equal the original's.
    from torch.func import functional_call, grad

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fast = fxfuse.optimize(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(5, 8)
    got = grad(lambda p: functional_call(fast, p, (x,)).square().sum())(params)
    ref = grad(lambda p: functional_call(model, p, (x,)).square().sum())(params)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_gradient_recording_calls_skip_autograd_functions_signature_binding(untrained_specs, monkeypatch):
    # Function.apply binds its arguments through inspect on every call (tens of µs of host per forward); the
    # fused Function's own apply skips that outside functorch transforms, with the same gradients.
    import inspect

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fast = fxfuse.optimize(model)
    x = torch.randn(5, 8, requires_grad=True)
    fast(x)  # the first call captures and plans (which may inspect); the next calls are the hot path

    def no_signature(*args, **kwargs):
        raise AssertionError("inspect.signature on the forward path")

    monkeypatch.setattr(inspect, "signature", no_signature)
    out = fast(x)
    assert _runs_fused_op(out)
    out.square().sum().backward()
    monkeypatch.undo()
    x_ref = x.detach().clone().requires_grad_(True)
    model(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)


def test_trained_region_records_gradients_through_the_original_ops(untrained_specs):
    # The op's backward recomputes the forward; a training step must not pay it twice. After the first
    # backward, gradient-recording calls run the original ops (eager's autograd keeps the intermediates),
    # gradients stay eager's at every step, and a no_grad call still runs the fused op.
    model = GatedMLP().train()
    fast = fxfuse.optimize(model)
    ref_model = copy.deepcopy(model)
    runs_op = []
    for _ in range(3):
        x = torch.randn(4, 32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        out = fast(x)
        runs_op.append(_runs_fused_op(out))
        out.square().sum().backward()
        ref_model(x_ref).square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
        for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert runs_op == [True, False, False]
    with torch.no_grad(), FusedOpCalls() as calls:
        fast(torch.randn(4, 32))
    assert calls.n == 1


def test_gradient_recording_inference_stays_fused(untrained_specs):
    # Inference without torch.no_grad() records gradients nobody asks for: the fused op keeps running.
    model = GatedMLP().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 32)
    for _ in range(2):
        out = fast(x)
        assert out.requires_grad and _runs_fused_op(out)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_on_gpu(dtype, untrained_specs):
    # The fused kernels run in the first step's forward and in no_grad calls (in every step for the NeRF chain,
    # whose backward is fused too: tests/test_chain_backward.py); gradients are eager's throughout.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for model in (GPT2MLP(256, 1024), GatedMLP(256, 768), nerf_mlp((32, 64, 64, 64, 16))):
        fused_backward = isinstance(model, nn.Sequential)
        model = model.cuda().to(dtype).train()
        fast = fxfuse.optimize(model)
        ref_model = copy.deepcopy(model)
        for step in range(3):
            x = torch.randn(64, model_in(model), device="cuda", dtype=dtype, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_(True)
            torch.manual_seed(step)  # the same dropout mask (GPT2MLP) in both
            out = fast(x)
            torch.manual_seed(step)
            ref = ref_model(x_ref)
            assert _runs_fused_op(out) == (step == 0 or fused_backward)
            grad = torch.randn_like(ref)
            out.backward(grad)
            ref.backward(grad)
            assert rel_err(x.grad, x_ref.grad) < tol
            for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
                assert rel_err(p.grad, p_ref.grad) < tol, name
            model.zero_grad()
            ref_model.zero_grad()
        with torch.no_grad(), FusedOpCalls() as calls:
            fast(x)
        assert calls.n >= 1


class FusedOpCalls(torch.overrides.TorchFunctionMode):
    """Counts ``torch.ops.fxfuse.mlp`` calls made while active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func is FUSED_OP
        return func(*args, **(kwargs or {}))


def test_optimize_is_fast_on_a_12_block_model():
    model = Stack(blocks=12).eval()
    fxfuse.optimize(model)  # warm: pattern graphs traced once per process
    start = time.perf_counter()
    fast = fxfuse.optimize(model)
    elapsed = time.perf_counter() - start
    assert count_fused(fast) == 12
    assert elapsed < 1.0, f"optimize took {elapsed:.2f}s"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_optimize_on_gpu(dtype):
    for model in (GPT2MLP(256, 1024), GatedMLP(256, 768), nerf_mlp((32, 64, 64, 64, 16)), Stack(2, 64, 256)):
        model = model.cuda().to(dtype).eval()
        x = torch.randn(4, 33, model_in(model), device="cuda", dtype=dtype)
        fast = fxfuse.optimize(model, example_inputs=(x,))
        assert count_fused(fast) >= 1
        check_same_function(model, fast, x, tol=1e-4 if dtype == torch.float32 else 2e-2)


def test_torch_export_keeps_the_fused_op():
    model = GatedMLP().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 32)
    exported = torch.export.export(fast, (x,))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets == [FUSED_OP]
    check_same_function(model, exported.module(), x)


@pytest.mark.parametrize("make_model", [
    lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)),
    lambda: nerf_mlp(),
    lambda: GPT2MLP(),
    lambda: Block(),
])
@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_records_the_original_ops(make_model, grad):
    """Under torch.jit.trace a region runs its original ops (traced sizes are tensors, which the kernels' choice
    cannot take): the ScriptModule holds plain aten ops and computes the model's function at other shapes too."""
    model = make_model().eval()
    fast = fxfuse.optimize(model)
    assert count_fused(fast) == 1
    x = torch.randn(4, model_in(model))
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(fast, (x,), check_trace=False)
    assert isinstance(traced, torch.jit.ScriptModule)
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert "aten::linear" in kinds and not any(k.startswith("fxfuse::") for k in kinds)
    for new in (torch.randn(4, model_in(model)), torch.randn(3, 7, model_in(model))):  # another input, shape
        with torch.no_grad():
            assert torch.equal(traced(new), model(new))
        check_same_function(model, fast, new)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU6(), nn.Hardtanh(), "relu_squared"])
def test_a_nan_in_the_input_reaches_the_output_as_in_eager(device, act):
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
            self.act = act if isinstance(act, nn.Module) else None

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(torch.relu(h) ** 2 if self.act is None else self.act(h))

    model = MLP().to(device).eval()
    fast = fxfuse.optimize(model)
    assert len(fxfuse.report(fast).regions) == 1
    x = torch.randn(4, 8, device=device)
    x[1, 3] = float("nan")
    with torch.no_grad():
        got, want = fast(x), model(x)
    assert torch.isnan(want[1]).all() and torch.isnan(got[1]).all()
    torch.testing.assert_close(got[[0, 2, 3]], want[[0, 2, 3]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_torch_func_vmap_over_an_optimized_model(grad_mode):
    from torch.func import vmap

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 5, 8)
    with torch.set_grad_enabled(grad_mode):
        torch.testing.assert_close(vmap(fast)(x), vmap(model)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frozen", [True, False])
def test_forward_mode_ad_through_an_optimized_model(frozen):
    """Forward AD (``dual_level``): the tangent is eager's, with frozen weights (the kernels would drop it) and with
    trained ones (the fused Function has no jvp)."""
    import torch.autograd.forward_ad as fwAD

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 4)).requires_grad_(not frozen)
    fast = fxfuse.optimize(model)
    x, t = torch.randn(5, 8), torch.randn(5, 8)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(fast(fwAD.make_dual(x, t)))
        want = fwAD.unpack_dual(model(fwAD.make_dual(x, t)))
    assert out.tangent is not None
    torch.testing.assert_close(out.primal, want.primal, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.tangent, want.tangent, rtol=1e-5, atol=1e-5)
    assert fused_calls(fast, x)[0] == 1  # fused again outside it


def test_a_vectorized_jacobian_takes_the_original_backward_quietly(caplog):
    """``jacobian(vectorize=True)`` hands the backward a batched gradient (outside any torch.func transform): the
    region's backward runs the original ops' path without trying the fused kernel (which failed with a warning)."""
    from torch.autograd.functional import jacobian

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 8)
    with caplog.at_level("WARNING", logger="fxfuse"):
        got = jacobian(fast, x, vectorize=True)
    torch.testing.assert_close(got, jacobian(model, x), rtol=1e-5, atol=1e-5)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


@pytest.mark.parametrize("make", [GPT2MLP, nerf_mlp])
def test_a_bias_written_in_place_between_forward_and_backward_raises_autograds_error(make, untrained_specs):
    """The fused op saves its biases (eager's backward reads none, its pre-activations instead): a bias written in
    place between the forward and the backward is autograd's in-place error here, never a wrong gradient."""
    model = make().eval()
    fast = fxfuse.optimize(model)
    out = fast(torch.randn(5, next(model.parameters()).shape[1]))
    with torch.no_grad():
        next(p for name, p in model.named_parameters() if name.endswith("bias")).add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()


def test_the_report_counts_original_runs_per_module_and_keeps_an_optimized_models_regions():
    model = Stack(blocks=2).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32)
    with torch.no_grad():
        fast.blocks[1].mlp.train()  # (its graph has no dropout: the original method runs, counted for it alone)
        fast(x)
        fast(x)
    text = str(fxfuse.report(fast))
    assert "blocks.1.mlp" in text and "2 calls ran the original code" in text
    assert "1 call ran" not in text and text.count("ran the original code (see below)") == 1
    again = fxfuse.optimize(fast)  # (nothing new to fuse: the regions it runs are the first optimize's)
    assert [r.module_path for r in fxfuse.report(again).regions] == [r.module_path for r in fxfuse.report(fast).regions]


def test_the_report_says_when_the_fused_backward_is_turned_off(monkeypatch):
    model = nerf_mlp().train()
    monkeypatch.setenv("FXFUSE_FUSED_BACKWARD", "0")
    notes = [n for r in fxfuse.report(fxfuse.optimize(model)).regions for n in r.notes]
    assert any("turned off by FXFUSE_FUSED_BACKWARD=0" in n for n in notes), notes
    monkeypatch.delenv("FXFUSE_FUSED_BACKWARD")
    notes = [n for r in fxfuse.report(fxfuse.optimize(model)).regions for n in r.notes]
    assert not any("turned off" in n for n in notes), notes


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the report says without a CUDA device")
def test_the_report_says_that_cpu_calls_run_the_original_ops_without_the_interpreter(monkeypatch):
    fast = fxfuse.optimize(GPT2MLP().eval())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CPU calls run the regions' original ops" in str(fxfuse.report(fast))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "CPU calls run" not in str(fxfuse.report(fast))


class _Checkpointed(torch.nn.Module):
    """An MLP under non-reentrant activation checkpointing (as transformers' gradient_checkpointing_enable())."""

    def __init__(self):
        super().__init__()
        self.mlp = GPT2MLP().eval()  # (eval: no dropout; still trained)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)


class _Watching(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["flop counter", "function mode"])
def test_a_checkpointed_forward_under_a_mode_recomputes_what_it_ran(mode):
    """The forward runs under a mode (FlopCounterMode's global module hooks, a TorchFunctionMode), the backward
    and its recomputation outside it: both must run the same code (else checkpoint's saved tensors differ)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _Checkpointed()
    eager = copy.deepcopy(model)
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 5, 32)
    for _ in range(2):  # (the second after a backward marked the region trained)
        grads = []
        for m in (fast, eager):
            m.zero_grad()
            with FlopCounterMode(display=False) if mode == "flop counter" else _Watching():
                y = m(x)
            y.square().sum().backward()
            grads.append([p.grad for p in m.parameters()])
        for g, want in zip(*grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)


class _RoundsLinears(torch.Tensor):
    """A numerics-study subclass: each linear's output rounded to bf16."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.to(torch.bfloat16).to(out.dtype).as_subclass(cls) if func is F.linear else out


class _KnowsSomeFunctions(torch.Tensor):
    """A subclass handling a fixed set of functions (returns NotImplemented for others)."""

    HANDLED = {F.linear, F.relu, torch.relu, F.gelu}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in cls.HANDLED and not getattr(func, "__name__", "").startswith("__"):
            return NotImplemented
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("subclass", [_RoundsLinears, _KnowsSomeFunctions])
def test_a_tensor_subclass_input_sees_the_original_ops(subclass):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    fast = fxfuse.optimize(model)
    assert len(fxfuse.report(fast).regions) == 1
    x = torch.randn(4, 16).as_subclass(subclass)
    with torch.no_grad():
        out, want = fast(x), model(x)
    assert type(out) is type(want) is subclass
    torch.testing.assert_close(out.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor), rtol=0, atol=0)


def test_a_mode_dependent_region_says_which_mode_it_was_fused_for():
    for mode, other in (("train", "eval"), ("eval", "training")):
        fast = fxfuse.optimize(getattr(Block(), mode)())
        (region,) = fxfuse.report(fast).regions
        assert any(f"calls in {other} mode run the original code" in n for n in region.notes), region.notes
    fast = fxfuse.optimize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).train())
    assert not any("mode run the original" in n for n in fxfuse.report(fast).regions[0].notes)


def test_a_parameter_fed_to_a_region_runs_the_kernels(monkeypatch):
    # (a learned query table through an MLP: a Parameter is no user subclass)
    class Queries(nn.Module):
        def __init__(self):
            super().__init__()
            self.queries = nn.Parameter(torch.randn(6, 16))
            self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

        def forward(self):
            return self.mlp(self.queries)

    model = Queries().eval()
    fast = fxfuse.optimize(model)
    dispatched = []
    dispatch = fxfuse.ops._dispatch
    monkeypatch.setattr(fxfuse.ops, "_dispatch", lambda *args: dispatched.append(type(args[0])) or dispatch(*args))
    with torch.no_grad():
        torch.testing.assert_close(fast(), model(), rtol=1e-5, atol=1e-5)
    assert dispatched == [nn.Parameter]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a process without a CUDA device")
def test_without_cuda_or_the_interpreter_a_fused_method_runs_its_original_code(tmp_path):
    # Nothing can run the kernels: the original code runs (eager's bits, eager's host cost; the regions' reference
    # ops differ in rounding: GPT-2's written-out GELU is F.gelu(approximate="tanh") there), and optimize()
    # leaves Python's and NumPy's random generators as they were with example inputs too.
    import subprocess
    import sys

    code = """
import math, random, numpy as np, torch, torch.nn as nn, fxfuse
class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
class LayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(32, 128), NewGELU(), nn.Linear(128, 32))
    def forward(self, x):
        if random.uniform(0, 1) < 0.0 or np.random.random() < 0.0:
            return x
        return x + self.mlp(x)
model = LayerDrop().eval().to(torch.bfloat16)
x = torch.randn(4, 32, dtype=torch.bfloat16)
random.seed(0); np.random.seed(0)
states = random.getstate(), np.random.get_state()[1].copy()
fast = fxfuse.optimize(model, example_inputs=(x,))
assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
assert len(fxfuse.report(fast).regions) == 1
calls = []
dispatch = fxfuse.ops._dispatch
fxfuse.ops._dispatch = lambda *a: calls.append(1) or dispatch(*a)
for grad in (False, True):
    with torch.set_grad_enabled(grad):
        assert torch.equal(fast(x), model(x))
print("ok", len(calls))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "0"], out.stdout
