"""torch.ops.fxfuse.mlp: kernels vs the float64 reference, fallbacks, fake, autograd, opcheck."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import fxfuse.ops  # noqa: F401
from fxfuse.ops import reference_mlp

mlp = torch.ops.fxfuse.mlp.default
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_args(spec: str, dims: list[int], dtype=torch.float32, device="cpu", lead=(5,)):
    """Random inputs for ``spec`` with layer widths ``dims`` (gated stages get two weights)."""
    from fxfuse.spec import MLPSpec

    parsed = MLPSpec.loads(spec)
    x = torch.randn(*lead, dims[0], dtype=dtype, device=device)
    weights, biases, operands = [], [], []
    for i, stage in enumerate(parsed.stages):
        k, n = dims[i], dims[i + 1]
        for j in range(stage.num_linears):
            weights.append(torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5)
            if stage.has_bias[j]:
                biases.append(torch.randn(n, dtype=dtype, device=device) * 0.1)
        operands += [torch.rand(n, dtype=dtype, device=device) + 0.5 for _ in range(stage.num_operands)]
    return x, weights, biases, operands, spec


def f64(args):
    x, w, b, o, spec = args
    return x.double(), [t.double() for t in w], [t.double() for t in b], [t.double() for t in o], spec


SPECS = [
    ("1b:gelu_tanh(a0);1b:a0", [24, 50, 24]),
    ("2--:mul(a0,silu(a1));1-:a0", [24, 40, 24]),
    ("1b:mul(relu(a0),v0);1-:a0", [20, 33, 7]),
    ("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0", [16, 32, 32, 32, 8]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec,dims", SPECS)
def test_kernels_match_float64_reference(spec, dims, dtype):
    args = make_args(spec, dims, dtype, lead=(2, 3))
    out = mlp(*args)
    assert out.shape == (2, 3, dims[-1]) and out.dtype == dtype
    assert rel_err(out, reference_mlp(*f64(args))) < TOL[dtype]


def test_m1_and_transposed_input():
    x, w, b, o, spec = make_args("1b:gelu(a0);1b:a0", [24, 40, 24], lead=(1,))
    assert rel_err(mlp(x, w, b, o, spec), reference_mlp(*f64((x, w, b, o, spec)))) < 1e-5
    xt = torch.randn(24, 9).t()  # non-contiguous [9, 24]
    assert rel_err(mlp(xt, w, b, o, spec), reference_mlp(*f64((xt, w, b, o, spec)))) < 1e-5


def test_float64_falls_back_to_reference_and_logs(caplog, monkeypatch):
    monkeypatch.setattr(fxfuse.ops, "_logged_fallbacks", set())  # (each reason is logged once per process)
    args = make_args("1b:silu(a0);1b:a0", [8, 16, 8], torch.float64)
    with caplog.at_level(logging.INFO, logger="fxfuse"):
        out = mlp(*args)
    torch.testing.assert_close(out, reference_mlp(*args))
    assert any("float64" in r.getMessage() for r in caplog.records)


def test_shape_mismatch_raises_eagers_error():
    x, w, b, o, spec = make_args("1b:relu(a0);1b:a0", [8, 16, 8])
    bad = torch.randn(4, 9)
    with pytest.raises(RuntimeError) as fused_err:
        mlp(bad, w, b, o, spec)
    with pytest.raises(RuntimeError) as eager_err:
        F.linear(bad, w[0], b[0])
    assert str(fused_err.value) == str(eager_err.value)


def test_gradients_equal_eager():
    x, w, b, o, spec = make_args("1b:mul(gelu(a0),v0);1b:a0", [12, 20, 6])
    leaves = [x, *w, *b, *o]
    for t in leaves:
        t.requires_grad_(True)
    out = mlp(x, w, b, o, spec)
    ref = reference_mlp(x, w, b, o, spec)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = make_args("2--:mul(a0,silu(a1));1-:a0", [16, 32, 16], lead=(3, 7))
        out = mlp(*args)
    assert isinstance(out, torch.Tensor) and mode is not None
    assert out.shape == (3, 7, 16) and out.dtype == torch.float32


def test_opcheck():
    args = make_args("1b:relu(a0);1-:a0", [8, 16, 8], lead=(3,))
    for t in (args[0], *args[1]):
        t.requires_grad_(True)
    torch.library.opcheck(mlp, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec,dims", SPECS + [("2--:mul(a0,gelu_tanh(a1));1-:a0", [768, 3072, 768])])
@pytest.mark.parametrize("lead", [(1,), (16,), (4, 512)])
def test_kernels_on_gpu(spec, dims, dtype, lead):
    args = make_args(spec, dims, dtype, device="cuda", lead=lead)
    out = mlp(*args)
    assert rel_err(out, reference_mlp(*f64(args))) < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
def test_measured_choice_keeps_the_faster_path_and_stays_correct(monkeypatch):
    from fxfuse import strategy
    from fxfuse.kernels.template import choice_bucket

    monkeypatch.setenv("FXFUSE_AUTOTUNE", "1")
    args = make_args("2--:mul(a0,silu(a1));1-:a0", [512, 1024, 512], torch.bfloat16, device="cuda", lead=(300,))
    out = mlp(*args)
    keys = [k for k in strategy._choices if k[0] == args[-1] and k[1] == choice_bucket(300)]
    assert len(keys) == 1  # timed once for this shape bucket (257-384 rows), then cached
    assert rel_err(out, reference_mlp(*f64(args))) < 1e-2
    assert rel_err(mlp(*args), reference_mlp(*f64(args))) < 1e-2
