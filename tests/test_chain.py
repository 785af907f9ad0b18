"""The fused-chain kernel: a whole narrow chain in one launch, against the float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch
from test_ops import TOL, f64, make_args, mlp, rel_err

from fxfuse import codegen, ops
from fxfuse import epilogue as ep
from fxfuse.kernels import run_chain
from fxfuse.ops import reference_mlp
from fxfuse.spec import MLPSpec
from fxfuse.strategy import FUSED_CHAIN, GEMM_EPILOGUE, choose_strategy, kernel_candidates

CHAINS = [
    ("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0", [16, 32, 32, 32, 8]),  # NeRF-style
    ("1-:relu(a0);1b:mul(silu(a0),v0);1-:a0", [3, 20, 17, 5]),  # odd widths, mixed biases, an operand
    ("1b:gelu_tanh(a0);1b:a0", [24, 50, 24]),  # a plain 2-layer MLP is a chain too
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec,dims", CHAINS)
def test_chain_kernel_matches_float64_reference(spec, dims, dtype):
    x, w, b, o, _ = args = make_args(spec, dims, dtype, lead=(37,))
    parsed = MLPSpec.loads(spec)
    assert choose_strategy(parsed, dims) == FUSED_CHAIN
    biases = ops.expand_biases(b, parsed)
    per_stage_ops, start = [], 0
    for stage in parsed.stages:
        per_stage_ops.append(o[start:start + stage.num_operands])
        start += stage.num_operands
    out = run_chain(x, w, biases, per_stage_ops, tuple(s.epilogue for s in parsed.stages))
    assert out.shape == (37, dims[-1]) and out.dtype == dtype
    assert rel_err(out, reference_mlp(*f64(args))) < TOL[dtype]
    assert rel_err(mlp(*args), reference_mlp(*f64(args))) < TOL[dtype]  # the op routes here too


@pytest.mark.parametrize("scale", [1e-2, 1e-4])
def test_chain_tanh_of_small_pre_activations_matches_float64(scale):
    # fp32 tanh keeps its relative precision near 0 (fxfuse.epilogue): with 2 * sigmoid(2x) - 1 alone this MLP's
    # output was 6e-6 (scale 1e-2) and 7e-4 (1e-4) off the float64 reference, eager fp32 1e-7.
    x, w, b, o, spec = args = make_args("1-:tanh(a0);1-:a0", [16, 32, 8], lead=(37,))
    w[0].mul_(scale)
    ref = reference_mlp(*f64(args))
    assert rel_err(run_chain(x, w, [None, None], [[], []], ("tanh(a0)", "a0")), ref) < 1e-6
    assert rel_err(mlp(*args), ref) < 1e-6  # the op routes here too


@pytest.mark.parametrize("spec,dims", CHAINS[:2])
def test_chain_kernel_rounds_an_fp32_input_as_it_loads_it(spec, dims):
    # Under autocast an fp32 input meets fp16 weights: the kernel rounds x to fp16 as it loads it, which is
    # exactly the kernel run on x cast first (autocast's first Linear casts it so), without the cast's own pass.
    (x, *rest), _ = _chain_call(spec, dims, torch.float16, 37)
    x32 = torch.randn(x.shape)
    out = run_chain(x32, *rest)
    assert out.dtype == torch.float16 and torch.equal(out, run_chain(x32.half(), *rest))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chain_kernel_stores_every_layer_input_for_the_backward(dtype):
    # STORE_HIDDEN (the wide-chain backward's forward): each layer's input as eager computes it (rounded to the
    # dtype), the same output as without the stores; poisoned buffers catch unwritten elements.
    spec, dims = CHAINS[1]
    x, w, b, o, _ = make_args(spec, dims, dtype, lead=(37,))
    parsed = MLPSpec.loads(spec)
    biases, epilogues = ops.expand_biases(b, parsed), tuple(s.epilogue for s in parsed.stages)
    per_stage_ops = [[], o, []]
    hidden = [torch.full((37, d), float("nan"), dtype=dtype) for d in dims[1:-1]]
    out = run_chain(x, w, biases, per_stage_ops, epilogues, hidden=hidden)
    assert torch.equal(out, run_chain(x, w, biases, per_stage_ops, epilogues))
    h = x
    for stage, weight, bias, operands, stored in zip(parsed.stages, w, biases, per_stage_ops, hidden):
        h = ep.evaluate(stage.expr, [torch.nn.functional.linear(h.double(), weight.double(),
                                                                None if bias is None else bias.double())],
                        [t.double() for t in operands]).to(dtype)
        assert not stored.isnan().any() and rel_err(stored, h) < TOL[dtype]
        h = stored  # the next layer reads what was stored, as the kernel does


def test_chain_kernel_takes_transposed_input_and_writes_one_file():
    x, w, b, o, spec = make_args("1b:relu(a0);1b:a0", [24, 40, 24])
    xt = torch.randn(24, 9).t()
    assert rel_err(mlp(xt, w, b, o, spec), reference_mlp(*f64((xt, w, b, o, spec)))) < 1e-5
    path = codegen.generated_chain_kernel(("relu(a0)", "a0")).__file__
    assert "fused_chain_kernel" in open(path).read()


def test_chain_kernel_only_where_a_layer_fits_on_chip():
    """A 256x256 fp32 weight tile spills so badly that ptxas runs for minutes: such chains run per stage."""
    spec = MLPSpec.loads("1b:relu(a0);1b:relu(a0);1b:a0")
    assert kernel_candidates(spec, (64, 128, 128, 64), elem_size=4)[0] == FUSED_CHAIN
    assert kernel_candidates(spec, (64, 256, 128, 64), elem_size=2)[0] == FUSED_CHAIN
    assert FUSED_CHAIN not in kernel_candidates(spec, (64, 256, 256, 64), elem_size=4)
    assert FUSED_CHAIN not in kernel_candidates(spec, (64, 256, 256, 64), elem_size=2)


def test_wide_or_gated_regions_run_per_stage():
    assert choose_strategy(MLPSpec.loads("1b:gelu_tanh(a0);1b:a0"), (768, 3072, 768)) == GEMM_EPILOGUE
    assert choose_strategy(MLPSpec.loads("2--:mul(a0,silu(a1));1-:a0"), (32, 64, 32)) != FUSED_CHAIN


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec,dims", CHAINS + [("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0",
                                                 [64, 128, 128, 128, 64])])
@pytest.mark.parametrize("m", [1, 70000])
def test_chain_kernel_on_gpu(spec, dims, dtype, m):
    args = make_args(spec, dims, dtype, device="cuda", lead=(m,))
    assert rel_err(mlp(*args), reference_mlp(*f64(args))) < (1e-4 if dtype == torch.float32 else 1e-2)


def _chain_call(spec, dims, dtype, m, device="cpu"):
    x, w, b, o, _ = args = make_args(spec, dims, dtype, device=device, lead=(m,))
    parsed = MLPSpec.loads(spec)
    per_stage_ops, start = [], 0
    for stage in parsed.stages:
        per_stage_ops.append(o[start:start + stage.num_operands])
        start += stage.num_operands
    call = (x, w, ops.expand_biases(b, parsed), per_stage_ops, tuple(s.epilogue for s in parsed.stages))
    return call, reference_mlp(*f64(args))


@pytest.mark.parametrize("variant", [dict(preload=1), dict(preload=1, persistent=1, loop_stages=2, per_sm=1)])
@pytest.mark.parametrize("spec,dims", CHAINS[:2])
def test_chain_variants_match_float64_reference(spec, dims, variant):
    # Weights loaded up front, and the persistent loop (4 programs here, so each walks several tiles).
    from fxfuse.kernels.chain_template import _config

    call, ref = _chain_call(spec, dims, torch.float32, 150)
    out = run_chain(*call, config=_config(16, 4, **variant))
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_chain_config_rounds_an_fp32_input_on_gpu(dtype):
    from triton.runtime.errors import OutOfResources

    from fxfuse.kernels.chain_template import chain_configs

    (x, *rest), _ = _chain_call("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0", [32, 64, 64, 64, 16], dtype, 70001,
                                device="cuda")
    x32 = torch.randn(x.shape, device="cuda")
    ran = 0
    for config in chain_configs():
        try:
            out = run_chain(x32, *rest, config=config)
        except OutOfResources:
            continue
        assert out.dtype == dtype and torch.equal(out, run_chain(x32.to(dtype), *rest, config=config)), config
        ran += 1
    assert ran >= len(chain_configs()) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("dims,dtype", [([32, 64, 64, 64, 16], torch.float16),
                                        ([64, 128, 128, 128, 64], torch.bfloat16), ([3, 20, 17, 5], torch.bfloat16)])
def test_every_chain_config_on_gpu(dims, dtype):
    # FXFUSE_AUTOTUNE=0 runs only the first config: check every variant the autotuner may pick.
    from fxfuse.kernels.chain_template import chain_configs

    spec = ";".join(["1b:relu(a0)"] * (len(dims) - 2) + ["1b:a0"])
    call, ref = _chain_call(spec, dims, dtype, 70001, device="cuda")
    from triton.runtime.errors import OutOfResources

    ran = 0
    for config in chain_configs():
        try:
            out = run_chain(*call, config=config)
        except OutOfResources:  # the autotuner skips these too
            continue
        assert rel_err(out, ref) < 1e-2, config
        ran += 1
    assert ran >= len(chain_configs()) // 2


def test_at_many_rows_only_persistent_chain_configs_compete_where_their_weights_fit():
    from fxfuse.kernels.chain_template import PERSISTENT_ONLY_ROWS, _config, _prune

    configs = [_config(128, 8, 1, 1, 3, 2), _config(64, 4, 1, 1, 3, 4), _config(128, 4, 1), _config(64, 4, 0)]
    w0 = torch.empty(0, dtype=torch.float16)

    def kept(pads, rows):
        args = {f"P{i}": p for i, p in enumerate(pads)} | {"w0_ptr": w0, "M_BUCKET": rows}
        return [(c.kwargs["BLOCK_M"], c.kwargs["PERSISTENT"]) for c in _prune(configs, args)]

    nerf64 = [32, 64, 64, 64, 16]
    assert kept(nerf64, PERSISTENT_ONLY_ROWS) == [(128, 1), (64, 1)]  # (the tuner once picked a tile: 72 vs 54 µs)
    assert kept(nerf64, PERSISTENT_ONLY_ROWS // 2) == [(128, 1), (64, 1), (128, 0), (64, 0)]
    # Weights too big for shared memory: the one-tile configs that load weights inline, at any number of rows.
    assert kept([256, 256, 256, 256], PERSISTENT_ONLY_ROWS) == [(64, 0)]


# metadata.shared (bytes) of the chain kernel as Triton 3.6 compiles it for sm_90: triton.compile(ASTSource(...),
# target=GPUTarget("cuda", 90, 128)) on a CPU, contiguous inputs (16-byte aligned, unit strides specialized), M = 64.
# (padded widths, weight bytes, x bytes (4: fp32 x under autocast), config (chain_template._config's arguments),
# bytes; fp32 rows: "ieee" dots unless marked tf32). The H200 allows 232448: it refused the first three on every
# call (the review's 360448 and 327680; the offline compile gives the same numbers).
_P128, _P64, _P256 = (128, 8, 1, 1, 3, 2), (64, 4, 1, 1, 3, 4), (256, 8, 1, 1, 3, 1)
_T128, _T64, _T128W8 = (128, 4, 1), (64, 4, 0), (128, 8, 0)
SM90_TRITON36_SHARED = [
    ([256, 128, 256], 2, 2, _P128, 360448),  # 16-bit 256 -> 128 -> 256 (GELU)
    ([128, 256, 128], 2, 2, _P128, 262144),
    ([64, 256, 64], 4, 4, _P128, 327680),  # fp32, tanh-GELU
    ([256, 128, 256], 2, 2, _P64, 245760),
    ([256, 128, 256], 2, 2, _P256, 557056),
    ([256, 128, 256], 2, 2, _T128, 196608),
    ([256, 128, 256], 2, 2, _T64, 98560),
    ([256, 128, 256], 2, 2, _T128W8, 131072),
    ([128, 256, 128], 2, 2, _P64, 188416),
    ([128, 256, 128], 2, 2, _T128, 163840),
    ([128, 256, 128], 2, 2, _T64, 82432),
    ([128, 256, 128], 2, 2, _T128W8, 98816),
    ([128, 256, 128], 2, 4, _P128, 294912),  # fp32 x under autocast
    ([128, 256, 128], 2, 4, _P64, 204800),
    ([128, 256, 128], 2, 4, _T128, 196608),
    ([64, 256, 64], 4, 4, _P64, 229376),
    ([64, 256, 64], 4, 4, _P256, 524288),
    ([64, 256, 64], 4, 4, _T64, 131072),  # the first config kept without autotuning
    ([64, 256, 64], 4, 4, _T128W8, 196608),
    ([64, 256, 64], 4, 4, _T128, 164864),  # tf32
    ([32, 64, 64, 64, 16], 2, 2, _P128, 51200),  # nerf64
    ([32, 64, 64, 64, 16], 2, 2, _P64, 36864),
    ([32, 64, 64, 64, 16], 2, 2, _T128, 30720),
    ([64, 128, 128, 128, 64], 2, 2, _P128, 163840),  # nerf128
    ([64, 128, 128, 128, 64], 2, 2, _P64, 131072),
    ([64, 128, 128, 128, 64], 2, 2, _P256, 212992),
    ([64, 128, 128, 128, 64], 4, 4, _P128, 327680),  # tf32
    ([64, 128, 128, 128, 64], 4, 4, _T128, 229376),  # tf32
    ([128, 128, 128], 4, 4, _P128, 393216),  # tf32
    ([128, 128, 128], 4, 4, _P128, 327680),
    ([128, 128, 128], 4, 4, _P64, 262144),  # tf32
    ([128, 128, 128], 4, 4, _P64, 229376),
    ([128, 128, 128], 4, 4, _T128, 197120),
    ([128, 128, 128], 4, 4, _T128, 196608),  # tf32
    ([256, 64, 256], 4, 4, _P128, 655360),  # tf32
    ([256, 64, 256], 4, 4, _T128W8, 196608),  # tf32
    ([64, 256, 64], 2, 2, _P128, 131072),
    ([256, 128, 128, 256], 2, 2, _P64, 278528),
    ([256, 128, 128, 256], 2, 2, _T128, 229376),
    ([128, 256, 128, 256, 128], 2, 2, _P64, 319488),
    ([128, 256, 128, 256, 128], 2, 2, _T128, 294912),
]


@pytest.mark.parametrize("pads,weight_size,x_size,config,shared", SM90_TRITON36_SHARED)
def test_chain_shared_memory_estimate_never_falls_short(pads, weight_size, x_size, config, shared):
    from fxfuse.kernels.chain_template import _config, shared_memory_estimate

    # Never below (close for the persistent loop; one-tile configs reuse the x tile's space, which it leaves out).
    assert shared_memory_estimate(_config(*config), pads, weight_size, x_size) >= shared


def _gpu_configs_pruned(monkeypatch, pads, weight_dtype, x_dtype=None, rows=64, autotune=True):
    """(BLOCK_M, num_warps, PERSISTENT) of the GPU's chain configs that _prune keeps, in order."""
    from fxfuse.kernels import chain_template

    monkeypatch.setattr(chain_template, "_interpreting", lambda: False)  # the GPU's list of configs
    monkeypatch.setenv("FXFUSE_AUTOTUNE", "1" if autotune else "0")
    w0, x = torch.empty(0, dtype=weight_dtype), torch.empty(0, dtype=x_dtype or weight_dtype)
    args = {f"P{i}": p for i, p in enumerate(pads)} | {"w0_ptr": w0, "x_ptr": x, "M_BUCKET": rows}
    return [(c.kwargs["BLOCK_M"], c.num_warps, c.kwargs["PERSISTENT"])
            for c in chain_template._prune(chain_template.chain_configs(), args)]


