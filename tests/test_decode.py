"""The decode kernel: a whole two-stage MLP for M <= 16 rows in one launch, against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from test_ops import TOL, f64, make_args, rel_err

from fxfuse import codegen, ops
from fxfuse.kernels import DECODE_MAX_M, run_decode
from fxfuse.kernels.workspace import _workspaces
from fxfuse.ops import reference_mlp
from fxfuse.spec import MLPSpec

# Odd widths: K, H and N are not multiples of the interpreter's 32-wide tiles.
SPECS = [
    ("2--:mul(silu(a0),a1);1-:a0", [32, 200, 24]),  # SwiGLU, no bias
    ("1b:gelu_tanh(a0);1b:a0", [80, 48, 72]),  # GPT-2 MLP
    ("2bb:mul(gelu_tanh(a0),a1);1b:mul(a0,v0)", [48, 100, 40]),  # gated with biases, operand in stage 1
    ("1-:mul(relu(a0),v0);1-:a0", [64, 77, 33]),  # operand in stage 0
]


def decode_call(args):
    """``run_decode``'s arguments for ``make_args``' output: biases with ``None`` holes, operands per stage."""
    x, weights, biases, operands, spec = args
    parsed = MLPSpec.loads(spec)
    per_stage, start = [], 0
    for stage in parsed.stages:
        per_stage.append(operands[start:start + stage.num_operands])
        start += stage.num_operands
    return x, weights, ops.expand_biases(biases, parsed), per_stage, tuple(s.epilogue for s in parsed.stages)


def workspaces_are_clean():
    # Only this kernel's pairs: the grid-sync kernel's scratch and barrier generation are not left zero.
    return all(ws.count_nonzero().item() == 0 and c.count_nonzero().item() == 0
               for key, (ws, c) in _workspaces.items() if key[0] == "decode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec,dims", SPECS)
def test_decode_matches_float64_reference(spec, dims, dtype):
    for m in (1, 3, DECODE_MAX_M):  # different M back to back share the workspace
        args = make_args(spec, dims, dtype, lead=(m,))
        out = run_decode(*decode_call(args))
        assert out.shape == (m, dims[-1]) and out.dtype == dtype
        assert rel_err(out, reference_mlp(*f64(args))) < TOL[dtype]
    assert workspaces_are_clean()


def test_repeated_calls_reset_the_workspace():
    spec, dims = SPECS[0]
    for _ in range(3):  # fresh inputs each call: a stale sum or counter would show in the next result
        args = make_args(spec, dims, lead=(5,))
        assert rel_err(run_decode(*decode_call(args)), reference_mlp(*f64(args))) < TOL[torch.float32]
        assert workspaces_are_clean()


def test_strided_inputs_and_single_element_operands():
    K, H, N = 40, 70, 24
    x = torch.randn(K, 3).t()  # [3, K], non-contiguous
    wg, wu = (torch.randn(K, H).t() / K ** 0.5 for _ in range(2))  # [H, K] views of [K, H] storage
    wd = torch.randn(2 * N, H)[::2] / H ** 0.5  # every other row
    scale = torch.tensor([1.5])
    out = run_decode(x, [wg, wu, wd], [None, None, None], [[scale], [torch.tensor(0.5)]],
                     ("mul(mul(silu(a0),a1),v0)", "mul(a0,v0)"))
    xd, gd, ud, dd = (t.double() for t in (x, wg, wu, wd))
    ref = (torch.nn.functional.silu(xd @ gd.T) * (xd @ ud.T) * 1.5) @ dd.T * 0.5
    assert rel_err(out, ref) < TOL[torch.float32]


def test_bad_arguments_raise():
    spec, dims = SPECS[1]
    x, w, b, o, epilogues = decode_call(make_args(spec, dims, lead=(DECODE_MAX_M + 1,)))
    with pytest.raises(ValueError, match="at most"):
        run_decode(x, w, b, o, epilogues)
    with pytest.raises(ValueError, match="weight 1"):
        run_decode(x[:4], [w[0], w[1][:, :-1]], b, o, epilogues)
    with pytest.raises(ValueError, match="workspace_sem"):
        run_decode(x[:4], w, b, o, epilogues, workspace_sem="seq_cst")


def test_under_deterministic_algorithms_the_atomic_kernel_raises_or_warns(deterministic):
    # Its fp32 partial sums meet in atomic adds: called directly under the flag it alerts as torch's own
    # nondeterministic ops do (the planner never picks it then: test_planner).
    args = make_args(*SPECS[1], torch.float32, lead=(2,))
    with deterministic():
        with pytest.raises(RuntimeError, match="run_decode"):
            run_decode(*decode_call(args))
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.warns(UserWarning, match="run_decode"):
            out = run_decode(*decode_call(args))
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert rel_err(out, reference_mlp(*f64(args))) < TOL[torch.float32]


def test_traced_call_runs_torch_ops_and_kernel_file_is_readable():
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    spec, dims = SPECS[0]
    with FakeTensorMode():
        x, w, b, o, epilogues = decode_call(make_args(spec, dims, lead=(2,)))
        out = run_decode(x, w, b, o, epilogues)
    assert out.shape == (2, dims[-1]) and is_fake(out)
    src = open(codegen.generated_decode_kernel(2, "mul(silu(a0),a1)", "a0").__file__).read()
    assert "fused_decode_kernel" in src and "tl.atomic_xchg" in src


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [
    ("2--:mul(silu(a0),a1);1-:a0", [4096, 14336, 4096], (1, 16)),  # Llama SwiGLU
    ("1b:gelu_tanh(a0);1b:a0", [1024, 4096, 1024], (1, 8)),  # GPT-2 medium
]
GPU_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("spec,dims,ms", GPU_SHAPES)
def test_decode_on_gpu(spec, dims, ms, dtype, no_tf32):
    for m in ms:
        for sem in ("acq_rel", "relaxed") if dtype == torch.bfloat16 else ("acq_rel",):  # each is a compile
            args = make_args(spec, dims, dtype, device="cuda", lead=(m,))
            out = run_decode(*decode_call(args), workspace_sem=sem)
            assert rel_err(out, reference_mlp(*f64(args))) < GPU_TOL[dtype], (m, sem)
    torch.cuda.synchronize()
    assert workspaces_are_clean()


@pytest.mark.gpu
def test_decode_on_two_streams_and_back_to_back():
    spec, dims, _ = GPU_SHAPES[1]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    calls = [make_args(spec, dims, torch.bfloat16, device="cuda", lead=(m,)) for m in (1, 8, 3, 16)]
    torch.cuda.synchronize()
    outs = []
    for _ in range(20):  # many launches in flight on both streams at once
        for i, args in enumerate(calls):
            with torch.cuda.stream(streams[i % 2]):
                outs.append((i, run_decode(*decode_call(args))))
    torch.cuda.synchronize()
    refs = [reference_mlp(*f64(args)) for args in calls]
    for i, out in outs:
        assert rel_err(out, refs[i]) < 1e-2
    assert workspaces_are_clean()


@pytest.mark.gpu
def test_decode_in_a_cuda_graph():
    spec, dims, _ = GPU_SHAPES[0]
    args = make_args(spec, dims, torch.bfloat16, device="cuda", lead=(4,))
    call = decode_call(args)
    run_decode(*call)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_decode(*call)
    for _ in range(3):  # new inputs in place, replayed: the captured workspace resets itself too
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference_mlp(*f64(args))) < 1e-2


@pytest.mark.gpu
def test_with_deterministic_algorithms_on_a_timed_decode_region_gives_the_same_bits_every_call(
        monkeypatch, tmp_path, deterministic):
    """Under ``torch.use_deterministic_algorithms(True)`` the planner times only kernels without float atomics
    (the split-K small-M kernel adds its splits in order), so the region's output is the same on every call."""
    from fxfuse import stages, strategy

    monkeypatch.setenv("FXFUSE_AUTOTUNE", "1")  # measured choice on (the GPU tests run untimed)
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(strategy, "_choices", {})
    monkeypatch.setattr(strategy, "_measured", {})
    monkeypatch.setattr(stages, "_choices", {})
    spec, dims, _ = GPU_SHAPES[-1]  # GPT-2 medium at 8 rows: split-hidden would be a candidate
    args = make_args(spec, dims, torch.float32, device="cuda", lead=(8,))
    with deterministic():
        outs = [ops.mlp(*args) for _ in range(20)]
    (measured,) = strategy.measurements()
    assert strategy.DECODE not in dict(measured.times)
    differ = [i for i, out in enumerate(outs) if not torch.equal(out, outs[0])]
    assert not differ, f"calls {differ} differ from the first ({measured.strategy}; {measured.times})"
    assert rel_err(outs[0], reference_mlp(*f64(args))) < 1e-2  # (tf32 allowed or not: the planner's pick)
