"""Replays of decode-size regions: recorded from a call whose every stage was a bound launch, re-run per input."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from test_ops import rel_err

import fxfuse
from fxfuse import replay
from fxfuse.kernels import fastlaunch


def fake_stage(w):
    """A stand-in for a recorded stage step: ``h -> h @ w.T``."""
    return lambda h: h @ w.T


def test_build_keeps_a_replay_only_when_every_stage_was_bound():
    w1, w2 = torch.randn(16, 8), torch.randn(4, 16)
    x = torch.randn(2, 8)

    def run(bound_second=True):
        h = x @ w1.T
        fastlaunch.record(fake_stage(w1))
        out = h @ w2.T
        fastlaunch.record(fake_stage(w2) if bound_second else None)
        return out

    replay.forget_all()
    out = replay.build(("a",), x, lambda: run(bound_second=False), 2)
    assert torch.equal(out, x @ w1.T @ w2.T) and ("a",) not in replay.replays
    replay.build(("b",), x, run, 2)
    fresh = torch.randn(2, 8)
    torch.testing.assert_close(replay.replays[("b",)](fresh), fresh @ w1.T @ w2.T)
    replay.build(("c",), x, lambda: (run(), run())[1], 2)  # more launches than stages (a timing run): no replay
    assert ("c",) not in replay.replays
    replay.forget_all()


def test_a_one_launch_region_replays_its_step_without_views():
    w1, w2 = torch.randn(16, 8), torch.randn(4, 16)
    step = fake_stage(w2 @ w1)  # the whole region as one launch

    def run(x):
        fastlaunch.record(step)
        return step(x.reshape(-1, 8)).reshape(*x.shape[:-1], 4)

    replay.forget_all()
    x = torch.randn(1, 8)
    replay.build(("2d",), x, lambda: run(x), 1)
    assert replay.replays[("2d",)] is step  # a 2-D input: nothing to reshape around the launch
    x3 = torch.randn(2, 3, 8)
    replay.build(("3d",), x3, lambda: run(x3), 1)
    fresh = torch.randn(2, 3, 8)
    torch.testing.assert_close(replay.replays[("3d",)](fresh), fresh @ (w2 @ w1).T)
    replay.forget_all()


class GPT2MLP(torch.nn.Module):
    def __init__(self, d=256, h=1024):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


@pytest.mark.gpu
def test_decode_calls_replay_and_follow_weight_changes():
    replay.forget_all()
    model = GPT2MLP().cuda().to(torch.bfloat16).eval()
    opt = fxfuse.optimize(model)
    with torch.no_grad():
        for m in (1, 4):
            for _ in range(3):  # fresh inputs each call; from the second call on, a replay
                x = torch.randn(2, m, 256, device="cuda", dtype=torch.bfloat16)
                assert rel_err(opt(x), model(x)) < 1e-2
        assert len(replay.replays) == 2  # one per input shape
        model.fc1.weight.mul_(-1.0)  # in place: same addresses, the replay reads the new values
        x = torch.randn(2, 1, 256, device="cuda", dtype=torch.bfloat16)
        assert rel_err(opt(x), model(x)) < 1e-2
        model.half()  # new tensors: recorded again, nothing stale runs
        x = x.half()
        for _ in range(2):
            assert rel_err(opt(x), model(x)) < 1e-2
        assert len(replay.replays) == 3
    replay.forget_all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_fused_chain_replays_its_one_bound_launch(dtype):
    """The NeRF-style chain (one kernel for every layer) is replayed from its second call: fresh inputs of the
    recorded shape, 3-D and 2-D, each checked against eager; an in-place weight change is seen."""
    replay.forget_all()
    torch.manual_seed(0)
    dims = (32, 64, 64, 16)
    layers = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(dims) - 2 else [])
    model = torch.nn.Sequential(*layers).cuda().to(dtype).eval()
    opt = fxfuse.optimize(model)
    tol = 1e-2 if dtype != torch.float32 else 1e-3
    with torch.no_grad():
        for shape in ((64, 96, 32), (4096, 32)):
            for _ in range(3):
                x = torch.randn(shape, device="cuda", dtype=dtype)
                assert rel_err(opt(x), model(x)) < tol
        assert len(replay.replays) == 2  # one per input shape, each a single step
        (run,) = [r for k, r in replay.replays.items() if k[1] == (4096, 32)]
        model[0].weight.mul_(-1.0)
        x = torch.randn(4096, 32, device="cuda", dtype=dtype)
        out = run(x)
        assert rel_err(out, model(x)) < tol and torch.isfinite(out).all()
    replay.forget_all()


def test_replaying_runner_times_the_replay_once_recorded():
    w = torch.randn(4, 8)
    x = torch.randn(2, 8)
    calls = []

    def run():
        calls.append("full")
        fastlaunch.record(lambda h: (calls.append("replay"), h @ w.T)[1])
        return x @ w.T

    runner = replay.replaying(x, run, 1)
    outs = [runner() for _ in range(3)]
    assert calls == ["full", "replay", "replay"] and not replay.replays  # kept by the runner, not published
    for out in outs:
        torch.testing.assert_close(out, x @ w.T)


def test_path_us_times_the_call_around_a_replay_that_does_nothing(monkeypatch):
    """The planner's estimate of a replayed call's own path: the call runs with a no-op replay under the key,
    which is gone afterwards (a real replay recorded later is not shadowed)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has no CUDA)
    key, x = ("path-test", 1), torch.randn(2, 3)
    outs, elsewhere = [], []

    def call():
        outs.append(replay.lookup(key)(x))
        if len(outs) == 2:  # another thread meanwhile (a server's pool calling the same region): no replay
            seen = threading.Thread(target=lambda: elsewhere.append(replay.lookup(key)))
            seen.start()
            seen.join()

    us = replay.path_us(key, call)
    assert us >= 0 and key not in replay.replays and replay.lookup(key) is None
    assert len(outs) == 61 and all(out is x for out in outs)  # one warm call, then 3 rounds of 20
    assert elsewhere == [None]


