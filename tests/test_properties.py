"""Property tests (hypothesis): random chains, written in random ways, with random input shapes and dtypes,
fuse into one call and compute what eager computes, within the dtype's tolerance."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from real_models import fused_calls
from torch import nn

import fxfuse

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "leaky_relu": lambda h: F.leaky_relu(h, 0.2),
    "relu_squared": lambda h: torch.relu(h) ** 2,
    "quick_gelu": lambda h: h * torch.sigmoid(1.702 * h),
}
# How a linear layer is written: nn.Linear, F.linear on parameters, x @ W.T + b (weight [N, K]),
# HF Conv1D (weight stored [K, N], addmm on the flattened input).
FORMS = ["module", "functional", "matmul_t", "conv1d"]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


class Chain(nn.Module):
    def __init__(self, widths, acts, gated, biases, forms):
        super().__init__()
        self.acts, self.gated, self.forms = acts, gated, forms
        self.layers = nn.ModuleList()
        for i, (k, n) in enumerate(zip(widths, widths[1:])):
            count = 2 if (gated and i == 0) else 1
            self.layers.append(nn.ModuleList(self._linear(k, n, biases[i], forms[i]) for _ in range(count)))

    @staticmethod
    def _linear(k, n, bias, form):
        if form == "module":
            return nn.Linear(k, n, bias=bias)
        m = nn.Module()
        shape = (k, n) if form == "conv1d" else (n, k)
        m.weight = nn.Parameter(torch.randn(shape) / math.sqrt(k))
        m.bias = nn.Parameter(torch.randn(n) * 0.1) if bias else None
        return m

    def _apply_linear(self, m, x, form):
        if form == "module":
            return m(x)
        if form == "functional":
            return F.linear(x, m.weight, m.bias)
        if form == "matmul_t":
            y = x @ m.weight.T
            return y + m.bias if m.bias is not None else y
        size_out = x.size()[:-1] + (m.weight.shape[1],)  # HF Conv1D
        if m.bias is None:
            return torch.mm(x.view(-1, x.size(-1)), m.weight).view(size_out)
        return torch.addmm(m.bias, x.view(-1, x.size(-1)), m.weight).view(size_out)

    def forward(self, x):
        h = x
        for i, linears in enumerate(self.layers):
            outs = [self._apply_linear(m, h, self.forms[i]) for m in linears]
            if i == len(self.layers) - 1:
                return outs[0]
            act = ACTIVATIONS[self.acts[i]]
            h = act(outs[0]) * outs[1] if len(outs) == 2 else act(outs[0])
        return h


@st.composite
def chains(draw):
    depth = draw(st.integers(2, 4))
    widths = draw(st.lists(st.integers(1, 40), min_size=depth + 1, max_size=depth + 1))
    acts = draw(st.lists(st.sampled_from(sorted(ACTIVATIONS)), min_size=depth - 1, max_size=depth - 1))
    gated = draw(st.booleans()) and depth <= 3
    biases = draw(st.lists(st.booleans(), min_size=depth, max_size=depth))
    forms = draw(st.lists(st.sampled_from(FORMS), min_size=depth, max_size=depth))
    lead = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    contiguous = draw(st.booleans())
    return widths, acts, gated, biases, forms, tuple(lead), dtype, contiguous


def check_chain(case, device: str = "cpu", dtype=None):
    widths, acts, gated, biases, forms, lead, drawn_dtype, contiguous = case
    dtype = dtype or drawn_dtype
    torch.manual_seed(0)
    model = Chain(widths, acts, gated, biases, forms).eval()
    ref_model = Chain(widths, acts, gated, biases, forms).eval()
    ref_model.load_state_dict(model.state_dict())
    model.to(device, dtype)
    fast = fxfuse.optimize(model)
    x = torch.randn(*lead, widths[0] * (1 if contiguous else 2))
    if not contiguous:
        x = x[..., ::2]
    n, out = fused_calls(fast, x.to(device, dtype))
    assert n == 1, fxfuse.report(fast)
    with torch.no_grad():
        ref = ref_model.double()(x.to(dtype).double())
    assert out.dtype == dtype and out.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    assert (out.double().cpu() - ref).abs().max().item() <= TOL[dtype] * scale * (1 if dtype == torch.float32 else 4)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_fused_equals_eager(case):
    check_chain(case)


# Examples per dtype on the GPU; FXFUSE_HYPOTHESIS_EXAMPLES caps them so a device call fits its time limit
# (benchmarks/gpu_session.sh sets it).
GPU_EXAMPLES = int(os.environ.get("FXFUSE_HYPOTHESIS_EXAMPLES", "20"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@settings(max_examples=GPU_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=chains())
def test_fused_equals_eager_on_gpu(dtype, case):
    check_chain(case, "cuda", dtype)
