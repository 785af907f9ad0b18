"""fxfuse.profile: the structural report (CPU, meta), its files, the command line, kernel attribution.

FLOPs and bytes below are computed by hand: FLOPs = 2·M·ΣK·N; minimum bytes = input + weights +
biases + output, each once; eager traffic = every op reads its inputs and writes its output.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import GPT2MLP, ControlFlowModel, GatedMLP, Stack
from torch import nn
from torch.autograd import DeviceType

from fxfuse import optimize as fxfuse_optimize
from fxfuse.__main__ import main
from fxfuse.profile import NEED_GPU, attribute, profile, short_kernel_name
from fxfuse.roofline import classify, count_call, named_ceilings

fxprofile = importlib.import_module("fxfuse.profile")  # the module, even once fxfuse exports profile()
HERE = Path(__file__).resolve().parent
PNG = b"\x89PNG\r\n\x1a\n"
BF16 = torch.bfloat16


def tiny_factory(shape=(2, 5, 32)):
    """For the command line: ``python -m fxfuse profile test_profile:tiny_factory``."""
    torch.manual_seed(0)
    return GatedMLP(act="gelu").eval(), (torch.randn(shape),)


class BigGated(nn.Module):
    """A gated MLP of any size, without biases (GeGLU with gelu_tanh, or SwiGLU)."""

    def __init__(self, d, h, act="gelu", device="meta", dtype=BF16):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(h, d, bias=False, device=device, dtype=dtype)
        self.act = nn.GELU(approximate="tanh") if act == "gelu" else nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


def meta_factory(shape=(2, 5, 32), device="meta"):
    """Builds on meta unless told a device, as the benchmark factories do."""
    return BigGated(32, 64, device=device, dtype=torch.float32).eval(), (torch.randn(shape, device=device),)


def meta_only_factory():
    return BigGated(32, 64, dtype=torch.float32).eval(), (torch.empty(2, 32, device="meta"),)


def _launches(region) -> int:
    return 1 if region.strategy.startswith("fused_chain") else 2


# ------------------------------------------------------------------------------------------ structure (CPU)

def test_gpt2_mlp_structure():
    rep = profile(GPT2MLP(32, 96).eval(), (torch.randn(2, 5, 32),))
    assert not rep.timed and rep.device == "cpu" and rep.ceilings.name == "H200"
    assert len(rep.regions) == 1
    r = rep.regions[0]
    assert (r.module_path, r.pattern, r.spec, r.m, r.dims, r.dtype) == \
        ("<root>", "mlp", "1b:gelu_tanh(a0);1b:a0", 10, "32→96→32", "float32")
    assert r.flops == 2 * 10 * 32 * 96 * 2 == 122880
    assert r.min_bytes == 4 * (10 * 32 + (96 * 32 + 96) + (32 * 96 + 32) + 10 * 32) == 27648
    # eager: linear (x, W1, b1 -> h), gelu (h -> h), linear (h, W2, b2 -> y)
    assert r.before.traffic_bytes == 4 * ((320 + 3168 + 960) + (960 + 960) + (960 + 3104 + 320)) == 43008
    assert r.before.launches == 3 and r.before.kernels == {"linear": 2, "gelu_tanh": 1}
    assert r.after.launches == _launches(r)
    assert r.after.traffic_bytes == (27648 if _launches(r) == 1 else 4 * ((320 + 3168 + 960) + (960 + 3104 + 320)))
    assert r.before.gpu_us is None and r.after.gpu_us is None and r.speedup is None
    text = str(rep)
    assert NEED_GPU in text and "<root>" in text and "predicted" in text


def test_inputs_as_a_bare_tensor_or_not_what_eager_takes():
    model = GPT2MLP(32, 96).eval()
    x = torch.randn(2, 5, 32)
    assert len(profile(model, x).regions) == 1  # (a bare tensor: the one input)
    with pytest.raises(TypeError, match="positional inputs as a tuple"):
        profile(model, {"x": x})
    for bad in (3.0, torch.tensor(1.0)):  # eager's error, not one from counting the call's work
        with pytest.raises((TypeError, RuntimeError)) as eager:
            model(bad)
        with pytest.raises(type(eager.value), match=re.escape(str(eager.value))):
            profile(model, (bad,))


def test_a_model_left_in_training_mode_is_as_it_was_after_its_profile():
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 32)
    rng = torch.get_rng_state()
    profile(model, (x,))
    assert model.training
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    assert torch.equal(torch.get_rng_state(), rng)


def test_gated_mlp_structure():
    rep = profile(GatedMLP(32, 80, act="gelu").eval(), (torch.randn(3, 7, 32),), gpu="A100")
    assert rep.ceilings.name == "A100"
    (r,) = rep.regions
    assert (r.pattern, r.m, r.dims) == ("gated_mlp", 21, "32→2×80→32")
    assert r.spec.startswith("2--:") and "gelu_tanh" in r.spec
    assert r.flops == 2 * 21 * (32 * 80 * 2 + 80 * 32) == 322560
    assert r.min_bytes == 4 * (21 * 32 + 3 * 32 * 80 + 21 * 32) == 36096
    h = 21 * 80  # one intermediate
    eager = 2 * (672 + 2560 + h) + 2 * h + 3 * h + (h + 2560 + 672)  # gate, up, gelu, mul, down
    assert r.before.traffic_bytes == 4 * eager
    assert r.after.traffic_bytes == 4 * ((672 + 5120 + h) + (h + 2560 + 672))  # gated stage, then down
    assert r.before.launches == 5 and r.after.launches == 2
    assert r.before.kernels == {"linear": 3, "gelu_tanh": 1, "mul": 1}


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_moe_experts_are_profiled_regions(family):
    # Each experts module runs its installed forward, outside the fxfuse.mlp op: profiled as a region of its own,
    # its work counted from the call's routing (top-k experts of the tiny model's tokens).
    pytest.importorskip("transformers")
    from real_models import tiny

    from fxfuse.moe import MOE_PATTERN

    model, inputs, _ = tiny(family)
    ids = inputs["input_ids"]
    rep = profile(model, (ids,))
    experts = [r for r in rep.regions if r.pattern == MOE_PATTERN]
    assert len(experts) == 2 and not [n for n in rep.notes if "experts" in n]
    config = model.config
    width, inter, top_k = config.hidden_size, config.intermediate_size, config.num_experts_per_tok
    for r in experts:
        assert r.m == ids.numel() and r.calls == 1 and r.dims.startswith(f"{width}→") and f"top-{top_k}" in r.dims
        assert r.flops == 2 * ids.numel() * top_k * 3 * width * inter  # every routed pair's three products
        assert r.min_bytes > 2 * ids.numel() * width * 4 and r.before.traffic_bytes > r.after.traffic_bytes
        assert r.after.launches == 4 and r.before.launches > r.after.launches


def test_moe_experts_profile_both_sides_timed(monkeypatch):
    # The timed path (host timers, CPU ops standing in for kernels): the installed forward and the class's own run
    # inside the experts' label; the modules' forwards are left as they were.
    pytest.importorskip("transformers")
    from real_models import tiny

    monkeypatch.setattr(fxprofile, "_HOST_TIMED", True)
    model, inputs, _ = tiny("mixtral")
    fast = fxfuse_optimize(model)
    rep = profile(model, (inputs["input_ids"],), optimized=fast, iters=2, warmup=1)
    experts = [r for r in rep.regions if r.dims.endswith("top-2")]
    assert len(experts) == 2
    for r in experts:
        assert r.before.gpu_us > 0 and r.after.gpu_us > 0 and r.before.host_us > 0 and r.after.host_us > 0
        assert r.before.kernels and r.after.kernels
    assert all("forward" not in vars(m) for m in fast.modules())


def test_predicted_regimes_on_h200_at_full_size():
    """meta tensors: full-size workloads of workloads.md, nothing allocated."""
    seed = profile(BigGated(768, 3072), (torch.empty(64, 128, 768, device="meta", dtype=BF16),), gpu="H200")
    (r,) = seed.regions
    assert r.m == 8192 and r.dtype == "bfloat16"
    assert r.flops == 2 * 8192 * 768 * 3072 * 3 == 115_964_116_992  # benchmark table: 116.0 GFLOP
    assert r.min_bytes == 2 * (8192 * 768 * 2 + 3 * 768 * 3072) == 39_321_600  # benchmark table: 39.3 MB
    assert r.bound == "compute" and round(r.floor_us) == 165  # workloads.md: floor 165 µs
    assert r.before.regime == r.after.regime == "compute"

    llama = profile(BigGated(4096, 14336, act="silu"), (torch.empty(1, 4096, device="meta", dtype=BF16),))
    (r,) = llama.regions
    assert r.bound == "memory" and round(r.floor_us) == 83  # workloads.md: floor 83 µs
    assert r.before.regime == r.after.regime == "memory"

    gpt2m = profile(GPT2MLP(1024, 4096).to("meta", BF16).eval(), (torch.empty(1, 1024, device="meta", dtype=BF16),))
    (r,) = gpt2m.regions
    assert r.bound == "memory" and round(r.floor_us) == 4  # workloads.md: floor 4 µs
    assert r.before.regime == r.after.regime == "overhead"  # ≥ 2 launches × 5 µs > 4 µs of weights
    assert "launch" in str(r.after.verdict)


def test_region_paths_of_a_stack_and_of_an_untraceable_model():
    rep = profile(Stack(3).eval(), (torch.randn(2, 4, 32),))
    assert [r.module_path for r in rep.regions] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    assert [r.module_path for r in profile(ControlFlowModel().eval(), (torch.randn(4, 32),)).regions] == ["mlp"]


def test_profile_uses_the_given_optimized_model_and_leaves_it_alone():
    import fxfuse

    model = GatedMLP().eval()
    x = torch.randn(4, 32)
    opt = fxfuse.optimize(model, (x,))
    rep = profile(model, (x,), optimized=opt)
    assert len(rep.regions) == 1 and rep.fusion is fxfuse.report(opt)
    assert torch._C._len_torch_function_stack() == 0  # the interception is over
    torch.testing.assert_close(opt(x), model(x))


def test_save_writes_png_and_html(tmp_path):
    rep = profile(Stack(2).eval(), (torch.randn(2, 4, 32),))
    written = rep.save(tmp_path)
    assert set(written) == {"png", "html"}  # no traces without a GPU
    assert (tmp_path / "roofline.png").read_bytes().startswith(PNG)
    page = (tmp_path / "report.html").read_text()
    assert "<table>" in page and "blocks.1.mlp" in page and "data:image/png;base64," in page
    assert NEED_GPU in page and "Fusion report" in page


# ------------------------------------------------------------------------------------------ command line

def test_cli_main(tmp_path, capsys):
    assert main(["profile", "test_profile:tiny_factory", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gated_mlp" in out and NEED_GPU in out and "32→2×80→32" in out
    assert (tmp_path / "roofline.png").read_bytes().startswith(PNG)
    assert (tmp_path / "report.html").exists()


def test_cli_shape_dtype_and_named_gpu(capsys):
    assert main(["profile", f"{HERE / 'test_profile.py'}:tiny_factory", "--shape", "6,32", "--dtype", "fp16",
                 "--gpu", "H100", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert "float16" in out and "H100" in out and "  6  " in out


@pytest.mark.parametrize("args, message", [
    (["--device", "foo"], "is not a device"),
    (["--shape", "3,x"], "is not a shape"),
    (["--gpu", "B200"], "unknown GPU"),
    (["--iters", "0"], "at least 1"),
])
def test_cli_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["profile", f"{HERE / 'test_profile.py'}:tiny_factory", "--no-save", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def returns_the_model_only():
    return GPT2MLP(32, 96).eval()


@pytest.mark.parametrize("target, message", [
    ("no_such_module_here:factory", "cannot import no_such_module_here"),
    (f"{HERE / 'no_such_file.py'}:factory", "cannot load"),
    (f"{HERE / 'test_profile.py'}:returns_the_model_only", "a factory returns (model, example_inputs)"),
])
def test_cli_targets_that_cannot_be_profiled_say_why(target, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["profile", target, "--device", "cpu", "--no-save"])


def test_cli_device_is_passed_to_a_factory_that_takes_it(capsys):
    # Weights built on meta have nothing to move: the factory is asked to build on the device instead.
    assert main(["profile", "test_profile:meta_factory", "--device", "cpu", "--no-save"]) == 0
    assert "gated_mlp" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="built its model on meta"):
        main(["profile", "test_profile:meta_only_factory", "--device", "cpu", "--no-save"])
    assert main(["profile", "test_profile:meta_only_factory", "--device", "meta", "--no-save"]) == 0


def test_cli_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "fxfuse", "profile", "test_profile:tiny_factory", "--device", "cpu",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "gated_mlp" in run.stdout and "timings need a GPU" in run.stdout
    assert (tmp_path / "report.html").exists()


# ------------------------------------------------------------------------------------------ pieces

def test_count_call_chain_in_one_launch_moves_the_minimum():
    x = torch.empty(100, 16, device="meta")
    ws = [torch.empty(32, 16, device="meta"), torch.empty(8, 32, device="meta")]
    bs = [torch.empty(32, device="meta"), torch.empty(8, device="meta")]
    one = count_call("1b:relu(a0);1b:a0", x, ws, bs, [], launches=1)
    two = count_call("1b:relu(a0);1b:a0", x, ws, bs, [], launches=2)
    assert one.min_bytes == one.fused_bytes == 4 * (1600 + 512 + 32 + 256 + 8 + 800)
    assert two.fused_bytes == one.min_bytes + 2 * 4 * 100 * 32  # the intermediate written and read once
    assert one.eager_launches == 3 and one.eager_ops == ("linear", "relu", "linear")


def test_classify_measured():
    c = named_ceilings("NVIDIA H200")
    flops, nbytes = 116e9, 39.3e6
    v = classify(flops, nbytes, 2, c, "bfloat16", gpu_us=236.0, host_us=60.0)
    assert v.regime == "compute" and "70% of the matmul ceiling" in v.detail
    v = classify(0.35e9, 352e6, 2, c, "bfloat16", gpu_us=95.0, host_us=30.0)
    assert v.regime == "memory" and "88% of copy bandwidth" in v.detail
    v = classify(0.35e9, 352e6, 2, c, "bfloat16", gpu_us=95.0, host_us=150.0)  # the GPU waits for the host
    assert v.regime == "overhead" and "host 150 µs" in v.detail
    with pytest.raises(ValueError):
        named_ceilings("TPU")


def test_short_kernel_name():
    gelu = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
            "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::"
            "{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, at::native::GeluCUDAKernelImpl("
            "at::TensorIteratorBase&, at::native::GeluType))")
    assert short_kernel_name(gelu) == "vectorized_elementwise_kernel<GeluCUDAKernelImpl>"
    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
           "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, ...)")
    assert short_kernel_name(mul) == "vectorized_elementwise_kernel<MulFunctor>"
    assert short_kernel_name("fused_stage_kernel") == "fused_stage_kernel"
    assert short_kernel_name("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN") == "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN"
    assert len(short_kernel_name("x" * 200)) == 60


def _ev(name, id, start, end, *, device=DeviceType.CPU, linked=0, parent=None, annotation=False):
    e = SimpleNamespace(name=name, id=id, device_type=device, linked_correlation_id=linked,
                        time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent, cpu_children=[],
                        is_user_annotation=annotation)
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_attribute_kernels_to_regions_and_iterations():
    """Synthetic profiler events: kernels found by their launching op, or by their launch call's time."""
    cuda = DeviceType.CUDA
    events = []
    for i in range(2):
        t = 1000 * i
        it = _ev(f"fxfuse iteration {i}", 100 * i + 1, t, t + 900, annotation=True)
        region = _ev("fxfuse region blocks.0.mlp", 100 * i + 2, t + 10, t + 50, parent=it, annotation=True)
        op = _ev("fxfuse::mlp", 100 * i + 3, t + 12, t + 48, parent=region)
        launch = _ev("cuLaunchKernelEx", 5000 + 10 * i, t + 13, t + 14, linked=op.id, parent=op)
        bare_launch = _ev("cuLaunchKernelEx", 5001 + 10 * i, t + 20, t + 21, linked=999)  # unlinked: by time
        other = _ev("aten::add", 100 * i + 4, t + 60, t + 70, parent=it)
        events += [it, region, op, launch, bare_launch, other,
                   _ev("fused_stage_kernel", 5000 + 10 * i, t + 100, t + 130, device=cuda, linked=op.id),
                   _ev("fused_stage_kernel", 5001 + 10 * i, t + 130, t + 150 + 10 * i, device=cuda),
                   _ev("vectorized_elementwise_kernel<AddFunctor>", 7000 + i, t + 200, t + 205, device=cuda,
                       linked=other.id),
                   _ev("fxfuse region blocks.0.mlp", 8000 + i, t + 100, t + 150, device=cuda, annotation=True)]
    flush_op = _ev("aten::zero_", 9000, 2000, 2010)
    events += [flush_op, _ev("memset", 9001, 2020, 2400, device=cuda, linked=flush_op.id)]
    per_region, total = attribute(events, iters=2)
    m = per_region["fxfuse region blocks.0.mlp"]
    assert m.kernels == {"fused_stage_kernel": 2.0} and m.launches == 2.0
    assert m.gpu_us == pytest.approx((30 + 20 + 30 + 30) / 2)  # per iteration 50, 60: median 55
    assert m.host_us == pytest.approx(40)
    assert total == pytest.approx((55 + 65) / 2)  # the region plus the add; not the flush


