"""Matching and planning: built-in and user patterns on symbolic_trace graphs and on the graph Dynamo gives a
backend; safety rejections with reasons; merging into chains; speed (CPU only, structure not numerics)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from models import dynamo_graph
from torch.fx.passes.shape_prop import ShapeProp

import fxfuse
from fxfuse import epilogue as ep
from fxfuse.normalize import is_linear, normalize
from fxfuse.pattern import all_patterns, compile_pattern, pointwise, register_pattern, registered, unregister_pattern
from fxfuse.plan import find_regions

FORMS = ["symbolic", "symbolic_noshapes", "dynamo"]


def capture(model: nn.Module, *inputs):
    return dynamo_graph(model, *inputs)[0]


def graph_of(model: nn.Module, form: str, *inputs) -> fx.GraphModule:
    if form == "dynamo":
        gm = capture(model, *inputs)
    else:
        gm = fx.symbolic_trace(model)
        if form == "symbolic":
            ShapeProp(gm).propagate(*inputs)
    normalize(gm)
    return gm


def plan(model, form, *inputs, patterns=None):
    gm = graph_of(model, form, *inputs)
    regions, rejections = find_regions(gm, patterns)
    gm.graph.lint()
    return gm, regions, rejections


def canon(text: str) -> str:
    return str(ep.canonicalize(ep.parse(text))[0])


def epilogues(region) -> list[str]:
    return [s.epilogue for s in region.spec.stages]


def assert_region_invariants(regions):
    seen = set()
    for r in regions:
        assert not (seen & set(r.nodes)), "regions overlap"
        seen |= set(r.nodes)
        order = {n: i for i, n in enumerate(r.output.graph.nodes)}
        assert [order[n] for n in r.nodes] == sorted(order[n] for n in r.nodes)
        assert r.nodes[-1] is r.output and is_linear(r.output)
        assert r.weights == [n.args[1] for n in r.nodes if is_linear(n)] or r.spec.is_gated
        assert len(r.weights) == len(r.biases) == r.spec.num_linears
        assert len(r.operands) == r.spec.num_operands
        lins = [n for n in r.nodes if is_linear(n)]
        assert r.input is lins[0].args[0]


# --------------------------------------------------------------------------------------- built-in patterns

class MLP(nn.Module):
    def __init__(self, act, bias=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32, bias=bias), nn.Linear(32, 8, bias=bias)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


ACTS = [
    ("relu", nn.ReLU(), "relu(a0)"),
    ("gelu", nn.GELU(), "gelu(a0)"),
    ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh"), "gelu_tanh(a0)"),
    ("silu", F.silu, "silu(a0)"),
    ("sigmoid", torch.sigmoid, "sigmoid(a0)"),
    ("tanh", nn.Tanh(), "tanh(a0)"),
    ("leaky_relu", nn.LeakyReLU(0.1), "leaky_relu(a0,0.1)"),
    ("quick_gelu", lambda h: h * torch.sigmoid(1.702 * h), "mul(a0,sigmoid(mul(1.702,a0)))"),
    ("squared_relu", lambda h: torch.relu(h) ** 2, "pow(relu(a0),2.0)"),
    ("relu6", nn.ReLU6(), "hardtanh(a0,0.0,6.0)"),
    ("siren", lambda h: torch.sin(30 * h), "sin(mul(30.0,a0))"),
]


@pytest.mark.parametrize("name,act,expected", ACTS, ids=[a[0] for a in ACTS])
@pytest.mark.parametrize("form", FORMS)
def test_mlp_activations(name, act, expected, form):
    model = MLP(act).eval()
    gm, regions, rejections = plan(model, form, torch.randn(4, 8))
    assert not rejections
    (r,) = regions
    assert r.pattern == "mlp" and r.strategy == "gemm_epilogue"
    assert epilogues(r) == [canon(expected), "a0"]
    assert [s.num_linears for s in r.spec.stages] == [1, 1]
    fc1, fc2 = [n for n in gm.graph.nodes if is_linear(n)]
    assert r.output is fc2 and r.nodes[0] is fc1
    assert r.weights == [fc1.args[1], fc2.args[1]] and r.biases == [fc1.args[2], fc2.args[2]]
    assert r.module_path == ""
    assert_region_invariants(regions)


class Gated(nn.Module):
    def __init__(self, act, order):
        super().__init__()
        self.gate, self.up = nn.Linear(8, 32, bias=False), nn.Linear(8, 32, bias=False)
        self.down = nn.Linear(32, 8, bias=False)
        self.act, self.order = act, order

    def forward(self, x):
        g, u = self.act(self.gate(x)), self.up(x)
        return self.down(g * u if self.order == "gate_first" else u * g)


@pytest.mark.parametrize("act,expected", [(F.silu, "mul(a0,silu(a1))"),
                                          (lambda h: F.gelu(h, approximate="tanh"), "mul(a0,gelu_tanh(a1))"),
                                          (F.gelu, "mul(a0,gelu(a1))")], ids=["swiglu", "geglu_tanh", "geglu"])
@pytest.mark.parametrize("order", ["gate_first", "up_first"])
@pytest.mark.parametrize("form", FORMS)
def test_gated(act, expected, order, form):
    model = nn.Sequential()
    model.add_module("mlp", Gated(act, order))
    gm, regions, rejections = plan(model, form, torch.randn(4, 8))
    assert not rejections
    (r,) = regions
    assert r.pattern == "gated_mlp" and r.strategy == "gated_gemm_epilogue"
    assert epilogues(r) == [expected, "a0"] and r.spec.stages[0].num_linears == 2
    assert r.module_path == "mlp"
    # a0 is the up projection (canonical order), a1 the gate: weights follow that order
    names = [w.target if w.op == "get_attr" else w.name for w in r.weights]
    assert "up" in names[0] and "gate" in names[1] and "down" in names[2]
    assert r.biases == [None, None, None]
    assert_region_invariants(regions)


class Chain(nn.Module):
    def __init__(self, n=4, act=nn.ReLU):
        super().__init__()
        layers = []
        for i in range(n):
            layers.append(nn.Linear(8, 8))
            if i < n - 1:
                layers += [act(), nn.Dropout(0.2)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("form", FORMS)
def test_four_layer_chain_with_eval_dropout(form):
    gm, regions, rejections = plan(Chain().eval(), form, torch.randn(4, 8))
    assert not rejections
    (r,) = regions
    assert epilogues(r) == ["relu(a0)", "relu(a0)", "relu(a0)", "a0"]
    lins = [n for n in gm.graph.nodes if is_linear(n)]
    assert [n for n in r.nodes if is_linear(n)] == lins and r.output is lins[-1]
    assert len(r.nodes) == 7 and r.module_path == "net"
    assert_region_invariants(regions)


@pytest.mark.parametrize("form", ["symbolic", "dynamo"])
def test_chain_stops_where_intermediate_is_shared(form):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.b(torch.relu(self.a(x)))
            return self.c(torch.relu(h)), h  # b's output is also returned

    gm, regions, rejections = plan(M(), form, torch.randn(4, 8))
    (r,) = regions
    assert epilogues(r) == ["relu(a0)", "a0"] and r.output.meta["fxfuse_module_path"] == "b"
    assert len(rejections) == 1 and rejections[0].reason.startswith("intermediate used elsewhere")


# ------------------------------------------------------------------------------------------ negative cases

class Shared(MLP):
    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(h), h.sum()


class Erfinv(MLP):
    def forward(self, x):
        return self.fc2(torch.erfinv(torch.tanh(self.fc1(x)) * 0.5))


class DropoutTrain(MLP):
    def __init__(self):
        super().__init__(nn.ReLU())
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


NEGATIVE = [
    ("shared", lambda: Shared(nn.ReLU()), torch.float32, "intermediate used elsewhere"),
    ("erfinv", lambda: Erfinv(nn.ReLU()), torch.float32, "unsupported op in the middle: torch.erfinv"),
    ("float64", lambda: MLP(nn.GELU()).double(), torch.float64, "dtype float64 not supported"),
    ("dropout_train", lambda: DropoutTrain().train(), torch.float32, "dropout active (training mode)"),
]


@pytest.mark.parametrize("name,make,dtype,reason", NEGATIVE, ids=[n[0] for n in NEGATIVE])
@pytest.mark.parametrize("form", FORMS)
def test_rejections(name, make, dtype, reason, form):
    gm, regions, rejections = plan(make(), form, torch.randn(4, 8, dtype=dtype))
    assert regions == []
    assert len(rejections) == 1
    rej = rejections[0]
    assert rej.reason.startswith(reason), rej.reason
    lins = [n.name for n in gm.graph.nodes if is_linear(n)]
    assert lins[0] in rej.nodes and lins[-1] in rej.nodes


def test_rejection_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="fxfuse"):
        plan(Shared(nn.ReLU()), "symbolic", torch.randn(4, 8))
    assert any("intermediate used elsewhere" in rec.getMessage() for rec in caplog.records)


def test_cast_in_the_middle():
    class M(MLP):
        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)).float())

    _, regions, (rej,) = plan(M(nn.ReLU()), "symbolic", torch.randn(4, 8))
    assert regions == [] and rej.reason == "cast (Tensor.float) in the middle"


def test_gated_with_different_inputs():
    class M(Gated):
        def forward(self, x, y):
            return self.down(self.act(self.gate(x)) * self.up(y))

    _, regions, (rej,) = plan(M(F.silu, "gate_first"), "dynamo", torch.randn(4, 8), torch.randn(4, 8))
    assert regions == [] and rej.reason == "linears of a gated stage read different inputs"


def test_a_low_rank_adapter_on_the_first_linear_is_named_in_the_reason():
    """A LoRA-wrapped fc1 (``base(x) + B(A(x)) * s``) reads as a gated stage whose second linear reads the
    adapter's first: not fused, and the reason says what to do."""
    class LoRALinear(nn.Module):
        def __init__(self, i, o, r=2):
            super().__init__()
            self.base, self.A, self.B = nn.Linear(i, o), nn.Linear(i, r, bias=False), nn.Linear(r, o, bias=False)

        def forward(self, x):
            return self.base(x) + self.B(self.A(x)) * 0.5

    class M(MLP):
        def __init__(self):
            super().__init__(nn.GELU(approximate="tanh"))
            self.fc1 = LoRALinear(8, 32)

    _, regions, (rej,) = plan(M(), "symbolic", torch.randn(4, 8))
    assert regions == [] and "LoRA" in rej.reason and rej.reason.startswith("linears of a gated stage")


