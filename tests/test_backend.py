"""torch.compile(model, backend="fxfuse"): found by name, fuses Dynamo's graph, runs correctly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from models import GPT2MLP, Block, Conv1DMLP, GatedMLP

import fxfuse


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_backend_found_by_name_without_importing_fxfuse():
    code = textwrap.dedent("""
        import sys, torch
        from torch._dynamo.backends.registry import lookup_backend
        fn = lookup_backend("fxfuse")
        print(fn.__module__, "fxfuse" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["fxfuse.backend", "True"]  # imported by the entry point, not by us


@pytest.mark.parametrize("model", [GPT2MLP(), GatedMLP()], ids=["gpt2", "swiglu"])
def test_backend_without_inductor_fuses_dynamo_graph(model):
    model.eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse", options={"inductor": False})
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.report(compiled).num_fused == before + 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_backend_fuses_gpt2s_conv1d_mlp_whose_views_dynamo_writes_as_numbers(dynamic):
    """HF Conv1D's ``x.size()[:-1] + (nf,)`` reaches the backend as ``view((2, 7, 128))`` or, with dynamic dims,
    ``view(torch.Size([s0, s1, 128]))``: the guarded numbers restore x's leading dims, so the views fold."""
    model = Conv1DMLP().eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse", options={"inductor": False}, dynamic=dynamic)
    with torch.no_grad():
        for shape in [(2, 7, 32), (3, 5, 32)]:
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.report(compiled).num_fused > before


def test_recompiles_of_one_frame_report_its_regions_once():
    """New shapes (without dynamic dims) and another grad mode recompile the frame: its region is still one."""
    model = GPT2MLP().eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse", options={"inductor": False}, dynamic=False)
    with torch.no_grad():
        for rows in (2, 3, 5):
            compiled(torch.randn(rows, 32))
    compiled(torch.randn(2, 32))  # (grad mode on: another graph)
    assert fxfuse.report(compiled).num_fused == before + 1


def test_a_reset_drops_the_reports_of_the_graphs_it_dropped():
    compiled = torch.compile(GPT2MLP().eval(), backend="fxfuse", options={"inductor": False})
    with torch.no_grad():
        compiled(torch.randn(2, 32))
    assert fxfuse.report(compiled).num_fused >= 1
    torch._dynamo.reset()
    assert fxfuse.report(compiled).num_fused == 0


def test_backend_with_inductor_default():
    model = GPT2MLP().eval()
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.fixture
def inductor_graphs(monkeypatch):
    """The call_function targets of each graph the backend hands to Inductor (which still compiles it)."""
    import torch._inductor.compile_fx as inductor

    graphs = []
    compile_fx = inductor.compile_fx

    def spy_compile(gm, example_inputs, **kwargs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return compile_fx(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", spy_compile)
    return graphs


def test_backend_hands_inductor_opaque_region_calls(inductor_graphs, monkeypatch):
    # Inductor would trace into the triton_op with fake tensors (untimed strategy, no replay, workspaces as fresh
    # zeros kernels): it gets opaque calls instead (fxfuse.mlp_infer without grad mode), which run fxfuse's
    # runtime at run time.
    from fxfuse import ops

    dispatched = []
    dispatch = ops._dispatch

    def spy_dispatch(*args):
        dispatched.append(type(args[0]))
        return dispatch(*args)

    monkeypatch.setattr(ops, "_dispatch", spy_dispatch)
    model = Block().eval()  # (norms, a residual and a softmax around the MLP: Inductor compiles those)
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(inductor_graphs) == 1
    assert inductor_graphs[0].count(torch.ops.fxfuse.mlp_infer.default) == 1
    assert not any(is_region_target(t) for t in inductor_graphs[0] if t is not torch.ops.fxfuse.mlp_infer.default)
    assert torch.Tensor in dispatched  # fxfuse's runtime ran on the real input, not only on fake tensors


def is_region_target(target) -> bool:
    from fxfuse import ops

    return target in ops.FUSED_TARGETS or target in (torch.ops.fxfuse.mlp_extern.default,
                                                     torch.ops.fxfuse.mlp_graphed.default)


def test_backend_frozen_region_in_a_grad_graph_is_differentiable(inductor_graphs):
    # Grad mode on, frozen weights: the region is fused as fxfuse.mlp_extern, whose autograd gives x's gradient.
    model = Block().eval().requires_grad_(False)
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled(x).square().sum().backward()
    model(x_ref).square().sum().backward()
    assert len(inductor_graphs) == 1 and torch.ops.fxfuse.mlp_extern.default in inductor_graphs[0]
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", [GPT2MLP(), GatedMLP()], ids=["gpt2", "swiglu"])
def test_backend_runs_a_graph_of_regions_only_without_inductor(model, inductor_graphs):
    # Nothing but the region (an MLP compiled on its own): Inductor would only wrap its call, so the graph runs as
    # it is, with or without grad mode (frozen weights: the region's own autograd gives x's gradient).
    from fxfuse.backend import only_regions

    model.eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert inductor_graphs == []
    assert fxfuse.report(compiled).num_fused == before + 1
    model.requires_grad_(False)
    x = torch.randn(3, 5, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled(x).square().sum().backward()
    model(x_ref).square().sum().backward()
    assert inductor_graphs == []
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    gm = torch.fx.symbolic_trace(Block())
    assert not only_regions(gm)  # (no region at all)


def test_opaque_ops_match_the_op_and_pass_opcheck():
    import fxfuse.extern  # noqa: F401  (registers the ops: the backend imports it when it compiles)

    x = torch.randn(3, 8, requires_grad=True)
    w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    b1 = torch.randn(16, requires_grad=True)
    args = (x, [w1, w2], [b1], [], "1b:gelu_tanh(a0);1:a0")
    out = torch.ops.fxfuse.mlp_extern(*args)
    ref = torch.ops.fxfuse.mlp(*args)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (x, w1, w2, b1))
    grads_ref = torch.autograd.grad(ref.square().sum(), (x, w1, w2, b1))
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r)
    torch.library.opcheck(torch.ops.fxfuse.mlp_extern.default, args)
    plain = (x.detach(), [w1.detach(), w2.detach()], [b1.detach()], [], args[-1])
    for op in (torch.ops.fxfuse.mlp_infer, torch.ops.fxfuse.mlp_graphed):
        torch.testing.assert_close(op(*plain), ref.detach())
        torch.library.opcheck(op.default, plain)


def test_backend_leaves_training_graphs_to_inductor():
    # Compiled with grad mode on, AOTAutograd differentiates the graph: Inductor's backward keeps the
    # intermediates, where the op's would recompute the forward. The no_grad graph (its own Dynamo graph,
    # guarded on grad mode) is fused.
    model = GatedMLP().train()
    compiled = torch.compile(model, backend="fxfuse")
    before = fxfuse.report().num_fused
    x = torch.randn(4, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    compiled(x).square().sum().backward()
    report = fxfuse.report(compiled)
    assert report.num_fused == before
    assert any("gradients are recorded" in r.reason for r in report.rejections)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.report(compiled).num_fused == before + 1


class _NoGradForward(torch.nn.Module):
    """An inference forward decorated with ``torch.no_grad()`` (compiled while grad mode is on)."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)
        self.mlp = GatedMLP()

    @torch.no_grad()
    def forward(self, x):
        return self.mlp(self.ln(x)) + x


class _Teacher(torch.nn.Module):
    """A training step's forward: a student trains, a teacher MLP runs under ``torch.no_grad()``."""

    def __init__(self):
        super().__init__()
        self.student = torch.nn.Linear(32, 32)
        self.teacher = GPT2MLP().eval()

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x)
        return self.student(x) + target


def test_backend_fuses_chains_under_no_grad_inside_a_graph_compiled_with_grad(inductor_graphs):
    # Grad mode is on when Dynamo hands the graph over, but these chains record no gradients (Dynamo's fake values
    # say so): they are fused, as fxfuse.mlp_infer, not left to Inductor as if they trained.
    model = _NoGradForward().eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert fxfuse.report().num_fused == before + 1
    assert inductor_graphs[-1].count(torch.ops.fxfuse.mlp_infer.default) == 1
    torch._dynamo.reset()
    model = _Teacher()
    compiled = torch.compile(model, backend="fxfuse")
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.student.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, p in zip(grads, model.student.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    assert model.teacher.c_fc.weight.grad is None
    assert fxfuse.report().num_fused == 1  # (the teacher's: the reset dropped the first graph and its report)
    assert inductor_graphs[-1].count(torch.ops.fxfuse.mlp_infer.default) == 1
    report = fxfuse.report(compiled)
    assert not [n for r in report.regions[-2:] for n in r.notes if n.startswith("training")]  # (nothing trains)


class _GradInside(torch.nn.Module):
    """Compiled without grad mode, it turns grad mode on around its MLP (a gradient asked for inside inference)."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)
        self.mlp = GPT2MLP().eval()

    def forward(self, x):
        with torch.enable_grad():
            return self.mlp(self.ln(x)) * 2


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_backend_differentiates_chains_under_enable_grad_inside_a_no_grad_graph(frozen, inductor_graphs):
    # The chain records gradients although the graph was compiled under no_grad: a trained chain stays Inductor's
    # (fxfuse.mlp_infer has no autograd: its weights' gradients were lost), a frozen one is fxfuse.mlp_extern,
    # whose autograd gives x's gradient.
    model = _GradInside().requires_grad_(not frozen)
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32, requires_grad=True)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    wrt = [x] if frozen else [x, model.mlp.c_fc.weight, model.mlp.c_proj.bias]
    for g, r in zip(torch.autograd.grad(out.sum(), wrt), torch.autograd.grad(ref.sum(), wrt)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    targets = inductor_graphs[-1]
    assert torch.ops.fxfuse.mlp_infer.default not in targets
    assert targets.count(torch.ops.fxfuse.mlp_extern.default) == (1 if frozen else 0)


def test_report_finds_model_compile_and_compiled_forward():
    model = GatedMLP().eval()
    model.compile(backend="fxfuse")
    with torch.no_grad():
        model(torch.randn(2, 32))
    assert fxfuse.report(model).num_fused >= 1
    assert fxfuse.report(torch.compile(GPT2MLP().forward, backend="fxfuse")).num_fused >= 1
    with pytest.raises(ValueError, match="not produced"):
        fxfuse.report(GPT2MLP())


def test_backend_says_why_autocast_chains_are_not_fused():
    # Under autocast Dynamo records the casts as the linears' dtypes: the chain runs as Inductor compiles it, and
    # the reason says autocast, not only which dtypes disagree.
    model = GatedMLP().eval()
    compiled = torch.compile(model, backend="fxfuse")
    x = torch.randn(4, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = compiled(x), model(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    reason = fxfuse.report(compiled).rejections[-1].reason
    assert reason.startswith("dtypes disagree") and "autocast" in reason


def test_backend_says_once_that_cpu_regions_run_their_original_ops(monkeypatch, caplog):
    # Without the interpreter a CPU region's opaque call runs the original ops: the report calls it fused, so the
    # log says what runs (once), as the op's own fallbacks do.
    import logging

    from fxfuse import ops

    monkeypatch.setattr(ops, "_interpreting", lambda: False)
    monkeypatch.setattr(ops, "_logged_fallbacks", set())
    model = Block().eval()
    compiled = torch.compile(model, backend="fxfuse")
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fxfuse.extern"):
        for rows in (4, 4, 6):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    said = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert said == ["fxfuse.mlp falls back to the reference ops: cpu tensors run the reference ops (the kernels need "
                    "CUDA)"]


def test_inductor_options_reach_inductor(monkeypatch):
    # torch.compile(..., options=...) hands a custom backend the dict: Inductor's settings in it go on to Inductor,
    # as backend="inductor" would apply them, beside the fused regions.
    import torch._inductor.compile_fx as inductor

    patches = []
    compile_fx = inductor.compile_fx

    def spy_compile(gm, example_inputs, **kwargs):
        patches.append(kwargs.get("config_patches"))
        return compile_fx(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", spy_compile)
    model = Block().eval()
    before = fxfuse.report().num_fused
    compiled = torch.compile(model, backend="fxfuse", options={"epilogue_fusion": False})
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert patches[0] == {"epilogue_fusion": False}  # (compile_fx then calls itself with them applied)
    assert fxfuse.report(compiled).num_fused == before + 1


def test_inductor_options_without_inductor_are_a_clear_error():
    compiled = torch.compile(GPT2MLP().eval(), backend="fxfuse", options={"inductor": False, "max_autotune": True})
    with pytest.raises(Exception, match="max_autotune.*without Inductor"):
        compiled(torch.randn(2, 32))


def test_a_non_bool_inductor_option_is_a_clear_error():
    compiled = torch.compile(GPT2MLP().eval(), backend="fxfuse", options={"inductor": "false"})
    with pytest.raises(Exception, match="True or False"):
        compiled(torch.randn(2, 32))


def test_unknown_backend_option_is_a_clear_error():
    compiled = torch.compile(GPT2MLP().eval(), backend="fxfuse", options={"inductr": False})
    with pytest.raises(Exception, match="inductr"):
        compiled(torch.randn(2, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("kind", ["block", "mlp"])  # (block: under Inductor; mlp: the graph runs as it is)
def test_backend_with_inductor_replays_decode_regions(rows, kind, monkeypatch):
    # The region runs fxfuse's runtime: planned at the first call on real tensors, then replayed.
    from fxfuse import backend, replay, shortcut

    made = []

    class Kept(shortcut.Shortcut):  # (the graph's shortcut, for its hits)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(backend, "Shortcut", Kept)
    model = (Block if kind == "block" else GPT2MLP)(1024, 4096).cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="fxfuse")
    before = set(replay.replays)
    with torch.no_grad():
        for _ in range(4):  # (plan, replay and learn, then shortcut calls where the graph is the region alone)
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            out, ref = compiled(x), model(x)
            assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
    assert set(replay.replays) - before, "the region was not replayed"
    assert [sc.hits >= 2 for sc in made] == ([True] if kind == "mlp" else [])


@pytest.mark.gpu
@pytest.mark.parametrize("inductor", [True, False])
def test_backend_on_gpu(inductor):
    model = GatedMLP(256, 768).cuda().to(torch.bfloat16).eval()
    x = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="fxfuse", options={"inductor": inductor})
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


def test_only_the_graphed_op_is_captured_by_inductors_cuda_graphs():
    # mlp_graphed's warm-up calls keep their lasting state off the graphs' pool (fxfuse.graph_pool); the others,
    # should CUDA graphs cover them, are called between graphs.
    for op in (torch.ops.fxfuse.mlp_infer.default, torch.ops.fxfuse.mlp_extern.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op
    assert torch.Tag.cudagraph_unsafe not in torch.ops.fxfuse.mlp_graphed.default.tags


def test_backend_with_reduce_overhead_hands_inductor_graphed_calls(inductor_graphs):
    model = GatedMLP().eval()
    compiled = torch.compile(model, backend="fxfuse", mode="reduce-overhead")
    x = torch.randn(4, 32)
    with torch.no_grad():  # (on the CPU Inductor skips CUDA graphs: the op runs plainly)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    # (compile_fx with config patches calls itself once more inside them: the same graph twice)
    assert inductor_graphs and all(g == [torch.ops.fxfuse.mlp_graphed.default] for g in inductor_graphs)


def test_nothing_warms_up_into_a_graph_pool_on_the_cpu():
    from fxfuse.graph_pool import warming_up_into_pool

    assert not warming_up_into_pool(torch.device("cpu"))


def test_unknown_cudagraph_trees_count_as_a_warm_up(monkeypatch):
    # Another torch's trees, whose state cannot be read: the call takes the safe side (off the pool), logged once.
    import types

    from fxfuse import graph_pool

    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(graph_pool, "_unknown_trees", [])
    assert graph_pool.warming_up_into_pool(torch.device("cuda", 0))
    assert graph_pool.warming_up_into_pool(torch.device("cuda", 0))
    assert len(graph_pool._unknown_trees) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("kind", ["block", "mlp"])  # (mlp: the region's result is the graph's output)
def test_backend_with_reduce_overhead_captures_the_regions(rows, kind, monkeypatch):
    # The whole step is one CUDA graph: the region's kernels are captured with the norms around them. Its first
    # call (the trees' warm-up) plans on fxfuse's helper thread, off the graphs' pool; the trees' own asserts
    # check that pool after each warm-up and recording.
    import threading

    from fxfuse import extern

    monkeypatch.setattr(torch._inductor.config.triton, "slow_path_cudagraph_asserts", True)
    threads = []
    run = extern._run

    def spy_run(*args):
        threads.append(threading.current_thread().name)
        return run(*args)

    monkeypatch.setattr(extern, "_run", spy_run)
    model = (Block if kind == "block" else GPT2MLP)(1024, 4096).cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="fxfuse", mode="reduce-overhead")
    with torch.no_grad():
        for step in range(6):  # (cudagraph trees warm up, then record, then replay)
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            out, ref = compiled(x).clone(), model(x)
            assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2, step
    assert len(threads) == 2, threads  # the warm-up and the recording; the replays run no Python
    assert threads[0].startswith("fxfuse-warmup") and not threads[1].startswith("fxfuse-warmup")
    with torch.no_grad():  # another row count: another graph (warm-up, recording), the first one still replays
        for step, m in enumerate([2 * rows, rows, 2 * rows, 2 * rows, rows]):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            out, ref = compiled(x).clone(), model(x)
            assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2, (m, step)


@pytest.mark.gpu
def test_off_pool_runs_on_the_callers_stream_without_grad():
    import threading

    from fxfuse.graph_pool import off_pool

    side = torch.cuda.Stream()
    x = torch.randn(4, device="cuda", requires_grad=True)
    seen = []

    def double(t):
        seen.extend([threading.current_thread().name, torch.cuda.current_stream().cuda_stream,
                     torch.is_grad_enabled()])
        return t * 2

    with torch.cuda.stream(side):
        out = off_pool(double, x)
        torch.testing.assert_close(out, x.detach() * 2)
    assert seen[0].startswith("fxfuse-warmup") and seen[1:] == [side.cuda_stream, False]
    with pytest.raises(ZeroDivisionError):  # the helper's exception reaches the caller
        off_pool(lambda t: 1 / 0, x)


