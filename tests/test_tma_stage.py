"""The Hopper TMA stage kernel (``run_stage_tma``) against a float64 reference, its applicability and configs.

On a CPU the kernel runs in the Triton interpreter, which emulates host tensor descriptors (zero-filled loads
and clipped stores past the edges), in fp32 and fp16 on small odd shapes; the ``gpu`` tests use the real
workload shapes, bf16, and every GPU config once.
"""

import pytest
import torch
import torch.nn.functional as F

from fxfuse import codegen
from fxfuse import epilogue as ep
from fxfuse.kernels import run_stage_tma, tma_launch, tma_supported
from fxfuse.kernels import tma_template as tt

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp inside sigmoid

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def stage_args(m, k, n, dtype, gated, bias, n_operands=0):
    x = rand(m, k, dtype=dtype)
    weights = [rand(n, k, dtype=dtype, scale=k**-0.5) for _ in range(2 if gated else 1)]
    biases = [rand(n, dtype=dtype, scale=0.5) if bias else None for _ in weights]
    operands = [torch.rand(n, device=DEV) + 0.5 for _ in range(n_operands)]
    return x, weights, biases, operands


def reference(x, weights, biases, operands, epilogue):
    """float64 ``epilogue(linear(x, W_i, b_i), operands)`` of the (already rounded) inputs."""
    accs = [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(weights, biases)]
    return ep.evaluate(ep.parse(epilogue), accs, [v.double().reshape(-1) for v in operands])


def check(x, weights, biases, operands, epilogue):
    out = run_stage_tma(x, weights, biases, operands, epilogue)
    assert out is not None, "the TMA kernel should apply to these arguments"
    ref = reference(x, weights, biases, operands, epilogue)
    assert out.shape == ref.shape and out.dtype == x.dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "unwritten or NaN elements"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= TOL[x.dtype], f"{epilogue} {x.dtype} {tuple(x.shape)}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------- CPU (interpreter)

# M, K, N not multiples of the interpreter tile (16 x 32 x 16) but TMA-describable (rows of 16-byte multiples);
# 3 x 2 tiles on 4 programs, so some programs walk two tiles.
CPU_SHAPES = {torch.float32: (37, 20, 36), torch.float16: (37, 24, 40)}


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test (the gpu tests cover the device)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_interpreter_matches_reference(dtype, gated, bias):
    m, k, n = CPU_SHAPES[dtype]
    epilogue = "mul(gelu_tanh(a0),a1)" if gated else "gelu_tanh(a0)"
    check(*stage_args(m, k, n, dtype, gated, bias), epilogue)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test (the gpu tests cover the device)")
def test_interpreter_gated_weight_layouts():
    """The [2, N, K] view over the gate/up pair: either order in memory, and the halves of one packed weight."""
    m, k, n = CPU_SHAPES[torch.float16]
    x, (w_a, w_b), biases, _ = stage_args(m, k, n, torch.float16, gated=True, bias=True)
    lower, upper = sorted((w_a, w_b), key=lambda w: w.data_ptr())
    packed = rand(2 * n, k, dtype=torch.float16, scale=k**-0.5)
    for weights in ([lower, upper], [upper, lower], [packed[:n], packed[n:]], [packed[n:], packed[:n]]):
        check(x, weights, biases, [], "mul(silu(a0),a1)")


def test_pair_layout():
    packed = rand(2 * 40, 72)
    for first, second, swapped in ((packed[:40], packed[40:], False), (packed[40:], packed[:40], True)):
        base, stride, swap = tma_launch._pair_layout(first, second)
        assert (base.data_ptr(), stride, swap) == (packed.data_ptr(), 40 * 72, swapped)
    w = rand(40, 72)
    assert tma_launch._pair_layout(w, w) is None  # the same weight twice: no positive stride
    assert tma_launch._pair_layout(packed[:40], packed[20:60]) is None  # overlapping views
    assert tma_launch._pair_layout(w, rand(80, 72)[:, :72][::2]) is None  # row strides differ
    x = rand(32, 72)
    assert not tma_launch.tma_applicable(x, [w, w])
    assert run_stage_tma(x, [w, w], [None, None], [], "mul(a0,a1)") is None


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test (the gpu tests cover the device)")
def test_interpreter_operands():
    m, k, n = CPU_SHAPES[torch.float32]
    x, weights, biases, operands = stage_args(m, k, n, torch.float32, gated=True, bias=True, n_operands=1)
    scalar = torch.tensor([1.5], device=DEV)  # one element: broadcast with stride 0
    check(x, weights, biases, [operands[0], scalar], "add(mul(mul(silu(a0),a1),v0),v1)")
    check(x, weights[:1], biases[:1], [scalar], "div(a0,v0)")