@pytest.mark.parametrize("shape,ok", [((32,), True), ((1,), True), ((4, 32), False), ((1, 1, 32), False)])
def test_operand_must_broadcast_along_last_dim(shape, ok):
    class M(MLP):
        def __init__(self):
            super().__init__(nn.ReLU())
            self.scale = nn.Parameter(torch.rand(shape))

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)) * self.scale)

    gm, regions, rejections = plan(M(), "symbolic", torch.randn(4, 8))
    if ok:
        (r,) = regions
        assert epilogues(r) == ["mul(relu(a0),v0)", "a0"] and r.operands[0].target == "scale"
    else:
        assert regions == [] and "not broadcast along the last dim" in rejections[0].reason


@pytest.mark.parametrize("shape", [(1, 32), (1, 1, 32)])
def test_an_operand_with_leading_ones_fuses_where_the_input_has_as_many_dims(shape):
    """Planned without the input's rank (optimize's discovery), a ``[1, H]`` operand fuses; a call whose input has
    fewer dims (eager's output would gain them) runs the original ops."""
    class M(MLP):
        def __init__(self):
            super().__init__(nn.ReLU())
            self.register_buffer("scale", torch.rand(shape))

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)) * self.scale)

    model = M().eval()
    fast = fxfuse.optimize(model)
    assert [r.spec for r in fxfuse.report(fast).regions] == ["1b:mul(relu(a0),v0);1b:a0"]
    for x in (torch.randn(5, 8), torch.randn(2, 3, 8), torch.randn(8)):
        with torch.no_grad():
            out, ref = fast(x), model(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_float16_and_mixed_dtypes():
    model = MLP(nn.ReLU()).half()
    _, regions, _ = plan(model, "symbolic_noshapes")
    assert len(regions) == 1
    model.fc2.float()
    _, regions, (rej,) = plan(model, "symbolic_noshapes")
    assert regions == [] and rej.reason.startswith("dtypes disagree")


# ---------------------------------------------------------------------------------------------- patterns

def relu_scale(x, w1, b1, scale, w2, b2):
    return F.linear(torch.relu(F.linear(x, w1, b1)) * scale, w2, b2)


class ReluScale(nn.Module):
    def __init__(self, bias1=True):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32, bias=bias1), nn.Linear(32, 8)
        self.scale = nn.Parameter(torch.rand(32))

    def forward(self, x):
        return self.fc2(self.scale * F.relu(self.fc1(x)))  # operands swapped w.r.t. the pattern


