"""Optimized models under ``torch.autocast``: a fused region follows autocast (fused when its weights already have
the autocast dtype, on kept casts of fp32 weights in a call that records no gradients, on casts made with autograd
in one that does (mixed-precision training); else the original ops), and a method that reads or sets the autocast
state is not a host. Each result is compared with eager's under the same autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT2MLP, Block, GatedMLP, nerf_mlp
from test_ops import TOL, rel_err
from torch import nn

import fxfuse
import fxfuse.ops
from fxfuse import autocast as fx_autocast
from fxfuse.autocast import REFERENCE, autocast_args


class _Counts:
    """How many region calls ran fused (``_dispatch``, no gradients) and as the original ops."""

    def __init__(self, monkeypatch):
        self.fused = self.reference = 0
        dispatch, reference = fxfuse.ops._dispatch, fxfuse.ops.reference_mlp

        def counted_dispatch(*args, **kwargs):
            self.fused += 1
            return dispatch(*args, **kwargs)

        def counted_reference(*args, **kwargs):
            self.reference += 1
            return reference(*args, **kwargs)

        monkeypatch.setattr(fxfuse.ops, "_dispatch", counted_dispatch)
        monkeypatch.setattr(fxfuse.ops, "reference_mlp", counted_reference)


def test_autocast_args_says_when_the_region_runs_fused(monkeypatch):
    x = torch.randn(3, 8)
    w16, b16, w32 = torch.randn(4, 8).half(), torch.randn(4).half(), torch.randn(4, 8)
    assert autocast_args(x, [w32], [], [], "1:relu(a0)") == (x, [w32], [])  # no autocast
    with torch.autocast("cpu", dtype=torch.float16):
        assert autocast_args(x, [w16], [b16], [], "1b:relu(a0)") is REFERENCE  # "cpu" is not a fused device
    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", "cpu"})
    with torch.autocast("cpu", dtype=torch.float16):
        same, weights, biases = autocast_args(x, [w16], [b16], [], "1b:relu(a0)")
        assert same is x and weights == [w16] and biases == [b16]  # fp32 x: the kernels round it as they load it
        cast, _, _ = autocast_args(x.half().float().requires_grad_(), [w16], [b16], [], "1b:relu(a0)")
        assert cast.dtype == torch.float16 and torch.equal(cast, x.half())  # recording gradients: cast first
        assert autocast_args(x, [w16], [], [], "1:exp(a0)") is REFERENCE  # autocast runs exp in fp32
        assert autocast_args(x, [w16], [], [torch.randn(4)], "1:mul(a0,v0)") is REFERENCE  # an operand
        assert autocast_args(x.double(), [w16], [], [], "1:relu(a0)") is REFERENCE  # autocast leaves fp64
        assert autocast_args(x, [w16.double()], [], [], "1:relu(a0)") is REFERENCE  # and fp64 weights
        with torch.inference_mode():
            frozen = torch.randn(4, 8)
        assert autocast_args(x, [frozen], [], [], "1:relu(a0)") is REFERENCE  # no version to check a cast by


def test_fp32_weights_are_cast_once_and_again_only_when_they_change(monkeypatch):
    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(fx_autocast, "weight_casts", fx_autocast.WeightCasts())
    casts = fx_autocast.weight_casts
    lin = nn.Linear(8, 4)  # fp32 parameters that require grad, as a trained model's
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.no_grad():
            _, (w,), (b,) = autocast_args(x, [lin.weight], [lin.bias], [], "1b:relu(a0)")
            assert w.dtype == b.dtype == torch.float16 and not w.requires_grad
            assert torch.equal(w, lin.weight.half()) and torch.equal(b, lin.bias.half())
            _, (w_again,), (b_again,) = autocast_args(x, [lin.weight], [lin.bias], [], "1b:relu(a0)")
            assert w_again is w and b_again is b and len(casts) == 2  # kept: one cast per parameter
            lin.weight.mul_(2)  # an optimizer step: a new version, cast again (into the same memory)
            _, (w_new,), _ = autocast_args(x, [lin.weight], [lin.bias], [], "1b:relu(a0)")
            assert w_new is w and torch.equal(w_new, lin.weight.half())
            lin.weight.data = torch.randn(4, 8)  # a new storage
            _, (w_data,), _ = autocast_args(x, [lin.weight], [lin.bias], [], "1b:relu(a0)")
            assert torch.equal(w_data, lin.weight.half())
        # A call that records gradients casts with autograd, as autocast does (the gradient reaches the fp32
        # parameter), x too, and the kept casts go: a training loop under autocast does not hold them.
        cx, (cw,), (cb,) = autocast_args(x, [lin.weight], [lin.bias], [], "1b:relu(a0)")
        assert cx.dtype == cw.dtype == cb.dtype == torch.float16 and len(casts) == 0
        cw.float().sum().backward()
        assert torch.equal(lin.weight.grad, torch.ones_like(lin.weight))
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False), torch.no_grad():
        assert autocast_args(x, [lin.weight], [lin.bias], [], "1b:relu(a0)") is REFERENCE  # no cache wanted
    temp = torch.randn(4, 8)
    casts.get(temp, torch.float16)
    assert len(casts) == 1
    del temp  # a cast goes with its parameter
    assert len(casts) == 0


@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp(), Block], ids=["gated", "gpt2", "nerf", "block"])
def test_cpu_autocast_gives_eagers_result_exactly(make, monkeypatch):
    # CPU autocast is not a fused device: the fused graph runs, every region as the original ops, under
    # autocast; result and gradients are eager's bit for bit.
    model = make().eval()
    fast = fxfuse.optimize(model)
    counts = _Counts(monkeypatch)
    x = torch.randn(4, 5, 32 if not isinstance(model, nn.Sequential) else 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            out, ref = fast(x), model(x)
    assert counts.reference >= 1 and counts.fused == 0
    assert out.dtype == ref.dtype  # (bf16, or fp32 after Block's fp32 residual)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)

    model.train()
    fast.train()
    eager = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)  # (GPT2MLP's dropout)
        fast(x).float().square().sum().backward()
        torch.manual_seed(1)
        eager(x).float().square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp()], ids=["gated", "gpt2", "nerf"])
def test_weights_in_the_autocast_dtype_run_fused(make, monkeypatch):
    # A float16 model under float16 autocast, fed float32 (as a LayerNorm under autocast gives it): the region
    # casts its input as its first Linear would and runs the kernels (the interpreter stands in for CUDA).
    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", "cpu"})
    model = make().eval().half()
    fast = fxfuse.optimize(model)
    counts = _Counts(monkeypatch)
    x = torch.randn(6, 32 if not isinstance(model, nn.Sequential) else 16)
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        out, ref = fast(x), model(x)
    assert counts.fused == 1 and counts.reference == 0
    assert out.dtype == ref.dtype == torch.float16
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.half().double())
    assert rel_err(out, exact) < max(TOL[torch.float16], 1.5 * rel_err(ref, exact))


@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp()], ids=["gated", "gpt2", "nerf"])
def test_fp32_weights_under_autocast_run_fused_at_inference(make, monkeypatch):
    # fp32 master weights evaluated under float16 autocast: the region runs the kernels on casts of its weights,
    # kept from call to call within the context (cast again into the same memory in the next), and the model's own
    # parameters stay as they were.
    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", "cpu"})
    model = make().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fast = fxfuse.optimize(model)
    counts = _Counts(monkeypatch)
    x = torch.randn(6, 32 if not isinstance(model, nn.Sequential) else 16)
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        out, ref = fast(x), model(x)
        kept = len(fx_autocast.weight_casts)
        again = fast(x)
        assert kept == len(list(model.parameters())) == len(fx_autocast.weight_casts)  # one cast each, kept
        memory = [cast.data_ptr() for cast in fx_autocast.weight_casts]
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():  # a new context: cast again, same memory
        torch.testing.assert_close(fast(x), out, rtol=0, atol=0)
        assert [cast.data_ptr() for cast in fx_autocast.weight_casts] == memory
    assert counts.fused == 3 and counts.reference == 0
    assert out.dtype == ref.dtype == torch.float16
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    with torch.no_grad():
        exact = copy.deepcopy(model).half().double()(x.half().double())
    assert rel_err(out, exact) < max(TOL[torch.float16], 1.5 * rel_err(ref, exact))
    assert all(v.dtype == torch.float32 and torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        plain = fast(x)  # without autocast: fp32 as before, and the casts are gone
    assert plain.dtype == torch.float32 and len(fx_autocast.weight_casts) == 0
    with torch.autocast("cpu", dtype=torch.float16):  # recording gradients: casts made with autograd
        grads_out = fast(x)
    assert grads_out.requires_grad and len(fx_autocast.weight_casts) == 0


def test_kept_casts_see_a_write_through_data_in_the_next_autocast_context(monkeypatch):
    """A write through ``.data`` bumps no version counter (an EMA or momentum teacher's update): the kept casts
    expire when the autocast context exits, as autocast's own cache does, so the next context casts the new
    values (into the same memory)."""
    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", "cpu"})
    model = GPT2MLP().eval()
    fast = fxfuse.optimize(model)
    counts = _Counts(monkeypatch)
    x = torch.randn(6, 32)
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
            out = fast(x)
            with torch.autocast("cpu", enabled=False):  # (an inner context's exit keeps them, as autocast does)
                pass
            assert len(fx_autocast.weight_casts) == 4
            ref = model(x)
        assert counts.fused == step + 1 and counts.reference == 0
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        for p in model.parameters():
            p.data.mul_(-1.5)


def _train_fp32_under_autocast(make, device: str, dtype: torch.dtype, rows: int) -> None:
    model = make().eval().to(device)  # (eval: GPT2MLP's dropout off; gradients are recorded all the same)
    eager = copy.deepcopy(model)
    fast = fxfuse.optimize(model)
    chain = not isinstance(model, (GatedMLP, GPT2MLP))
    for _ in range(3):
        x = torch.randn(rows, 16 if chain else 32, device=device)
        with torch.autocast(device, dtype=dtype):
            out, ref = fast(x), eager(x)
        assert out.dtype == ref.dtype == dtype
        if chain:
            assert "_FusedMLPFunction" in out.grad_fn.name()  # the fused chain backward, every step
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert p.grad.dtype == torch.float32 and rel_err(p.grad, q.grad) < 2e-2
            p.grad = q.grad = None
    assert len(fx_autocast.weight_casts) == 0


@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp()], ids=["gated", "gpt2", "nerf"])
def test_fp32_weights_train_under_autocast(make, untrained_specs, monkeypatch):
    # Mixed precision (fp32 master weights, float16 autocast): every step's region runs on casts made with autograd,
    # as autocast's own; a narrow chain keeps its fused forward and fused backward every step. Outputs and fp32
    # gradients match eager's under the same autocast.
    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", "cpu"})
    _train_fp32_under_autocast(make, "cpu", torch.float16, 6)


class _QueriesAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x):
        if torch.is_autocast_enabled():  # a traced graph would always take the branch it saw
            x = x * 2
        return self.fc2(torch.relu(self.fc1(x)))


class _EntersAutocast(_QueriesAutocast):
    def forward(self, x):
        with torch.autocast("cpu", enabled=False):  # a traced graph would not keep the context
            return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("cls", [_QueriesAutocast, _EntersAutocast])
def test_a_method_that_uses_the_autocast_state_is_not_a_host(cls):
    model = cls().eval()
    fast = fxfuse.optimize(model)
    report = fxfuse.report(fast)
    assert not report.regions
    assert any("autocast state" in r.reason for r in report.rejections), str(report)
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp()], ids=["gated", "gpt2", "nerf"])
def test_gpu_autocast_runs_fused_on_a_model_in_its_dtype(make, dtype, monkeypatch):
    model = make().eval().to("cuda", dtype)
    fast = fxfuse.optimize(model)
    counts = _Counts(monkeypatch)
    x = torch.randn(64, 32 if not isinstance(model, nn.Sequential) else 16, device="cuda")
    with torch.autocast("cuda", dtype=dtype), torch.no_grad():
        out, ref = fast(x), model(x)
    assert counts.fused == 1 and counts.reference == 0
    assert out.dtype == ref.dtype == dtype
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.to(dtype).double())
    assert rel_err(out, exact) < max(TOL[dtype], 1.5 * rel_err(ref, exact))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp()], ids=["gated", "gpt2", "nerf"])
def test_gpu_autocast_runs_fused_on_fp32_weights(make, dtype, rows, monkeypatch):
    # fp32 weights evaluated under autocast, the way a decode loop calls them (replayed from the second call);
    # then a step changes the weights in place: the next call must see them (no stale cast, no stale replay).
    model = make().eval().cuda()
    fast = fxfuse.optimize(model)
    counts = _Counts(monkeypatch)
    x = torch.randn(rows, 32 if not isinstance(model, nn.Sequential) else 16, device="cuda")

    def check():
        with torch.autocast("cuda", dtype=dtype), torch.no_grad():
            outs, ref = [fast(x) for _ in range(3)], model(x)
        with torch.no_grad():
            exact = copy.deepcopy(model).to(dtype).double()(x.to(dtype).double())
        for out in outs:
            assert out.dtype == ref.dtype == dtype
            assert rel_err(out, exact) < max(TOL[dtype], 1.5 * rel_err(ref, exact))

    check()
    assert counts.fused == 3 and counts.reference == 0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    check()
    assert counts.fused == 6 and counts.reference == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP, lambda: nerf_mlp()], ids=["gated", "gpt2", "nerf"])
def test_gpu_fp32_weights_train_under_autocast(make, dtype, untrained_specs):
    _train_fp32_under_autocast(make, "cuda", dtype, 256)


@pytest.mark.gpu
def test_gpu_autocast_training_of_fp32_weights(untrained_specs, monkeypatch):
    # Mixed precision: fp32 master weights under bf16 autocast. With FXFUSE_GATED_TRAINING=1 every step after the
    # first runs the gated MLP as one autograd node in bf16 on inputs cast as autocast casts them; gradients match
    # eager's under the same autocast.
    monkeypatch.setenv("FXFUSE_GATED_TRAINING", "1")
    model = GatedMLP(64, 160).cuda().train()
    fast = fxfuse.optimize(model)
    eager = copy.deepcopy(model)
    for step in range(3):
        x = torch.randn(32, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fast(x)
            ref = eager(x)
        assert out.dtype == ref.dtype == torch.bfloat16
        # (the first step runs the fused op and its vjp, which marks the region trained, as for a bf16 model)
        assert "GatedMLPFunction" in out.grad_fn.name() or step == 0
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert p.grad.dtype == torch.float32
            assert rel_err(p.grad, q.grad) < 2e-2
            p.grad, q.grad = None, None


@pytest.mark.parametrize("make", [GatedMLP, GPT2MLP], ids=["gated", "gpt2"])
def test_the_backend_under_autocast_gives_eagers_result(make):
    # A function compiled with backend="fxfuse" that enters autocast itself: eager's dtype and values.
    model = make().eval()
    x = torch.randn(4, 32)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fxfuse", options={"inductor": False})
    with torch.no_grad():
        out, ref = compiled(x), f(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(fx_autocast.AUTOCAST_NEUTRAL_OPS))
def test_neutral_ops_keep_their_input_dtype_under_cuda_autocast(op):
    # What AUTOCAST_NEUTRAL_OPS claims, asked of CUDA autocast itself: the op is on neither of its cast lists (an
    # fp16 input stays fp16, an fp32 input stays fp32), so the fused epilogue may run it in the region's dtype.
    from fxfuse import epilogue as ep

    fn = ep.OPS[op].torch
    extra = {"leaky_relu": (0.1,), "hardtanh": (-1.0, 1.0), "clamp_min": (0.0,), "clamp_max": (1.0,)}
    for dtype in (torch.float16, torch.float32):
        x = torch.rand(8, device="cuda", dtype=dtype) + 0.5
        args = (x, x) if ep.OPS[op].arity == 2 and op not in extra else (x, *extra.get(op, ()))
        with torch.autocast("cuda", dtype=torch.float16):
            assert fn(*args).dtype == dtype, (op, dtype)