def test_attribute_falls_back_to_the_kernels_torch_attached_to_ops():
    it = _ev("fxfuse iteration 0", 1, 0, 100, annotation=True)
    region = _ev("fxfuse region mlp", 2, 10, 50, parent=it, annotation=True)
    op = _ev("aten::mm", 3, 12, 20, parent=region)
    op.kernels = [SimpleNamespace(name="nvjet_tst_128x64", device=0, duration=7.0)] * 2
    per_region, total = attribute([it, region, op], iters=1)
    assert per_region["fxfuse region mlp"].kernels == {"nvjet_tst_128x64": 2.0}
    assert per_region["fxfuse region mlp"].gpu_us == total == 14.0


def test_host_timed_path_on_cpu(monkeypatch, tmp_path):
    """The timed path end to end, with host timers and CPU ops standing in for kernels."""
    monkeypatch.setattr(fxprofile, "_HOST_TIMED", True)
    rep = profile(GatedMLP(16, 32).eval(), (torch.randn(4, 16),), iters=2, warmup=1)
    assert rep.timed and rep.before_us > 0 and rep.after_us > 0 and rep.speedup > 0
    (r,) = rep.regions
    for side in (r.before, r.after):
        assert side.gpu_us > 0 and side.host_us > 0 and side.kernels and side.tflops > 0
        assert "predicted" not in str(side.verdict)
    assert NEED_GPU not in str(rep) and "end to end" in str(rep)
    written = rep.save(tmp_path)
    assert {"png", "html", "trace_before", "trace_after"} <= set(written)
    trace = json.loads((tmp_path / "trace_before.json").read_text())
    assert any(str(e.get("name", "")).startswith("fxfuse region") for e in trace["traceEvents"])


