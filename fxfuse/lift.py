"""Parameter reads lifted out of a fused graph: the host method reads them and passes them in.

A fused method's generated code reads each parameter as ``self.fc1.weight``: two ``nn.Module.__getattr__``
calls per tensor (~0.3-0.5 µs each on the H200 machine's host), eight for a GPT-2 MLP, which is a tenth of
a decode call's host path. :func:`lift_params` turns the graph's ``get_attr`` reads of parameters and
buffers into trailing arguments; the host method reads them through the modules' dicts
(:func:`fxfuse.meta.param_getter`) and passes them, so the graph still reads the live tensors on every call
(a replaced or moved parameter is seen as before).

Example:
    >>> lifted, paths = lift_params(gm)                     # doctest: +SKIP
    >>> paths                                               # doctest: +SKIP
    ['fc1.weight', 'fc1.bias', 'fc2.weight', 'fc2.bias']
    >>> type(lifted).forward(module, x, *param_getter(paths)(module))   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch.fx as fx
from torch import nn

__all__ = ["lift_params"]

log = logging.getLogger(__name__)


def _owner(root: nn.Module, target: str) -> Optional[nn.Module]:
    """The module holding ``target`` as a parameter or buffer, reached through ``_modules`` only, else None."""
    *parts, name = target.split(".")
    m = root
    for part in parts:
        m = m._modules.get(part)
        if m is None:
            return None
    return m if name in m._parameters or name in m._buffers else None


def lift_params(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """A copy of ``gm`` whose parameter and buffer reads are trailing arguments, and their paths in order.

    Returns ``(gm, [])`` unchanged when there is nothing to lift, or when the signature cannot take trailing
    arguments (a parameter with a default, ``*args`` or ``**kwargs``).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(n.args or str(n.target).startswith("*") for n in placeholders):
        return gm, []
    reads = [n for n in gm.graph.nodes if n.op == "get_attr" and _owner(gm, str(n.target)) is not None]
    if not reads:
        return gm, []
    graph = copy.deepcopy(gm.graph)
    nodes = {n.name: n for n in graph.nodes}
    anchor = nodes[placeholders[-1].name] if placeholders else None
    paths = []
    for read in reads:
        node = nodes[read.name]
        if anchor is None:
            ctx = graph.inserting_before(next(iter(graph.nodes)))
        else:
            ctx = graph.inserting_after(anchor)
        with ctx:
            arg = graph.placeholder(f"{node.name}_arg")
        arg.meta = dict(node.meta)
        node.replace_all_uses_with(arg)
        graph.erase_node(node)
        anchor = arg
        paths.append(str(read.target))
    graph.lint()
    lifted = fx.GraphModule(gm, graph)
    log.debug("fxfuse: %d parameter reads lifted into arguments: %s", len(paths), ", ".join(paths))
    return lifted, paths
