"""normalize(): every linear form becomes one canonical F.linear node, pointwise nodes are classified,
eval-mode dropout disappears, and the graph still computes the same function (CPU only, fast)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from models import dynamo_graph
from torch.fx.passes.shape_prop import ShapeProp

from fxfuse.meta import TensorInfo, tensor_info
from fxfuse.normalize import DROPOUT_ACTIVE, is_linear, module_path_of, normalize
from fxfuse.pointwise import INPLACE_UNSAFE


def capture(model: nn.Module, *inputs):
    return dynamo_graph(model, *inputs)


def trace(model: nn.Module, *inputs, shapes: bool = True) -> fx.GraphModule:
    gm = fx.symbolic_trace(model)
    if shapes:
        ShapeProp(gm).propagate(*inputs)
    return gm


def linears(gm):
    return [n for n in gm.graph.nodes if is_linear(n)]


def check_same(model, gm, inputs, gm_inputs=None):
    gm.graph.lint()
    expected = model(*inputs)
    got = gm(*(gm_inputs if gm_inputs is not None else inputs))
    if isinstance(got, (tuple, list)):
        got = got[0]
    torch.testing.assert_close(got, expected)


# ------------------------------------------------------------------------------------------ linear forms

class Mods(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(16))
        self.w2 = nn.Parameter(torch.randn(4, 16))

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, weight=self.w1, bias=self.b1)), self.w2)


class AddMM(nn.Module):  # W stored [K, N]
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16))

    def forward(self, x):
        return torch.addmm(self.b, x, self.w)


class MatmulBias(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.w_kn, self.w_nk = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16, 8))
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        if self.form == "matmul":
            return x @ self.w_kn + self.b
        if self.form == "torch.matmul":
            return self.b + torch.matmul(x, self.w_kn)
        if self.form == "mm":
            return torch.mm(x, self.w_kn)
        if self.form == "t()":
            return x @ self.w_nk.t() + self.b
        if self.form == ".T":
            return x.matmul(self.w_nk.T)
        if self.form == "transpose":
            return x @ self.w_nk.transpose(0, 1) + self.b
        if self.form == "linear+b":
            return F.linear(x, self.w_nk) + self.b
        raise AssertionError(self.form)


@pytest.mark.parametrize("model,n_linears", [(Mods(), 2), (Functional(), 2), (AddMM(), 1)])
@pytest.mark.parametrize("form", ["symbolic", "symbolic_noshapes", "dynamo"])
def test_linear_forms(model, n_linears, form):
    x = torch.randn(3, 8)
    if form == "dynamo":
        gm, ex = capture(model, x)
        assert any(n.target is torch._C._nn.linear or n.target is torch.addmm for n in gm.graph.nodes)
    else:
        gm, ex = trace(model, x, shapes=form == "symbolic"), [x]
    normalize(gm)
    lins = linears(gm)
    assert len(lins) == n_linears
    for lin in lins:  # canonical: F.linear(x, w, b_or_None), weight [N, K]
        assert lin.target is F.linear and len(lin.args) == 3 and not lin.kwargs
        w = tensor_info(gm, lin.args[1])
        assert w is not None and w.ndim == 2
    check_same(model, gm, [x], ex)


@pytest.mark.parametrize("form,transposes,bias", [
    ("matmul", 1, True), ("torch.matmul", 1, True), ("mm", 1, False),
    ("t()", 0, True), (".T", 0, False), ("transpose", 0, True), ("linear+b", 0, True)])
@pytest.mark.parametrize("graph_form", ["symbolic", "dynamo"])
def test_matmul_forms(form, transposes, bias, graph_form):
    model = MatmulBias(form)
    x = torch.randn(3, 8)
    gm, ex = capture(model, x) if graph_form == "dynamo" else (trace(model, x), [x])
    normalize(gm)
    (lin,) = linears(gm)
    assert (lin.args[2] is not None) == bias
    assert not [n for n in gm.graph.nodes if n.target in (operator.add, torch.add, operator.matmul, torch.matmul)]
    t_nodes = [n for n in gm.graph.nodes if n.target is torch.t]
    assert len(t_nodes) == transposes
    if transposes:  # x @ W with W [K, N] -> F.linear(x, W.t()): the t node is a helper the rewrite may drop
        assert lin.args[1] is t_nodes[0] and t_nodes[0].meta["fxfuse_helper"]
        assert tensor_info(gm, t_nodes[0]).shape == (16, 8)
    else:
        assert lin.args[1].op in ("get_attr", "placeholder")
    check_same(model, gm, [x], ex)


def test_unknown_shapes_are_left_alone():
    def f(x, w, b):  # placeholders without metadata: x @ w could be anything
        return x @ w + b

    gm = fx.symbolic_trace(f)
    normalize(gm)
    assert not linears(gm)
    assert any(n.target is operator.matmul for n in gm.graph.nodes)


class _BatchLinear(nn.Linear):
    """The official SIREN repo's ``BatchLinear`` (its 2-D case, parameters read as attributes): ``permute(-1, -2)``,
    then ``+=`` the bias or a ``[1, N]`` view of it."""

    def __init__(self, a, b, bias_view):
        super().__init__(a, b)
        self.bias_view = bias_view

    def forward(self, input):
        output = input.matmul(self.weight.permute(-1, -2))
        output += {"unsqueeze": lambda b: b.unsqueeze(-2), "getitem": lambda b: b[None], "none": lambda b: b}[
            self.bias_view](self.bias)
        return output


@pytest.mark.parametrize("bias_view", ["none", "unsqueeze", "getitem"])
@pytest.mark.parametrize("graph_form", ["symbolic", "dynamo"])
def test_a_weight_transposed_by_negative_dims_makes_a_linear_and_only_a_bias_of_shape_n_folds(bias_view,
                                                                                              graph_form):
    # (before: the matmul stayed a matmul, so a SIREN of BatchLinears had no linear to match and no reason given.)
    # A [1, N] view of the bias stays an add: folded, a 1-D input's result would be [N] where eager's is [1, N]
    # (or raises, in place), at any later call.
    model, x = _BatchLinear(8, 16, bias_view), torch.randn(2, 3, 8)
    gm, ex = capture(model, x) if graph_form == "dynamo" else (trace(model, x), [x])
    normalize(gm)
    (lin,) = linears(gm)
    assert (lin.args[2] is not None) == (bias_view == "none")
    assert not [n for n in gm.graph.nodes if n.target in (operator.matmul, "matmul", "permute")]
    check_same(model, gm, [x], ex)


def test_bias_not_folded_when_not_per_channel():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16, bias=False)
            self.b = nn.Parameter(torch.randn(3, 16))  # [M, N]: not a bias

        def forward(self, x):
            return self.fc(x) + self.b

    model, x = M(), torch.randn(3, 8)
    gm = trace(model, x)
    normalize(gm)
    (lin,) = linears(gm)
    assert lin.args[2] is None
    check_same(model, gm, [x])


def test_user_modules_untouched_and_parameters_shared():
    model = Mods()
    gm = fx.symbolic_trace(model)
    normalize(gm)
    assert isinstance(model.fc1, nn.Linear) and gm.fc1.weight is model.fc1.weight
    (fc1, fc2) = linears(gm)
    assert fc1.args[1].op == "get_attr" and fc1.args[1].target == "fc1.weight"
    assert fc2.args[2] is None
    assert fc1.meta["fxfuse_module_path"] == "fc1"


def test_dynamo_module_path():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)))
    gm, _ = capture(model, torch.randn(2, 8))
    normalize(gm)
    assert [module_path_of(n) for n in linears(gm)] == ["0", "2.0"]


def test_normalize_is_idempotent():
    model, x = Mods(), torch.randn(3, 8)
    gm = trace(model, x)
    normalize(gm)
    before = str(gm.graph)
    normalize(gm)
    assert str(gm.graph) == before
    check_same(model, gm, [x])


# ---------------------------------------------------------------------------------------- pointwise forms

class Act(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = act  # a module or a function of the tensor

    def forward(self, x):
        return self.act(self.fc(x))


ACTIVATIONS = [
    ("nn.ReLU", nn.ReLU(), ["relu(v0)"]),
    ("nn.ReLU inplace", nn.ReLU(inplace=True), ["relu(v0)"]),
    ("nn.GELU", nn.GELU(), ["gelu(v0)"]),
    ("nn.GELU tanh", nn.GELU(approximate="tanh"), ["gelu_tanh(v0)"]),
    ("nn.SiLU", nn.SiLU(), ["silu(v0)"]),
    ("nn.Sigmoid", nn.Sigmoid(), ["sigmoid(v0)"]),
    ("nn.Tanh", nn.Tanh(), ["tanh(v0)"]),
    ("nn.LeakyReLU", nn.LeakyReLU(0.2), ["leaky_relu(v0,0.2)"]),
    ("nn.ReLU6", nn.ReLU6(), ["hardtanh(v0,0.0,6.0)"]),
    ("nn.Hardtanh", nn.Hardtanh(-2.0, 3.0), ["hardtanh(v0,-2.0,3.0)"]),
    ("F.relu inplace", lambda h: F.relu(h, inplace=True), ["relu(v0)"]),
    ("F.gelu tanh", lambda h: F.gelu(h, approximate="tanh"), ["gelu_tanh(v0)"]),
    ("F.silu", F.silu, ["silu(v0)"]),
    ("F.leaky_relu", lambda h: F.leaky_relu(h, negative_slope=0.1), ["leaky_relu(v0,0.1)"]),
    ("F.relu6", F.relu6, ["hardtanh(v0,0.0,6.0)"]),
    ("method relu", lambda h: h.relu(), ["relu(v0)"]),
    ("method relu_", lambda h: h.relu_(), ["relu(v0)"]),
    ("method sigmoid/mul", lambda h: h.mul(h.sigmoid()), ["sigmoid(v0)", "mul(v0,v1)"]),
    ("method pow", lambda h: h.relu().pow(2), ["relu(v0)", "pow(v0,2.0)"]),
    ("torch.*", lambda h: torch.mul(torch.tanh(h), torch.sigmoid(h)), ["tanh(v0)", "sigmoid(v0)", "mul(v0,v1)"]),
    ("operator.*", lambda h: -(h * 2.0 + 1.0) / 3.0 - h ** 2,
     ["mul(v0,2.0)", "add(v0,1.0)", "neg(v0)", "div(v0,3.0)", "pow(v0,2.0)", "sub(v0,v1)"]),
    ("quick gelu", lambda h: h * torch.sigmoid(1.702 * h), ["mul(1.702,v0)", "sigmoid(v0)", "mul(v0,v1)"]),
    ("squared relu", lambda h: torch.relu(h) ** 2, ["relu(v0)", "pow(v0,2.0)"]),
    ("clamp", lambda h: h.clamp(min=-1.0), ["clamp_min(v0,-1.0)"]),
    ("siren sin", lambda h: torch.sin(30 * h), ["mul(30.0,v0)", "sin(v0)"]),
    ("method cos", lambda h: h.cos(), ["cos(v0)"]),
]


@pytest.mark.parametrize("name,act,exprs", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
@pytest.mark.parametrize("graph_form", ["symbolic", "dynamo"])
def test_pointwise_forms(name, act, exprs, graph_form):
    model, x = Act(act), torch.randn(4, 8)
    gm, ex = capture(model, x) if graph_form == "dynamo" else (trace(model, x), [x])
    normalize(gm)
    got = [str(n.meta["fxfuse_pointwise"].expr) for n in gm.graph.nodes if "fxfuse_pointwise" in n.meta]
    assert got == exprs
    for node in gm.graph.nodes:
        if "fxfuse_pointwise" in node.meta:
            assert all(isinstance(i, fx.Node) for i in node.meta["fxfuse_pointwise"].inputs)
    check_same(model, gm, [x], ex)


@pytest.mark.parametrize("graph_form", ["symbolic", "dynamo"])
def test_unsupported_pointwise_is_not_classified(graph_form):
    model, x = Act(lambda h: torch.erfinv(torch.tanh(h)).float()), torch.randn(4, 8)
    gm, ex = capture(model, x) if graph_form == "dynamo" else (trace(model, x), [x])
    normalize(gm)
    erfinv = next(n for n in gm.graph.nodes if n.target in (torch.erfinv, "erfinv"))
    assert "fxfuse_pointwise" not in erfinv.meta
    cast = next(n for n in gm.graph.nodes if n.target in ("float", "to"))
    assert "cast" in cast.meta["fxfuse_unsupported"]


class _OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)


def test_unsafe_inplace_is_unsupported():
    class M(_OneLinear):
        def forward(self, x):
            h = self.fc(x)
            v = h.view(2, 8)  # a view taken before the write sees it
            r = h.relu_()
            return r + v

    gm = trace(M(), torch.randn(2, 8))
    normalize(gm)
    relu_ = next(n for n in gm.graph.nodes if n.target == "relu_")
    assert relu_.meta["fxfuse_unsupported"] == INPLACE_UNSAFE and "fxfuse_pointwise" not in relu_.meta


def test_readers_after_an_inplace_write_read_its_result():
    class M(_OneLinear):
        def forward(self, x):
            h = self.fc(x)
            s = torch.sigmoid(h)  # read before the write: the value it replaces
            h.mul_(s)
            return h + h  # read after it: the result

    model = M()
    gm = trace(model, torch.randn(2, 8))
    normalize(gm)
    mul_ = next(n for n in gm.graph.nodes if n.target == "mul_")
    add = next(n for n in gm.graph.nodes if n.target in (operator.add, "add"))
    assert add.args == (mul_, mul_) and "fxfuse_pointwise" in mul_.meta
    x = torch.randn(2, 8)
    torch.testing.assert_close(gm(x), model(x))


# ----------------------------------------------------------------------------------------------- dropout

class Drop(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop, self.ident = nn.Dropout(0.1), nn.Identity()

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.kind == "module":
            h = self.drop(h)
        elif self.kind == "functional":
            h = F.dropout(h, 0.1, self.training)
        elif self.kind == "torch":
            h = torch.dropout(h, 0.1, self.training)
        elif self.kind == "p0":
            h = F.dropout(h, 0.0, True)
        return self.fc2(self.ident(h))


@pytest.mark.parametrize("kind", ["module", "functional", "torch", "p0"])
@pytest.mark.parametrize("graph_form", ["symbolic", "dynamo"])
def test_eval_dropout_and_identity_removed(kind, graph_form):
    model, x = Drop(kind).eval(), torch.randn(4, 8)
    gm, ex = capture(model, x) if graph_form == "dynamo" else (trace(model, x), [x])
    normalize(gm)
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not [t for t in targets if "dropout" in t or t in ("drop", "ident")]
    relu = next(n for n in gm.graph.nodes if "fxfuse_pointwise" in n.meta)
    assert list(relu.users)[0] is linears(gm)[1]
    check_same(model, gm, [x], ex)


@pytest.mark.parametrize("kind", ["module", "functional", "torch"])
@pytest.mark.parametrize("graph_form", ["symbolic", "dynamo"])
def test_active_dropout_stays(kind, graph_form):
    model, x = Drop(kind).train(), torch.randn(4, 8)
    gm, _ = capture(model, x) if graph_form == "dynamo" else (trace(model, x), [x])
    normalize(gm)
    drops = [n for n in gm.graph.nodes if n.meta.get("fxfuse_unsupported") == DROPOUT_ACTIVE]
    assert len(drops) == 1


# -------------------------------------------------------------------------------------------- tensor_info

def test_tensor_info_sources():
    model, x = Mods(), torch.randn(3, 8)
    gm = fx.symbolic_trace(model)
    normalize(gm)
    fc1 = linears(gm)[0]
    assert tensor_info(gm, fc1) is None  # no metadata yet
    assert tensor_info(gm, fc1.args[1]) == TensorInfo((16, 8), torch.float32, torch.device("cpu"), True)
    ShapeProp(gm).propagate(x)
    assert tensor_info(gm, fc1).shape == (3, 16)
    gm2, _ = capture(model, x)
    ph = next(n for n in gm2.graph.nodes if n.op == "placeholder" and "fc1" in n.name and "weight" in n.name)
    assert tensor_info(gm2, ph).shape == (16, 8) and tensor_info(gm2, ph).device == torch.device("cpu")
