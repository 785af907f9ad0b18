"""The small-M stage kernel (M <= 64, split-K) against the float64 reference, and its place among the stages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
from test_ops import TOL, rel_err

from fxfuse import stages
from fxfuse.kernels import GEMV_MAX_M, run_stage_gemv
from fxfuse.kernels.gemv_template import (
    GEMV_BLOCK_M,
    GEMV_MAX_SPLIT,
    MANY_ROWS_CONFIGS,
    _prune,
    fit_gemv_config,
    gemv_block_m,
    gemv_workspace_splits,
    gpu_gemv_configs,
)
from fxfuse.kernels.workspace import _workspaces

# (epilogue, number of linears, bias?, operands?, K, N): odd widths, not multiples of the test tiles.
STAGES = [
    ("mul(silu(a0),a1)", 2, False, 0, 70, 45),  # SwiGLU gate+up
    ("gelu_tanh(a0)", 1, True, 0, 100, 33),  # GPT-2 fc1
    ("a0", 1, True, 0, 129, 50),  # a plain linear with bias, K past two splits
    ("mul(mul(gelu_tanh(a0),a1),v0)", 2, True, 1, 48, 40),  # gated with biases and an operand
]


def make_stage(epilogue, n_lin, bias, n_ops, k, n, m, dtype=torch.float32, device="cpu"):
    x = torch.randn(m, k, dtype=dtype, device=device)
    ws = [torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5 for _ in range(n_lin)]
    bs = [torch.randn(n, dtype=dtype, device=device) * 0.1 if bias else None for _ in range(n_lin)]
    ops = [torch.rand(n, dtype=dtype, device=device) + 0.5 for _ in range(n_ops)]
    return x, ws, bs, ops, epilogue


def reference(x, ws, bs, ops, epilogue):
    """The stage in float64 (epilogues of ``STAGES`` only)."""
    a = [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(ws, bs)]
    out = {"mul(silu(a0),a1)": lambda: F.silu(a[0]) * a[1],
           "gelu_tanh(a0)": lambda: F.gelu(a[0], approximate="tanh"),
           "a0": lambda: a[0],
           "mul(mul(gelu_tanh(a0),a1),v0)": lambda: F.gelu(a[0], approximate="tanh") * a[1] * ops[0].double()}
    return out[epilogue]()


def workspaces_are_clean():
    # This kernel's counters are left zero for the next launch; its workspace slices hold the last launch's partial
    # sums, which the next overwrites before it reads them.
    return all(c.count_nonzero().item() == 0 for key, (_, c) in _workspaces.items() if key[0] == "gemv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("stage", STAGES, ids=[s[0] for s in STAGES])
def test_gemv_matches_float64_reference(stage, dtype):
    for m in (1, 3, GEMV_BLOCK_M, 24, GEMV_MAX_M):  # different M back to back share the split-K workspace (per BLOCK_M)
        args = make_stage(*stage, m, dtype)
        out = run_stage_gemv(*args)
        assert out.shape == (m, stage[-1]) and out.dtype == dtype
        assert rel_err(out, reference(*args)) < TOL[dtype]
    assert workspaces_are_clean()


# ONE_ROW configs (M == 1, multiply-and-sum instead of tl.dot), small enough for the interpreter: a tile narrower
# than 16 columns, a split-K one, and a split one-column tile (one counter per column; probe_one_row_split.py).
ONE_ROW_CONFIGS = [triton.Config({"BLOCK_N": 4, "BLOCK_K": 32, "SPLIT_K": 1, "ONE_ROW": 1}, num_warps=4),
                   triton.Config({"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 3, "ONE_ROW": 1}, num_warps=4),
                   triton.Config({"BLOCK_N": 1, "BLOCK_K": 16, "SPLIT_K": 2, "ONE_ROW": 1}, num_warps=4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("stage", STAGES, ids=[s[0] for s in STAGES])
def test_one_row_configs_match_float64_reference(stage, dtype):
    # With PREFETCH the first K step's weights are loaded before the (here absent) wait for the previous kernel.
    prefetching = [triton.Config({**c.kwargs, "PREFETCH": True}, num_warps=c.num_warps) for c in ONE_ROW_CONFIGS]
    for config in ONE_ROW_CONFIGS + prefetching:
        args = make_stage(*stage, 1, dtype)
        assert rel_err(run_stage_gemv(*args, config=config), reference(*args)) < TOL[dtype], config
    assert workspaces_are_clean()
    with pytest.raises(ValueError, match="at most ONE_ROW=1 rows"):
        run_stage_gemv(*make_stage(*stage, 2, dtype), config=ONE_ROW_CONFIGS[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("stage", STAGES, ids=[s[0] for s in STAGES])
def test_register_stream_for_a_few_rows_matches_float64_reference(stage, dtype):
    """ONE_ROW = R streams each weight tile once for R rows; fewer rows read row r % M and drop it at the store."""
    for rows, one_row in ((2, ONE_ROW_CONFIGS[0]), (4, ONE_ROW_CONFIGS[1])):  # (the second splits K)
        config = triton.Config({**one_row.kwargs, "ONE_ROW": rows}, num_warps=one_row.num_warps)
        for m in (rows - 1, rows):
            args = make_stage(*stage, m, dtype)
            out = run_stage_gemv(*args, config=config)
            assert out.shape == (m, stage[-1]) and rel_err(out, reference(*args)) < TOL[dtype], (config, m)
    assert workspaces_are_clean()


def test_register_stream_configs_take_the_m_bucket_as_their_rows():
    x = torch.empty(1, 4096, dtype=torch.bfloat16)
    for bucket in (1, 2, 4, 8, 16):
        for gated in (False, True):
            args = {"x_ptr": x, "N": 14336, "K": 4096, "M_BUCKET": bucket, **({"w1_ptr": x} if gated else {})}
            kept = _prune(gpu_gemv_configs(), args)
            stream = [c for c in kept if c.kwargs["ONE_ROW"]]
            assert bool(stream) == (bucket <= 4) and all(c.kwargs["ONE_ROW"] == bucket for c in stream)
            assert all(c.kwargs["SPLIT_K"] == 1 or c.kwargs["BLOCK_N"] >= 16 for c in stream)
            # Partial sums within the register budget: 4 rows drop the widest gated one-row tiles.
            assert all(c.kwargs["ONE_ROW"] * (2 if gated else 1) * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"]
                       <= 128 * 32 * c.num_warps for c in stream)
            # One row over a column per SM or more: the one-row stream only (it beat every tile measured there);
            # a few rows keep the tl.dot tiles beside it.
            assert (len(stream) == len(kept)) == (bucket == 1)


@pytest.mark.parametrize("block_m", [32, 64])
def test_more_than_16_rows_try_a_few_tiles_whose_sums_fit_the_registers(block_m):
    x = torch.empty(block_m, 4096, dtype=torch.bfloat16)
    for gated in (False, True):
        args = {"x_ptr": x, "N": 14336, "K": 4096, "M_BUCKET": block_m, "BLOCK_M": block_m,
                **({"w1_ptr": x} if gated else {})}
        kept = _prune(gpu_gemv_configs(), args)
        assert kept and len(kept) <= len(MANY_ROWS_CONFIGS)
        for c in kept:
            kw = c.kwargs
            assert not kw["ONE_ROW"] and (kw["BLOCK_N"], kw["BLOCK_K"], kw["SPLIT_K"], c.num_warps) in {
                t[:4] for t in MANY_ROWS_CONFIGS}
            assert (2 if gated else 1) * kw["BLOCK_N"] * block_m <= 64 * 32 * c.num_warps
            # (x's 64-row tile counted in each pipeline stage's shared memory)
            assert fit_gemv_config(c, 2 if gated else 1, 2, block_m).num_stages == c.num_stages


def test_a_shape_no_tile_suits_gets_the_narrowest_smallest_tile_fitted_to_shared_memory():
    # A gated fp32 stage 8 columns wide at 64 rows: every tile is wider than N. The one kept must still fit the
    # shared-memory budget (it was returned unfitted: 3 stages of 288 KB by the model).
    from fxfuse.kernels.template import _SMEM_BUDGET

    for block_m, k in ((64, 4096), (16, 64)):
        x = torch.empty(block_m, k, dtype=torch.float32)
        args = {"x_ptr": x, "w1_ptr": x, "N": 8, "K": k, "M_BUCKET": block_m, "BLOCK_M": block_m}
        (c,) = _prune(gpu_gemv_configs(), args)
        kw = c.kwargs
        per_stage = (2 * kw["BLOCK_N"] * kw["BLOCK_K"] + block_m * kw["BLOCK_K"]) * 4
        assert c.num_stages == 1 or c.num_stages * per_stage <= _SMEM_BUDGET, (kw, c.num_stages)
        assert kw["BLOCK_N"] == min(t.kwargs["BLOCK_N"] for t in gpu_gemv_configs() if not t.kwargs["ONE_ROW"]
                                    and t.kwargs["BLOCK_N"] * t.kwargs["BLOCK_K"] == kw["BLOCK_N"] * kw["BLOCK_K"]
                                    and (block_m == 16 or (t.kwargs["BLOCK_N"], t.kwargs["BLOCK_K"], t.kwargs[
                                        "SPLIT_K"], t.num_warps, t.num_stages) in MANY_ROWS_CONFIGS))


def test_one_row_keeps_the_tiles_when_columns_leave_sms_idle():
    x = torch.empty(1, 65536, dtype=torch.bfloat16)
    kept = _prune(gpu_gemv_configs(), {"x_ptr": x, "N": 64, "K": 65536, "M_BUCKET": 1})
    assert any(c.kwargs["ONE_ROW"] for c in kept) and any(not c.kwargs["ONE_ROW"] for c in kept)
    assert any(c.kwargs["SPLIT_K"] > 1 for c in kept)  # the split-K tiles that fill the SMs stay candidates


def test_prefetching_one_row_launch_takes_whole_row_configs():
    x = torch.empty(1, 14336, dtype=torch.bfloat16)
    args = {"x_ptr": x, "N": 4096, "K": 14336, "M_BUCKET": 1}
    kept = _prune(gpu_gemv_configs(), {**args, "PREFETCH": True})
    assert kept and all(c.kwargs["ONE_ROW"] and c.kwargs["BLOCK_K"] >= 14336 for c in kept)
    assert any(c.kwargs["BLOCK_K"] < 14336 for c in _prune(gpu_gemv_configs(), {**args, "PREFETCH": False}))
    wide = {**args, "K": 65536, "x_ptr": torch.empty(1, 65536, dtype=torch.bfloat16), "PREFETCH": True}
    assert _prune(gpu_gemv_configs(), wide)  # no whole-row config: the others stay


def test_strided_inputs_and_single_element_operand():
    k, n = 40, 24
    x = torch.randn(k, 3).t()  # [3, K], non-contiguous
    wg, wu = (torch.randn(k, n).t() / k ** 0.5 for _ in range(2))  # [N, K] views of [K, N] storage
    scale = torch.tensor([1.5])
    out = run_stage_gemv(x, [wg, wu], [None, None], [scale], "mul(mul(silu(a0),a1),v0)")
    xd = x.double()
    ref = F.silu(xd @ wg.double().T) * (xd @ wu.double().T) * 1.5
    assert rel_err(out, ref) < TOL[torch.float32]
    rows = torch.randn(2 * n, k)[::2] / k ** 0.5  # every other row of a bigger weight
    assert rel_err(run_stage_gemv(x, [rows], [None], [], "a0"), xd @ rows.double().T) < TOL[torch.float32]


def test_bad_arguments_raise():
    x, ws, bs, ops, epi = make_stage(*STAGES[1], GEMV_MAX_M + 1)
    with pytest.raises(ValueError, match="at most"):
        run_stage_gemv(x, ws, bs, ops, epi)
    with pytest.raises(ValueError, match="weight 0"):
        run_stage_gemv(x[:2], [ws[0][:, :-1]], bs, ops, epi)


def test_a_forced_config_may_not_split_past_the_workspaces_slices():
    # Above 16 rows the workspace holds the two slices per linear its configs use (gemv_workspace_splits); a
    # probe's config splitting further would write into the next linear's slices.
    for m, split in ((24, gemv_workspace_splits(32) + 1), (GEMV_BLOCK_M, GEMV_MAX_SPLIT + 1)):
        args = make_stage(*STAGES[0], m)
        config = triton.Config({"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": split, "ONE_ROW": 0}, num_warps=4)
        with pytest.raises(ValueError, match="K splits"):
            run_stage_gemv(*args, config=config)


def test_uneven_k_splits_each_get_steps_and_match_float64():
    # 5 K steps over 4 splits: 1, 1, 1, 2 (each split a share of its own), the same sums in order on every call.
    epilogue, n_lin, bias, n_ops, _, n = STAGES[0]
    args = make_stage(epilogue, n_lin, bias, n_ops, 5 * 16 - 3, n, 3)
    config = triton.Config({"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 4, "ONE_ROW": 0}, num_warps=4)
    outs = [run_stage_gemv(*args, config=config) for _ in range(2)]
    assert torch.equal(*outs) and rel_err(outs[0], reference(*args)) < TOL[torch.float32]
    assert workspaces_are_clean()


def test_a_prefetching_split_with_no_k_step_adds_nothing():
    # 2 K steps over 3 splits: one split has none. Its prefetch (the first step's weights, loaded before the wait)
    # must not add the step the next split adds too.
    epilogue, n_lin, bias, n_ops, _, n = STAGES[2]
    args = make_stage(epilogue, n_lin, bias, n_ops, 20, n, 1)
    config = triton.Config({"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 3, "ONE_ROW": 1, "PREFETCH": True}, num_warps=4)
    assert rel_err(run_stage_gemv(*args, config=config), reference(*args)) < TOL[torch.float32]
    assert workspaces_are_clean()


def test_unfilled_workspaces_stay_unfilled_under_deterministic_algorithms(monkeypatch, deterministic):
    # torch.empty fills NaN (ints: their largest value) under the flag; captured, that fill would run on every
    # replay after the capturer zeroed the counters once.
    from fxfuse.kernels import workspace

    seen = []
    empty, x = torch.empty, torch.zeros(2, 3)
    monkeypatch.setattr(workspace.torch, "empty", lambda *a, **k: seen.append(
        torch.utils.deterministic.fill_uninitialized_memory) or empty(*a, **k))
    monkeypatch.setattr(workspace, "_workspaces", {})
    with deterministic():
        ws, counters = workspace.zeroed_workspace(x, "test", (4, 5), 3, zero_sums=False)
        assert seen == [False] and torch.utils.deterministic.fill_uninitialized_memory
    assert counters.count_nonzero() == 0


def test_the_split_k_workspace_is_not_filled_only_its_counters(monkeypatch):
    # Each split writes its slice before the last one reads it: only the counters need zeros, and a fill of the
    # slices captured into a CUDA graph would run on every replay.
    from fxfuse.kernels import workspace

    filled = []
    zeros = torch.zeros
    monkeypatch.setattr(workspace.torch, "zeros", lambda *a, **k: filled.append(a[0]) or zeros(*a, **k))
    monkeypatch.setattr(workspace, "_workspaces", {})
    args = make_stage(*STAGES[0], 3)
    run_stage_gemv(*args)
    assert filled == [(STAGES[0][-1],)]  # the counters, one per column


def test_untimed_stage_choice_is_the_small_m_kernel(monkeypatch):
    calls = []
    real = stages.run_stage_gemv
    monkeypatch.setattr(stages, "run_stage_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    for m in (1, stages.GEMV_ONLY_M, stages.GEMV_ONLY_M + 1):
        x, ws, bs, ops, epi = make_stage(*STAGES[0], m)
        out, _ = stages.run_best_stage(x, ws, bs, ops, epi, timed=False)
        assert rel_err(out, reference(x, ws, bs, ops, epi)) < TOL[torch.float32]
    assert calls == [1, stages.GEMV_ONLY_M]  # 17 rows take the GEMM kernels


def test_from_17_to_64_rows_the_small_m_kernel_is_timed_beside_the_gemm_kernels():
    x, ws, bs, ops, epi = make_stage(*STAGES[0], 24)
    assert "gemv" in stages._runners(x, ws, bs, ops, epi, timed=True)
    assert "gemv" not in stages._runners(x, ws, bs, ops, epi, timed=False)  # (untimed: a GEMM kernel runs)
    x65 = make_stage(*STAGES[0], GEMV_MAX_M + 1)[0]
    assert "gemv" not in stages._runners(x65, ws, bs, ops, epi, timed=True)


def test_a_stage_after_a_small_m_stage_is_told_so(monkeypatch):
    """The region's stage loop tells a small-M launch whether the previous stage was one (its PREFETCH rule)."""
    from fxfuse.ops import _run_kernels
    from fxfuse.strategy import GATED_GEMM_EPILOGUE

    seen = []
    real = stages.run_stage_gemv
    monkeypatch.setattr(stages, "run_stage_gemv", lambda *a, **k: seen.append(k["after_gemv"]) or real(*a, **k))
    x, (wg, wu), _, _, _ = make_stage(*STAGES[0], 1)
    wd = torch.randn(20, STAGES[0][-1]) / 7
    out = _run_kernels(x, [wg, wu, wd], [], [], "2:mul(silu(a0),a1);1:a0", GATED_GEMM_EPILOGUE)
    assert seen == [False, True]
    ref = (F.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T)) @ wd.double().T
    assert rel_err(out, ref) < TOL[torch.float32]