def test_not_applicable_returns_none():
    x, weights, biases, _ = stage_args(32, 72, 40, torch.float32, gated=False, bias=True)
    wide = rand(32, 80)
    cases = {
        "K=70 fp32: row stride 280 B": (rand(32, 70), [rand(40, 70)]),
        "x last dim strided": (rand(72, 32).t(), weights),
        "x base 4 B past alignment": (wide[:, 1:73], weights),
        "weight last dim strided": (x, [rand(72, 40).t()]),
        "N=42 fp32: output row stride 168 B": (x, [rand(42, 72)]),
    }
    for why, (xx, ws) in cases.items():
        assert not tma_launch.tma_applicable(xx, ws), why
        assert run_stage_tma(xx, ws, [None] * len(ws), [], "relu(a0)") is None, why
    assert tma_launch.tma_applicable(x, weights)


def test_tracing_returns_none():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(rand(64, 32))
        w = mode.from_tensor(rand(48, 32))
        assert run_stage_tma(x, [w], [None], [], "relu(a0)") is None


def test_invalid_arguments_raise():
    x, weights, biases, _ = stage_args(32, 24, 40, torch.float32, gated=False, bias=True)
    with pytest.raises(ValueError, match="weight 0 has shape"):
        run_stage_tma(x, [rand(40, 16)], biases, [], "relu(a0)")
    with pytest.raises(ValueError, match="accumulator"):
        run_stage_tma(x, weights, biases, [], "mul(a0,a1)")


def test_supported_devices():
    assert not tma_supported("meta")
    if not HAS_CUDA:
        assert tma_supported("cpu")  # the interpreter emulates TMA
    else:
        assert tma_supported("cuda") == (torch.cuda.get_device_capability()[0] >= 9)


def test_rendered_source():
    gated = open(codegen.generated_tma_kernel(2, "mul(silu(a0),a1)").__file__).read()
    assert "w_desc.load([0, off_n, off_k]).reshape(2 * BLOCK_N, BLOCK_K)" in gated and "HAS_BIAS1" in gated
    assert "w_desc.load([off_n, off_k])\n" not in gated and "# [" not in gated
    plain = open(codegen.generated_tma_kernel(1, "mul(gelu_tanh(a0),v0)").__file__).read()
    assert "w = w_desc.load([off_n, off_k])\n" in plain and "acc1" not in plain and "SWAP_PAIR: tl" not in plain
    assert "v0 = tl.load(v0_ptr + offs_cn * stride_v0" in plain
    # One tile loop: flattened with the K loop, or not (warp-specialized configs) as the config says.
    assert "flatten=not WARP_SPECIALIZE" in plain and "warp_specialize=WARP_SPECIALIZE" in plain
    assert codegen.generated_tma_kernel(1, "relu(a0)") is codegen.generated_tma_kernel(1, "relu(a0)")
    # The epilogue twice: as written, and with the hardware tanh for bf16 outputs (FAST_MATH).
    assert "if FAST_MATH:" in gated and "_tanh_approx(0.5 * acc0)" in gated and "tl.sigmoid(acc0)" in gated
    assert codegen.generated_tma_kernel(2, "mul(silu(a0),a1)").HAS_FAST_FORMS
    assert not codegen.generated_tma_kernel(1, "relu(a0)").HAS_FAST_FORMS


@pytest.mark.parametrize("op", sorted(ep.FAST_FORMS))
def test_each_hardware_form_is_its_op_given_an_exact_tanh(op):
    """The hardware forms are rearranged for fewer instructions; with ``tanh`` exact in place of ``tanh.approx``
    each must be its op in float64 (a wrong constant or a dropped term would show at once)."""
    x = torch.linspace(-12, 12, 4097, dtype=torch.float64)
    fast = eval(ep.FAST_FORMS[op].format("x"), {"x": x, "_tanh_approx": torch.tanh})  # noqa: S307 (our own text)
    torch.testing.assert_close(fast, ep.OPS[op].torch(x), rtol=1e-12, atol=1e-12)


def test_fast_math_only_for_bf16_on_the_gpu_and_never_with_warp_specialization(monkeypatch):
    monkeypatch.setenv("FXFUSE_AUTOTUNE", "1")
    ws = [c for c in tt.gpu_configs() if c.kwargs["WARP_SPECIALIZE"]]
    assert ws and tt._prune(ws, _prune_args(8192, torch.bfloat16, gated=False)) != []
    kept = tt._prune(tt.gpu_configs(), _prune_args(8192, torch.bfloat16, gated=False, fast=True))
    assert kept and not any(c.kwargs["WARP_SPECIALIZE"] for c in kept)
    seen = {}
    kernel = codegen.generated_tma_kernel(1, "gelu_tanh(a0)").fused_stage_tma_kernel
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: seen.update(kw))  # what the launch passes
    run_stage_tma(*stage_args(37, 24, 40, torch.float16, False, False), "gelu_tanh(a0)")
    assert seen["FAST_MATH"] is False  # the interpreter (and fp16, fp32: the hardware tanh is for bf16)
    from fxfuse.kernels.template import fast_math_enabled

    assert fast_math_enabled()
    monkeypatch.setenv("FXFUSE_FAST_MATH", "0")  # the user's way out: exact forms everywhere
    assert not fast_math_enabled()