def test_library_step_holds_its_tensors_weakly():
    from fxfuse import stages

    packed = torch.nn.Parameter(torch.randn(32, 8))  # a packed weight: the stage sees a view of half of it
    w, b = packed[:16], torch.nn.Parameter(torch.randn(16))
    step = replay.weak_step(stages._torch_stage, [w], [b], [], "gelu_tanh(a0)")
    h = torch.randn(3, 8)
    torch.testing.assert_close(step(h), F.gelu(h @ packed[:16].T + b, approximate="tanh"))
    del w, packed  # the view's base is gone: the step must not run on freed memory
    import gc

    gc.collect()
    with pytest.raises(ReferenceError):
        step(h)


def test_original_ops_leave_one_replay_step():
    """A region whose measured choice is its original ops is replayed too: one step that runs them (the full
    call path around them costs a host-bound region more than the ops), its tensors held weakly."""
    import functools

    from fxfuse import ops

    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(32, 8), torch.randn(32), torch.randn(8, 32), torch.randn(8)
    spec = "1b:gelu_tanh(a0);1b:a0"
    x = torch.randn(5, 8)
    key = ("test original ops", id(x))
    out = replay.build(key, x, functools.partial(ops._run_original, x, [w1, w2], [b1, b2], [], spec), 1)
    run = replay.replays.pop(key)
    eager = lambda x: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)  # noqa: E731
    assert torch.equal(out, eager(x))
    x2 = torch.randn(5, 8)
    assert torch.equal(run(x2), eager(x2))


