"""What a user does to a model after ``fxfuse.optimize``: rebinding what its code reads (a module-level name, a
config attribute, the class's method), deep copies, replaced buffers and parameters, dtype moves, frozen weights
and grad modes. The optimized model must compute what eager does on the same parameters (or raise what it
raises); running the original code instead is fine, and is counted. (tests/test_robustness.py has hooks,
replaced submodules, settings changed in place, bad inputs and ranks.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import GPT2MLP, GatedMLP, nerf_mlp
from real_models import fused_calls
from test_robustness import InlineStyle
from torch import nn

import fxfuse

TOL = dict(rtol=1e-5, atol=1e-6)


def check(fast, reference, x, fused, **tol):
    """``fast(x)`` equals ``reference(x)``, with ``fused`` fused calls."""
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        ref = reference(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **(tol or TOL))
    assert n == fused


def reasons(fast) -> list[str]:
    return [o.reason for o in fxfuse.report(fast).original_runs]


SCALE = 2.0


class GlobalScaled(nn.Module):
    """Reads a module-level number in its forward: the trace bakes it into the graph."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)) * SCALE)


def test_a_module_level_name_rebound_after_optimize_runs_the_original_code():
    global SCALE
    model = GlobalScaled().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32)
    check(fast, model, x, 1)
    try:
        SCALE = 3.0
        check(fast, model, x, 0)
        assert reasons(fast) == ["module-level SCALE was 2.0, is 3.0 since it was fused"]
    finally:
        SCALE = 2.0
    check(fast, model, x, 1)  # fused again once it is back


class Config:
    def __init__(self):
        self.scale, self.act, self.unused = 2.0, "gelu", 1


class ConfigScaled(nn.Module):
    """Reads settings through a config object (``self.config.x``), as Hugging Face code does."""

    def __init__(self):
        super().__init__()
        self.config = Config()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        h = self.fc1(x)
        h = F.gelu(h) if self.config.act == "gelu" else F.relu(h)
        return self.fc2(h * self.config.scale)


@pytest.mark.parametrize("name, value", [("scale", 3.0), ("act", "relu")])
def test_a_config_attribute_changed_after_optimize_runs_the_original_code(name, value):
    model = ConfigScaled().eval()
    fast = fxfuse.optimize(model)
    assert fast.config is model.config  # (shared: the copy is shallow)
    x = torch.randn(3, 32)
    check(fast, model, x, 1)
    model.config.unused = 5  # not read by forward: stays fused
    check(fast, model, x, 1)
    was = getattr(model.config, name)
    setattr(model.config, name, value)
    check(fast, model, x, 0)
    assert reasons(fast) == [f"its config.{name} was {was!r}, is {value!r} since it was fused"]
    setattr(model.config, name, was)
    check(fast, model, x, 1)


def test_a_deep_copy_still_sees_a_global_module_hook():
    # The copy's guards must read torch's global hook dicts, not copies of them made by deepcopy.
    x = torch.randn(3, 32)
    for make in (GPT2MLP, InlineStyle):
        model = make().eval()
        twin = copy.deepcopy(fxfuse.optimize(model))
        check(twin, model, x, 1)
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, a, out: out * 2 if isinstance(m, nn.Linear) else None)
        try:
            check(twin, model, x, 0)
        finally:
            handle.remove()
        check(twin, model, x, 1)


class Patched(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("cls", [Patched, InlineStyle])
def test_a_class_method_patched_after_optimize_runs_the_new_method(cls, monkeypatch):
    # A library that patches the class's forward after optimize (a fused graph host, an inline hand-off parent).
    model = cls().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32)
    check(fast, model, x, 1)
    monkeypatch.setattr(cls, "forward", lambda self, x: self.fc2(torch.relu(self.fc1(x))) * 2)
    check(fast, model, x, 0)
    assert reasons(fast) == [f"{cls.__qualname__}.forward was replaced since "
                             f"{'the hand-off was proven' if cls is InlineStyle else 'it was fused'}"]
    monkeypatch.undo()
    check(fast, model, x, 1)


