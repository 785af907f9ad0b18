"""What an optimized model does with inputs and operations its author did not plan for: bad dtypes and
shapes (eager's error), any input rank and strides, dtype/device moves, train/eval, autocast, keyword
calls, export, copies. Never a wrong result, never a crash inside fxfuse."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT2MLP, Block, ControlFlowModel, GatedMLP, Stack, nerf_mlp
from real_models import fused_calls
from torch import nn

import fxfuse


def same_error(fn_eager, fn_fused):
    """Both raise, the same exception type with the same message."""
    with pytest.raises(Exception) as eager:
        fn_eager()
    with pytest.raises(Exception) as fused:
        fn_fused()
    assert type(fused.value) is type(eager.value)
    assert str(fused.value) == str(eager.value)


class InlineStyle(nn.Module):
    """A chain inline in a forward that cannot be traced: fused by the hand-off between fc1 and fc2."""

    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d)

    def forward(self, x):
        if x.numel() and x.abs().amax() > 1e6:  # data-dependent
            x = x.clamp(-1e6, 1e6)
        h = self.act(self.fc1(x))
        h = self.fc2(h)
        return h


MODELS = {
    "gpt2_mlp": lambda: GPT2MLP(),
    "gated": lambda: GatedMLP(act="gelu"),
    "nerf": lambda: nerf_mlp(),
    "block": lambda: Block(),
    "inline": lambda: InlineStyle(),
}


def width(model: nn.Module) -> int:
    return next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bad_inputs_raise_what_eager_raises(name):
    model = MODELS[name]().eval()
    fast = fxfuse.optimize(model)
    d = width(model)
    for bad in (torch.randn(3, d, dtype=torch.float64),  # unsupported dtype
                torch.randint(0, 5, (3, d)),  # integers
                torch.randn(3, d + 1),  # wrong width
                torch.randn(d)[None, None, :].expand(2, 3, d).contiguous()[..., :-1]):  # wrong width, strided
        same_error(lambda bad=bad: model(bad), lambda bad=bad: fast(bad))
    same_error(lambda: model(torch.randn(3, d), torch.randn(3, d)), lambda: fast(torch.randn(3, d), torch.randn(3, d)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_any_rank_any_strides_and_empty(name):
    model = MODELS[name]().eval()
    fast = fxfuse.optimize(model)
    d = width(model)
    base = torch.randn(4, 6, 2 * d)
    inputs = [
        torch.randn(5, d),  # 2-D
        torch.randn(2, 5, d),  # 3-D
        torch.randn(2, 3, 4, d),  # 4-D
        torch.randn(5, 2, d).transpose(0, 1),  # non-contiguous leading dims
        base[..., ::2],  # strided last dim
        torch.randn(0, d),  # empty batch
        torch.randn(d),  # 1-D: a single vector
    ]
    for x in inputs:
        with torch.no_grad():
            ref = model(x)
            out = fast(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert fused_calls(fast, torch.randn(2, 3, 4, d))[0] == 1


def test_moves_between_dtypes_after_optimize():
    model = Stack(blocks=2).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(2, 5, 32)
    for dtype, tol in ((torch.float16, 2e-2), (torch.float64, 1e-12), (torch.float32, 1e-5)):
        fast.to(dtype)  # moves the shared parameters: the original model moves with it
        assert next(model.parameters()).dtype == dtype
        n, out = fused_calls(fast, x.to(dtype))
        assert n == 2 and out.dtype == dtype
        with torch.no_grad():
            torch.testing.assert_close(out, model(x.to(dtype)), rtol=tol, atol=tol)


def test_train_eval_switch_keeps_dropout_semantics():
    model = GPT2MLP().eval()  # dropout after the chain
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 32)
    assert fused_calls(fast, x)[0] == 1
    fast.train()
    model.train()
    torch.manual_seed(5)
    ref = model(x)
    torch.manual_seed(5)
    n, out = fused_calls(fast, x)
    assert n == 0  # traced in eval mode (dropout removed): in training mode the original forward runs
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    fast.eval()
    assert fused_calls(fast, x)[0] == 1
    assert [(o.calls, o.reason) for o in fxfuse.report(fast).original_runs] == [
        (1, "it was fused in eval mode and runs in training mode")]

    class DropInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.drop, self.fc2 = nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(self.drop(torch.relu(self.fc1(x))))

    model = DropInside().train()
    fast = fxfuse.optimize(model)  # active dropout inside the chain: left unfused, with the reason
    assert fused_calls(fast, torch.randn(3, 16))[0] == 0
    assert any("dropout" in r.reason for r in fxfuse.report(fast).rejections)
    torch.manual_seed(2)
    ref = model(x[:3, :16])
    torch.manual_seed(2)
    torch.testing.assert_close(fast(x[:3, :16]), ref, rtol=0, atol=0)


def test_the_op_under_autocast_runs_the_original_ops():
    # A function mode (here the counter) sees the region as the op; under autocast the op runs the original ops,
    # which autocast as eager's do (tests/test_autocast.py has the rest).
    model = GatedMLP().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        n, out = fused_calls(fast, x)
        ref = model(x)
    assert n == 1 and out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_keyword_calls_and_guards():
    class WithOptions(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 48), nn.Linear(48, 16)

        def forward(self, x, scale=None, *, square=False):
            y = self.fc2(torch.relu(self.fc1(x)))
            if scale is not None:
                y = y * scale
            return y * y if square else y

    model = WithOptions().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 16)
    for kwargs, fused in (({}, 1), ({"x": x}, 1), ({"scale": None}, 1), ({"square": False}, 1),
                          ({"scale": 2.0}, 0), ({"square": True}, 0)):
        args = () if "x" in kwargs else (x,)
        n, out = fused_calls(fast, *args, **kwargs)
        assert n == fused, kwargs  # a call the graph was not traced for runs the original forward
        with torch.no_grad():
            torch.testing.assert_close(out, model(*args, **kwargs), rtol=1e-5, atol=1e-6)
    assert "fused only for calls with scale=None, square=False" in str(fxfuse.report(fast))


def test_state_dict_both_ways_copies_and_reoptimizing():
    model = Stack(blocks=2).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(2, 3, 32)
    other = fxfuse.optimize(Stack(blocks=2).eval())
    other.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x))
    fresh = Stack(blocks=2).eval()
    fresh.load_state_dict(fast.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x))
    twin = copy.deepcopy(fast)  # an independent copy, still fused
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    assert not torch.equal(next(twin.parameters()), next(model.parameters()))
    assert fused_calls(twin, x)[0] == 2
    again = fxfuse.optimize(fast)  # optimizing an optimized model is harmless
    n, out = fused_calls(again, x)
    assert n == 2
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def test_export_with_a_dynamic_batch():
    model = Stack(blocks=2).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 5, 32)
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(fast, (x,), dynamic_shapes=({0: batch},))
    assert sum(1 for n in exported.graph.nodes if "fxfuse" in str(n.target)) == 2
    for b in (1, 4, 9):
        xb = torch.randn(b, 5, 32)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(xb), model(xb), rtol=1e-5, atol=1e-6)


def test_torch_nn_transformer_layers():
    """torch.nn's own layers: forward has fast-path checks, the MLP is in ``_ff_block``."""
    model = nn.Transformer(32, 4, 1, 1, 64, dropout=0.1, batch_first=True).eval()
    fast = fxfuse.optimize(model)
    assert sorted(r.module_path for r in fxfuse.report(fast).regions) == ["decoder.layers.0", "encoder.layers.0"]
    src, tgt = torch.randn(2, 5, 32), torch.randn(2, 3, 32)
    n, out = fused_calls(fast, src, tgt)
    assert n == 2
    with torch.no_grad():
        torch.testing.assert_close(out, model(src, tgt), rtol=1e-4, atol=1e-5)


