"""MLPs of 1x1 convolutions: not matched, and the report says so (and nothing else is listed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.pointwise_convs import pointwise_conv_mlps


class ConvMlp(nn.Module):
    """timm's ConvMlp: 1x1 conv, norm, act, 1x1 conv on an NCHW tensor."""

    def __init__(self, c=8, hidden=32, conv=nn.Conv2d, norm=True):
        super().__init__()
        self.fc1 = conv(c, hidden, 1)
        self.norm = nn.BatchNorm2d(hidden) if norm and conv is nn.Conv2d else nn.Identity()
        self.act = nn.GELU()
        self.fc2 = conv(hidden, c, 1)

    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


class Bottleneck(nn.Module):
    """ResNet's: the two 1x1 convolutions sandwich a 3x3 one, so it is no channel MLP."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, c, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return x + self.conv3(self.relu(self.conv2(self.relu(self.conv1(x)))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ConvMlp(), ConvMlp(), Bottleneck())
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3), nn.Conv2d(8, 4, 1))  # one pointwise conv: not an MLP

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def test_report_lists_conv_mlps_with_the_reason():
    model = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    fast = fxfuse.optimize(model, [x])
    torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)  # left as it is
    failures = fxfuse.report(fast).capture_failures
    assert [f.module_path for f in failures] == ["blocks.* (x2)"], failures
    assert "1x1 convolutions (fc1, fc2): not matched" in failures[0].error
    assert "MLP of 1x1 convolutions" in str(fxfuse.report(fast))


class SqueezeExcite(nn.Module):
    """An SE gate: an MLP of 1x1 convolutions on the pooled map (a few values per image: nothing to fuse)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv_reduce, self.act, self.conv_expand = nn.Conv2d(c, 2, 1), nn.ReLU(), nn.Conv2d(2, c, 1)

    def forward(self, x):
        return x * self.conv_expand(self.act(self.conv_reduce(x.mean((2, 3), keepdim=True)))).sigmoid()


class Heads(nn.Module):
    """A detection head: two 1x1 convolutions reading the same features, side by side."""

    def __init__(self, c=8):
        super().__init__()
        self.cls_logits, self.bbox_pred = nn.Conv2d(c, 5, 1), nn.Conv2d(c, 4, 1)

    def forward(self, x):
        return self.cls_logits(x), self.bbox_pred(x)


class Projections(nn.Module):
    """Chaining channels, but a quantizer between them in methods other than forward (Mimi's RVQ)."""

    def __init__(self, c=8):
        super().__init__()
        self.input_proj, self.output_proj = nn.Conv1d(c, 4, 1), nn.Conv1d(4, c, 1)

    def forward(self, x):
        return self.output_proj(torch.round(self.input_proj(x)) + self.input_proj(x))


@pytest.mark.parametrize("make,listed", [
    (lambda: SqueezeExcite(), False),
    (lambda: nn.Sequential(nn.Conv2d(8, 2, 1), nn.ReLU(), nn.Conv2d(2, 8, 1), nn.Sigmoid()), False),  # RegNet's SE
    (lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 2, 1), nn.ReLU(), nn.Conv2d(2, 8, 1)), False),
    (lambda: Heads(), False),
    (lambda: Projections(), False),
    (lambda: nn.Sequential(nn.Conv2d(8, 8, 1, padding="same"), nn.GELU(), nn.Conv2d(8, 8, 1)), True),
    (lambda: ConvMlp(conv=nn.Conv1d), True),  # a Conformer-style pointwise MLP over [B, C, T]
    (lambda: ConvMlp(norm=False), True),
    (lambda: Bottleneck(), False),
    (lambda: nn.Sequential(nn.Conv2d(8, 8, 1, stride=2), nn.ReLU(), nn.Conv2d(8, 8, 1)), False),  # strided
    (lambda: nn.Sequential(nn.Conv2d(8, 8, 1, groups=2), nn.ReLU(), nn.Conv2d(8, 8, 1)), False),  # grouped
    (lambda: nn.Sequential(nn.Conv2d(8, 8, 1), nn.Linear(8, 8), nn.Conv2d(8, 8, 1)), False),  # other weights
])
def test_which_modules_are_conv_mlps(make, listed):
    assert bool(pointwise_conv_mlps(make())) == listed
