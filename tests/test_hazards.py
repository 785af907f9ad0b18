"""A chain with an in-place write or a grad-mode switch between its first and last op is not fused (the fused call
runs at the last op), through every entry point; tracing runs no code on the user's tensors."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse.hazards import hazard

# On the GPU machine (``-m gpu``) the same checks run with the CUDA kernels.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class InputWritten(nn.Module):
    """The residual stream is updated in place after fc1 read it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        x += 1.0
        return x + self.fc2(h)


class BufferViewWritten(nn.Module):
    """The chain reads a view of a buffer that is scaled in place before fc2."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.register_buffer("buf", torch.randn(4, 16))

    def forward(self, x):
        h = torch.relu(self.fc1(self.buf[:3]))
        self.buf.mul_(2.0)
        return self.fc2(h) + x


class GatedInputWritten(nn.Module):
    """Between a gated MLP's gate and up linears, their shared input is scaled in place."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        g = self.gate(x)
        x.mul_(2.0)
        return self.down(F.silu(g) * self.up(x))


class WeightWritten(nn.Module):
    """fc1's weight is halved after its use (a weight update in the forward)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        with torch.no_grad():
            self.fc1.weight.mul_(0.5)
        return self.fc2(h)


class FrozenProjection(nn.Module):
    """Linear probing: a frozen projection under no_grad, a trained head after it."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        with torch.no_grad():
            feats = F.gelu(self.proj(x))
        return self.head(feats)


class FrozenHead(nn.Module):
    """fc1 trained, fc2 under no_grad, another trained branch beside."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.other = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(16, 8)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        with torch.no_grad():
            y = self.fc2(h)
        return y + self.other(x)


def _entry(kind: str, model: nn.Module):
    if kind == "optimize":
        return fxfuse.optimize(model)
    torch._dynamo.reset()
    return torch.compile(model, backend="fxfuse", options={"inductor": False})


def _report(kind: str, runner) -> fxfuse.FusionReport:
    """The report of ``runner`` (for the compile backend, every graph compiled since ``_entry``'s reset)."""
    return fxfuse.report(runner)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["optimize", "compile"])
@pytest.mark.parametrize("cls", [InputWritten, BufferViewWritten, GatedInputWritten, WeightWritten])
def test_an_inplace_write_between_a_chains_ends_keeps_eagers_result_and_says_why(kind, cls, device):
    model = cls().to(device).eval()
    ref = copy.deepcopy(model)
    runner = _entry(kind, model)
    x = torch.randn(3, 16, device=device)
    x_fused, x_eager = x.clone(), x.clone()
    with torch.no_grad():
        for _ in range(2):  # the second call sees the state the first one wrote
            got, want = runner(x_fused), ref(x_eager)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_fused, x_eager)  # the caller's tensor is written as eager writes it
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    report = _report(kind, runner)
    assert not report.regions
    if kind == "compile" or cls is not WeightWritten:  # (optimize: that forward switches grad mode, said so)
        assert any("in-place op" in r.reason and "between the chain's first and last linear" in r.reason
                   for r in report.rejections), [r.reason for r in report.rejections]


class _Normalizer(nn.Module):
    """Scales its input in place; a data-dependent branch keeps it from tracing (it stays one opaque call)."""

    def forward(self, t):
        if t.abs().max() > 0:
            t.div_(t.abs().max())
        return t


class _ScaleInPlace(torch.autograd.Function):
    """A custom Function that writes its input (``mark_dirty``): one call in the graph, its code unseen."""

    @staticmethod
    def forward(ctx, t):
        ctx.mark_dirty(t)
        return t.mul_(0.5)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class OpaqueWriter(nn.Module):
    """Between fc1 and fc2, a call whose code the graph does not show writes the chain's input."""

    def __init__(self, how: str):
        super().__init__()
        self.fc1, self.fc2, self.norm, self.how = nn.Linear(16, 32), nn.Linear(32, 16), _Normalizer(), how

    def forward(self, x):
        h = self.fc1(x)
        x = self.norm(x) if self.how == "module" else _ScaleInPlace.apply(x)
        return self.fc2(torch.relu(h)) + x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["module", "function"])
def test_a_call_fxfuse_cannot_see_into_between_a_chains_ends_is_a_hazard(how, device):
    model = OpaqueWriter(how).to(device).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(6, 16, device=device) * 3
    with torch.no_grad():
        torch.testing.assert_close(fast(x.clone()), model(x.clone()), rtol=1e-5, atol=1e-5)
    report = fxfuse.report(fast)
    assert not report.regions
    assert any("cannot see into" in r.reason for r in report.rejections), [r.reason for r in report.rejections]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["optimize", "compile"])