@pytest.mark.parametrize("pads,dtype,x_dtype", [([256, 128, 256], torch.float16, None),
                                                ([256, 128, 256], torch.bfloat16, None),
                                                ([128, 256, 128], torch.float16, None),
                                                ([128, 256, 128], torch.float16, torch.float32),
                                                ([64, 256, 64], torch.float32, None)])
def test_chain_configs_the_gpu_refused_are_pruned(monkeypatch, pads, dtype, x_dtype):
    # FXFUSE_AUTOTUNE=0 on the H200 took the persistent 128-row config of these chains, which needs more shared
    # memory than the GPU has, and failed on every call: now the first kept config fits (measured above).
    measured = {(tuple(p), w, x, c[:2] + (c[3] if len(c) > 3 else 0,)): s
                for p, w, x, c, s in SM90_TRITON36_SHARED}
    x_size = (x_dtype or dtype).itemsize
    for autotune in (True, False):
        kept = _gpu_configs_pruned(monkeypatch, pads, dtype, x_dtype, autotune=autotune)
        assert kept and (128, 8, 1) not in kept
        for c in kept:
            assert measured.get((tuple(pads), dtype.itemsize, x_size, c), 0) <= 232448, c
    assert _gpu_configs_pruned(monkeypatch, pads, dtype, x_dtype, autotune=False) == kept[:1]


