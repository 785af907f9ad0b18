"""The grid-sync decode kernel: a whole two-stage MLP for one row in one launch, against the float64 reference.

On the CPU the interpreter runs the two stages as two launches (``phases=2``: its programs run one after
another, so a grid barrier would never open); the barrier itself, the prefetch configs and the cooperative
launch run in the GPU tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_decode import SPECS, decode_call
from test_ops import TOL, f64, make_args, rel_err
from test_replay import GPT2MLP

import fxfuse
from fxfuse import codegen, ops, replay
from fxfuse.kernels import run_grid_sync
from fxfuse.kernels.grid_sync_template import (
    fit_grid_sync_config,
    gpu_grid_sync_configs,
    grid_sync_programs,
    prefetch_fits,
)
from fxfuse.kernels.workspace import _workspaces
from fxfuse.ops import reference_mlp
from fxfuse.strategy import DECODE_GRID_SYNC


def arrivals_are_zero():
    """Every grid-sync workspace's arrival counter is back at zero (the generation may be anything)."""
    return all(c[0].item() == 0 for key, (_, c) in _workspaces.items() if key[0] == "grid_sync")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec,dims", SPECS)
def test_grid_sync_matches_float64_reference(spec, dims, dtype):
    for _ in range(2):  # fresh inputs: a stale intermediate in the scratch would show
        args = make_args(spec, dims, dtype, lead=(1,))
        out = run_grid_sync(*decode_call(args))
        assert out.shape == (1, dims[-1]) and out.dtype == dtype
        assert rel_err(out, reference_mlp(*f64(args))) < TOL[dtype]


def test_strided_inputs_and_single_element_operands():
    K, H, N = 40, 70, 24
    x = torch.randn(K, 2).t()[:1]  # [1, K], not contiguous along K
    wg, wu = (torch.randn(K, H).t() / K ** 0.5 for _ in range(2))  # [H, K] views of [K, H] storage
    wd = torch.randn(2 * N, H)[::2] / H ** 0.5  # every other row
    out = run_grid_sync(x, [wg, wu, wd], [None, None, None], [[torch.tensor([1.5])], [torch.tensor(0.5)]],
                        ("mul(mul(silu(a0),a1),v0)", "mul(a0,v0)"))
    xd, gd, ud, dd = (t.double() for t in (x, wg, wu, wd))
    ref = (F.silu(xd @ gd.T) * (xd @ ud.T) * 1.5) @ dd.T * 0.5
    assert rel_err(out, ref) < TOL[torch.float32]


def test_bad_arguments_raise():
    spec, dims = SPECS[1]
    x, w, b, o, epilogues = decode_call(make_args(spec, dims, lead=(2,)))
    with pytest.raises(ValueError, match="one row"):
        run_grid_sync(x, w, b, o, epilogues)
    with pytest.raises(ValueError, match="weight 1"):
        run_grid_sync(x[:1], [w[0], w[1][:, :-1]], b, o, epilogues)
    with pytest.raises(ValueError, match="phases"):
        run_grid_sync(x[:1], w, b, o, epilogues, phases=3)
    with pytest.raises(ValueError, match="interpreter"):
        run_grid_sync(x[:1], w, b, o, epilogues, phases=1)


def test_traced_call_runs_torch_ops_and_kernel_file_has_the_barrier():
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    spec, dims = SPECS[0]
    with FakeTensorMode():
        out = run_grid_sync(*decode_call(make_args(spec, dims, lead=(1,))))
    assert out.shape == (1, dims[-1]) and is_fake(out)
    src = open(codegen.generated_grid_sync_kernel(2, "mul(silu(a0),a1)", "a0").__file__).read()
    assert "fused_grid_sync_kernel" in src and "while seen == generation" in src and "w2_pre" in src


