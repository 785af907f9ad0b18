"""The kernel layer: generated stage kernels against a float64 reference, and the kernel-file cache.

On a CPU the kernels run in the Triton interpreter (fp32 and fp16 only: its bf16 ``tl.dot`` is broken);
the ``gpu`` tests use larger shapes and bf16 and are skipped without CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from fxfuse import codegen
from fxfuse import epilogue as ep
from fxfuse.kernels import launch, run_stage

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp inside sigmoid

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference(x, weights, biases, operands, epilogue):
    """float64 ``epilogue(linear(x, W_i, b_i), operands)`` of the (already rounded) inputs."""
    accs = [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(weights, biases)]
    return ep.evaluate(ep.parse(epilogue), accs, [v.double().reshape(-1) for v in operands])


def check(x, weights, biases, operands, epilogue, tol=None):
    out = run_stage(x, weights, biases, operands, epilogue)
    ref = reference(x, weights, biases, operands, epilogue)
    assert out.shape == ref.shape and out.dtype == x.dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "unwritten or NaN elements"
    err = rel_err(out, ref)
    assert err <= (tol or TOL[x.dtype]), f"{epilogue}: relative error {err:.2e}"
    return out


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def linear_params(n, k, dtype, bias=True):
    w = rand(n, k, dtype=dtype, scale=k**-0.5)
    return w, (rand(n, dtype=dtype, scale=0.5) if bias else None)


# One epilogue per op, with arguments in the op's domain.
def _op_epilogue(name: str) -> tuple[str, int]:
    """(epilogue text, number of operands) exercising ``name``."""
    if name in ("log", "sqrt", "rsqrt"):
        return f"{name}(add(abs(a0),0.5))", 0
    if name == "leaky_relu":
        return "leaky_relu(a0,0.1)", 0
    if name == "pow":
        return "pow(a0,3.0)", 0
    if name == "hardtanh":
        return "hardtanh(a0,-0.5,0.5)", 0
    if ep.OPS[name].arity == 1:
        return f"{name}(a0)", 0
    return f"{name}(a0,v0)", 1


@pytest.mark.parametrize("op", sorted(ep.OPS))
def test_every_op(op):
    epilogue, n_ops = _op_epilogue(op)
    x = rand(37, 24)
    w, b = linear_params(50, 24, torch.float32)
    operands = [torch.rand(50, device=DEV) + 0.5 for _ in range(n_ops)]  # away from 0 for div
    check(x, [w], [b], operands, epilogue)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the unused branch at infinity
def test_tanh_keeps_fp32_relative_precision_near_zero():
    """fp32 tanh, elementwise against float64: 2 * sigmoid(2x) - 1 alone cancels near 0 (an absolute error of ~6e-8,
    so 6e-4 relative at x = 1e-4); below ``TANH_SMALL`` a polynomial runs. Zero weights and the values as the bias
    make the accumulator exactly those values (infinities and NaN included)."""
    t = ep.TANH_SMALL
    small = torch.logspace(-30, 1, 240, dtype=torch.float64).float()
    border = torch.tensor([t, t * (1 - 2**-23), t * (1 + 2**-23), 0.3, 0.5, 0.7, 1.0, 3.0, 9.0, 20.0, 90.0])
    values = torch.cat([small, -small, border, -border, torch.tensor([0.0, -0.0, 1e-38, 1e-45])]).to(DEV)
    out = run_stage(rand(3, 16), [torch.zeros(values.numel(), 16, device=DEV)], [values], [], "tanh(a0)")
    ref = torch.tanh(values.double()).expand(3, -1)
    err = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-300)).max().item()
    assert err <= 2e-6 and torch.equal(out[:, values == 0], values[values == 0].expand(3, -1)), f"relative {err:.2e}"
    special = torch.tensor([float("inf"), float("-inf"), float("nan")], device=DEV)
    out = run_stage(rand(2, 16), [torch.zeros(3, 16, device=DEV)], [special], [], "tanh(a0)")
    assert out[:, :2].tolist() == [[1.0, -1.0]] * 2 and out[:, 2].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", ["sin", "cos"])
def test_sin_and_cos_round_as_the_dtype_does_at_siren_arguments(op, dtype):
    """SIREN's sin(30 a) reaches arguments of a few hundred: elementwise against float64, fp32 within a few ulp of
    the result's magnitude 1 (libdevice's), 16-bit outputs within an ulp of their dtype (the hardware's after a
    reduction to [-pi, pi]: fxfuse/kernels/fast_math.py; the interpreter runs the reduction, then tl.sin). Zero
    weights and the values as the bias make the accumulator exactly those values."""
    values = torch.cat([torch.linspace(-400.0, 400.0, 4001), torch.tensor([0.0, -0.0, 1e-30, 3.1415927, 1e4])])
    values = values.to(DEV, dtype)
    out = run_stage(rand(3, 16, dtype=dtype), [torch.zeros(values.numel(), 16, device=DEV, dtype=dtype)], [values],
                    [], f"{op}(a0)")
    ref = getattr(torch, op)(values.double()).expand(3, -1)
    bound = (torch.finfo(dtype).eps if dtype != torch.float32 else 0.0) * ref.abs() + 2e-6
    assert ((out.double() - ref).abs() <= bound).all(), f"{op}: {((out.double() - ref).abs() - bound).max():.2e}"


@pytest.mark.parametrize("scale", [1e-3, 1e-5])
def test_tanh_of_small_pre_activations_in_a_stage(scale):
    # A layer whose pre-activations are ~scale (small weights): the fp32 tolerance against float64 still holds
    # (the sigmoid form alone: 8e-5 at 1e-3, 7e-4 at 1e-4).
    x = rand(37, 24)
    w = rand(50, 24, scale=scale * 24**-0.5)
    check(x, [w], [None], [], "tanh(a0)")


def test_pow_exponents():
    x = rand(16, 24)
    w, b = linear_params(50, 24, torch.float32)
    check(x, [w], [b], [], "add(pow(a0,2.0),pow(abs(a0),0.5))")
    check(x, [w], [b], [], "mul(pow(a0,4.0),pow(a0,1.0))")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("x_layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
def test_layouts(dtype, m, x_layout, w_layout):
    k, n = 24, 50
    if x_layout == "contiguous":
        x = rand(m, k, dtype=dtype)
    elif x_layout == "transposed":  # stride (1, m): read in place
        x = rand(k, m, dtype=dtype).T
    else:  # every other column of a wider tensor
        x = rand(m, 2 * k + 3, dtype=dtype)[:, 3::2]
    w, b = linear_params(n, k, dtype)
    if w_layout == "kn":  # a [K, N] parameter passed as .t()
        w = w.t().contiguous().t()
    check(x, [w], [b], [], "gelu_tanh(a0)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_and_identity(dtype, bias):
    x = rand(37, 24, dtype=dtype)
    w, b = linear_params(50, 24, dtype, bias=bias)
    check(x, [w], [b], [], "a0")
    check(x, [w], [b], [], "relu(a0)")


def test_k_spans_several_tiles():
    x = rand(20, 72)  # 72 = 4.5 interpreter K-tiles
    w, b = linear_params(33, 72, torch.float32)
    check(x, [w], [b], [], "silu(a0)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_operands(dtype):
    x = rand(37, 24, dtype=dtype)
    w, b = linear_params(50, 24, dtype)
    per_col = rand(50, dtype=dtype)
    per_col_f32 = rand(50)
    strided = rand(100, dtype=dtype)[::2]  # numel N, stride 2
    scalar = torch.tensor(1.7, device=DEV, dtype=dtype)  # 0-d
    one = rand(1, dtype=dtype)
    expanded = rand(1, dtype=dtype).expand(50)  # numel N, stride 0
    check(x, [w], [b], [per_col], "mul(relu(a0),v0)")
    check(x, [w], [b], [per_col_f32, strided], "add(mul(a0,v0),v1)")
    check(x, [w], [b], [scalar, one], "add(mul(gelu(a0),v0),v1)")
    check(x, [w], [b], [expanded], "sub(a0,v0)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 37])
def test_gated(dtype, m):
    x = rand(24, m, dtype=dtype).T
    w0, b0 = linear_params(50, 24, dtype)
    w1, _ = linear_params(50, 24, dtype)
    w1 = w1.t().contiguous().t()
    check(x, [w0, w1], [b0, None], [], "mul(a0,silu(a1))")
    v = rand(50, dtype=dtype)
    check(x, [w0, w1], [None, b0], [v], "mul(add(a0,v0),gelu_tanh(a1))")


def test_empty_rows():
    w, b = linear_params(50, 24, torch.float32)
    out = run_stage(rand(0, 24), [w], [b], [], "relu(a0)")
    assert out.shape == (0, 50)


def test_validation_errors(monkeypatch):
    x = rand(8, 24)
    w, b = linear_params(50, 24, torch.float32)
    with pytest.raises(ValueError, match=r"weight 0 has shape \(50, 23\)"):
        run_stage(x, [w[:, :23]], [b], [], "relu(a0)")
    with pytest.raises(ValueError, match="bias 0 has shape"):
        run_stage(x, [w], [b[:49]], [], "relu(a0)")
    with pytest.raises(ValueError, match="unsupported dtype"):
        run_stage(x.double(), [w.double()], [None], [], "relu(a0)")
    with pytest.raises(ValueError, match="dtype"):
        run_stage(x, [w.half()], [None], [], "relu(a0)")
    with pytest.raises(ValueError, match="2 weight"):
        run_stage(x, [w, w], [b, b], [], "relu(a0)")
    with pytest.raises(ValueError, match="1 operand"):
        run_stage(x, [w], [b], [], "mul(a0,v0)")
    with pytest.raises(ValueError, match="operand v0 has shape"):
        run_stage(x, [w], [b], [rand(49)], "mul(a0,v0)")
    with pytest.raises(ValueError, match="2-D"):
        run_stage(x[0], [w], [b], [], "relu(a0)")
    with pytest.raises(ValueError):
        run_stage(x, [w], [b], [], "frobnicate(a0)")
    monkeypatch.setattr(launch, "_interpreting", lambda: False)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="CUDA"):
            run_stage(x, [w], [b], [], "relu(a0)")


def test_fake_tensors_trace():
    """Under FakeTensorMode (what a triton_op's fake impl sees) the result has the right metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = rand(24, 37, dtype=torch.float16).T
    w0, b0 = linear_params(50, 24, torch.float16)
    w1, _ = linear_params(50, 24, torch.float16)
    with FakeTensorMode() as mode:
        fx, fw0, fb0, fw1 = (mode.from_tensor(t) for t in (x, w0, b0, w1))
        out = run_stage(fx, [fw0, fw1], [fb0, None], [], "mul(a0,silu(a1))")
    assert out.shape == (37, 50) and out.dtype == torch.float16 and out.is_contiguous()


def test_gpu_config_pruning():
    """The GPU autotuning candidates kept for one launch (pure Python: runs on the CPU too)."""
    from fxfuse.kernels import template

    configs = template.gpu_configs()

    def kept(m, dtype=torch.float16, gated=False):
        args = {"M": m, "x_ptr": torch.empty(1, dtype=dtype)}
        if gated:
            args["w1_ptr"] = args["x_ptr"]
        return template._prune(configs, {}, **args)

    assert {c.kwargs["BLOCK_M"] for c in kept(1)} == {16}
    assert {c.kwargs["BLOCK_M"] for c in kept(37)} == {32, 64}
    assert {c.kwargs["BLOCK_M"] for c in kept(4096)} == {64, 128}
    assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128 for c in kept(4096, gated=True))
    for m in (1, 37, 4096):
        for dtype in (torch.float16, torch.float32):
            for gated in (False, True):
                cs = kept(m, dtype, gated)
                assert cs, (m, dtype, gated)
                for c in cs:  # pipelined tiles fit in shared memory
                    kw, elem = c.kwargs, (4 if dtype == torch.float32 else 2)
                    tile = (kw["BLOCK_M"] + (1 + gated) * kw["BLOCK_N"]) * kw["BLOCK_K"] * elem
                    assert c.num_stages >= 2 and c.num_stages * tile <= 200 * 1024
    assert [template.m_bucket(m) for m in (1, 2, 17, 32, 33, 4096, 4097)] == [1, 2, 32, 32, 64, 4096, 8192]