@pytest.mark.parametrize("form", FORMS)
def test_user_pattern_relu_scale(form):
    with registered(relu_scale) as pat:
        assert all_patterns()[0] is pat
        gm, regions, rejections = plan(ReluScale(), form, torch.randn(4, 8))
    assert not rejections
    (r,) = regions
    assert r.pattern == "relu_scale" and epilogues(r) == ["mul(relu(a0),v0)", "a0"]
    (scale,) = r.operands
    assert scale.op in ("get_attr", "placeholder") and "scale" in scale.name
    assert r.replacement is None
    assert all_patterns()[0].name != "relu_scale"  # unregistered on exit


@pytest.mark.parametrize("form", ["symbolic", "dynamo"])
def test_user_pattern_with_replacement(form):
    def replacement(x, w1, b1, scale, w2, b2):
        return F.linear(torch.relu(F.linear(x, w1, b1)) * scale, w2, b2)

    with registered(relu_scale, name="scaled", replacement=replacement):
        gm, (r,), _ = plan(ReluScale(), form, torch.randn(4, 8))
        # A replacement gets every argument its pattern declares: fc1 without a bias is not its match.
        _, (r_no_bias,), _ = plan(ReluScale(bias1=False), form, torch.randn(4, 8))
    fc1, fc2 = [n for n in gm.graph.nodes if is_linear(n)]
    assert r.pattern == "scaled" and r.replacement is replacement
    args = r.replacement_args
    assert list(args) == ["x", "w1", "b1", "scale", "w2", "b2"]
    assert args["x"] is fc1.args[0] and args["w1"] is fc1.args[1] and args["b1"] is fc1.args[2]
    assert args["scale"] is r.operands[0] and args["w2"] is fc2.args[1] and args["b2"] is fc2.args[2]
    assert r_no_bias.pattern == "mlp" and r_no_bias.replacement is None