def test_prefetch_only_where_a_programs_w2_rows_fit():
    configs = gpu_grid_sync_configs()
    prefetching = [c for c in configs if c.kwargs["PREFETCH"]]
    # GPT-2 medium: 128 output tiles of 8 rows on 132 SMs, 8 x 4096 elements each: prefetched, all of H.
    gpt2m = [fit_grid_sync_config(c, 1024, 4096, 1024, 132) for c in prefetching]
    assert any(c is not None and c.kwargs["BLOCK_HH"] == 4096 for c in gpt2m)
    # Llama: 14336-wide rows do not fit registers; more output tiles than SMs cannot be one per program.
    assert all(fit_grid_sync_config(c, 4096, 14336, 4096, 132) is None for c in prefetching)
    assert not prefetch_fits(8, 4096, 4096, 132)
    streaming = [fit_grid_sync_config(c, 4096, 14336, 4096, 132) for c in configs if not c.kwargs["PREFETCH"]]
    assert streaming and all(c is not None for c in streaming)
    # At most one program per SM (the barrier needs them all resident), at least one per tile of the larger stage.
    assert grid_sync_programs({"BLOCK_H": 32, "BLOCK_N": 8}, 14336, 4096, 132) == 132
    assert grid_sync_programs({"BLOCK_H": 32, "BLOCK_N": 8}, 70, 24, 132) == 3


def test_op_runs_the_grid_sync_strategy_for_one_row():
    spec, dims = "1b:gelu_tanh(a0);1b:a0", [48, 100, 40]
    args = make_args(spec, dims, lead=(1, 1))  # [1, 1, K]: one row behind a leading dim
    out = ops._run_kernels(*args, DECODE_GRID_SYNC)
    assert out.shape == (1, 1, dims[-1])
    assert rel_err(out, reference_mlp(*f64(args))) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [
    ("2--:mul(silu(a0),a1);1-:a0", [4096, 14336, 4096]),  # Llama SwiGLU: W2 streamed after the barrier
    ("1b:gelu_tanh(a0);1b:a0", [1024, 4096, 1024]),  # GPT-2 medium: W2 prefetched
    ("2bb:mul(gelu_tanh(a0),a1);1b:mul(a0,v0)", [200, 300, 100]),  # odd widths, operand, few programs
]
GPU_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("spec,dims", GPU_SHAPES)
def test_every_config_on_gpu(spec, dims, dtype, no_tf32):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tried = 0
    for c in gpu_grid_sync_configs():
        c = fit_grid_sync_config(c, dims[0], dims[1], dims[2], sms)
        if c is None:
            continue
        for phases in (1, 2):
            args = make_args(spec, dims, dtype, device="cuda", lead=(1,))
            out = run_grid_sync(*decode_call(args), phases=phases, config=c)
            assert rel_err(out, reference_mlp(*f64(args))) < GPU_TOL[dtype], (c, phases)
        tried += 1
    assert tried >= 2
    torch.cuda.synchronize()
    assert arrivals_are_zero()


@pytest.mark.gpu
def test_back_to_back_launches_and_two_streams():
    spec, dims = GPU_SHAPES[1][:2]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    calls = [make_args(spec, dims, torch.bfloat16, device="cuda", lead=(1,)) for _ in range(4)]
    torch.cuda.synchronize()
    outs = []
    for _ in range(25):  # many barriers in flight on both streams (each stream has its own counters)
        for i, args in enumerate(calls):
            with torch.cuda.stream(streams[i % 2]):
                outs.append((i, run_grid_sync(*decode_call(args))))
    torch.cuda.synchronize()
    refs = [reference_mlp(*f64(args)) for args in calls]
    for i, out in outs:
        assert rel_err(out, refs[i]) < 1e-2
    assert arrivals_are_zero()


@pytest.mark.gpu
def test_grid_sync_in_a_cuda_graph():
    spec, dims = GPU_SHAPES[0][:2]
    args = make_args(spec, dims, torch.bfloat16, device="cuda", lead=(1,))
    call = decode_call(args)
    run_grid_sync(*call)  # compile and tune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_grid_sync(*call)
    for _ in range(3):  # new inputs in place, replayed: the captured barrier opens every time
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference_mlp(*f64(args))) < 1e-2


@pytest.mark.gpu
def test_a_one_row_region_replays_its_one_launch(monkeypatch):
    monkeypatch.setattr(ops, "_candidates", lambda *a: (DECODE_GRID_SYNC,))
    replay.forget_all()
    model = GPT2MLP(1024, 4096).cuda().to(torch.bfloat16).eval()
    opt = fxfuse.optimize(model)
    with torch.no_grad():
        for _ in range(3):  # from the second call on, the recorded launch alone
            x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
            assert rel_err(opt(x), model(x)) < 1e-2
        assert len(replay.replays) == 1
        model.fc2.weight.mul_(-1)  # in place: the same address, the replay reads the new values
        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
        assert rel_err(opt(x), model(x)) < 1e-2
    replay.forget_all()