def _prune_args(m, dtype, gated, fast=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [16] * t.dim())

    w = torch.empty(2, 64, 64, dtype=dtype) if gated else torch.empty(64, 64, dtype=dtype)
    return {"M": m, "x_desc": desc(torch.empty(64, 64, dtype=dtype)), "w_desc": desc(w), "FAST_MATH": fast}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [16, 8192])
def test_prune_fits_shared_memory(monkeypatch, dtype, gated, m):
    monkeypatch.setenv("FXFUSE_AUTOTUNE", "1")
    kept = tt._prune(tt.gpu_configs(), _prune_args(m, dtype, gated))
    assert kept
    elem = torch.empty(0, dtype=dtype).element_size()
    for c in kept:
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        store = bm * bn * elem // (2 if c.kwargs["EPILOGUE_SUBTILE"] else 1)
        budget = tt._SMEM_BUDGET if c.kwargs["CTAS_PER_SM"] == 1 else tt._SMEM_BUDGET_2CTAS
        assert c.num_stages * (bm * bk + (2 if gated else 1) * bn * bk) * elem + store <= budget
        assert c.num_stages >= 2 and c.pre_hook is tt.set_block_shapes
        threads = 32 * c.num_warps
        assert (2 if gated else 1) * bm * bn // threads <= 128  # accumulator registers per thread
        assert m > 64 or bm <= 64
        assert bk * elem <= 256  # fp32 halves the K step
    monkeypatch.setenv("FXFUSE_AUTOTUNE", "0")
    assert len(tt._prune(tt.gpu_configs(), _prune_args(m, dtype, gated))) == 1


def test_a_replay_steps_descriptor_by_address_keys_as_one_over_its_tensor():
    # A replayed TMA stage binds its weight's descriptor to the weight's address (tma_launch._Address: no reference
    # kept); the lean launcher keys it as a descriptor over the tensor. When that key gained the tensor's GPU
    # (session 35), _Address had no get_device: every replayed TMA stage raised and its region ran the original ops
    # from then on (session 38: test_profile_on_the_gpu saw the stage plus eager's five kernels each call).
    descriptor = tma_launch._tensor_descriptor()
    w = torch.randn(64, 32)
    over_tensor = descriptor(w, [64, 32], [32, 1], [16, 16])
    by_address = descriptor(tma_launch._Address(w), [64, 32], [32, 1], [16, 16])
    key = tma_launch._TmaLeanLauncher.other_key
    assert key(None, by_address) == key(None, over_tensor) == (torch.float32, True, w.get_device())


def test_block_shape_hook():
    args = _prune_args(8192, torch.bfloat16, gated=True)
    args["out_desc"] = _prune_args(8192, torch.bfloat16, gated=False)["w_desc"]
    args.update(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EPILOGUE_SUBTILE=True)
    tt.set_block_shapes(args)
    assert args["x_desc"].block_shape == [128, 64] and args["w_desc"].block_shape == [2, 128, 64]
    assert args["out_desc"].block_shape == [128, 64]


# ---------------------------------------------------------------------------------------------- GPU