@pytest.mark.gpu
def test_a_region_kept_on_its_original_ops_replays_them(monkeypatch):
    """Through the op's dispatch: a region whose choice is the original ops (forced here) records a one-step
    replay on its second call and runs it from then on, bit for bit eager's ops, following in-place weight
    changes."""
    from fxfuse import ops
    from fxfuse.strategy import ORIGINAL_OPS

    replay.forget_all()
    monkeypatch.setattr(ops, "_candidates", lambda *args: (ORIGINAL_OPS,))
    model = GPT2MLP().cuda().to(torch.bfloat16).eval()
    opt = fxfuse.optimize(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8, 256, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(opt(x), model(x))
        (run,) = replay.replays.values()
        model.fc2.weight.mul_(-1.0)
        x = torch.randn(2, 8, 256, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(run(x), model(x)) and torch.equal(opt(x), model(x))
    replay.forget_all()


class SwiGLU(torch.nn.Module):
    def __init__(self, d=256, h=512):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.down = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.gpu
def test_large_m_regions_replay_their_tma_launches(caplog):
    import gc
    import logging

    replay.forget_all()
    model = SwiGLU().cuda().to(torch.bfloat16).eval()
    opt = fxfuse.optimize(model)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fxfuse"):
        for _ in range(3):  # TMA gate+up and down (untimed in the GPU tests): recorded, then replayed
            x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
            assert rel_err(opt(x), model(x)) < 1e-2
        assert len(replay.replays) == 1
        # (a replay step that raised falls back to the original ops, right but slow, with a warning: sessions 35-37's
        # descriptor key did so for every TMA stage)
        assert "failed" not in caplog.text, caplog.text
        del opt, model
        gc.collect()
        torch.cuda.empty_cache()
        model = SwiGLU().cuda().to(torch.bfloat16).eval()  # may reuse the addresses: still right
        opt = fxfuse.optimize(model)
        for _ in range(2):
            x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
            assert rel_err(opt(x), model(x)) < 1e-2
    replay.forget_all()


@pytest.mark.gpu
def test_a_pointer_kernel_stage_replays_its_bound_launch():
    """fc1 reads K=100 bf16 columns (200-byte rows: no TMA), so it runs the pointer GEMM kernel; that launch now
    leaves a replay step too, and the region (pointer fc1, TMA fc2) replays both from its second call."""
    from fxfuse.kernels.tma_launch import tma_applicable

    replay.forget_all()
    model = GPT2MLP(d=100, h=1024).cuda().to(torch.bfloat16).eval()
    opt = fxfuse.optimize(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 100, 100, device="cuda", dtype=torch.bfloat16)
            assert rel_err(opt(x), model(x)) < 1e-2
        assert not tma_applicable(x.reshape(-1, 100), [model.fc1.weight])
        assert len(replay.replays) == 1
        model.fc1.weight.mul_(-1.0)
        x = torch.randn(3, 100, 100, device="cuda", dtype=torch.bfloat16)
        assert rel_err(opt(x), model(x)) < 1e-2
    replay.forget_all()


def test_a_recording_that_runs_a_timing_loop_keeps_few_steps():
    """The first call at a shape times its stages (hundreds of launches); its recording must not keep them all."""
    with fastlaunch.recording() as steps:
        for _ in range(1000):
            fastlaunch.record(lambda h: h)
    assert len(steps) == fastlaunch._MAX_RECORDED + 1
    assert replay.build(("timing",), torch.randn(2, 3), lambda: torch.zeros(2, 3), 2) is not None
    assert ("timing",) not in replay.replays


@pytest.mark.gpu
def test_timing_a_large_region_does_not_hold_its_outputs(monkeypatch):
    """The first call at a shape times every candidate while recording; its launches must not keep their
    inputs and outputs alive (an H200 benchmark ran out of 139 GiB that way)."""
    monkeypatch.setenv("FXFUSE_AUTOTUNE", "1")
    replay.forget_all()
    model = SwiGLU(256, 512).cuda().to(torch.bfloat16).eval()
    opt = fxfuse.optimize(model)
    x = torch.randn(16384, 256, device="cuda", dtype=torch.bfloat16)
    out_bytes = 16384 * 512 * 2 * 2  # the gated stage's output, the largest tensor of a call
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        y = opt(x)  # times the candidates (hundreds of launches), recording
        assert rel_err(y, model(x)) < 1e-2
    del y
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 4 * out_bytes
    assert torch.cuda.max_memory_allocated() - before < 64 * out_bytes
    replay.forget_all()


def test_bound_key_follows_what_a_bound_launch_depends_on():
    w, b = torch.randn(8, 8), torch.randn(8)
    x = torch.randn(3, 8)
    key = fastlaunch.bound_key("a0", x, [w], [b], [])
    assert fastlaunch.bound_key("a0", torch.randn(3, 8), [w], [b], []) == key  # a new input of the same layout
    assert fastlaunch.bound_key("a0", x, [w.clone()], [b], []) != key  # a new weight storage
    assert fastlaunch.bound_key("a0", x, [w.t()], [b], []) != key  # same storage, other strides
    assert fastlaunch.bound_key("a0", x.half(), [w.half()], [b.half()], []) != key  # dtype
    assert fastlaunch.bound_key("a0", torch.randn(4, 8), [w], [b], []) != key  # rows
    assert fastlaunch.bound_key("relu(a0)", x, [w], [b], []) != key  # another kernel
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not old  # fp32 launches compile the precision in
        assert fastlaunch.bound_key("a0", x, [w], [b], []) != key
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class _FakeCudaLauncher:
    """The attributes of Triton 3.6's ``CudaLauncher`` that the direct launch reads; records each C launch."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.calls = []
        self.launch = lambda *a: self.calls.append(a)

    def __call__(self, *a):  # the Python path the direct launch skips
        raise AssertionError("went through CudaLauncher.__call__")


def test_the_deterministic_algorithms_flag_keys_replays_and_their_sites(deterministic):
    # Choices made with torch.use_deterministic_algorithms on are their own (fxfuse.strategy, fxfuse.stages): a
    # replay recorded with the flag off must not run once it is on, nor a shape marked unreplayable stay so.
    w, x = torch.randn(4, 3), torch.randn(2, 3)
    off = replay.replay_key(x, [w], [], [], "1:a0")
    replay.will_not_replay("1:a0", x)
    try:
        with deterministic():
            on = replay.replay_key(x, [w], [], [], "1:a0")
            assert replay.may_replay("1:a0", x)
        assert off != on and off[:-1] == on[:-1] and (off[-1], on[-1]) == (False, True)
        assert not replay.may_replay("1:a0", x)
    finally:
        replay.forget_all()


def test_direct_launch_calls_the_known_c_layout_and_falls_back_otherwise(monkeypatch):
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", fastlaunch._KNOWN_LAUNCH_FORMAT, raising=False)
    run = _FakeCudaLauncher()
    direct = fastlaunch._direct_launch(run)
    direct(4, 1, 1, "stream", "fn", "packed", None, None, None, "x", 7)
    assert run.calls == [(4, 1, 1, "stream", "fn", False, True, None, None, "packed", None, None, None, "x", 7)]
    assert direct.raw == (run.launch, False, True)
    with_scratch = _FakeCudaLauncher(global_scratch_size=128)  # the Python path allocates it: keep that path
    assert fastlaunch._direct_launch(with_scratch) is with_scratch
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKOOOO", raising=False)  # another Triton's layout
    assert fastlaunch._direct_launch(run) is run


def test_an_output_step_allocates_like_its_input_when_the_layouts_match():
    seen = []

    def bound(h, out):
        seen.append(out)
        out.copy_(h[:, : out.shape[1]] * 2)

    x = torch.randn(2, 8)
    step = fastlaunch.output_step(bound, 2, 8, x.dtype, x.device, x)
    assert step.__name__ == "step_like"
    y = step(torch.randn(2, 8))
    assert y.shape == (2, 8) and y.stride() == (8, 1) and y.dtype == x.dtype
    wide = fastlaunch.output_step(bound, 2, 4, x.dtype, x.device, x)  # another output width: a sized torch.empty
    assert wide.__name__ == "step" and wide(x).shape == (2, 4)
    strided = torch.randn(8, 2).t()  # the output's shape, not its strides
    assert fastlaunch.output_step(bound, 2, 8, x.dtype, x.device, strided).__name__ == "step"
    assert fastlaunch.output_step(bound, 2, 8, torch.float16, x.device, x).__name__ == "step"


def test_each_thread_records_its_own_launches():
    """Two threads recording their first calls at once (a server's pool): neither takes the other's steps, and
    each ends with no recording open."""
    barrier, got = threading.Barrier(2), {}

    def record(name):
        with fastlaunch.recording() as steps:
            barrier.wait()
            fastlaunch.record(name)
            barrier.wait()
        got[name] = (steps, fastlaunch.recording_open())

    threads = [threading.Thread(target=record, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"a": (["a"], False), "b": (["b"], False)}
