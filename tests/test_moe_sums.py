"""The MoE layer's sums against float64: the biases' gradient kernels (:mod:`fxfuse.kernels.moe_bias_template`:
the down bias's as one routed GEMM over dout, experts held elsewhere left out; the gate/up bias's as each expert's
sum of the column sums the gate backward writes per block), also through the experts' autograd node with an expert
that gets no pair and with the many-expert fallback; and each token's top-k rows summed
(:func:`fxfuse.kernels.moe_launch.sum_pairs`)."""

from __future__ import annotations

import pytest
import torch
import triton
from test_moe import GRAD_TOL, biased_experts, check_gradients, force_tma
from test_ops import rel_err

from fxfuse.kernels import moe_backward_launch, moe_bias_launch, moe_launch
from fxfuse.kernels.fastlaunch import launch
from fxfuse.kernels.moe_bias_template import moe_block_sums_kernel, moe_routed_sums_kernel
from fxfuse.kernels.template import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="interpreter test (TRITON_INTERPRET=1)")


def routed_case(dtype):
    """70 tokens (a partial step), 45 columns (a partial 32-column tile), 5 experts (the dot's 16 rows), dout's rows
    strided; pairs at expert E (transformers' marker) and -1 belong to no expert here. And the float64 sums."""
    torch.manual_seed(0)
    T, top_k, E, H = 70, 3, 5, 45
    dout = torch.randn(T, H + 7, dtype=dtype)[:, :H]
    index = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)])
    index[0, 0], index[9, 2] = E, -1
    weights = torch.softmax(torch.randn(T, top_k), -1).to(dtype)
    want = torch.zeros(E, H, dtype=torch.float64)
    for t in range(T):
        for k in range(top_k):
            if 0 <= index[t, k] < E:
                want[index[t, k]] += weights[t, k].double() * dout[t].double()
    return dout, index, weights, want


ROUTED_TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_routed_sums_match_float64_and_leave_out_experts_held_elsewhere(dtype, splits):
    # splits=3 at 16 tokens a step: runs of 32 tokens, the last one partial (64..70)
    dout, index, weights, want = routed_case(dtype)
    (T, H), E = dout.shape, want.shape[0]
    parts = torch.full((E, splits, H), float("nan"), dtype=dtype if splits == 1 else torch.float32)
    launch(moe_routed_sums_kernel, lambda meta: (triton.cdiv(H, 32), splits), dict(
        dout_ptr=dout, index_ptr=index.reshape(-1), routing_ptr=weights.reshape(-1), out_ptr=parts, T=T, N=H,
        TOP_K=index.shape[1], num_experts=E, stride_dm=dout.stride(0), stride_oe=parts.stride(0),
        stride_os=parts.stride(1), INPUT_PRECISION="ieee", E_PAD=16, BLOCK_T=16, BLOCK_N=32), ("T",))
    assert rel_err(parts.sum(1), want) < ROUTED_TOL[dtype]


@pytest.mark.parametrize("split_from", [1024, 16])
def test_down_bias_grad_adds_its_splits(split_from, monkeypatch):
    # 70 tokens: one run, or (from 16 tokens on, 16 a run) four runs of 32 tokens at 16 a step, the last empty
    monkeypatch.setattr(moe_bias_launch, "_SPLIT_FROM", split_from)
    monkeypatch.setattr(moe_bias_launch, "TOKENS_PER_SPLIT", 16)
    monkeypatch.setattr(moe_bias_launch, "routed_tokens", lambda num_experts: 16)
    dout, index, weights, want = routed_case(torch.float16)
    assert moe_bias_launch.routed_splits(dout.shape[0]) == (1 if split_from == 1024 else 4)
    got = moe_bias_launch.down_bias_grad(dout, index, weights.reshape(-1), want.shape[0], "ieee")
    assert got.dtype == dout.dtype and rel_err(got, want) < ROUTED_TOL[torch.float16]


def test_block_sums_add_each_experts_blocks_only():
    # Experts 0..3 own blocks [0, 3), none, [3, 4), [4, 7); blocks 7.. are of no expert and hold NaN (never read);
    # 300 columns (a partial 256-column tile); two blocks a step (expert 0: a full step and a partial one).
    torch.manual_seed(1)
    parts = torch.randn(9, 300)
    parts[7:] = float("nan")
    segments = torch.tensor([0, 3, 3, 4, 7], dtype=torch.int32)
    out = torch.full((4, 300), float("nan"), dtype=torch.float16)
    launch(moe_block_sums_kernel, lambda meta: (4, triton.cdiv(300, 256)), dict(
        parts_ptr=parts, out_ptr=out, seg_ptr=segments, N=300, stride_oe=out.stride(0), BLOCK_B=2, BLOCK_N=256), ())
    want = torch.stack([parts[0:3].sum(0), torch.zeros(300), parts[3], parts[4:7].sum(0)]).double()
    assert rel_err(out, want) < 2e-3 and bool((out[1] == 0).all())


@pytest.mark.parametrize("routed", [True, False])
@pytest.mark.parametrize("family", ["gpt_oss", "privacy"])
def test_bias_gradients_with_an_expert_that_gets_no_pair(family, routed, monkeypatch):
    # Expert 4 of 5 gets no token: its bias gradients are zeros; routed=False: the down bias by the expert's rows
    # (the path past ROUTED_MAX_EXPERTS), forced at 5 experts.
    force_tma(False, monkeypatch)
    if not routed:
        monkeypatch.setattr(moe_backward_launch, "ROUTED_MAX_EXPERTS", 4)
    torch.manual_seed(2)
    module = biased_experts(family, torch.float32, "cpu", num=5)
    x = 2 * torch.randn(11, 32)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(11)])
    weights = torch.softmax(torch.randn(11, 2), -1)
    check_gradients(module, x, index, weights, lambda m, *a: type(m).forward(m, *a), GRAD_TOL[torch.float32])


@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_sum_pairs_rounds_each_tokens_fp32_sum_once(top_k):
    # 13 tokens (a partial 8-token tile), 300 columns (a partial 256-column tile), fp16 rows: the sum of fp32 values
    # rounded once, as torch's reduction rounds
    torch.manual_seed(4)
    T, H = 13, 300
    pairs = torch.randn(T * top_k, H).to(torch.float16)
    got = moe_launch.sum_pairs(pairs, T, top_k)
    want = pairs.double().view(T, top_k, H).sum(1)
    assert got.shape == (T, H) and got.dtype == torch.float16
    # (one fp16 rounding of an fp32 sum: within half an fp16 ulp plus fp32's error, element by element)
    assert bool(((got.double() - want).abs() <= want.abs() * 2.0 ** -11 * 1.01 + 1e-6).all())