def test_chain_configs_that_fit_are_kept(monkeypatch):
    # The persistent configs that win the NeRF rows (benchmarks/NOTES.md), and one that fits a 16-bit 128 -> 256 ->
    # 128 chain (188416 bytes), stay.
    assert _gpu_configs_pruned(monkeypatch, [32, 64, 64, 64, 16], torch.float16)[:2] == [(128, 8, 1), (64, 4, 1)]
    assert _gpu_configs_pruned(monkeypatch, [64, 128, 128, 128, 64], torch.float16)[:2] == [(128, 8, 1), (64, 4, 1)]
    assert _gpu_configs_pruned(monkeypatch, [128, 256, 128], torch.float16, autotune=False) == [(64, 4, 1)]
    # Nothing fits: the smallest estimate, not the fewest rows (the persistent 64-row config needs 393216 here).
    from fxfuse.kernels import chain_template

    w0 = torch.empty(0, dtype=torch.float32)
    args = {"P0": 256, "P1": 64, "P2": 256, "w0_ptr": w0, "x_ptr": w0, "M_BUCKET": 64}
    persistent64 = chain_template._config(64, 4, 1, 1, 3, 4)
    (kept,) = chain_template._prune([persistent64, chain_template._config(128, 8, 0)], args)
    assert kept.kwargs["PERSISTENT"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dims,dtype,act", [((256, 128), torch.float16, "gelu"), ((128, 256), torch.float16, "gelu"),
                                            ((256, 128), torch.bfloat16, "gelu"), ((128, 256), torch.bfloat16, "gelu"),
                                            ((64, 256), torch.float32, "tanh")])
