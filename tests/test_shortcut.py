"""Shortcuts: a one-region host method calls its region's replay directly while every check of the full path holds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_ops import rel_err
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxfuse
from fxfuse import replay, shortcut
from fxfuse.autocast import weight_casts
from fxfuse.lift import lift_params


class GPT2MLP(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Gated(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Residual(GPT2MLP):
    def forward(self, x):
        return x + super().forward(x)


def lifted_graph(model: nn.Module):
    (_, gm), = fxfuse.install.fused_graphs(fxfuse.optimize(model))
    return lift_params(gm)


def test_region_call_finds_the_region_among_the_lifted_parameters():
    gm, paths = lifted_graph(GPT2MLP())
    call = shortcut.region_call(gm)
    assert [paths[i] for i in call.weights] == ["fc1.weight", "fc2.weight"]
    assert [paths[i] for i in call.biases] == ["fc1.bias", "fc2.bias"] and call.operands == ()
    gm, paths = lifted_graph(Gated())
    call = shortcut.region_call(gm)
    assert sorted(paths[i] for i in call.weights) == ["down.weight", "gate.weight", "up.weight"]
    assert call.biases == () and "silu" in call.spec


def test_a_graph_with_more_than_the_region_has_no_shortcut():
    gm, _ = lifted_graph(Residual())
    assert shortcut.region_call(gm) is None
    opt = fxfuse.optimize(Residual())
    assert not any(k.startswith("_fxfuse_shortcut") for k in vars(opt))
    opt = fxfuse.optimize(GPT2MLP())
    assert isinstance(vars(opt)["_fxfuse_shortcut_forward"], shortcut.Shortcut)


def dynamo_graph(model: nn.Module, x: torch.Tensor):
    """Dynamo's graph of ``model`` (no grad mode), fused as the compile backend fuses it."""
    from fxfuse.pipeline import fuse_graph

    graphs = []

    def keep(gm, example_inputs):
        fuse_graph(gm)
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=keep)(x)
    finally:
        torch._dynamo.reset()
    (gm,) = graphs
    return gm


def test_graph_region_finds_the_region_among_a_dynamo_graphs_arguments():
    gm = dynamo_graph(GPT2MLP().eval(), torch.randn(2, 64))
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    region = shortcut.graph_region(gm)
    assert region.tupled and names[region.x] == "L_x_"
    assert [names[i] for i in region.call.weights] == ["L_self_modules_fc1_parameters_weight_",
                                                       "L_self_modules_fc2_parameters_weight_"]
    assert [names[i] for i in region.call.biases] == ["L_self_modules_fc1_parameters_bias_",
                                                      "L_self_modules_fc2_parameters_bias_"]
    assert shortcut.region_call(gm) is None  # (a lifted graph's form: x first, the output alone)
    assert shortcut.graph_region(dynamo_graph(Residual().eval(), torch.randn(2, 64))) is None


def _learned(model: GPT2MLP, x: torch.Tensor, calls: list, autocast_free: bool = False, run=None):
    """A Shortcut with an entry learned by hand for x (a CPU stand-in for a recorded replay) and the extra
    arguments the host method would pass."""
    gm, paths = lift_params(fxfuse.install.fused_graphs(fxfuse.optimize(model))[0][1])
    call = shortcut.region_call(gm)
    extra = [model.get_parameter(p) for p in paths]

    def model_run(h):
        calls.append(h)
        return model(h)

    sc = shortcut.Shortcut(call, autocast_free)
    tensors = tuple(extra[i] for i in call.weights + call.biases + call.operands)
    key = ("test", "shortcut", id(sc))
    replay.replays[key] = run or model_run
    sc.entries[x.shape] = shortcut._entry(call, sc._tensors, x, tensors, key, run or model_run, autocast_free)
    return sc, paths


