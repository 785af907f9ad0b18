"""Inputs on another GPU than the current one (a model split across GPUs, transformers' ``device_map="auto"``):
Triton launches on the current device, so fxfuse's entry points run such a call under its tensors' GPU
(``fxfuse.ops.on_its_device``). Needs two GPUs: skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from models import GPT2MLP
from test_ops import rel_err

import fxfuse
from fxfuse.ops import on_its_device

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two GPUs")


def test_a_cpu_tensor_is_on_its_device():
    assert on_its_device(torch.zeros(3))


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("rows", [1, 64, 2048])  # the one-launch decode kernel, the stage kernels, TMA
def test_gpu_a_region_on_the_second_gpu_runs_there(rows):
    torch.cuda.set_device(0)
    model = GPT2MLP(256, 1024).to("cuda:1", torch.bfloat16).eval()
    fast = fxfuse.optimize(model)
    x = torch.randn(rows, 256, device="cuda:1", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        for _ in range(3):  # plan, record, replay (and the shortcut's direct call)
            out = fast(x)
            assert out.device == x.device and rel_err(out, ref) < 2e-2
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@two_gpus
def test_gpu_moe_experts_on_the_second_gpu_run_there():
    from test_moe import experts, local_routing, reference

    from fxfuse import moe

    torch.cuda.set_device(0)
    module = experts("silu", torch.bfloat16, "cuda:1", hidden=256, inter=512, num=8)
    forward = moe.moe_forward(type(module).forward, "silu")
    for tokens in (1, 300):
        x = torch.randn(tokens, 256, device="cuda:1", dtype=torch.bfloat16)
        index, weights = local_routing(tokens, 2, 8, "cuda:1", torch.bfloat16)
        with torch.no_grad():
            out = forward(module, x, index, weights)
        assert out.device == x.device and rel_err(out, reference(module, x, index, weights, "silu")) < 2e-2
    assert module.__dict__["_fxfuse_moe"] is True and torch.cuda.current_device() == 0


@pytest.mark.gpu
@two_gpus
def test_gpu_the_same_shapes_on_both_gpus_launch_on_each():
    # A model split across GPUs has layers of one shape on each: a launch that skips Triton's Python path
    # (fxfuse.kernels.fastlaunch) must use the kernel loaded on its tensors' GPU, not the one recorded on the other.
    from test_moe import experts, local_routing, reference

    from fxfuse import moe

    torch.cuda.set_device(0)
    mlps = [GPT2MLP(256, 1024).to(f"cuda:{i}", torch.bfloat16).eval() for i in range(2)]
    fasts = [fxfuse.optimize(m) for m in mlps]
    layers = [experts("silu", torch.bfloat16, f"cuda:{i}", hidden=256, inter=512, num=8) for i in range(2)]
    forward = moe.moe_forward(type(layers[0]).forward, "silu")
    with torch.no_grad():
        for _ in range(3):  # (alternating: each GPU's second and third calls find the other's entries recorded)
            for i in range(2):
                x = torch.randn(64, 256, device=f"cuda:{i}", dtype=torch.bfloat16)
                assert rel_err(fasts[i](x), mlps[i](x)) < 2e-2
                index, weights = local_routing(64, 2, 8, f"cuda:{i}", torch.bfloat16)
                out = forward(layers[i], x, index, weights)
                assert rel_err(out, reference(layers[i], x, index, weights, "silu")) < 2e-2
    assert all(layer.__dict__["_fxfuse_moe"] is True for layer in layers)  # (no launch failed over to the original)