def test_hooks_and_replaced_submodules_after_optimize():
    # The fused graph skips the __call__ of the modules it absorbed or traced into: a hook there (registered before
    # optimize or after, global too), an instance forward, or a replaced, removed or added submodule must make
    # the original method run, not be silently ignored.
    x = torch.randn(3, 32)

    def check(fast, model, fused):
        n, out = fused_calls(fast, x)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
        assert n == fused

    model = GPT2MLP().eval()
    handle = model.c_fc.register_forward_hook(lambda m, a, out: out * 0.5 + 1)
    fast = fxfuse.optimize(model)
    check(fast, model, 0)
    handle.remove()  # from the user's model: the optimized copy of c_fc took the hook with it and keeps it
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model.c_proj(model.act(model.c_fc(x) * 0.5 + 1)), rtol=1e-5, atol=1e-6)
    assert n == 0
    fast = fxfuse.optimize(model)
    check(fast, model, 1)  # optimized after the hook is gone: fused
    for register in (lambda m: [m.c_proj.register_forward_pre_hook(lambda m, a: (a[0] * 2,))],
                     lambda m: [m.act.register_forward_hook(lambda m, a, out: out + 1)],
                     lambda m: [nn.modules.module.register_module_forward_hook(
                         lambda m, a, out: out * 2 if isinstance(m, nn.Linear) else None)] if m is fast else []):
        ref = copy.deepcopy(model)  # (the optimized model's modules are copies: the hook is on its own)
        handles = register(fast) + register(ref)
        check(fast, ref, 0)
        for handle in handles:
            handle.remove()
    seen = []
    handle = fast.c_fc.register_full_backward_hook(lambda m, gi, go: seen.append(1))
    fast(x.requires_grad_()).sum().backward()
    handle.remove()
    assert seen == [1]
    fast.c_fc.forward = lambda h: nn.Linear.forward(fast.c_fc, h) * 2  # (accelerate wraps forward like this)
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model.c_proj(model.act(model.c_fc(x) * 2)), rtol=1e-5, atol=1e-6)
    assert n == 0
    del fast.c_fc.forward
    fast.act = nn.ReLU()  # on the copy only: the model keeps its GELU
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model.c_proj(torch.relu(model.c_fc(x))), rtol=1e-5, atol=1e-6)
    assert n == 0 and isinstance(model.act, nn.GELU)

    seq = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).eval()
    fast = fxfuse.optimize(seq)
    fast.append(nn.Tanh())
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, torch.tanh(seq(x)), rtol=1e-5, atol=1e-6)
    del fast[1]  # renumbered: "2" is gone
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, torch.tanh(seq[2](seq[0](x))), rtol=1e-5, atol=1e-6)
    assert n == 0 and len(seq) == 3