@pytest.mark.parametrize("cls", [FrozenProjection, FrozenHead])
def test_a_chain_across_a_grad_mode_switch_keeps_eagers_gradients(kind, cls, device):
    model = cls().to(device)
    ref = copy.deepcopy(model)
    runner = _entry(kind, model)
    x = torch.randn(4, 16, device=device)
    got, want = runner(x), ref(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    report = _report(kind, runner)
    assert not report.regions
    reasons = " ".join(r.reason for r in report.rejections)
    optimize_says, compile_says = "switches or reads torch's global modes", "mode switch (_set_grad_enabled"
    assert (optimize_says if kind == "optimize" else compile_says) in reasons


@pytest.mark.parametrize("device", DEVICES)
def test_a_chain_wholly_inside_no_grad_still_fuses_in_its_own_module(device):
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
            self.head = nn.Linear(16, 8)

        def forward(self, x):
            with torch.no_grad():
                z = self.enc(x)
            return self.head(z)

    model = Encoder().to(device)
    ref = copy.deepcopy(model)
    opt = fxfuse.optimize(model)
    x = torch.randn(4, 16, device=device)
    got, want = opt(x), ref(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    assert model.enc[0].weight.grad is None and model.head.weight.grad is not None
    assert [r.module_path for r in fxfuse.report(opt).regions] == ["enc"]


def test_tracing_runs_no_code_on_the_users_buffers():
    model = BufferViewWritten()
    before = model.buf.clone()
    fxfuse.optimize(model)
    torch.testing.assert_close(model.buf, before, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_an_inplace_add_on_a_fresh_intermediate_is_fused(device):
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            h = self.fc1(x)
            h += 1.0  # nobody else sees h: the same as h = h + 1
            return self.fc2(F.gelu(h))

    model = Shifted().to(device).eval()
    opt = fxfuse.optimize(model)
    x = torch.randn(5, 16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert [r.spec for r in fxfuse.report(opt).regions] == ["1b:gelu(add(1.0,a0));1b:a0"]


def test_what_counts_as_a_hazard():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = {
        "add_": graph.call_method("add_", (x, 1)),
        "iadd": graph.call_function(__import__("operator").iadd, (x, 1)),
        "relu inplace": graph.call_function(F.relu, (x, True)),
        "out=": graph.call_function(torch.add, (x, x), {"out": x}),
        "aten copy_": graph.call_function(torch.ops.aten.copy_.default, (x, x)),
        "no_grad": graph.call_function(torch._C._set_grad_enabled, (False,)),
        "add": graph.call_function(torch.add, (x, 1)),
        "relu": graph.call_function(F.relu, (x,)),
        "view": graph.call_method("view", (x, -1)),
    }
    found = {name: hazard(node) for name, node in nodes.items()}
    assert all(found[name] for name in ("add_", "iadd", "relu inplace", "out=", "aten copy_", "no_grad")), found
    assert not any(found[name] for name in ("add", "relu", "view")), found


_LOG: list = []
_CALLS = 0


class KeepsActivation(nn.Module):
    """Python state changed in the forward: an attribute, a counter, a list outside the call."""

    def __init__(self, how: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.how, self.cache, self.calls, self.store = how, None, 0, {"h": None}

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.how == "attribute":
            self.cache = h
        elif self.how == "new attribute":
            self.last_hidden = h  # (not set in __init__: tracing creates it)
        elif self.how == "counter":
            self.calls += 1
        elif self.how == "global":
            global _CALLS
            _CALLS += 1
        elif self.how == "item":
            self.store["h"] = h  # (a store, no call: seen as the dict's item changed)
        else:
            _LOG.append(h)
        return self.fc2(h)


@pytest.mark.parametrize("how", ["attribute", "new attribute", "counter", "global", "item", "list"])
def test_a_method_that_changes_python_state_keeps_running_its_code(how):
    model = KeepsActivation(how).eval()
    calls_before = _CALLS
    _LOG.clear()
    opt = fxfuse.optimize(model)
    assert _CALLS == calls_before  # tracing ran the code, and undid what it did to the module's globals
    assert model.store == {"h": None}  # and to the module's dict (a proxy had been stored in it)
    assert _LOG == [] and "last_hidden" not in vars(model)  # and to a list outside, and to the module
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = model(x)
        calls = opt.calls
        torch.testing.assert_close(opt(x), want)
    report = fxfuse.report(opt)
    assert not report.regions
    assert any("changes state a traced graph would not change" in r.reason for r in report.rejections)
    if how == "attribute":
        assert isinstance(opt.cache, torch.Tensor)
    elif how == "new attribute":
        assert isinstance(opt.last_hidden, torch.Tensor)
    elif how == "counter":
        assert opt.calls == calls + 1
    elif how == "global":
        assert _CALLS == calls_before + 2
    elif how == "item":
        assert isinstance(opt.store["h"], torch.Tensor)
    else:
        assert len(_LOG) == 2


def test_local_lists_in_a_forward_do_not_stop_fusion():
    class Gathers(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            parts = []
            parts.append(self.fc2(F.gelu(self.fc1(x))))
            parts.append(x)
            return torch.cat(parts, -1)

    model = Gathers().eval()
    opt = fxfuse.optimize(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(fxfuse.report(opt).regions) == 1


class _GradReverse(torch.autograd.Function):
    """Identity forward, negated gradient (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, t):
        return t * 1.0

    @staticmethod
    def backward(ctx, g):
        return -g


@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_custom_autograd_function_keeps_its_backward(where):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            if where == "inside":
                return self.fc2(_GradReverse.apply(torch.relu(self.fc1(x))))
            return _GradReverse.apply(self.fc2(torch.relu(self.fc1(x))))

    model = Head()
    ref = copy.deepcopy(model)
    fast = fxfuse.optimize(model)
    assert len(fxfuse.report(fast).regions) == (0 if where == "inside" else 1)
    x = torch.randn(8, 16)
    fast(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("read, mode", [
    (torch.is_grad_enabled, torch.no_grad),
    (torch.is_inference_mode_enabled, torch.inference_mode),
    (torch.are_deterministic_algorithms_enabled, None),
])
def test_a_method_that_reads_a_global_mode_follows_the_callers(read, mode):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            y = self.fc2(torch.relu(self.fc1(x)))
            return y * 0.5 if read() else y

    model = Block()
    fast = fxfuse.optimize(model)
    x = torch.randn(4, 16)
    if mode is None:
        torch.use_deterministic_algorithms(True)
        try:
            got, want = fast(x), model(x)
        finally:
            torch.use_deterministic_algorithms(False)
    else:
        with mode():
            got, want = fast(x), model(x)
    torch.testing.assert_close(got, want)
    assert any("torch's global modes" in r.reason for r in fxfuse.report(fast).rejections)


def test_a_custom_autograd_function_is_kept_under_another_profiler_too():
    """With a profiler installed (cProfile, a tracing tool) capture cannot watch the trace, but a Function still
    stays one call."""
    import sys

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(_GradReverse.apply(torch.relu(self.fc1(x))))

    model = Head()
    sys.setprofile(lambda frame, event, arg: None)
    try:
        fast = fxfuse.optimize(model)
    finally:
        sys.setprofile(None)
    report = fxfuse.report(fast)
    assert not report.regions
    # (the method is still a host: the chain is left unfused at the Function's call, not the whole method)
    assert any("_GradReverse_apply" in r.reason for r in report.rejections), [r.reason for r in report.rejections]


def test_fxfuse_imported_through_a_dotted_path_still_fuses(tmp_path):
    # A script that puts ``scripts/..`` on sys.path imports fxfuse with such file names: its own code (the tracer's
    # bookkeeping) must not read as the model's side effects (nothing fused at all, before).
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(fxfuse.__file__)))
    code = f"""
import os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # forget any install
sys.path.insert(0, os.path.join({os.path.join(repo, "tests")!r}, ".."))
import torch, fxfuse
from torch import nn
assert ".." in fxfuse.__file__, fxfuse.__file__
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()
report = fxfuse.report(fxfuse.optimize(model))
print(len(report.regions), [r.reason for r in report.rejections])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "1", out.stdout


def test_only_torch_fxfuse_and_the_standard_library_are_library_code():
    from fxfuse import capture

    folders = capture._LIBRARY_DIRS
    assert capture._file_in(os.path.join(capture._STDLIB_DIR, "json", "decoder.py"), folders)
    assert capture._file_in("<frozen os>", folders)
    assert capture._file_in(os.path.join(capture._TORCH_DIR, "nn", "modules", "linear.py"), folders)
    # Installed packages inside the standard library's folder (conda's layout) are not: model code lives there.
    assert not capture._file_in(os.path.join(capture._STDLIB_DIR, "site-packages", "transformers", "m.py"), folders)
    assert not capture._file_in(capture._TORCH_DIR.rstrip(os.sep) + "vision" + os.sep + "ops.py", folders)
    assert not capture._file_in(os.path.join(os.path.dirname(__file__), "models.py"), folders)


class InplaceStatement(nn.Module):
    """An activation written in place as a statement: ``fc2`` reads ``h`` after the write."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.fc1, self.fc2, self.act = nn.Linear(16, 32), nn.Linear(32, 16), nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc1(x)
        if self.form == "relu_":
            h.relu_()
        elif self.form == "F.relu inplace":
            F.relu(h, inplace=True)
        elif self.form == "module inplace":
            self.act(h)
        elif self.form == "swish":  # timm's Swish(inplace=True): x.mul_(x.sigmoid())
            h.mul_(h.sigmoid())
        elif self.form == "view read after":  # a view taken before the write sees it: not fused
            v = h[:, :16]
            h.relu_()
            return self.fc2(h) + v
        return self.fc2(h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["relu_", "F.relu inplace", "module inplace", "swish", "view read after"])
def test_an_inplace_activation_written_as_a_statement_fuses(form, device):
    model = InplaceStatement(form).to(device)
    fast = fxfuse.optimize(model)
    fused = form != "view read after"
    assert len(fxfuse.report(fast).regions) == int(fused), str(fxfuse.report(fast))
    x = torch.randn(5, 16, device=device)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    # Training: the same gradients (the fused region's backward, or the original ops).
    grads = []
    for m in (fast, model):
        m.zero_grad()
        m(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class _HookedInplaceStatement(nn.Module):
    """``self.act(h)`` as a statement, ``act`` in place with hooks of its own; a plain MLP after it fuses."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 16)
        self.up, self.gelu, self.down = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, x):
        h = self.fc1(x)
        self.act(h)
        y = self.fc2(h)
        return y + self.down(self.gelu(self.up(y)))


@pytest.mark.parametrize("kind", ["forward hook", "pre-hook", "instance forward"])
def test_an_inplace_statement_whose_module_runs_hooks_is_read_as_written(kind):
    # The call's result may be another tensor (a hook's), and the write may go elsewhere (a pre-hook's clone): fc2
    # reads h, as in eager.
    model = _HookedInplaceStatement().eval()
    if kind == "forward hook":
        model.act.register_forward_hook(lambda mod, args, out: out * 2)
    elif kind == "pre-hook":
        model.act.register_forward_pre_hook(lambda mod, args: (args[0].clone(),))
    else:
        model.act.forward = lambda h: torch.relu(h) * 3
    x = torch.randn(8, 16)
    fast = fxfuse.optimize(model, example_inputs=(x,))
    assert len(fxfuse.report(fast).regions) == 1
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_number_updated_in_place_leaves_its_earlier_readers_alone():
    # ``m = n; n += 1`` on a size: FX writes an in-place operator as ``n += 1`` on the variable of its argument,
    # which made ``m`` read n + 1 in the traced graph (a traced host's output off by a whole row's scale).
    class SizeScaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            n = x.shape[0]
            m = n
            n += 1
            return self.fc2(F.relu(self.fc1(x))) * m + n

    model = SizeScaled().eval()
    fast = fxfuse.optimize(model)
    assert len(fxfuse.report(fast).regions) == 1
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draw", ["random", "numpy"])
def test_a_method_drawing_from_python_random_generators_keeps_running_its_code(draw):
    # Stochastic depth written with Python's random (or NumPy's): a trace would keep one draw's branch for every
    # call, and optimize() would advance the user's generator.
    import random

    import numpy as np

    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            u = random.random() if draw == "random" else np.random.uniform()
            if self.training and u < 0.5:
                return x
            return x + self.fc2(F.relu(self.fc1(x)))

    model = LayerDrop().train()
    random.seed(0)
    np.random.seed(0)
    states = random.getstate(), np.random.get_state()[1].copy()
    fast = fxfuse.optimize(model)
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    report = fxfuse.report(fast)
    assert not report.regions and any("random generator" in r.reason for r in report.rejections), str(report)
    x = torch.randn(4, 16)
    outs = []
    for m in (model, fast):
        random.seed(1)
        np.random.seed(1)
        with torch.no_grad():
            outs.append([m(x) for _ in range(8)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