def test_concrete_pattern_does_not_match_other_math():
    with registered(relu_scale):
        _, (r,), _ = plan(MLP(nn.ReLU()), "symbolic", torch.randn(4, 8))
    assert r.pattern == "mlp"


def test_register_unregister_priority():
    def p1(x, w1, w2):
        return F.linear(pointwise(F.linear(x, w1)), w2)

    a = register_pattern(p1, name="first")
    b = register_pattern(p1, name="second")
    try:
        names = [p.name for p in all_patterns()]
        assert names[:2] == ["second", "first"] and names[2:] == ["gated_mlp", "mlp"]
        _, (r,), _ = plan(MLP(nn.ReLU()), "symbolic", torch.randn(4, 8))
        assert r.pattern == "second"
    finally:
        unregister_pattern(a.name)
        unregister_pattern(b.name)
    assert [p.name for p in all_patterns()] == ["gated_mlp", "mlp"]


def test_bad_patterns_are_refused():
    with pytest.raises(ValueError, match="must return the result of a linear"):
        compile_pattern(lambda x, w: torch.relu(F.linear(x, w)))
    with pytest.raises(ValueError, match="unsupported op"):
        compile_pattern(lambda x, w1, w2: F.linear(torch.erfinv(F.linear(x, w1)), w2))


def _mlp(x, w1, b1, w2, b2):
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)


def _wild(x, w1, b1, w2, b2):
    return F.linear(pointwise(F.linear(x, w1, b1)), w2, b2)