def test_monte_carlo_dropout_after_optimize():
    # Dropout switched on alone in an eval model (MC dropout): the graph traced in eval mode has none, so the
    # original method must run while a submodule's mode differs from the trace's.
    model = GPT2MLP().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 32)
    assert fused_calls(fast, x)[0] == 1
    fast.dropout.train()  # (on the optimized model's copy of the dropout: the user's stays in eval mode)
    assert not model.dropout.training
    mc = copy.deepcopy(model)
    mc.dropout.train()
    torch.manual_seed(1)
    ref = mc(x)
    torch.manual_seed(1)
    n, out = fused_calls(fast, x)
    assert n == 0 and (out == 0).any()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    fast.dropout.eval()
    assert fused_calls(fast, x)[0] == 1


def test_a_parameter_set_to_none_after_optimize():
    # A bias removed (set to None) after optimize: eager drops it; the fused paths must run the original code.
    x = torch.randn(3, 32)
    for make in (GPT2MLP, InlineStyle):
        model = make().eval()
        fast = fxfuse.optimize(model)
        assert fused_calls(fast, x)[0] == 1
        (model.c_proj if make is GPT2MLP else model.fc2).bias = None  # (the parameter dicts are shared)
        n, out = fused_calls(fast, x)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
        assert n == 0
        [runs] = fxfuse.report(fast).original_runs  # (counted, whichever guard turned it away)
        assert runs.calls == 1 and "None" in runs.reason, runs