GPU_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# Decode-like widths: gated 512 -> 1000 (K and N not multiples of the tiles), down 1000 -> 384 (split-K applies).
GPU_STAGES = [("mul(silu(a0),a1)", 2, False, 0, 512, 1000), ("a0", 1, True, 0, 1000, 384),
              ("gelu_tanh(a0)", 1, True, 0, 1024, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("stage", GPU_STAGES, ids=[s[0] for s in GPU_STAGES])
def test_gemv_on_gpu(stage, dtype, no_tf32):
    for m in (1, 5, GEMV_BLOCK_M, 24, 40, GEMV_MAX_M):
        args = make_stage(*stage, m, dtype, "cuda")
        assert rel_err(run_stage_gemv(*args), reference(*args)) < GPU_TOL[dtype], m
    torch.cuda.synchronize()
    assert workspaces_are_clean()


@pytest.mark.gpu
@pytest.mark.parametrize("stage", GPU_STAGES[:2], ids=[s[0] for s in GPU_STAGES[:2]])
def test_every_gpu_config(stage):
    """Each config the autotuner may pick (fitted to shared memory as it would be), split-K ones included, run
    directly (bf16)."""
    for listed in gpu_gemv_configs():
        config = fit_gemv_config(listed, stage[1], 2)
        runs = [(config, m) for m in ((1,) if config.kwargs["ONE_ROW"] else (1, GEMV_BLOCK_M))]
        kw = listed.kwargs
        if (kw["BLOCK_N"], kw["BLOCK_K"], kw["SPLIT_K"], listed.num_warps, listed.num_stages) in MANY_ROWS_CONFIGS:
            runs += [(fit_gemv_config(listed, stage[1], 2, gemv_block_m(m)), m) for m in (24, 40, GEMV_MAX_M)]
        if config.kwargs["ONE_ROW"]:  # the register stream at 4 rows too, where its partial sums fit (as pruned)
            four = fit_gemv_config(triton.Config({**config.kwargs, "ONE_ROW": 4}, num_warps=config.num_warps,
                                                 num_stages=config.num_stages), stage[1], 2)
            if 4 * stage[1] * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] <= 128 * 32 * config.num_warps:
                runs += [(four, 3), (four, 4)]
        for run_config, m in runs:
            args = make_stage(*stage, m, torch.bfloat16, "cuda")
            out = run_stage_gemv(*args, config=run_config)
            assert rel_err(out, reference(*args)) < 1e-2, (run_config, m)
    torch.cuda.synchronize()
    assert workspaces_are_clean()


@pytest.mark.gpu
def test_prefetching_stage_sees_weights_written_just_before_the_region():
    """A one-row stage after a small-M stage loads its first weights before waiting for that stage (PREFETCH). The
    weights it reads must still be the ones written by the kernel before the region: a short first stage, a
    wide second whose weights are rewritten in place right before every call, all on one stream."""
    from fxfuse.kernels.gemv_launch import _bound

    one_row = next(c for c in gpu_gemv_configs() if c.kwargs["ONE_ROW"] and c.kwargs["BLOCK_N"] == 1)
    x, w1, _, _, _ = make_stage("gelu_tanh(a0)", 1, False, 0, 64, 256, 1, torch.bfloat16, "cuda")
    w2 = torch.empty(8192, 256, dtype=torch.bfloat16, device="cuda")
    for step in range(6):
        w2.copy_(torch.randn_like(w2) * (step + 1))  # a kernel writing the weights, right before the region
        h = run_stage_gemv(x, w1, [None], [], "gelu_tanh(a0)")
        out = run_stage_gemv(h, [w2], [None], [], "a0", after_gemv=True)
        assert rel_err(out, h.double() @ w2.double().T) < 1e-2, step
    assert any(key[0] == ("a0", True) for key in _bound)  # the prefetching launch was bound (and reused)
    for config in (one_row, triton.Config({**one_row.kwargs, "PREFETCH": True}, num_warps=one_row.num_warps)):
        assert rel_err(run_stage_gemv(h, [w2], [None], [], "a0", config=config), h.double() @ w2.double().T) < 1e-2


@pytest.mark.gpu
def test_gemv_on_two_streams_and_in_a_cuda_graph():
    split = next(c for c in gpu_gemv_configs() if c.kwargs["SPLIT_K"] > 1)
    stage = GPU_STAGES[1]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    calls = [make_stage(*stage, m, torch.bfloat16, "cuda") for m in (1, 8, 3, 16)]
    torch.cuda.synchronize()
    outs = []
    for _ in range(20):  # many split-K launches in flight on both streams at once
        for i, args in enumerate(calls):
            with torch.cuda.stream(streams[i % 2]):
                outs.append((i, run_stage_gemv(*args, config=split)))
    torch.cuda.synchronize()
    for i, out in outs:
        assert rel_err(out, reference(*calls[i])) < 1e-2
    args = calls[2]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_stage_gemv(*args, config=split)
    for _ in range(3):  # new inputs in place, replayed: the captured workspace resets itself too
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(*args)) < 1e-2
    assert workspaces_are_clean()


