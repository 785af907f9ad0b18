"""torch.compile(model, backend="fxfuse"): found by name, fuses Dynamo's graph, runs correctly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from models import GPT2MLP, GatedMLP

import fxfuse


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_backend_found_by_name_without_importing_fxfuse():
    code = textwrap.dedent("""
        import sys, torch
        from torch._dynamo.backends.registry import lookup_backend
        fn = lookup_backend("fxfuse")
        print(fn.__module__, "fxfuse" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["fxfuse.backend", "True"]  # imported by the entry point, not by us


@pytest.mark.parametrize("model", [GPT2MLP(), GatedMLP()], ids=["gpt2", "swiglu"])
def test_backend_without_inductor_fuses_dynamo_graph(model):
    model.eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse", options={"inductor": False})
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.report(compiled).num_fused == before + 1


def test_backend_with_inductor_default():
    model = GPT2MLP().eval()
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_backend_leaves_training_graphs_to_inductor():
    # Compiled with grad mode on, AOTAutograd differentiates the graph: Inductor's backward keeps the
    # intermediates, where the op's would recompute the forward. The no_grad graph (its own Dynamo graph,
    # guarded on grad mode) is fused.
    model = GatedMLP().train()
    compiled = torch.compile(model, backend="fxfuse")
    before = fxfuse.report().num_fused
    x = torch.randn(4, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled(x).square().sum().backward()
    report = fxfuse.report(compiled)
    assert report.num_fused == before
    assert any("gradients are recorded" in r.reason for r in report.rejections)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.report(compiled).num_fused == before + 1


def test_unknown_backend_option_is_a_clear_error():
    compiled = torch.compile(GPT2MLP().eval(), backend="fxfuse", options={"inductr": False})
    with pytest.raises(Exception, match="inductr"):
        compiled(torch.randn(2, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("inductor", [True, False])
def test_backend_on_gpu(inductor):
    model = GatedMLP(256, 768).cuda().to(torch.bfloat16).eval()
    x = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="fxfuse", options={"inductor": inductor})
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