def test_chain_first_config_fits_the_gpu_without_autotuning(monkeypatch, dims, dtype, act):
    """FXFUSE_AUTOTUNE=0 (the H200 review): the chain's first kept config launches (its shared memory fits), every
    call runs the chain kernel, and the report says so."""
    import copy

    from torch import nn

    import fxfuse

    monkeypatch.setenv("FXFUSE_AUTOTUNE", "0")
    k, h = dims
    model = nn.Sequential(nn.Linear(k, h), nn.GELU(approximate=act if act == "tanh" else "none"),
                          nn.Linear(h, k)).eval().to("cuda", dtype)
    x = torch.randn(64, k, device="cuda", dtype=dtype)
    fast = fxfuse.optimize(model, example_inputs=(x,))
    failed = []
    run_kernels = ops._run_kernels

    def watched(*a, **kw):
        try:
            return run_kernels(*a, **kw)
        except Exception as err:
            failed.append(err)
            raise

    monkeypatch.setattr(ops, "_run_kernels", watched)
    with torch.no_grad():
        for _ in range(3):
            out = fast(x)
        ref = copy.deepcopy(model).double()(x.double())
    assert not failed, failed[0]
    assert rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 1e-2)
    assert fxfuse.report(fast).regions[0].running == "fused_chain (1 launch)"