# ---- generated files -------------------------------------------------------------------------------------


def test_generated_file_is_readable_and_reused():
    path = codegen.kernel_path(1, "mul(gelu_tanh(a0),v0)")
    assert path.exists() and path.parent == codegen.cache_dir()
    text = path.read_text()
    assert "epilogue: mul(gelu_tanh(a0),v0)" in text and "def fused_stage_kernel" in text
    assert codegen.kernel_path(1, "mul( gelu_tanh(a0) , v0 )") == path  # same text after parsing
    assert codegen.generated_kernel(1, "mul(gelu_tanh(a0),v0)") is codegen.generated_kernel(1, "mul(gelu_tanh(a0),v0)")
    assert codegen.kernel_path(1, "gelu_tanh(a0)") != path
    assert codegen.kernel_path(2, "mul(a0,a1)") != codegen.kernel_path(1, "mul(a0,a0)")
    codegen.clear_loaded()
    assert codegen.kernel_path(1, "mul(gelu_tanh(a0),v0)") == path  # same file from a "new process"
    assert path.read_text() == text


def test_inspect_getsource_works():
    import inspect

    mod = codegen.generated_kernel(2, "mul(a0,silu(a1))")
    fn = mod.fused_stage_kernel  # Autotuner -> JITFunction / InterpretedFunction -> python function
    while not inspect.isfunction(fn):
        fn = fn.fn
    src = inspect.getsource(fn)
    assert "acc1 = tl.dot" in src