class BufScaled(nn.Module):
    """A buffer operand in the chain's epilogue (``h * mul``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.register_buffer("mul", torch.full((64,), 2.0))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)) * self.mul)


def test_a_buffer_operand_replaced_by_another_shape_follows_eager():
    x = torch.randn(3, 32)
    for new in (torch.tensor(3.0), torch.full((1,), 3.0), torch.randn(128)[::2]):  # still along the last dim
        model = BufScaled().eval()
        fast = fxfuse.optimize(model)
        model.mul = new  # (the buffer dict is shared)
        check(fast, model, x, 1)
    for new in (torch.randn(3, 64), torch.randn(2, 3, 64)):  # eager broadcasts it over rows (and dims)
        model = BufScaled().eval()
        fast = fxfuse.optimize(model)
        model.mul = new
        check(fast, model, x, 1)  # (the op's reference ops, with eager's broadcasting)
    model = BufScaled().eval()
    fast = fxfuse.optimize(model)
    model.mul = torch.randn(64, 1)  # eager raises (3 rows against 64): so must the optimized model
    with pytest.raises(RuntimeError) as eager:
        model(x)
    with pytest.raises(RuntimeError) as fused:
        fast(x)
    assert str(fused.value) == str(eager.value)


class TensorScaled(nn.Module):
    """A plain tensor attribute (not a buffer: ``.half()`` leaves it as it is) as an epilogue operand."""

    def __init__(self, shape=(64,)):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.mul = torch.full(shape, 2.0)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)) * self.mul)


def test_an_fp32_operand_beside_other_weights_follows_eager():
    x = torch.randn(3, 32)
    # A [64] fp32 operand promotes h to fp32 in eager, and fc2's fp16 weight then raises: so must the fused model.
    model = TensorScaled().eval()
    fast = fxfuse.optimize(model)
    check(fast, model, x, 1)
    fast.half()
    with pytest.raises(RuntimeError) as eager:
        model(x.half())
    with pytest.raises(RuntimeError) as fused:
        fast(x.half())
    assert str(fused.value) == str(eager.value)
    # A 0-d fp32 operand does not promote: eager runs in the weights' dtype, in the kernels (fp16) and in the
    # reference ops (bf16 on the CPU) alike.
    for dtype in (torch.float16, torch.bfloat16):
        model = TensorScaled(()).eval()
        fast = fxfuse.optimize(model)
        fast.to(dtype)
        check(fast, model, x.to(dtype), 1, rtol=2e-2, atol=2e-2)


def test_a_plain_tensor_attribute_changed_after_optimize_is_read_on_every_call():
    model = TensorScaled().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32)
    check(fast, model, x, 1)
    model.mul.mul_(1.5)  # in place: shared
    check(fast, model, x, 1)
    fast.mul = torch.randn(64)  # rebound on the optimized model (the host copy's own attribute)
    check(fast, lambda x: TensorScaled.forward(fast, x), x, 1)


@pytest.mark.parametrize("make", [GPT2MLP, lambda: GatedMLP(act="gelu"), InlineStyle, nerf_mlp])
def test_weights_changed_after_optimize_are_read_on_every_call(make):
    model = make().eval()
    fast = fxfuse.optimize(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    x = torch.randn(3, linears[0].in_features)
    check(fast, model, x, 1)
    fast.load_state_dict({k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()})
    check(fast, model, x, 1)
    for p in model.parameters():
        p.data = torch.randn_like(p) * 0.1  # (what .to() does without overwriting the parameters)
    check(fast, model, x, 1)
    with torch.no_grad():
        for p in fast.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    check(fast, model, x, 1)
    # New Parameters of other hidden widths (a gated MLP's gate and up read the same input: both widened).
    width = {m: 2 * m.out_features for m in linears[:-1]} | {linears[-1]: linears[-1].out_features}
    for lin in linears:
        inner = lin is not linears[0] and not (isinstance(model, GatedMLP) and lin is model.up_proj)
        lin.weight = nn.Parameter(torch.randn(width[lin], 2 * lin.in_features if inner else lin.in_features) * 0.1)
        if lin.bias is not None:
            lin.bias = nn.Parameter(torch.randn(width[lin]) * 0.1)
    check(fast, model, x, 1)


@pytest.mark.parametrize("make", [GPT2MLP, InlineStyle])
def test_moving_the_original_model_moves_the_optimized_one(make):
    model = make().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float16, 2e-2), (torch.float32, 1e-5)):
        model.to(dtype)  # the parameters are shared
        assert next(fast.parameters()).dtype is dtype
        check(fast, model, x.to(dtype), 1, rtol=tol, atol=tol)


@pytest.mark.parametrize("make", [GPT2MLP, nerf_mlp])
def test_frozen_weights_and_grad_modes_after_optimize(make):
    model = make().eval()
    fast = fxfuse.optimize(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    linears[0].requires_grad_(False)
    x = torch.randn(3, linears[0].in_features, requires_grad=True)
    out = fast(x)
    out.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    x.grad = None
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, **TOL)
    assert linears[0].weight.grad is None
    for g, want in zip(grads, [x.grad] + [p.grad for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out, ref = fast(x), model(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, ref, **TOL)



def test_hooks_and_buffers_registered_on_either_model_stay_on_it():
    """The optimized model is a copy: a hook registered on a module it copied is not on the user's, and back
    (parameters and buffers are shared)."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.norm = GPT2MLP(), nn.LayerNorm(32)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    model = nn.Sequential(Block(), Block()).eval()
    ref = copy.deepcopy(model)
    fast = fxfuse.optimize(model)
    assert [r.module_path for r in fxfuse.report(fast).regions] == ["0.mlp", "1.mlp"]
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = model(x)
        for m in (fast, ref):
            m.register_forward_hook(lambda mod, args, out: out * 2)
            m[0].mlp.register_forward_hook(lambda mod, args, out: out + 100)
        assert not model._forward_hooks and not model[0].mlp._forward_hooks
        torch.testing.assert_close(model(x), want)
        model[1].mlp.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
        torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)


