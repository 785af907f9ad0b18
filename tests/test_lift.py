"""Parameter reads lifted out of fused graphs: the host passes the live tensors in, the results do not change."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse import install
from fxfuse.lift import lift_params


class MLP(nn.Module):
    def __init__(self, d=16, h=48):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh")) * self.scale


class Functional(nn.Module):
    """Parameters read in forward (``get_attr`` nodes in a trace), one of them twice, and a buffer."""

    def __init__(self, d=16, h=48):
        super().__init__()
        self.inner = MLP(d, h)
        self.w = nn.Parameter(torch.randn(h, d) / d ** 0.5)

    def forward(self, x):
        h = F.linear(x, self.w) + F.linear(x, self.w)
        return F.linear(torch.relu(h), self.inner.fc2.weight, self.inner.fc2.bias) * self.inner.scale


def test_parameters_and_buffers_become_trailing_arguments():
    model = Functional()
    gm = fx.symbolic_trace(model)
    lifted, paths = lift_params(gm)
    assert paths == ["w", "inner.fc2.weight", "inner.fc2.bias", "inner.scale"]  # the trace reads w once
    assert not any(n.op == "get_attr" for n in lifted.graph.nodes)
    x = torch.randn(3, 16)
    params = [model.get_parameter(p) if p != "inner.scale" else model.get_buffer(p) for p in paths]
    torch.testing.assert_close(type(lifted).forward(model, x, *params), model(x))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)  # the original graph is left as it was


def test_a_signature_with_defaults_is_left_alone():
    graph = fx.Graph()
    x = graph.placeholder("x")
    shift = graph.placeholder("shift", default_value=0.0)
    w = graph.get_attr("w")
    graph.output(graph.call_function(torch.add, (graph.call_function(F.linear, (x, w)), shift)))
    root = nn.Module()
    root.w = nn.Parameter(torch.randn(4, 3))
    gm = fx.GraphModule(root, graph)
    assert lift_params(gm) == (gm, [])  # a trailing argument cannot follow one with a default
    plain = fx.symbolic_trace(nn.ReLU())
    assert lift_params(plain) == (plain, [])  # nothing to lift


def test_optimized_module_reads_replaced_parameters_through_the_lifted_path():
    model = MLP().eval()
    opt = fxfuse.optimize(model)
    graphs = install.fused_graphs(opt)
    assert graphs, fxfuse.report(opt)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        model.fc2.weight = nn.Parameter(torch.randn_like(model.fc2.weight))  # a new tensor object
        model.scale.fill_(3.0)
        torch.testing.assert_close(opt(x), model(x))
    assert opt.state_dict().keys() == model.state_dict().keys()