@pytest.mark.parametrize("garbage", ["", "def broken(:\n", "import this_module_does_not_exist\n"])
def test_corrupt_cache_file_is_regenerated(garbage):
    epilogue = "mul(sigmoid(a0),1.5)"
    path = codegen.kernel_path(1, epilogue)
    good = path.read_text()
    path.write_text(garbage)
    codegen.clear_loaded()
    x = rand(5, 24)
    w, b = linear_params(50, 24, torch.float32)
    check(x, [w], [b], [], epilogue)
    assert path.read_text() == good


def test_bad_stage_rejected():
    with pytest.raises(ValueError):
        codegen.generated_kernel(1, "mul(a0,a1)")
    with pytest.raises(ValueError):
        codegen.generated_kernel(3, "a0")


# ---- GPU (H200): larger shapes, bf16, tf32, torch.compile through a triton_op ------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 16, 4096])
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_large(dtype, m, gated):
    k, n = 768, 3072
    x = rand(m, k, dtype=dtype)
    w0, b0 = linear_params(n, k, dtype)
    if gated:
        w1, b1 = linear_params(n, k, dtype)
        check(x, [w0, w1], [b0, b1], [], "mul(a0,silu(a1))")
    else:
        check(x, [w0], [b0], [], "gelu_tanh(a0)")
        check(rand(k, m, dtype=dtype).T, [w0.t().contiguous().t()], [b0], [rand(n, dtype=dtype)], "mul(relu(a0),v0)")


