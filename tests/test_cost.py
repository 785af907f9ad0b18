"""fxfuse.cost: per-strategy predictions for the benchmark workloads (../shared/workloads.md), and the report's
predicted / measured columns.

Workload figures by hand (H200: copy 4.23 TB/s, bf16 701 / fp16 707 TFLOP/s):
* llama_swiglu_m1: 3 weights of 4096×14336 bf16 = 352.3 MB → 83.3 µs at copy bandwidth (memory-bound).
* nerf64: 2^20 rows, 32→64→64→64→16 fp16: 23.6 GFLOP → 33.4 µs (compute-bound once fused); the original ops
  write and re-read every 64-wide intermediate: 1.71 GB.
* gpt2_mlp: 8192 rows, 768→3072→768 bf16: 77.3 GFLOP → 110 µs (compute-bound).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse import cost, strategy
from fxfuse.cost import BANDWIDTH_EFFICIENCY, predict, rank
from fxfuse.roofline import Ceilings, count_call, named_ceilings
from fxfuse.spec import MLPSpec

SWIGLU = "2--:mul(silu(a0),a1);1-:a0"
LLAMA = (4096, 14336, 14336, 4096)
NERF = "1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0"
NERF64 = (32, 64, 64, 64, 16)
GPT2 = "1b:gelu_tanh(a0);1b:a0"


def test_nerf64_one_kernel_far_below_the_original_ops():
    chain = predict(NERF, NERF64, 1 << 20, torch.float16, strategy.FUSED_CHAIN, "H200")
    original = predict(NERF, NERF64, 1 << 20, torch.float16, strategy.ORIGINAL_OPS, "H200")
    assert chain.launches == 1 and original.launches == 7  # 4 linears + 3 relus
    assert chain.regime == "compute" and original.regime == "memory"
    assert chain.bytes == (1 << 20) * (32 + 16) * 2 + 2 * (32 * 64 + 64 * 64 * 2 + 64 * 16 + 64 * 3 + 16)
    assert original.bytes > 16 * chain.bytes
    assert chain.predicted_us < original.predicted_us / 5
    assert 33 < chain.compute_us < 60  # 33.4 µs at the matmul rate, over the Triton GEMM efficiency


def test_llama_m1_is_memory_bound_at_the_weight_streaming_floor():
    floor_us = 3 * 4096 * 14336 * 2 / 4.23e12 * 1e6  # 83.3
    ranked = rank(SWIGLU, LLAMA, 1, "bfloat16", device_name="NVIDIA H200")
    assert [p.strategy for p in ranked] == [strategy.DECODE_GRID_SYNC, strategy.GATED_GEMM_EPILOGUE,
                                            strategy.ORIGINAL_OPS]
    for p in ranked:
        assert p.regime == "memory"
        assert p.memory_us == pytest.approx(floor_us / BANDWIDTH_EFFICIENCY, rel=0.01)
        assert p.predicted_us == pytest.approx(floor_us / BANDWIDTH_EFFICIENCY + 5.0 * p.launches, rel=0.01)


def test_compute_bound_stages_at_the_rate_their_kernels_reach():
    """On Hopper a stage with its epilogue fused runs the TMA kernel (``FUSED_GEMM_EFFICIENCY``), a stage with
    nothing to fuse runs in cuBLAS; before, every generated GEMM was taken at 0.8 of the matmul rate, and Llama's
    region at 4096 rows read as slower fused than as the original ops (2583 against 2346 µs; measured 2031 / 2258)."""
    fused = predict(SWIGLU, LLAMA, 4096, "bfloat16", strategy.GATED_GEMM_EPILOGUE, "H200")
    original = predict(SWIGLU, LLAMA, 4096, "bfloat16", strategy.ORIGINAL_OPS, "H200")
    assert fused.regime == "compute" and fused.predicted_us < original.predicted_us
    gate_up, down = fused.kernels
    assert not gate_up.library and down.library  # the down projection's stage is a0: one cuBLAS GEMM
    rate = 701e12
    expected = (gate_up.flops / (rate * cost.FUSED_GEMM_EFFICIENCY["H200"])
                + down.flops / (rate * cost.CUBLAS_EFFICIENCY)) * 1e6
    assert fused.compute_us == pytest.approx(expected)
    # A GPU without a figure of its own: the generated kernels at TRITON_GEMM_EFFICIENCY.
    a100 = predict(SWIGLU, LLAMA, 4096, "bfloat16", strategy.GATED_GEMM_EPILOGUE, "A100")
    assert a100.compute_us == pytest.approx((gate_up.flops / cost.TRITON_GEMM_EFFICIENCY
                                             + down.flops / cost.CUBLAS_EFFICIENCY) / 312e12 * 1e6)


def test_large_m_is_compute_bound_and_small_m_launch_bound():
    gpt2 = predict(GPT2, (768, 3072, 768), 8192, "bfloat16", strategy.GEMM_EPILOGUE, "H200")
    assert gpt2.regime == "compute" and gpt2.flops == 2 * 8192 * 768 * 3072 * 2
    tiny = rank(GPT2, (1024, 4096, 1024), 1, "bfloat16", device_name="H200")
    assert tiny[0].strategy == strategy.DECODE_GRID_SYNC and all(p.regime == "launch" for p in tiny)


@pytest.mark.parametrize("spec, widths, operands", [
    (GPT2, (64, 256, 64), []),
    (SWIGLU, (64, 256, 256, 64), []),
    ("1b:mul(relu(a0),v0);1-:a0", (64, 128, 32), [128]),
])
def test_bytes_agree_with_the_roofline_count(spec, widths, operands):
    m, dt = 300, torch.float16
    parsed = MLPSpec.loads(spec)
    weights, k, w = [], widths[0], 0
    for s in parsed.stages:
        n = widths[w + 1]
        weights += [torch.empty(n, k, device="meta", dtype=dt) for _ in range(s.num_linears)]
        w += s.num_linears
        k = n
    x = torch.empty(m, widths[0], device="meta", dtype=dt)
    biases = [torch.empty(t.shape[0], device="meta", dtype=dt) for t, b in zip(weights, parsed.has_bias) if b]
    ops = [torch.empty(n, device="meta", dtype=dt) for n in operands]
    work = count_call(spec, x, weights, biases, ops, launches=len(parsed.stages))
    original = predict(spec, widths, m, dt, strategy.ORIGINAL_OPS, "H200")
    fused = predict(spec, widths, m, dt, strategy.GATED_GEMM_EPILOGUE if parsed.is_gated else
                    strategy.GEMM_EPILOGUE, "H200")
    assert (original.bytes, original.launches) == (work.eager_bytes, work.eager_launches)
    assert (fused.bytes, fused.flops, fused.launches) == (work.fused_bytes, work.flops, len(parsed.stages))


def test_strategies_that_cannot_run_are_refused_or_left_out():
    with pytest.raises(ValueError, match="gated"):
        predict(SWIGLU, (64, 128, 128, 64), 8, "float16", strategy.FUSED_CHAIN)
    with pytest.raises(ValueError, match="rows"):
        predict(GPT2, (64, 128, 64), 17, "float16", strategy.DECODE)
    with pytest.raises(ValueError, match="widths"):
        predict(GPT2, (64, 128), 8, "float16", strategy.GEMM_EPILOGUE)
    names = [p.strategy for p in rank(SWIGLU, (64, 128, 128, 64), 4096, "float16")]
    assert sorted(names) == sorted([strategy.GATED_GEMM_EPILOGUE, strategy.ORIGINAL_OPS])


def test_ceilings_unknown_gpu_and_measured_override():
    assert cost.ceilings_for("Some Future GPU").name == "H200"
    base = predict(SWIGLU, LLAMA, 1, "bfloat16", strategy.DECODE_GRID_SYNC, "H200")
    h200 = named_ceilings("H200")
    slow = Ceilings("measured", h200.copy_bytes_per_s / 2, dict(h200.matmul_flops_per_s), "test")
    halved = predict(SWIGLU, LLAMA, 1, "bfloat16", strategy.DECODE_GRID_SYNC, ceilings=slow)
    assert halved.device == "measured" and halved.memory_us == pytest.approx(2 * base.memory_us)
    assert "memory-bound" in str(halved)


# ------------------------------------------------------------------------------------------ the report

def _mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 64)).eval()


def test_report_shows_predicted_and_measured_columns(monkeypatch):
    monkeypatch.setattr(strategy, "_measured", {})
    fast = fxfuse.optimize(_mlp(), (torch.randn(4, 8, 64),))
    region = fxfuse.report(fast).regions[0]
    assert (region.m, region.widths, region.dtype) == (32, (64, 256, 64), "float32")
    expected = predict(region.spec, region.widths, 32, "float32", region.strategy.split()[0])
    assert region.predicted_us.fused_us == pytest.approx(expected.predicted_us)
    assert region.predicted_us.fused_us < region.predicted_us.original_us
    text = str(fxfuse.report(fast))
    assert "predicted µs (fused / original)" in text and "measured µs (fused / original)" in text
    assert f"{region.predicted_us} at M=32, launch-bound" in text and "not yet" in text
    # A measurement made after optimize (at run time) shows when the report is printed again.
    strategy._measured["k"] = strategy.Measurement(region.spec, 32, 32, (64, 256, 64), "float32", "cpu",
                                                   "fused_chain", 7.5, 12.25, "timed")
    assert region.measured_us.fused_us == 7.5
    assert "7.5 / 12.2 at M~32" in str(fxfuse.report(fast))


def test_report_strategy_column_says_what_the_first_gpu_call_chose(monkeypatch):
    monkeypatch.setattr(strategy, "_measured", {})
    fast = fxfuse.optimize(_mlp(), (torch.randn(1, 64),))
    region = fxfuse.report(fast).regions[0]
    planned = region.strategy
    assert region.running == planned  # nothing measured yet: the plan
    measured = functools.partial(strategy.Measurement, region.spec, 1, 1, (64, 256, 64), "float32", "cpu")
    strategy._measured["graph"] = measured("gemm_epilogue", 9.0, 12.0, "timed", for_cuda_graph=True)
    assert region.running == planned  # a choice for CUDA graph replays is not what plain calls run
    strategy._measured["plain"] = measured(strategy.DECODE_GRID_SYNC, 11.0, 12.0, "timed")
    assert region.running == "decode_grid_sync (1 launch)" and region.strategy == planned
    assert "decode_grid_sync (1 launch)" in str(fxfuse.report(fast))
    strategy._measured["plain"] = measured(strategy.GEMM_EPILOGUE, 13.0, 12.0, "timed")  # slower: originals run
    assert region.running == "original ops"
    # M unknown at optimize time: each bucket measured.
    unknown = fxfuse.report(fxfuse.optimize(_mlp())).regions[0]
    strategy._measured["plain"] = measured(strategy.GEMM_EPILOGUE, 11.0, 12.0, "timed")
    strategy._measured["m8"] = strategy.Measurement(region.spec, 8, 8, (64, 256, 64), "float32", "cpu",
                                                    strategy.DECODE, 11.0, 12.0, "timed")
    assert unknown.running == "gemm_epilogue (2 launches) at M~1; decode_split_hidden (1 launch) at M~8"
    assert unknown.running_at(5) == "decode_split_hidden (1 launch)"


def test_report_says_when_m_is_unknown(monkeypatch):
    monkeypatch.setattr(strategy, "_measured", {})
    fast = fxfuse.optimize(_mlp())
    region = fxfuse.report(fast).regions[0]
    assert region.m is None and region.predicted_us is None
    assert "M unknown" in str(fxfuse.report(fast))
    # Once the region has run (M known then), the prediction at that M stands beside the measured times.
    expected = predict(region.spec, region.widths, 32, "float32", "fused_chain")
    assert "predicted: none yet" in str(fxfuse.report(fast))  # no prediction made yet
    strategy._measured["k"] = strategy.Measurement(region.spec, 32, 32, (64, 256, 64), "float32", "cpu",
                                                   "fused_chain", 7.5, 12.25, "timed", expected.predicted_us, 20.0,
                                                   expected.regime)
    text = str(fxfuse.report(fast))
    assert "M unknown" not in text
    assert f"{expected.predicted_us:.1f} / 20.0 at M=32, {expected.regime}-bound" in text
    assert "7.5 / 12.2 at M~32" in text
    assert "predicted: cost model on H200 ceilings" in text  # a CPU run's prediction falls back to the H200's
    # The ceilings named are those of the GPU the first call ran on (an H100 here), not a default.
    strategy._measured["k"] = dataclasses.replace(strategy._measured["k"], device="NVIDIA H100 80GB HBM3")
    assert "predicted: cost model on H100 ceilings" in str(fxfuse.report(fast))


def test_h100_ceilings_are_the_measured_ones_not_the_datasheet():
    h100 = cost.ceilings_for("NVIDIA H100 80GB HBM3")
    assert h100.name == "H100" and "measured" in h100.source
    assert 2.9e12 <= h100.copy_bytes_per_s <= 3.1e12 and h100.matmul("bfloat16") < 800e12