GPU_CASES = [
    # (name, M, K, N, gated, bias, epilogue, operands)
    ("gpt2 fc1", 8192, 768, 3072, False, True, "gelu_tanh(a0)", 0),
    ("gpt2 fc2", 8192, 3072, 768, False, True, "a0", 0),
    ("geglu gate/up", 8192, 768, 3072, True, False, "mul(gelu_tanh(a0),a1)", 0),
    ("llama gate/up", 512, 4096, 14336, True, False, "mul(silu(a0),a1)", 0),
    ("odd", 1000, 72, 200, False, False, "relu(a0)", 0),
    ("odd gated bias operand", 1000, 72, 200, True, True, "mul(mul(silu(a0),a1),v0)", 1),
    ("small M", 48, 512, 1024, True, True, "mul(silu(a0),a1)", 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_reference(monkeypatch, dtype, case):
    if not tma_supported("cuda"):
        pytest.skip("needs Hopper (sm_90+) and a Triton with TensorDescriptor")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32: ieee, as eager
    _, m, k, n, gated, bias, epilogue, n_ops = case
    check(*stage_args(m, k, n, dtype, gated, bias, n_ops), epilogue)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["mul(gelu_tanh(a0),a1)", "mul(silu(a0),a1)", "gelu_tanh(a0)", "sigmoid(a0)",
                                      "tanh(a0)"])
def test_gpu_fast_math_errors_stay_below_bf16_rounding(epilogue):
    """bf16 runs the hardware tanh (FAST_MATH): its 2^-11 relative error, times |x|/2 in GELU's and SiLU's tails,
    stays under the output's own rounding. Pre-activations span about ±12 here, deep into the tails."""
    if not tma_supported("cuda"):
        pytest.skip("needs Hopper (sm_90+) and a Triton with TensorDescriptor")
    gated = "a1" in epilogue
    x, weights, biases, operands = stage_args(2048, 256, 512, torch.bfloat16, gated, False)
    x = x * 4
    out = run_stage_tma(x, weights, biases, operands, epilogue).double()
    ref = reference(x, weights, biases, operands, epilogue)
    rounded = ref.to(torch.bfloat16).double()  # eager's best: the exact value rounded once
    max_err, max_rounding = (out - ref).abs().max().item(), (rounded - ref).abs().max().item()
    rel, rel_rounding = ((out - ref).norm() / ref.norm()).item(), ((rounded - ref).norm() / ref.norm()).item()
    print(f"{epilogue}: max err {max_err:.2e} (rounding {max_rounding:.2e}), rel {rel:.2e} ({rel_rounding:.2e})")
    assert rel <= 2 * rel_rounding and max_err <= 2 * max_rounding


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_every_config(gated):
    """Each GPU config alone (as FXFUSE_AUTOTUNE=0 would pick it): compiles, fits shared memory, is correct."""
    if not tma_supported("cuda"):
        pytest.skip("needs Hopper (sm_90+) and a Triton with TensorDescriptor")
    epilogue = "mul(gelu_tanh(a0),a1)" if gated else "gelu_tanh(a0)"
    kernel = codegen.generated_tma_kernel(2 if gated else 1, epilogue).fused_stage_tma_kernel
    saved = kernel.configs
    try:
        for config in tt.gpu_configs():
            # One config skips the autotuner's pruning: apply it here, as a launch would.
            kernel.configs = tt._prune([config], _prune_args(1000, torch.bfloat16, gated, fast=True))
            kernel.cache.clear()
            check(*stage_args(1000, 520, 392, torch.bfloat16, gated, True), epilogue)
    finally:
        kernel.configs = saved
        kernel.cache.clear()


@pytest.mark.gpu
def test_gpu_unaligned_falls_back():
    if not tma_supported("cuda"):
        pytest.skip("needs Hopper (sm_90+) and a Triton with TensorDescriptor")
    x, weights, biases, _ = stage_args(256, 72, 64, torch.bfloat16, gated=False, bias=True)
    assert run_stage_tma(x[:, 1:], [w[:, 1:] for w in weights], biases, [], "a0") is None


@pytest.mark.gpu
def test_gpu_repeated_launch_takes_the_lean_path(monkeypatch):
    """A second launch of the same signature (M in the same bucket) skips Triton's Python path and is correct."""
    if not tma_supported("cuda"):
        pytest.skip("needs Hopper (sm_90+) and a Triton with TensorDescriptor")
    from fxfuse.kernels import fastlaunch

    # Under test here: the TMA signature (descriptors keyed by their tensor), not fastlaunch's launch-hook check.
    monkeypatch.setattr(fastlaunch, "lean_launch_enabled", lambda: True)
    epilogue = "mul(silu(a0),a1)"
    kernel = codegen.generated_tma_kernel(2, epilogue).fused_stage_tma_kernel
    # The same weights each time: which of the two sits at the lower address (SWAP_PAIR) is part of the signature.
    _, weights, biases, operands = stage_args(1, 264, 520, torch.bfloat16, gated=True, bias=True)
    for m in (700, 1000, 513):  # one M bucket (1024): one signature
        check(rand(m, 264, dtype=torch.bfloat16), weights, biases, operands, epilogue)
    assert kernel._fxfuse_tma_lean.hits >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["separate", "swapped", "packed halves"])
def test_gpu_gated_weight_layouts(layout):
    if not tma_supported("cuda"):
        pytest.skip("needs Hopper (sm_90+) and a Triton with TensorDescriptor")
    x, weights, biases, _ = stage_args(1000, 264, 520, torch.bfloat16, gated=True, bias=True)
    if layout == "swapped":
        weights = sorted(weights, key=lambda w: -w.data_ptr())
    elif layout == "packed halves":
        packed = rand(2 * 520, 264, dtype=torch.bfloat16, scale=264**-0.5)
        weights = [packed[520:], packed[:520]]
    check(x, weights, biases, [], "mul(gelu_tanh(a0),a1)")
