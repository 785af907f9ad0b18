"""Built-in pattern: the gated MLP ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU, ...).

The wildcard reads two linears of the same input; the planner checks that they do read the same node.
Either operand order of the product matches (the epilogue is compared in canonical form).
"""

import torch.nn.functional as F

from fxfuse.pattern import pointwise


def gated_mlp(x, w_gate, w_up, w_down):
    return F.linear(pointwise(F.linear(x, w_gate), F.linear(x, w_up)), w_down)