@pytest.mark.parametrize("fn, kwargs, error, message", [
    (42, {}, TypeError, "a pattern is a plain function over tensors"),
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), {}, TypeError, "got Sequential"),
    (_mlp, {"name": 123}, TypeError, "non-empty string"),
    (_mlp, {"name": "mlp"}, ValueError, "is a built-in pattern's"),
    (_mlp, {"replacement": 5}, TypeError, "replacement must be callable"),
    (_mlp, {"replacement": lambda inp, weight1, bias1, weight2, bias2: inp}, TypeError,
     r"called as replacement\(x=..., w1=..., b1=..., w2=..., b2=...\)"),
    (_wild, {"replacement": _mlp}, ValueError, "cannot take a replacement"),
    (lambda x, w1, b1, w2, b2: F.linear(torch.relu(x @ w1.t() + b1), w2, b2), {}, ValueError,
     r"spelled F.linear\(x, w, b\)"),
])
def test_register_pattern_refuses_what_it_cannot_honour_with_a_clear_error(fn, kwargs, error, message):
    with pytest.raises(error, match=message):
        register_pattern(fn, **kwargs)
    assert [p.name for p in all_patterns()] == ["gated_mlp", "mlp"]


@pytest.mark.parametrize("handle", ["name", "function", "pattern"])
def test_unregister_pattern_by_name_function_or_pattern(handle):
    pat = register_pattern(_mlp, name="mine")
    unregister_pattern({"name": "mine", "function": _mlp, "pattern": pat}[handle])
    assert [p.name for p in all_patterns()] == ["gated_mlp", "mlp"]


def test_compiled_models_follow_a_pattern_unregistered_after_they_compiled():
    """Dynamo caches a compiled forward per code object: a change of patterns resets it, so no model keeps
    calling the replacement of a pattern that is gone."""
    def sevens(x, w1, b1, w2, b2):
        return torch.full((*x.shape[:-1], w2.shape[0]), 7.0)

    model = MLP(nn.ReLU()).eval()
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    register_pattern(_mlp, name="sevens", replacement=sevens)
    try:
        with torch.no_grad():
            assert torch.all(torch.compile(model, backend="fxfuse", options={"inductor": False})(x) == 7.0)
    finally:
        unregister_pattern("sevens")
    other = MLP(nn.ReLU()).eval()
    with torch.no_grad():
        got = torch.compile(other, backend="fxfuse", options={"inductor": False})(x)
        torch.testing.assert_close(got, other(x), rtol=1e-5, atol=1e-5)


def test_patterns_are_traced_once():
    first = all_patterns()
    assert [p.gm for p in all_patterns()] == [p.gm for p in first]


# ------------------------------------------------------------------------------------------- transformer

class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Dropout(0.1),
                                 nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.mlp(self.ln2(x))


@pytest.mark.parametrize("form", FORMS)
def test_twelve_blocks_fast(form):
    model = nn.Sequential(*[Block() for _ in range(12)]).eval()
    x = torch.randn(2, 5, 16)
    all_patterns()  # compiled once, up front
    gm = capture(model, x) if form == "dynamo" else fx.symbolic_trace(model)
    if form == "symbolic":
        ShapeProp(gm).propagate(x)
    start = time.perf_counter()
    normalize(gm)
    regions, rejections = find_regions(gm)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed
    assert len(regions) == 12 and not rejections
    assert sorted(r.module_path for r in regions) == sorted(f"{i}.mlp" for i in range(12))
    assert all(epilogues(r) == ["gelu_tanh(a0)", "a0"] for r in regions)
    assert_region_invariants(regions)


# ---------------------------------------------------------------------------------------------- more cases

def test_operand_depending_on_the_chain():
    class M(MLP):
        def forward(self, x):
            h = self.act(self.fc1(x))
            return self.fc2(h * h.amax())  # one element, but computed from the chain

    _, regions, (rej,) = plan(M(nn.ReLU()), "symbolic", torch.randn(4, 8))
    assert regions == [] and rej.reason == \
        "operand amax depends on the chain itself (Tensor.amax is not a supported pointwise op)"