def test_an_entry_runs_its_replay_only_while_every_check_holds(deterministic):
    model = GPT2MLP().eval()
    x = torch.randn(2, 64)
    calls: list = []
    sc, paths = _learned(model, x, calls)

    def extra():
        return [model.get_parameter(p) for p in paths]

    with torch.no_grad():
        fresh = torch.randn(2, 64)
        torch.testing.assert_close(sc(fresh, extra()), model(fresh))
        assert calls[-1] is fresh and sc.hits == 1
        assert sc(torch.randn(3, 64), extra()) is None  # another shape: no entry
        assert sc(torch.randn(64, 2).t(), extra()) is None  # same shape, other strides
        assert sc(torch.randn(2, 64, dtype=torch.float64), extra()) is None
        assert sc(torch.randn(2, 64)[:, :64], extra()) is not None  # the same layout (a full view)
        assert sc([1, 2], extra()) is None  # not a tensor
        with torch.autocast("cpu"):  # a host method that runs under autocast: the region follows autocast
            assert _learned(model, x, [], autocast_free=True)[0](x, extra()) is None
        assert sc(x.clone(), extra()) is not None
        with deterministic():  # the flag's choices are their own (a replay's key has it)
            assert sc(x.clone(), extra()) is None

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Watch():  # something watches the ops: it must see them
            assert sc(x.clone(), extra()) is None
        kept = torch.randn(4, 4)
        weight_casts.get(kept, torch.float16)  # autocast casts kept from an earlier call (while ``kept`` lives)
        try:
            assert sc(x.clone(), extra()) is None
        finally:
            weight_casts.clear()
        model.fc1.weight.data = model.fc1.weight.data.clone()  # a moved parameter
        assert sc(x.clone(), extra()) is None
    # parameters require gradients: with grad mode on the call must record them
    sc, _ = _learned(model, x, calls)
    assert sc(x.clone(), extra()) is None
    with torch.no_grad():
        assert sc(x.clone(), extra()) is not None
        replay.replays[("test", "another")] = None  # adding a replay keeps the entries
        assert sc(x.clone(), extra()) is not None
        replay.replays.pop(("test", "another"))  # dropping one may have dropped a choice: learn again
        assert sc(x.clone(), extra()) is None
    replay.forget_all()


def test_an_entry_whose_replay_lost_a_tensor_drops_it_and_takes_the_full_path():
    model = GPT2MLP().eval()
    x = torch.randn(2, 64)

    def gone(h):
        raise ReferenceError("a tensor of a replayed stage was freed")

    sc, paths = _learned(model, x, [], run=gone)
    extra = [model.get_parameter(p) for p in paths]
    (key,) = [k for k in replay.replays if k[:2] == ("test", "shortcut")]
    with torch.no_grad():
        assert sc(x.clone(), extra) is None
    assert key not in replay.replays
    replay.forget_all()


def test_a_copied_module_learns_its_own_entries():
    opt = fxfuse.optimize(GPT2MLP())
    sc = opt._fxfuse_shortcut_forward
    sc.entries[torch.Size([1])] = lambda x, extra: None
    assert copy.deepcopy(opt)._fxfuse_shortcut_forward.entries == {}
    assert copy.copy(sc).entries == {} and copy.copy(sc).call == sc.call


def test_no_entry_is_learned_without_a_replay():
    opt = fxfuse.optimize(GPT2MLP())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 64)
            torch.testing.assert_close(opt(x), opt._fxfuse_original_class.forward(opt, x))
    assert opt._fxfuse_shortcut_forward.entries == {}  # no replays on the CPU


@pytest.mark.gpu
@pytest.mark.parametrize("model_cls", [GPT2MLP, Gated])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_calls_take_the_shortcut_and_follow_every_change(model_cls, dtype, no_tf32, untrained_specs):
    """(``untrained_specs``: the backward below marks these specs trained for the process, which would change how
    later tests' regions of the same spec run.)"""
    replay.forget_all()
    model = model_cls(256, 1024).cuda().to(dtype).eval()
    opt = fxfuse.optimize(model)
    sc = opt._fxfuse_shortcut_forward
    tol = 1e-2 if dtype is not torch.float32 else 1e-4

    def check(x):
        assert rel_err(opt(x), model(x)) < tol

    def fresh(m=1):
        return torch.randn(m, 256, device="cuda", dtype=dtype)

    with torch.no_grad():
        for _ in range(4):  # the first call plans and records, the second replays and learns, then shortcuts
            check(fresh())
        assert sc.hits >= 2 and torch.Size([1, 256]) in sc.entries
        for _ in range(3):  # a second shape has its own entry
            check(fresh(4))
        assert len(sc.entries) == 2
        first = next(iter(model.parameters()))
        first.mul_(-1.0)  # in place: the same addresses, the new values
        check(fresh())
        first.data = first.data.clone() * 0.5  # moved: the entry's addresses fail, the full path runs
        hits = sc.hits
        check(fresh())
        check(fresh())
        check(fresh())
        assert sc.hits > hits  # learned again for the new address
        replay.forget_all()  # every replay dropped: no shortcut until one is recorded again
        hits = sc.hits
        check(fresh())
        assert sc.hits == hits
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # another stream: its own replay
            x = fresh()
            side.wait_stream(torch.cuda.default_stream())
            for _ in range(3):
                check(x)
        torch.cuda.synchronize()
    x = fresh()
    y = opt(x)  # grad mode on, parameters require gradients: the call records them
    assert y.requires_grad
    y.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    hits = sc.hits
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # the region follows autocast
        x = fresh()
        assert rel_err(opt(x), model(x)) < 2e-2
    assert sc.hits == hits
    replay.forget_all()