def _siren_errors(widths, dtype, m, device="cpu"):
    """Relative errors against the float64 model of fxfuse's SIREN and eager's, in ``dtype``, and whether the
    fused op ran."""
    from models import siren
    from test_api import _runs_fused_op

    import fxfuse

    model = siren(widths).eval().to(device)
    ref = copy.deepcopy(model).double()
    eager = copy.deepcopy(model).to(dtype)
    fast = fxfuse.optimize(copy.deepcopy(model).to(dtype))
    coords = torch.rand(m, widths[0], device=device) * 2 - 1
    out = fast(coords.to(dtype))  # (recording gradients: the autograd node says which op ran)
    with torch.no_grad():
        expected = ref(coords.double())
        return rel_err(out.detach(), expected), rel_err(eager(coords.to(dtype)), expected), _runs_fused_op(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_siren_runs_as_one_chain_with_eager_accuracy(dtype, untrained_specs):
    # sin(30 linear(x)) in every layer: the whole network is one fused chain (the sines on the fp32 accumulator).
    fused, eager, ran = _siren_errors((2, 32, 32, 3), dtype, 37)
    assert ran and fused < max(TOL[dtype], 1.5 * eager), (fused, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("widths,dtype", [((2, 256, 256, 256, 3), torch.float16), ((3, 64, 64, 1), torch.float32),
                                          ((3, 64, 64, 1), torch.float16), ((3, 64, 64, 1), torch.bfloat16)])
def test_siren_on_gpu(widths, dtype, untrained_specs):
    fused, eager, ran = _siren_errors(widths, dtype, 20000, device="cuda")
    assert ran and fused < max(1e-4 if dtype == torch.float32 else 1e-2, 1.5 * eager), (fused, eager)


@pytest.mark.parametrize("dtype,device", [
    (torch.float16, "cpu"),  # the interpreter: the reduction, then tl.sin / tl.cos (fxfuse/kernels/fast_math.py)
    pytest.param(torch.float16, "cuda", marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu),
    pytest.param(torch.float32, "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("op", ["sin", "cos"])
def test_chain_sine_and_cosine_round_as_the_dtype_does(op, dtype, device):
    # 16-bit outputs take the hardware's sine / cosine after a reduction to [-pi, pi]: elementwise, within an ulp
    # of the output's dtype (plus 2e-6) of float64 over SIREN's arguments and beyond; fp32 keeps libdevice's.
    # Zero weights and the values as the bias make the accumulator exactly those values.
    values = torch.cat([torch.linspace(-400.0, 400.0, 2001), torch.tensor([0.0, 1e-3, -2.5e-4, 3.1415927, 1e4])])
    values = values.to(device, dtype)
    x = torch.randn(5, 16, device=device, dtype=dtype)
    from fxfuse.kernels.chain_template import _config

    out = run_chain(x, [torch.zeros(values.numel(), 16, device=device, dtype=dtype)], [values], [[]], (f"{op}(a0)",),
                    config=_config(16 if device == "cpu" else 64, 4))  # (one config: autotuning all takes ~40 s)
    ref = getattr(torch, op)(values.double()).expand(5, -1)
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 2e-6
    bound = eps * ref.abs() + 2e-6
    assert ((out.double() - ref).abs() <= bound).all(), ((out.double() - ref).abs() - bound).max().item()