def test_train_and_eval_on_either_model_leave_the_other_as_it_was():
    """Every module of the optimized model is a copy with its own training flag, an untouched one (the dropout
    before the MLP, the norm, the head) included; parameters and buffers stay the same tensors."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.norm, self.mlp, self.head = nn.Dropout(0.5), nn.LayerNorm(32), GPT2MLP(), nn.Linear(32, 8)
            self.tied = self.head  # one module at two paths: one copy

        def forward(self, x):
            return self.head(self.mlp(self.norm(self.drop(x))))

    model = Net().eval()
    fast = fxfuse.optimize(model)
    assert [r.module_path for r in fxfuse.report(fast).regions] == ["mlp"]
    assert all(a is not b for a, b in zip(model.modules(), fast.modules())) and fast.tied is fast.head
    assert all(fast.state_dict(keep_vars=True)[k] is v for k, v in model.state_dict(keep_vars=True).items())
    x = torch.randn(6, 32)
    fast.train()
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))  # the user's dropout is still off
        model.train()
        fast.eval()
        assert all(m.training for m in model.modules()) and not any(m.training for m in fast.modules())
        check(fast, Net.forward.__get__(model.eval()), x, 1, rtol=1e-5, atol=1e-5)


def test_optimizing_an_optimized_model_keeps_its_guards_on_the_new_copies():
    model = nn.Sequential(GPT2MLP(), GPT2MLP()).eval()
    fast = fxfuse.optimize(model)
    again = fxfuse.optimize(fast)
    x = torch.randn(4, 32)
    check(again, model, x, 2)
    again[0].act.register_forward_hook(lambda mod, args, out: out * 0)  # on again's copy of the activation only
    ref = copy.deepcopy(model)
    ref[0].act.register_forward_hook(lambda mod, args, out: out * 0)
    check(again, ref, x, 1)
    check(fast, model, x, 2)


class _DictScaled(nn.Module):
    """Reads its settings from a dict and a list (a trace bakes both in)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.cfg, self.scales = {"scale": 0.5, "act": "relu"}, [1.0, 2.0]

    def forward(self, x):
        h = torch.relu(self.fc1(x)) if self.cfg["act"] == "relu" else F.gelu(self.fc1(x))
        return self.fc2(h * self.cfg["scale"] * self.scales[1])