@pytest.mark.gpu
def test_gpu_odd_shapes_and_new_batch_sizes():
    for m in (3, 37, 100, 129, 1000):  # several M buckets, one autotuned config each
        x = rand(m, 200, dtype=torch.bfloat16)
        w, b = linear_params(300, 200, torch.bfloat16)
        check(x, [w], [b], [], "gelu(a0)")


@pytest.mark.gpu
def test_gpu_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    x = rand(512, 768)
    w, b = linear_params(1024, 768, torch.float32)
    check(x, [w], [b], [], "gelu_tanh(a0)", tol=1e-3)


@pytest.mark.gpu
def test_gpu_triton_op_compiles():
    @torch.library.triton_op("fxfuse_test::gated_stage", mutates_args=())
    def gated_stage(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        return run_stage(x, [w0, w1], [None, None], [], "mul(a0,silu(a1))")

    x = rand(256, 512, dtype=torch.bfloat16)
    w0, _ = linear_params(1024, 512, torch.bfloat16)
    w1, _ = linear_params(1024, 512, torch.bfloat16)
    eager = gated_stage(x, w0, w1)
    compiled = torch.compile(lambda x, a, b: gated_stage(x, a, b) * 2, fullgraph=True, dynamic=True)
    assert rel_err(compiled(x, w0, w1), 2 * eager.double()) <= 1e-2
    x2 = rand(77, 512, dtype=torch.bfloat16)
    assert rel_err(compiled(x2, w0, w1), 2 * reference(x2, [w0, w1], [None, None], [], "mul(a0,silu(a1))")) <= 1e-2


@pytest.mark.gpu
def test_gpu_lean_launch_matches_and_respects_alignment():
    # After the first launch, calls with the same signature go straight to the compiled launcher; a
    # different signature (a misaligned view, another M specialization) must take Triton's path again.
    from fxfuse.kernels.fastlaunch import lean_launch_enabled

    assert lean_launch_enabled()
    w = torch.randn(96, 64, device="cuda", dtype=torch.float16)
    kernel = codegen.generated_kernel(1, "relu(a0)").fused_stage_kernel
    buf = torch.randn(40 * 64 + 1, device="cuda", dtype=torch.float16)
    for m in (33, 33, 40, 1, 1):
        for offset in (0, 1, 0):  # offset 1: a 2-byte-aligned x, which the aligned kernel must not read
            x = buf[offset:offset + m * 64].view(m, 64)
            out = run_stage(x, [w], [None], [], "relu(a0)")
            ref = torch.relu(x.double() @ w.double().T)
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, (m, offset)
    assert kernel._fxfuse_lean.hits >= 6


def test_lean_launch_signature():
    # What the lean path keys a compiled kernel by: dtype, 16-byte alignment and GPU of tensors, Triton's
    # specialization of the varying row count, other plain values as they are; anything else opts out.
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fxfuse.kernels.fastlaunch import LeanLauncher

    class Kernel:
        arg_names = ["x_ptr", "M", "N", "FLAG"]

    lean = LeanLauncher(Kernel(), varying=("M",))
    buf = torch.zeros(64, dtype=torch.float16)
    sig = lean.signature({"x_ptr": buf, "M": 33, "N": 64, "FLAG": True})
    assert sig == ((torch.float16, True, -1), (False, False, False), 64, True)  # (-1: no GPU)
    assert lean.signature({"x_ptr": buf, "M": 35, "N": 64, "FLAG": True}) == sig  # same specialization of M
    assert lean.signature({"x_ptr": buf, "M": 48, "N": 64, "FLAG": True}) != sig  # M % 16 == 0
    assert lean.signature({"x_ptr": buf, "M": 1, "N": 64, "FLAG": True}) != sig  # M == 1
    assert lean.signature({"x_ptr": buf[1:], "M": 33, "N": 64, "FLAG": True}) != sig  # misaligned pointer
    assert lean.signature({"x_ptr": buf, "M": 33, "N": 65, "FLAG": True}) != sig  # other ints by value
    desc = TensorDescriptor(buf.view(4, 16), [4, 16], [16, 1], [4, 16])
    assert lean.signature({"x_ptr": desc, "M": 33, "N": 64, "FLAG": True}) is None  # Triton's own path
    # The TMA launcher keys a descriptor as its tensor (the config's pre-hook changes nothing it launches with).
    from fxfuse.kernels.tma_launch import _TmaLeanLauncher

    tma = _TmaLeanLauncher(Kernel(), varying=("M",))
    assert tma.signature({"x_ptr": desc, "M": 33, "N": 64, "FLAG": True}) == sig
