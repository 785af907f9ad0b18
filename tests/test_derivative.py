"""The epilogue derivatives written by fxfuse.derivative, against torch.autograd in float64."""

from __future__ import annotations

import pytest
import torch

from fxfuse import epilogue as ep
from fxfuse.derivative import derivative, derivative_text

SMOOTH = [
    "a0", "neg(a0)", "exp(a0)", "log(add(mul(a0,a0),1.0))", "sqrt(add(mul(a0,a0),0.5))", "rsqrt(add(mul(a0,a0),0.5))",
    "sin(mul(30.0,a0))", "cos(a0)", "tanh(a0)", "sigmoid(a0)", "silu(a0)", "erf(a0)", "gelu(a0)", "gelu_tanh(a0)",
    "mul(a0,sigmoid(mul(1.702,a0)))",  # QuickGELU
    "exp(neg(pow(a0,2.0)))",  # a Gaussian activation (INRs)
    "pow(a0,3.0)", "pow(a0,4.0)", "pow(a0,1.0)", "pow(add(mul(a0,a0),1.0),0.5)",
    "div(a0,add(exp(neg(a0)),1.0))", "sub(tanh(a0),mul(0.5,a0))", "add(sin(a0),cos(mul(2.0,a0)))",
]


@pytest.mark.parametrize("text", SMOOTH)
def test_derivative_matches_autograd_in_float64(text):
    a = torch.linspace(-4, 4, 801, dtype=torch.float64).requires_grad_()
    expr = ep.parse(text)
    (expected,) = torch.autograd.grad(ep.evaluate(expr, [a], []).sum(), a)
    d = derivative(expr)
    assert d is not None and ep.num_operands(d) == 0
    got = ep.evaluate(d, [a.detach()], [])
    got = got if isinstance(got, torch.Tensor) else torch.full_like(expected, got)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert derivative_text(text) == str(d) and ep.parse(str(d)) == d  # a text the kernels' renderer parses back


@pytest.mark.parametrize("text", ["relu(a0)", "abs(a0)", "leaky_relu(a0,0.1)", "hardtanh(a0,0.0,6.0)",
                                  "pow(relu(a0),2.0)", "maximum(a0,0.5)", "clamp_min(sin(a0),0.0)",
                                  "mul(a0,v0)", "mul(silu(a0),a1)"])
def test_no_derivative_for_kinks_operands_or_a_second_accumulator(text):
    # Eager picks a side at a kink op by op (relu's gradient at 0 is 0, clamp's passes): a formula would not.
    assert derivative(ep.parse(text)) is None and derivative_text(text) is None
