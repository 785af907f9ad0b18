"""Built-in pattern: the plain MLP ``Linear → pointwise → Linear``.

The wildcard matches any supported pointwise middle (ReLU, GELU erf/tanh, SiLU, ``x * sigmoid(1.702x)``,
squared ReLU, per-channel scales, ...). Longer chains ``Linear → act → Linear → act → … → Linear`` are
overlapping matches of this pattern, merged by the planner.
"""

import torch.nn.functional as F

from fxfuse.pattern import pointwise


def mlp(x, w1, b1, w2, b2):
    return F.linear(pointwise(F.linear(x, w1, b1)), w2, b2)