@pytest.mark.gpu
@pytest.mark.parametrize("one_row", [0, 1])
def test_split_k_outputs_are_the_same_bits_on_every_call(one_row, no_tf32):
    """The splits' partial sums are added in split order whichever finishes last (the atomic adds before session
    40 summed them in arrival order: gpt2m_mlp_m8's output differed between calls), fp32 accumulations included."""
    splits = [c for c in gpu_gemv_configs() if c.kwargs["SPLIT_K"] > 1]
    for config in splits:
        config = triton.Config({**config.kwargs, "ONE_ROW": one_row}, num_warps=config.num_warps,
                               num_stages=1 if one_row else config.num_stages)
        for m in ((1,) if one_row else (1, 8, GEMV_BLOCK_M, GEMV_MAX_M)):
            # (above 16 rows fitted to shared memory as the pruning fits them: x's tile is 64 fp32 rows there)
            fitted = config if one_row or m <= GEMV_BLOCK_M else fit_gemv_config(config, 1, 4, gemv_block_m(m))
            if fitted is None or fitted.kwargs["SPLIT_K"] > gemv_workspace_splits(gemv_block_m(m)):
                continue  # (no such launch: the pruning keeps at most two splits above 16 rows)
            args = make_stage("a0", 1, True, 0, 4096, 1024, m, torch.float32, "cuda")
            first = run_stage_gemv(*args, config=fitted)
            for _ in range(30):
                assert torch.equal(run_stage_gemv(*args, config=fitted), first), (fitted, m)
            assert rel_err(first, reference(*args)) < 1e-4, (fitted, m)
    assert workspaces_are_clean()


