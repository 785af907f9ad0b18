"""Small reference models shared by the tests (each written the way real code writes it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GPT2MLP(nn.Module):
    """Linear+bias → GELU(tanh) module → Linear+bias → dropout."""

    def __init__(self, d: int = 32, hidden: int = 96):
        super().__init__()
        self.c_fc = nn.Linear(d, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class GatedMLP(nn.Module):
    """Llama / GeGLU style: ``down(act(gate(x)) * up(x))``, no biases."""

    def __init__(self, d: int = 32, hidden: int = 80, act: str = "silu", up_first: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act, self.up_first = act, up_first

    def forward(self, x):
        g = self.gate_proj(x)
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        u = self.up_proj(x)
        return self.down_proj(u * g if self.up_first else g * u)


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` (GPT-2): ``addmm`` over the flattened rows, a ``[in, out]`` weight."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx ** 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Conv1DMLP(nn.Module):
    """transformers' ``GPT2MLP``: ``c_proj(gelu_tanh(c_fc(x)))`` over ``Conv1D``s (dropout left out)."""

    def __init__(self, d: int = 32, hidden: int = 128):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(hidden, d), Conv1D(d, hidden)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def nerf_mlp(widths=(16, 32, 32, 32, 8), bias: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SineLayer(nn.Module):
    """SIREN's layer (Sitzmann et al. 2020): sin(omega_0 * linear(x)), weights initialised as the paper does."""

    def __init__(self, d_in, d_out, first=False, omega_0=30.0):
        super().__init__()
        self.omega_0, self.linear = omega_0, nn.Linear(d_in, d_out)
        bound = 1 / d_in if first else (6 / d_in) ** 0.5 / omega_0
        nn.init.uniform_(self.linear.weight, -bound, bound)

    def forward(self, x):
        return torch.sin(self.omega_0 * self.linear(x))


def siren(widths=(2, 32, 32, 3)) -> nn.Sequential:
    """SIREN: sine layers, then a last linear."""
    layers = [SineLayer(a, b, first=i == 0) for i, (a, b) in enumerate(zip(widths[:-2], widths[1:-1]))]
    return nn.Sequential(*layers, nn.Linear(widths[-2], widths[-1]))


class Block(nn.Module):
    """A transformer-ish block: norm, a token mix that is not an MLP, and a GPT-2 MLP with residuals."""

    def __init__(self, d: int = 32, hidden: int = 96):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GPT2MLP(d, hidden)

    def forward(self, x):
        x = x + self.mix(self.ln_1(x)).softmax(-1)
        return x + self.mlp(self.ln_2(x))


class Stack(nn.Module):
    def __init__(self, blocks: int = 12, d: int = 32, hidden: int = 96):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(blocks))
        self.register_buffer("scale", torch.ones(d))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.scale


class ControlFlowModel(nn.Module):
    """Python control flow on a value outside the MLP: the whole model cannot be traced."""

    def __init__(self, d: int = 32, hidden: int = 96):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = GPT2MLP(d, hidden)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        if x.mean() > 0:  # data-dependent branch: symbolic_trace fails here
            x = self.norm(x)
        return self.head(self.mlp(x))


def dynamo_graph(model: nn.Module, *inputs):
    """The graph and example inputs a torch.compile backend receives, captured on the CPU."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    finally:
        torch._dynamo.reset()
    assert len(seen) == 1
    return seen[0]