@pytest.mark.parametrize("change", [lambda m: m.cfg.update(scale=3.0), lambda m: m.cfg.update(act="gelu"),
                                    lambda m: m.scales.__setitem__(1, 5.0)])
def test_a_dict_or_list_of_settings_changed_in_place_runs_the_original_method(change):
    model = _DictScaled().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 16)
    check(fast, model, x, 1)
    change(model)  # (the dict and list are the same objects in both models: a shallow copy)
    check(fast, model, x, 0)
    assert "since it was fused" in reasons(fast)[0]


class _Looped(nn.Module):
    """A chain in a loop over a ModuleList (never called itself) and through a Sequential."""

    def __init__(self):
        super().__init__()
        self.up = nn.Sequential(nn.Linear(32, 64), nn.GELU())
        self.layers = nn.ModuleList([nn.Linear(64, 64), nn.ReLU()])
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        h = self.up(x)
        for layer in self.layers:
            h = layer(h)
        return self.down(h)


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("change", ["append to the Sequential", "append to the ModuleList", "swap a class"])
def test_a_container_grown_or_a_class_swapped_after_optimize_runs_the_original_method(change):
    model = _Looped().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 32)
    check(fast, model, x, 1)
    if change == "append to the Sequential":
        fast.up.append(nn.Tanh())
    elif change == "append to the ModuleList":
        fast.layers.append(nn.Linear(64, 64))
    else:
        fast.layers[0].__class__ = _Doubled
    check(fast, lambda t: _Looped.forward(fast, t), x, 0)  # (the class's own forward on the changed modules)
    assert reasons(fast)


class _ClassScaled(nn.Module):
    SCALE = 0.5  # a class attribute the method reads as self.SCALE: the trace bakes it in

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.SCALE)


def test_a_class_attribute_changed_after_optimize_runs_the_original_method():
    model = _ClassScaled().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert fused_calls(fast, x)[0] == 1
        try:
            _ClassScaled.SCALE = 2.0
            n, got = fused_calls(fast, x)
            torch.testing.assert_close(got, model(x))
            assert n == 0
        finally:
            _ClassScaled.SCALE = 0.5
        assert fused_calls(fast, x)[0] == 1


def _without_bias(model: nn.Module, name: str) -> nn.Module:
    getattr(model, name).bias = None
    return model


@pytest.mark.parametrize("kind", ["host", "chain", "inline"])
def test_a_bias_added_to_a_linear_built_without_one_runs_the_original_code(kind):
    """The trace baked "no bias" in: a parameter slot that held None and holds a tensor now is a change."""
    model, name = {"host": (GatedMLP(), "down_proj"), "chain": (nerf_mlp(bias=False), "2"),
                   "inline": (_without_bias(InlineStyle(), "fc2"), "fc2")}[kind]
    model = model.eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(5, next(model.parameters()).shape[1])
    check(fast, model, x, 1)
    linear = getattr(fast, name)
    linear.bias = nn.Parameter(torch.randn(linear.out_features))  # (the parameter dict is shared: on both)
    assert getattr(model, name).bias is linear.bias
    check(fast, model, x, 0)
    assert any("bias was None" in r for r in reasons(fast)) or kind == "inline"


class _PackedGated(nn.Module):
    """Phi-3's packed gate/up: ``gate_up_proj(x).chunk(2, dim=-1)``."""

    def __init__(self, hidden: int = 48):
        super().__init__()
        self.gate_up_proj = nn.Linear(32, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, 32, bias=False)

    def forward(self, x):
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(g) * u)


@pytest.mark.parametrize("hidden", [40, 56])
def test_a_packed_gate_up_pruned_or_grown_after_optimize_splits_where_eager_does(hidden):
    model = _PackedGated().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(5, 32)
    check(fast, model, x, 1)
    model.gate_up_proj.weight = nn.Parameter(torch.randn(2 * hidden, 32) * 0.2)  # structured pruning's way
    model.down_proj.weight = nn.Parameter(torch.randn(32, hidden) * 0.2)
    check(fast, model, x, 1)


