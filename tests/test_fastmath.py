"""fastmath: the epilogue's tanh-based activations, exact for fp32 outputs and hardware-tanh for 16-bit ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fxfuse import epilogue as ep
from fxfuse.kernels import fastmath


@triton.jit
def _apply(x_ptr, out_ptr, n, WHICH: tl.constexpr, LOW_PRECISION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if WHICH == "tanh":
        y = fastmath.tanh(x, LOW_PRECISION)
    elif WHICH == "sigmoid":
        y = fastmath.sigmoid(x, LOW_PRECISION)
    elif WHICH == "silu":
        y = fastmath.silu(x, LOW_PRECISION)
    else:
        y = fastmath.gelu_tanh(x, LOW_PRECISION)
    tl.store(out_ptr + offs, y, mask=offs < n)


def test_fast_forms_are_rendered_only_with_a_flag():
    expr = ep.parse("mul(gelu_tanh(a0),silu(a1))")
    fast, _ = ep.to_triton(expr, acc_names=["acc0", "acc1"], operand_names=[], fast="LOW_PRECISION")
    assert any("_fm.gelu_tanh(acc0, LOW_PRECISION)" in line for line in fast)
    assert any("_fm.silu(acc1, LOW_PRECISION)" in line for line in fast)
    exact, _ = ep.to_triton(expr, acc_names=["acc0", "acc1"], operand_names=[])
    assert not any("_fm." in line for line in exact) and any("tl.sigmoid" in line for line in exact)
    relu, _ = ep.to_triton(ep.parse("relu(a0)"), acc_names=["acc0"], operand_names=[], fast="LOW_PRECISION")
    assert relu == ["    _e0 = tl.maximum(acc0, 0.0)"]  # no fast form: unchanged


REFERENCES = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_gpu_fast_and_exact_activations(name):
    x = torch.linspace(-12, 12, 100_003, device="cuda")
    ref = REFERENCES[name](x.double())
    for low in (False, True):
        out = torch.empty_like(x)
        _apply[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), WHICH=name, LOW_PRECISION=low, BLOCK=1024)
        err = ((out.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
        # hardware tanh: ~2^-11 relative; well under bf16's 2^-8 and fp16's 2^-11 output rounding
        assert err < (2e-3 if low else 1e-6), (name, low, err)


def test_interpreter_keeps_the_exact_forms():
    """Under TRITON_INTERPRET (CI) no PTX can run: the flag is off and every form is the exact one."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("runs in the interpreter only")
    assert not fastmath.ASM_TANH
    x = torch.linspace(-6, 6, 1000)
    out = torch.empty_like(x)
    _apply[(1,)](x, out, x.numel(), WHICH="gelu_tanh", LOW_PRECISION=True, BLOCK=1024)
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