@pytest.mark.gpu
def test_a_region_tuned_by_plain_calls_is_captured_without_tuning():
    """A CUDA graph capture launches without PDL. A prefetching stage (the second of a one-row region) must still ask
    the autotuner for the key its plain calls tuned: tuning inside the capture is refused (it would invalidate
    the graph), and the capture then fails. Widths no other test uses, so nothing is tuned before this test."""
    x, w1, _, _, _ = make_stage("gelu_tanh(a0)", 1, False, 0, 208, 592, 1, torch.bfloat16, "cuda")
    w2 = make_stage("a0", 1, False, 0, 592, 176, 1, torch.bfloat16, "cuda")[1]

    def region():
        h = run_stage_gemv(x, w1, [None], [], "gelu_tanh(a0)", check=False)
        return run_stage_gemv(h, w2, [None], [], "a0", check=False, after_gemv=True)

    def expected():
        h = F.gelu(x.double() @ w1[0].double().T, approximate="tanh").to(x.dtype)
        return h.double() @ w2[0].double().T

    region()  # the plain call: tunes both stages
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = region()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, expected()) < 1e-2


@pytest.mark.gpu
def test_bound_launch_follows_new_inputs_and_weights():
    """After the first launch the host path is a launch bound to the call's weights: fresh inputs, weights updated
    in place and new weight tensors all give the right result."""
    from fxfuse.kernels.gemv_launch import _bound

    x, ws, bs, ops, epi = make_stage(*GPU_STAGES[1], 4, torch.bfloat16, "cuda")
    run_stage_gemv(x, ws, bs, ops, epi)
    bound = len(_bound)
    for _ in range(3):
        x = torch.randn_like(x)
        assert rel_err(run_stage_gemv(x, ws, bs, ops, epi), reference(x, ws, bs, ops, epi)) < 1e-2
    assert len(_bound) == bound  # every call after the first took the bound launch
    ws[0].mul_(-2.0)  # same storage, new values
    assert rel_err(run_stage_gemv(x, ws, bs, ops, epi), reference(x, ws, bs, ops, epi)) < 1e-2
    new_ws = [w.clone() * 0.5 for w in ws]  # new storage: a new binding
    assert rel_err(run_stage_gemv(x, new_ws, bs, ops, epi), reference(x, new_ws, bs, ops, epi)) < 1e-2
    assert rel_err(run_stage_gemv(x, new_ws, bs, ops, epi), reference(x, new_ws, bs, ops, epi)) < 1e-2
    assert len(_bound) == bound + 1
    unaligned = torch.randn(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x)  # a different signature
    assert rel_err(run_stage_gemv(unaligned, ws, bs, ops, epi), reference(unaligned, ws, bs, ops, epi)) < 1e-2