def test_a_model_with_uninitialized_lazy_modules_is_left_as_it_is_and_says_why():
    model = nn.Sequential(nn.LazyLinear(64), nn.GELU(), nn.LazyLinear(32)).eval()
    fast = fxfuse.optimize(model)
    assert ["lazy module" in f.error for f in fxfuse.report(fast).capture_failures] == [True]
    x = torch.randn(4, 16)
    check(fast, model, x, 0)  # (its first call initializes the lazy layers, as eager's does)
    check(fxfuse.optimize(model), model, x, 1)  # initialized: fused


class _TiedChain(nn.Module):
    """Two linears of one shared (tied) weight, or weights kept as buffers."""

    def __init__(self, buffers: bool = False):
        super().__init__()
        w = torch.randn(32, 32) * 0.2
        if buffers:
            self.register_buffer("w1", w)
            self.register_buffer("w2", torch.randn(32, 32) * 0.2)
        else:
            self.w1 = self.w2 = nn.Parameter(w)

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w1)), self.w2)


@pytest.mark.parametrize("buffers", [False, True], ids=["tied", "buffers"])
def test_a_chain_of_tied_weights_or_weight_buffers_is_captured(buffers):
    model = _TiedChain(buffers).eval()
    fast = fxfuse.optimize(model)
    assert len(fxfuse.report(fast).regions) == 1
    check(fast, model, torch.randn(5, 32), 1)