class ScaledGelu(nn.Module):
    """A host whose method reads settings of its own (``scale``, ``act``: a function), beside one it never
    reads (``gradient_checkpointing``, a flag other code uses)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.scale, self.act, self.gradient_checkpointing = 2.0, torch.nn.functional.gelu, False

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)) * self.scale)


def test_settings_changed_in_place_after_optimize(caplog):
    # The trace bakes a module's settings into the kernel (GELU's approximate, LeakyReLU's slope, a host's own
    # scale or activation function): one changed in place after optimize must make the original code run (and
    # say why), while a flag the fused method never reads keeps it fused.
    x = torch.randn(3, 32)

    def check(fast, reference, fused):
        n, out = fused_calls(fast, x)
        with torch.no_grad():
            torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)
        assert n == fused

    def inline_leaky():
        model = InlineStyle()
        model.act = nn.LeakyReLU(0.1)
        return model

    cases = [  # (model, the module holding the setting, setting, new value)
        (lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32)),
         lambda m: m[1], "approximate", "none"),
        (lambda: nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.1), nn.Linear(64, 32)),
         lambda m: m[1], "negative_slope", 0.3),
        (ScaledGelu, lambda m: m, "scale", 3.0),
        (ScaledGelu, lambda m: m, "act", torch.nn.functional.silu),
        (inline_leaky, lambda m: m.act, "negative_slope", 0.3),
    ]
    for make, holder, name, value in cases:
        model = make().eval()
        fast = fxfuse.optimize(model)
        check(fast, model, 1)
        was = getattr(holder(fast), name)
        with caplog.at_level("INFO", logger="fxfuse"):
            setattr(holder(fast), name, value)
            setattr(holder(model), name, value)
            check(fast, model, 0)
        assert any(f"{name} was {was!r}, is {value!r}" in r.getMessage() for r in caplog.records), name
        setattr(holder(fast), name, was)
        setattr(holder(model), name, was)
        check(fast, model, 1)  # fused again once it is back
        delattr(holder(fast), name)  # (gone from the dict: the original code raises what eager raises)
        with pytest.raises(AttributeError):
            fast(x)
        caplog.clear()

    model = ScaledGelu().eval()
    fast = fxfuse.optimize(model)
    fast.gradient_checkpointing = True  # not read by forward
    check(fast, model, 1)


class HelperScaled(nn.Module):
    """A host whose method reads its settings through a helper method and a property."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)
        self.scale, self.shift_value = 2.0, 0.5

    @property
    def shift(self):
        return self.shift_value

    def scaled(self, h):
        return h * self.scale + self.shift

    def forward(self, x):
        return self.fc2(self.scaled(self.act(self.fc1(x))))


def test_settings_read_through_a_helper_method_or_a_property_are_guarded():
    # The trace inlines self.scaled() and the property: both values are baked into the fused graph, so a change
    # in place must make the original code run, as for a setting the method reads itself.
    x = torch.randn(3, 32)
    for name, value in (("scale", 3.0), ("shift_value", -1.0)):
        model = HelperScaled().eval()
        fast = fxfuse.optimize(model)
        assert fused_calls(fast, x)[0] == 1
        setattr(fast, name, value)
        setattr(model, name, value)
        n, out = fused_calls(fast, x)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
        assert n == 0, name
        assert any(name in o.reason for o in fxfuse.report(fast).original_runs), name