def test_region_host_time_is_its_own_call_timed_outside_the_profiler(monkeypatch):
    """Under torch.profiler every launch is slower and the fused op takes its full path: the regime's host time is
    the region's own call on its first arguments, timed without the profiler (per call × calls per forward)."""
    monkeypatch.setattr(fxprofile, "_HOST_TIMED", True)
    seen = []

    def call_host_us(side, args, device):
        seen.append((side, tuple(args[0].shape), args[-1]))
        return {"before": 3.0, "after": 1e6}[side]  # the fused call's host far above its work: overhead-bound

    monkeypatch.setattr(fxprofile, "_call_host_us", call_host_us)
    rep = profile(GatedMLP(16, 32).eval(), (torch.randn(4, 16),), iters=2, warmup=1)
    (r,) = rep.regions
    assert sorted(side for side, _, _ in seen) == ["after", "before"] and all(s[1] == (4, 16) for s in seen)
    assert r.before.host_us == 3.0 and r.after.host_us == 1e6
    assert r.after.regime == "overhead" and "host 1000000 µs" in str(r.after.verdict)


def test_end_to_end_times_are_interleaved_rounds():
    """before/after are measured in turn, ROUNDS times, and each side keeps its median over the rounds."""
    order = []
    vals = {"before": iter([10.0, 14.0, 11.0]), "after": iter([9.0, 8.0, 20.0])}

    def measure(side):
        return lambda: (order.append(side), next(vals[side]))[1]

    assert fxprofile.ROUNDS == 3
    assert fxprofile._interleaved(measure("before"), measure("after")) == [11.0, 9.0]
    assert order == ["before", "after"] * 3


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
def test_profile_on_the_gpu(tmp_path):
    model = BigGated(256, 512, device="cuda").eval()
    x = torch.randn(4, 128, 256, device="cuda", dtype=BF16)
    rep = profile(model, (x,), iters=5)
    assert rep.timed
    assert rep.ceilings.copy_bytes_per_s > 1e11 and rep.ceilings.matmul("bfloat16") > 1e13
    assert rep.before_us > 0 and rep.after_us > 0
    (r,) = rep.regions
    assert r.after.launches == 2, r.after.kernels  # gate+up with the epilogue, then down
    assert r.before.launches >= 5, r.before.kernels  # 3 GEMMs, gelu, mul (cuBLAS may add its own)
    assert r.before.gpu_us > 0 and r.after.gpu_us > 0 and r.speedup > 0
    assert sum(r.after.kernels.values()) == r.after.launches
    assert r.after.gpu_us <= rep.after_kernel_us + 1e-6
    written = rep.save(tmp_path)
    for side in ("before", "after"):
        trace = json.loads(written[f"trace_{side}"].read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "fxfuse region <root>" in names
    assert written["png"].read_bytes().startswith(PNG)


@pytest.mark.gpu
def test_profile_of_a_moe_model_on_the_gpu():
    # A MoE model's experts: the installed forward's kernels (routing, gate/up, down) attributed to each experts
    # module's region, transformers' grouped_mm path on the other side.
    pytest.importorskip("transformers")
    from real_models import tiny

    from fxfuse.moe import MOE_PATTERN

    model, inputs, _ = tiny("mixtral", batch=4, seq=64)
    model = model.to("cuda", BF16).eval()
    rep = profile(model, (inputs["input_ids"].cuda(),), iters=5)
    experts = [r for r in rep.regions if r.pattern == MOE_PATTERN]
    assert rep.timed and len(experts) == 2
    for r in experts:
        kernels = set(r.after.kernels)  # (each GEMM by TMA or by pointer, by its rows per block)
        assert {"moe_gate_up_kernel", "moe_gate_up_tma_kernel"} & kernels, r.after.kernels
        assert {"moe_down_kernel", "moe_down_tma_kernel"} & kernels, r.after.kernels
        assert not any(k.startswith("moe_") for k in r.before.kernels), r.before.kernels
        assert r.before.gpu_us > 0 and r.after.gpu_us > 0 and r.after.tflops > 0
        assert r.after.gpu_us <= rep.after_kernel_us + 1e-6


@pytest.mark.gpu
def test_profile_region_time_agrees_with_do_bench_of_the_region_alone():
    """One region that is the whole model: its kernel time ≈ the model's do_bench median (within 25%)."""
    model = BigGated(1024, 4096, device="cuda").eval()  # ~300 µs of GPU work: not host-bound
    x = torch.randn(8192, 1024, device="cuda", dtype=BF16)
    rep = profile(model, (x,), iters=10)
    (r,) = rep.regions
    assert r.after.gpu_us == pytest.approx(rep.after_us, rel=0.25)
    assert r.before.gpu_us == pytest.approx(rep.before_us, rel=0.25)