class _SeparateBias(nn.Module):
    """``F.linear(..) + self.b2``: normalize folds the bias into the linear."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(64, 32) * 0.2), nn.Parameter(torch.randn(32, 64) * 0.2)
        self.b2 = nn.Parameter(torch.randn(32) * 0.1)

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w1)), self.w2) + self.b2


def test_a_folded_bias_replaced_by_one_that_broadcasts_over_more_dims_follows_eager():
    model = _SeparateBias().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(5, 32)
    check(fast, model, x, 1)
    model.b2 = nn.Parameter(torch.randn(3, 1, 32) * 0.1)  # eager broadcasts the sum to [3, 5, 32]
    check(fast, model, x, 1)  # (the op's reference ops, adding it after the product)


@pytest.mark.parametrize("make", [GPT2MLP, lambda: nerf_mlp((16, 32, 32, 16)), GatedMLP])
def test_a_frozen_first_layer_lets_the_input_be_written_before_the_backward(make):
    # Eager's first linear keeps no input when its weights are frozen, so an in-place residual (``x += mlp(x)``)
    # may write the chain's input before the backward; fxfuse's backward reads a copy of it then.
    mlp = make().eval()  # (eval: GPT2MLP's dropout draws nothing)
    pre = nn.Linear(mlp_width(mlp), mlp_width(mlp))
    model = nn.ModuleDict({"pre": pre, "mlp": mlp})

    def run(m, inp):
        x = m["pre"](inp)
        x += m["mlp"](x)
        return x

    fast = nn.ModuleDict({"pre": pre, "mlp": fxfuse.optimize(mlp)})
    assert len(fxfuse.report(fast["mlp"]).regions) == 1
    first = [m for m in mlp.modules() if isinstance(m, nn.Linear)][:2 if isinstance(mlp, GatedMLP) else 1]
    for lin in first:
        lin.requires_grad_(False)
    inp = torch.randn(5, mlp_width(mlp))
    grads = []
    for m in (fast, model):
        m.zero_grad()
        run(m, inp).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def mlp_width(mlp: nn.Module) -> int:
    return next(m for m in mlp.modules() if isinstance(m, nn.Linear)).in_features


class _Frequency:
    def __init__(self, omega: float):
        self.omega_0 = omega


class _SinePrivate(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.linear, self._omega = nn.Linear(a, b), 30.0

    def forward(self, x):
        return torch.sin(self._omega * self.linear(x))


class _SineConfig(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.linear, self.cfg = nn.Linear(a, b), _Frequency(30.0)

    def forward(self, x):
        return torch.sin(self.cfg.omega_0 * self.linear(x))


class _SineProperty(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.linear, self._w = nn.Linear(a, b), 30.0

    @property
    def omega_0(self):
        return self._w

    def forward(self, x):
        return torch.sin(self.omega_0 * self.linear(x))


class _HostPrivate(nn.Module):
    def __init__(self):
        super().__init__()
        self._omega, self.l1, self.l2 = 30.0, nn.Linear(2, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.l2(torch.sin(self._omega * self.l1(x)))


@pytest.mark.parametrize("build,change", [
    (lambda: nn.Sequential(_SinePrivate(2, 16), nn.Linear(16, 3)), lambda m: setattr(m[0], "_omega", 10.0)),
    (lambda: nn.Sequential(_SineConfig(2, 16), nn.Linear(16, 3)), lambda m: setattr(m[0], "cfg", _Frequency(10.0))),
    (lambda: nn.Sequential(_SineConfig(2, 16), nn.Linear(16, 3)), lambda m: setattr(m[0].cfg, "omega_0", 10.0)),
    (lambda: nn.Sequential(_SineProperty(2, 16), nn.Linear(16, 3)), lambda m: setattr(m[0], "_w", 10.0)),
    (_HostPrivate, lambda m: setattr(m, "_omega", 10.0)),
], ids=["submodule private", "submodule config replaced", "submodule config changed", "property", "host private"])
def test_a_setting_read_privately_or_through_an_object_changed_after_optimize_runs_the_original_code(build, change):
    # A SIREN frequency changed after optimize (a sweep): read from a private attribute (of the host or of a
    # submodule whose forward the graph traced), through a config object a submodule holds, or through a property
    # over a private field. Before, the kernel kept 30 and nothing said so (max error 1.4-1.8).
    model = build().eval()
    x = torch.rand(8, 2) * 2 - 1
    fast = fxfuse.optimize(model, (x,))
    eager = copy.deepcopy(model)
    with torch.no_grad():
        assert fused_calls(fast, x)[0] == 1
        change(fast)
        change(eager)
        n, got = fused_calls(fast, x)
        torch.testing.assert_close(got, eager(x))
        assert n == 0
    assert fxfuse.report(fast).original_runs


class _OfficialBatchLinear(nn.Linear):
    """The official SIREN repo's ``BatchLinear``, verbatim: its parameters read through ``named_parameters()``."""

    def forward(self, input, params=None):
        from collections import OrderedDict

        if params is None:
            params = OrderedDict(self.named_parameters())
        bias = params.get("bias", None)
        weight = params["weight"]
        output = input.matmul(weight.permute(*[i for i in range(len(weight.shape) - 2)], -1, -2))
        output += bias.unsqueeze(-2)
        return output


class _OfficialSiren(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.out = _OfficialBatchLinear(2, 16), _OfficialBatchLinear(16, 16), \
            _OfficialBatchLinear(16, 3)

    def forward(self, coords):
        return self.out(torch.sin(30 * self.l1(torch.sin(30 * self.l0(coords)))))


def test_parameters_read_through_named_parameters_are_not_baked_into_a_graph():
    # The trace ran weight.permute(...) and bias.unsqueeze(-2) on the real parameters and kept them as constants:
    # a replaced weight was not seen (outputs off by ~2), .double() raised, a deep copy raised. Such a method is
    # now left as it is, with the reason.
    model, x = _OfficialSiren().eval(), torch.rand(1, 24, 2) * 2 - 1
    fast = fxfuse.optimize(model, (x,))
    report = fxfuse.report(fast)
    assert not report.regions and {f.module_path for f in report.capture_failures} == {"l0", "l1", "out"}
    assert all("ParameterConstantError" in f.error for f in report.capture_failures)
    copy.deepcopy(fast)
    new = torch.randn(16, 16) * 0.1
    fast.l1.weight = nn.Parameter(new.clone())
    model.l1.weight = nn.Parameter(new.clone())
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)
    fast.double()
    with torch.no_grad():
        assert fast(x.double()).dtype == torch.float64