def test_an_operand_computed_from_the_chain_names_the_reduction_not_the_op_after_it():
    class GRN(MLP):  # ConvNeXt-V2's global response norm, timm's form: pointwise ops after a norm and a mean
        def forward(self, x):
            h = self.act(self.fc1(x))
            g = h.norm(p=2, dim=0, keepdim=True)
            n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
            return self.fc2(h + torch.addcmul(torch.ones(32), torch.ones(32), h * n))

    _, regions, (rej,) = plan(GRN(nn.GELU()), "symbolic", torch.randn(4, 8))
    assert regions == [] and "(Tensor.norm is not a supported pointwise op)" in rej.reason, rej.reason


def test_dynamic_shapes_and_size_constants():
    class M(MLP):
        def __init__(self):
            super().__init__(nn.GELU())
            self.scale = nn.Parameter(torch.rand(32))

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)) * self.scale / x.shape[-1] ** 0.5)

    model, x = M(), torch.randn(3, 5, 8)
    seen = []
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, ex: (seen.append(gm), gm.forward)[1], dynamic=True)(x)
    torch._dynamo.reset()
    gm = seen[0]
    normalize(gm)
    (r,), rejections = find_regions(gm)
    assert not rejections
    assert epilogues(r) == [f"div(mul(gelu(a0),v0),{8 ** 0.5!r})", "a0"]
    assert len(r.operands) == 1 and "scale" in r.operands[0].name


def test_gated_then_mlp_merge_into_one_chain():
    class M(Gated):
        def __init__(self):
            super().__init__(F.silu, "gate_first")
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            return self.out(torch.tanh(super().forward(x)))

    gm, (r,), rejections = plan(M(), "dynamo", torch.randn(4, 8))
    assert not rejections
    assert epilogues(r) == ["mul(a0,silu(a1))", "tanh(a0)", "a0"]
    assert [s.num_linears for s in r.spec.stages] == [2, 1, 1]
    assert r.strategy == "gated_gemm_epilogue" and len(r.weights) == 4
    assert r.biases[:3] == [None, None, None] and r.biases[3] is not None


def test_adjacent_regions_do_not_overlap():
    model = nn.Sequential(MLP(nn.ReLU()), MLP(nn.GELU()))  # fc2 of the first feeds fc1 of the second
    gm, regions, rejections = plan(model, "symbolic", torch.randn(4, 8))
    assert len(regions) == 2 and not rejections
    assert regions[1].input is regions[0].output  # the rewrite must remap it to the first fused node
    assert_region_invariants(regions)


def test_near_miss_is_short_and_single_use():
    class M(MLP):
        def forward(self, x):
            h = self.act(self.fc1(x))
            return self.fc2(torch.erfinv(torch.sigmoid(torch.exp(torch.sin(torch.cos(h))))))  # 5 nodes in between

    _, regions, rejections = plan(M(nn.ReLU()), "symbolic", torch.randn(4, 8))
    assert regions == [] and rejections == []


def test_a_source_checkout_that_is_not_installed_finds_the_builtin_patterns():
    # Installed, the top-level patterns/ folder ships as fxfuse.patterns; a checkout on sys.path has no such
    # module, and used to fuse nothing ("not analyzed: No module named 'fxfuse.patterns'").
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    code = f"""
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # forget any install
sys.path.insert(0, {str(repo)!r})
import torch.nn as nn
import fxfuse
assert fxfuse.__file__.startswith({str(repo)!r}), fxfuse.__file__
opt = fxfuse.optimize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)))
print(len(fxfuse.report(opt).regions))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip().splitlines()[-1] == "1", out.stdout + out.stderr


def test_a_gated_mlp_with_an_activation_not_fused_is_rejected_for_that_activation_only():
    class HardswishGated(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)
            self.act = nn.Hardswish()

        def forward(self, x):
            return self.down(self.act(self.gate(x)) * self.up(x))

    report = fxfuse.report(fxfuse.optimize(HardswishGated().eval()))
    assert not report.regions
    assert [r.reason for r in report.rejections] == ["unsupported op in the middle: nn.Hardswish"]


class _DepthWiseConv(nn.Module):
    """SegFormer's ``SegformerDepthWiseConv``: tokens back to an image, a 3x3 depthwise conv, back to tokens."""

    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)

    def forward(self, h, height, width):
        batch_size, seq_len, num_channels = h.shape  # (seq_len unused: a read nobody uses)
        h = h.transpose(1, 2).view(batch_size, num_channels, height, width)
        return self.dwconv(h).flatten(2).transpose(1, 2)