def test_methods_whose_first_argument_is_not_named_self():
    # Capture finds a chain's host among the methods on the stack by their first argument, whatever its name.
    class MLP(nn.Module):
        def __init__(me):
            super().__init__()
            me.fc1, me.act, me.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

        def forward(me, x):
            return me.fc2(me.act(me.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.norm = MLP(), nn.LayerNorm(32)

        def forward(self, x):
            return self.norm(self.mlp(x))

    model = Net().eval()
    fast = fxfuse.optimize(model)
    assert [r.module_path for r in fxfuse.report(fast).regions] == ["mlp"]
    x = torch.randn(3, 32)
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    assert n == 1


def test_inference_tensor_into_a_partly_frozen_model(untrained_specs):
    # Eager saves no inference tensor when the first Linear is frozen; the fused op must not try to either.
    with torch.inference_mode():
        x = torch.randn(3, 16)
    model = nerf_mlp()
    model[0].requires_grad_(False)
    fast = fxfuse.optimize(model)
    out = fast(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


class Scaled(nn.Module):
    """An MLP with a defaulted argument that changes its input when passed."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, x, scale=None):
        if scale is not None:
            x = x * scale
        return self.fc2(self.act(self.fc1(x)))


def test_calls_outside_the_traced_arguments_run_the_original_method_and_say_so_once(caplog):
    # A host traced with a defaulted argument stands only for calls that leave it alone; a model that passes it
    # on every call would never run the fused graph, so the first such call says why (once).
    model = Scaled().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32)
    assert fused_calls(fast, x)[0] == 1
    with caplog.at_level("INFO", logger="fxfuse"), torch.no_grad():
        for _ in range(2):
            n, out = fused_calls(fast, x, scale=2.0)
            torch.testing.assert_close(out, model(x, scale=2.0), rtol=1e-5, atol=1e-6)
            assert n == 0
    said = [r.getMessage() for r in caplog.records if "are not those it was traced for" in r.getMessage()]
    assert len(said) == 1 and "scale=None" in said[0] and "Scaled" in said[0]


def test_the_report_counts_calls_outside_the_traced_arguments():
    # A model that passes a defaulted argument on every call never runs the fused graph: the report must say so
    # (the log says it once), with the calls counted when the report is asked for.
    model = Scaled().eval()
    fast = fxfuse.optimize(model)
    before = str(fxfuse.report(fast))
    x = torch.randn(3, 32)
    for _ in range(3):
        assert fused_calls(fast, x, scale=2.0)[0] == 0
    after = fxfuse.report(fast)
    assert "ran the original code" not in before  # (counted when asked for)
    [runs] = after.original_runs
    assert (runs.host, runs.calls, runs.modules) == ("Scaled", 3, ("",))
    assert "are not those it was traced for" in runs.reason and "scale=None" in runs.reason
    text = str(after)
    assert "ran the original code instead (calls since optimize, in this process):" in text
    assert any(line.split()[:2] == ["Scaled", "3"] and runs.reason in line for line in text.splitlines())
    assert "fused_chain (1 launch); 3 calls ran the original code (see below)" in text
    assert fused_calls(fast, x)[0] == 1 and fxfuse.report(fast).original_runs[0].calls == 3  # (fused: not counted)
    # Counted per optimized model, though both share the host class.
    assert fxfuse.report(fxfuse.optimize(model)).original_runs == []


def test_the_report_of_a_model_whose_calls_all_run_fused_lists_no_original_runs():
    for make in (GPT2MLP, InlineStyle, ControlFlowModel):
        fast = fxfuse.optimize(make().eval())
        x = torch.randn(3, 32)
        for _ in range(2):
            assert fused_calls(fast, x)[0] == 1
        found = fxfuse.report(fast)
        assert found.num_fused == 1 and found.original_runs == [], make
        assert "ran the original code" not in str(found)


def test_the_report_counts_calls_a_hook_added_after_optimize_sent_to_the_original_code():
    # A hook on a submodule the fused code skips: a host method (GPT2MLP.forward, here inside a model that does not
    # trace) and the inline hand-off (counted for its parent) run the original code, and the report says so.
    x = torch.randn(3, 32)
    for make, holder, host, path, why in (
            (ControlFlowModel, lambda m: m.mlp.act, "GPT2MLP", "mlp",
             "act has hooks or its own forward since it was fused"),
            (InlineStyle, lambda m: m.fc1, "InlineStyle", "",
             "fc1 has hooks or its own forward since the hand-off was proven")):
        model = make().eval()
        fast = fxfuse.optimize(model)
        assert fused_calls(fast, x)[0] == 1
        handle = holder(fast).register_forward_hook(lambda m, a, out: out + 1)
        for _ in range(2):
            assert fused_calls(fast, x)[0] == 0
        handle.remove()
        assert fused_calls(fast, x)[0] == 1
        found = fxfuse.report(fast)
        assert [(o.host, o.calls, o.reason, o.modules) for o in found.original_runs] == [(host, 2, why, (path,))]
        assert [r.host_path for r in found.regions] == [path]
        text = str(found)
        assert "ran the original code instead" in text and why in text
        assert "; 2 calls ran the original code (see below)" in text


def test_the_report_counts_an_inline_chain_run_in_training_mode():
    # The inline hand-off is for eval: a model optimized in eval and then trained runs its original code, and the
    # report says so instead of reading as fused.
    fast = fxfuse.optimize(InlineStyle().eval())
    x = torch.randn(3, 32)
    assert fused_calls(fast, x)[0] == 1
    fast.train()
    for _ in range(2):
        assert fused_calls(fast, x)[0] == 0
    assert [(o.host, o.calls, o.reason) for o in fxfuse.report(fast).original_runs] == [
        ("InlineStyle", 2, "it runs in training mode (the hand-off is for eval)")]


def test_a_sparse_input_runs_the_original_ops_without_a_warning(caplog):
    model = GPT2MLP().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(3, 32).to_sparse()
    with caplog.at_level("WARNING", logger="fxfuse"), torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


# ------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["module", "inline"])
def test_cuda_model_cpu_input_and_moves(kind):
    model = (GPT2MLP(64, 256) if kind == "module" else InlineStyle(64, 256)).eval()
    fast = fxfuse.optimize(model).to("cuda")  # moved after optimize
    x = torch.randn(3, 5, 64, device="cuda")
    n, out = fused_calls(fast, x)
    assert n == 1
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    same_error(lambda: model(x.cpu()), lambda: fast(x.cpu()))  # a CPU tensor into a CUDA model
    same_error(lambda: model(x.double()), lambda: fast(x.double()))
    fast.to(torch.bfloat16)
    for shape in ((7, 64), (2, 3, 64), (2, 2, 3, 64)):
        xb = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        n, out = fused_calls(fast, xb)
        assert n == 1
        with torch.no_grad():
            torch.testing.assert_close(out, model(xb), rtol=3e-2, atol=3e-2)


def _probe(layer, x):
    return layer.fc1(x).sum()  # (a helper that calls the chain's first module itself)


class _Layers(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d)


class _HelperCalls(_Layers):
    def forward(self, x):
        if x.numel() and x.abs().amax() > 1e6:  # data-dependent: the hand-off, not a trace
            x = x.clamp(-1e6, 1e6)
        s = _probe(self, x)
        h = self.act(self.fc1(x))
        h = self.fc2(h)
        return h + s


class _MaybeSkipped(_Layers):
    use_mlp = True

    def forward(self, x):
        if x.numel() and x.abs().amax() > 1e6:
            x = x.clamp(-1e6, 1e6)
        h = self.act(self.fc1(x))
        y = self.fc2(h) if self.use_mlp else x
        return y


class _ChildrenLoop(_Layers):
    def forward(self, x):
        if x.numel() and x.abs().amax() > 1e6:
            x = x.clamp(-1e6, 1e6)
        h = self.act(self.fc1(x))
        h = self.fc2(h)
        return h + sum(m(x).sum() for m in self.children() if isinstance(m, nn.Linear) and m.in_features == 32)


@pytest.mark.parametrize("cls, fused", [(_HelperCalls, 1), (_MaybeSkipped, 0), (_ChildrenLoop, 0)])
def test_the_inline_hand_off_only_takes_calls_it_proved(cls, fused):
    """A call of the chain's first module from a helper (or a hook) gets that module's own forward (it got the
    hand-off's token: a crash); a last call that may be skipped (a conditional) or modules reached through
    ``children()`` are not proven: the chain stays unfused."""
    model = cls().eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(5, 32)
    for flag in (True, False):
        cls.use_mlp = flag
        n, out = fused_calls(fast, x)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    cls.use_mlp = True
    assert len(fxfuse.report(fast).regions) == fused


def _relu6_with(max_val: float) -> nn.Module:
    act = nn.ReLU6()
    act.max_val = max_val  # (ReLU6's forward is Hardtanh's: it reads the bounds)
    return act


@pytest.mark.parametrize("act", [_relu6_with(1.0), nn.GELU(approximate="Tanh"), nn.GELU(approximate="exact")],
                         ids=["relu6 bounds changed", "gelu 'Tanh'", "gelu 'exact'"])
def test_an_activation_configured_before_optimize_is_fused_as_eager_runs_it_or_raises_its_error(act):
    model = nn.Sequential(nn.Linear(16, 32), act, nn.Linear(32, 16)).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 16) * 3
    with torch.no_grad():
        try:
            ref = model(x)
        except RuntimeError as eager:
            with pytest.raises(RuntimeError, match=str(eager)):
                fast(x)
            return
        torch.testing.assert_close(fast(x), ref)
    assert fxfuse.report(fast).regions


def test_threads_calling_one_model_through_the_inline_hand_off_get_eagers_answers(monkeypatch):
    """A server's thread pool calling one model: one thread arms the hand-off at a time, the others run the
    original code; none takes another's token. Two threads are held together right after the check that no
    call is in progress (the race), then a pool runs with thread switches forced often."""
    import sys
    import threading

    from fxfuse import inline

    model = InlineStyle(16, 32).eval()
    fast = fxfuse.optimize(model)
    errors, together, held = [], threading.Barrier(2, timeout=10), threading.local()
    tracing = inline._tracing

    def hold_once():  # (called by the parent method after its "nothing in progress" check, before arming)
        if getattr(held, "done", False) is False:
            held.done = True
            together.wait()
        return tracing()

    def worker(k, calls):
        g = torch.Generator().manual_seed(k)
        for i in range(calls):
            x = torch.randn(1 + (k + i) % 5, 16, generator=g)
            try:
                with torch.no_grad():
                    torch.testing.assert_close(fast(x), model(x))
            except Exception as err:  # (kept for the assert: an exception in a thread is lost otherwise)
                errors.append(f"{type(err).__name__}: {err}")

    def run(n_threads, calls):
        threads = [threading.Thread(target=worker, args=(k, calls)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    monkeypatch.setattr(inline, "_tracing", hold_once)
    run(2, 1)
    monkeypatch.setattr(inline, "_tracing", tracing)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        run(4, 100)
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    x = torch.randn(3, 16)
    n, out = fused_calls(fast, x)
    torch.testing.assert_close(out, model(x))
    assert n == 1


class _Intermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.act = nn.Linear(16, 32), nn.GELU()

    def forward(self, x):
        x = self.dense(x)
        x = self.act(x)
        return x


class _Output(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.norm = nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, h, residual):
        h = self.dense(h)
        return self.norm(h + residual)


def _intermediate_mean(layer, x):  # a helper that looks at the intermediate activations (a metric, a log)
    return layer.intermediate(x).mean()


class _GroupedLayer(nn.Module):
    """BERT / MPNet style: the chain runs through two groups, ``output(intermediate(a), a)``; a hook may call the
    first group on its own during the forward."""

    def __init__(self):
        super().__init__()
        self.pre, self.intermediate, self.output = nn.Linear(16, 16), _Intermediate(), _Output()

    def forward(self, x):
        if x.sum() > 1e9:  # data-dependent: not traced, the hand-off fuses it
            x = x * 0
        a = self.pre(x)
        inter = self.intermediate(a)
        out = self.output(inter, a)
        return out


class _GroupedLayerWithHelper(nn.Module):
    """The same, with a helper function calling the first group on its own first."""

    def __init__(self):
        super().__init__()
        self.pre, self.intermediate, self.output = nn.Linear(16, 16), _Intermediate(), _Output()

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 0
        a = self.pre(x)
        s = _intermediate_mean(self, a)
        inter = self.intermediate(a)
        out = self.output(inter, a)
        return out + s


@pytest.mark.parametrize("caller", ["helper", "hook"])
def test_a_group_of_the_hand_off_called_by_a_helper_or_a_hook_runs_its_own_code(caller):
    model = (_GroupedLayerWithHelper() if caller == "helper" else _GroupedLayer()).eval()
    fast = fxfuse.optimize(model)
    assert len(fxfuse.report(fast).regions) == 1
    seen, seen_eager = [], []
    if caller == "hook":
        fast.pre.register_forward_hook(lambda mod, inp, out: seen.append(fast.intermediate(out).sum()))
        model.pre.register_forward_hook(lambda mod, inp, out: seen_eager.append(model.intermediate(out).sum()))
    x = torch.randn(4, 16)
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(seen, seen_eager)
    assert n == 1


class _SharedInline(nn.Module):
    """One hand-off layer called by every step of a loop (ALBERT / universal-transformer style)."""

    def __init__(self):
        super().__init__()
        self.layer = InlineStyle(16, 32)

    def forward(self, x):
        for _ in range(3):
            x = self.layer(x)
        return x


def test_a_hand_off_layer_reached_by_several_calls_is_one_region():
    model = _SharedInline().eval()
    fast = fxfuse.optimize(model)
    assert [r.module_path for r in fxfuse.report(fast).regions] == ["layer"]
    x = torch.randn(4, 16)
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    assert n == 3


class _Cache:
    """A plain object handed down to a submodule (a KV cache): FX cannot make it a graph argument."""


class _UsesCache(nn.Module):
    def forward(self, x, cache):
        rows = [r for r in x]  # (iterates a tensor: kept opaque in its callers' traces, with the cache an argument)
        return torch.stack(rows) * 2


class _CachedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = _UsesCache(), GPT2MLP()

    def forward(self, x, cache):
        return self.mlp(self.attn(x, cache))


class _CachedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_CachedLayer(), _CachedLayer()])

    def forward(self, x):
        cache = _Cache()
        for layer in self.layers:
            x = layer(x, cache)
        return x


def test_a_submodule_call_that_cannot_be_recorded_is_reported_as_such_and_the_mlps_below_fuse():
    """Keeping the submodule opaque does not help when its call's arguments are the cause: the capture says so at
    once (it retried the same submodule until a retry limit, and then named the limit) and goes into the layers."""
    model = _CachedModel().eval()
    fast = fxfuse.optimize(model)
    report = fxfuse.report(fast)
    assert report.capture_failures and all("argument of type" in f.error for f in report.capture_failures[:1])
    assert not any("too many submodules" in f.error for f in report.capture_failures)
    assert len(report.regions) == 2
    x = torch.randn(3, 32)
    n, out = fused_calls(fast, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    assert n == 2


def test_hooks_registered_before_optimize_run_and_the_report_says_what_they_keep_unfused():
    # A hook on the activation: the chain cannot skip its call, so it is not fused, and the report says why. A hook on
    # the whole MLP (capturing activations, a common probe): the block keeps calling it, and it fuses inside.
    captured = []
    model = Block().eval()
    model.mlp.act.register_forward_hook(lambda m, args, out: out * 0.5)
    model.mlp.register_forward_hook(lambda m, args, out: captured.append(out.detach().clone()))
    fast = fxfuse.optimize(model)
    report = fxfuse.report(fast)
    assert report.regions == []
    assert [(r.module_path, r.reason.split(" has ")[0]) for r in report.rejections] == [("mlp", "act")], str(report)
    x = torch.randn(3, 32)
    with torch.no_grad():
        n, out = fused_calls(fast, x)
        want = model(x)
    torch.testing.assert_close(out, want)
    assert n == 0 and len(captured) == 2 and torch.equal(captured[0], captured[1])
    assert not fxfuse.report(fast).original_runs  # nothing was fused that a call could not run

    model = Block().eval()
    model.mlp.register_forward_hook(lambda m, args, out: captured.append(out.detach().clone()))
    fast = fxfuse.optimize(model)
    assert [r.module_path for r in fxfuse.report(fast).regions] == ["mlp"]
    captured.clear()
    with torch.no_grad():
        n, out = fused_calls(fast, x)
        want = model(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert n == 1 and len(captured) == 2
    torch.testing.assert_close(captured[0], captured[1], rtol=1e-5, atol=1e-5)
    assert not fxfuse.report(fast).original_runs


def test_a_linear_hooked_before_optimize_is_named_as_what_keeps_its_mlp_unfused():
    # A forward hook recording fc1's activations (a common probe): the MLP is not fused, its hook runs, and the
    # report says why, with no other rejection.
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.mlp2 = GPT2MLP(), GPT2MLP()

        def forward(self, x):
            x = x + self.mlp(x)
            return x + self.mlp2(x)

    model = Residual().eval()
    seen = []
    model.mlp.c_fc.register_forward_hook(lambda m, args, out: seen.append(out))
    fast = fxfuse.optimize(model, example_inputs=(torch.randn(4, 32),))
    report = fxfuse.report(fast)
    assert [r.module_path for r in report.regions] == ["mlp2"]
    assert [(r.module_path, r.reason) for r in report.rejections] == \
        [("mlp", "mlp.c_fc has hooks or its own forward, which its call runs")], str(report)
    x = torch.randn(3, 32)
    seen.clear()  # (the example inputs ran the model's modules)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(seen) == 2


def test_a_hand_off_region_reports_its_shape_and_mode():
    # (its widths and dtype key the GPU measurements the report shows; the hand-off runs in eval mode only)
    fast = fxfuse.optimize(InlineStyle().eval())
    (region,) = fxfuse.report(fast).regions
    assert any("hand-off" in n for n in region.notes)
    assert region.widths == (32, 64, 32) and region.dtype == "float32" and region.stages == 2
    assert any("calls in training mode run the original code" in n for n in region.notes), region.notes


def test_a_submodule_kept_opaque_with_a_linear_of_a_chain_is_listed_with_why():
    # DeBERTa's ContextPooler builds its activation module on each call (not traceable): kept opaque in its parent's
    # trace, so the chain pooler.dense -> act -> classifier is not seen; the report lists the pooler and why.
    class Pooler(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(32, 32)

        def forward(self, h):
            return nn.GELU()(self.dense(h[:, 0]))

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.pooler, self.classifier = nn.Linear(32, 32), Pooler(), nn.Linear(32, 4)

        def forward(self, h):
            return self.classifier(self.pooler(torch.tanh(self.mix(h))))

    model = Classifier().eval()
    fast = fxfuse.optimize(model)
    failures = {f.module_path: f.error for f in fxfuse.report(fast).capture_failures}
    assert "kept opaque" in failures.get("pooler", ""), failures
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