class _MixFFN(nn.Module):
    """SegFormer's Mix-FFN: fc1 → depthwise conv → GELU → fc2."""

    def __init__(self):
        super().__init__()
        self.fc1, self.dwconv, self.act, self.fc2 = nn.Linear(8, 32), _DepthWiseConv(32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.dwconv(self.fc1(x), 4, 4)))


def test_a_convolution_between_the_linears_is_named_in_the_reason():
    fast = fxfuse.optimize(_MixFFN().eval(), example_inputs=(torch.randn(2, 16, 8),))
    report = fxfuse.report(fast)
    assert report.regions == []
    (rejection,) = report.rejections
    assert rejection.pattern == "mlp (near miss)"
    assert rejection.reason.startswith("dwconv (")  # the submodule, and its class where Python names it
    assert "nn.Conv2d" in rejection.reason and "getitem" not in rejection.reason, rejection.reason


def test_a_convolution_written_inline_between_the_linears_is_named_too():
    # The Mix-FFN with its reshapes and depthwise conv in the block's own forward (no submodule of its own): a
    # middle of ten nodes, reported because a module with parameters sits in it (before: nothing reported).
    class InlineMixFFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
            self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)

        def forward(self, x, height=4, width=4):
            h = self.fc1(x)
            b, n, c = h.shape
            h = self.dw(h.transpose(1, 2).reshape(b, c, height, width)).flatten(2).transpose(1, 2)
            return self.fc2(self.act(h))

    report = fxfuse.report(fxfuse.optimize(InlineMixFFN().eval(), example_inputs=(torch.randn(2, 16, 8),)))
    assert report.regions == []
    assert [(r.pattern, r.reason) for r in report.rejections] == \
        [("mlp (near miss)", "dw (nn.Conv2d) between fc1 and fc2 is not a supported epilogue")]


def test_a_head_after_a_fused_mlp_and_a_norm_is_no_near_miss():
    # fc2 ends a fused region; norm, mean and the head after it are no MLP left unfused (before: "norm (nn.LayerNorm)
    # between fc2 and head" once a module with parameters in a long middle was named).
    class OneBlockClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.norm, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16), \
                nn.Linear(16, 4)

        def forward(self, x):
            h = self.norm(x + self.fc2(F.gelu(self.fc1(x))))
            return self.head(F.gelu(h.mean(1)) * 2.0 + 1.0)

    report = fxfuse.report(fxfuse.optimize(OneBlockClassifier().eval(), example_inputs=(torch.randn(2, 8, 16),)))
    assert len(report.regions) == 1 and not report.rejections, str(report)


def test_residual_blocks_of_mlps_report_no_gated_stage_across_them():
    # x + mlp0(norm(x)), then + mlp1(norm(...)), then a head: fc2 of both blocks reach the head through the
    # stream's adds, which reads like a gated stage whose linears read different inputs. It is none.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(8), MLP(nn.GELU())

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    model = nn.Sequential(Block(), Block(), nn.Linear(8, 4)).eval()
    _, regions, rejections = plan(model, "symbolic", torch.randn(4, 8))
    assert len(regions) == 2 and rejections == [], rejections


def test_mix_ffns_of_later_stages_are_near_misses_too():
    # SegFormer's later stages take height and width from tensors computed after earlier blocks: a size read is a
    # number the block reads, not a path back to the earlier blocks' linears.
    class TwoStages(nn.Module):
        def __init__(self):
            super().__init__()
            self.block0, self.block1 = _MixFFN(), _MixFFN()

        def forward(self, x):
            x = x + self.block0(x)
            width = x.shape[1] // 4
            return x + self.block1.fc2(self.block1.act(self.block1.dwconv(self.block1.fc1(x), 4, width)))

    fast = fxfuse.optimize(TwoStages().eval(), example_inputs=(torch.randn(2, 16, 8),))
    report = fxfuse.report(fast)
    assert report.regions == []
    assert sorted(r.module_path for r in report.rejections if r.pattern == "mlp (near miss)") == \
        ["block0", "block1"], str(report)
