"""Rewrite: replace each planned region of the graph with one call to ``torch.ops.fxfuse.mlp``.

Example:
    >>> regions, rejections = find_regions(gm)      # doctest: +SKIP
    >>> replace_regions(gm, regions)                # doctest: +SKIP

``gm`` then calls ``torch.ops.fxfuse.mlp`` where each region was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch
import torch.fx as fx

from . import ops
from .records import FusionRegion

__all__ = ["replace_regions", "fused_call_args"]

log = logging.getLogger(__name__)

# Metadata that describes a node's value: the fused node produces the same value as the region's output.
_VALUE_META = ("tensor_meta", "val", "example_value", "nn_module_stack", "stack_trace")


def fused_call_args(region: FusionRegion, renamed: Optional[dict[fx.Node, fx.Node]] = None) -> tuple:
    """The arguments of the ``torch.ops.fxfuse.mlp`` call for ``region`` (only existing biases).

    ``renamed`` maps the outputs of regions already replaced to their fused nodes (one region may
    feed the next).
    """
    get = (lambda n: renamed.get(n, n)) if renamed else (lambda n: n)
    spec = region.spec.with_biases([b is not None for b in region.biases])
    present = [get(b) for b in region.biases if b is not None]
    return (get(region.input), [get(w) for w in region.weights], present, [get(o) for o in region.operands],
            spec.dumps())


def replace_regions(gm: fx.GraphModule, regions: Sequence[FusionRegion]) -> None:
    """Replace every region in ``gm`` (in place), then ``lint()`` and ``recompile()``."""
    graph = gm.graph
    renamed: dict[fx.Node, fx.Node] = {}
    for region in regions:
        with graph.inserting_before(region.output):
            if region.replacement is not None:
                kwargs = {k: renamed.get(v, v) for k, v in region.replacement_args.items()}
                fused = graph.call_function(region.replacement, kwargs=kwargs)
            else:
                fused = graph.call_function(ops.fused_mlp, fused_call_args(region, renamed))
        renamed[region.output] = fused
        for key in _VALUE_META:
            if key in region.output.meta:
                fused.meta[key] = region.output.meta[key]
        fused.meta["fxfuse_region"] = region.pattern
        region.output.replace_all_uses_with(fused)
        _erase(graph, region.nodes)
        log.debug("replaced %s region at %r with %s", region.pattern, region.module_path, fused.format_node())
    _erase_dead_helpers(graph)
    graph.lint()
    gm.recompile()


def _erase(graph: fx.Graph, nodes: Sequence[fx.Node]) -> None:
    # Users first: walk the region backwards, so each node has no users left when it goes.
    for node in reversed(list(nodes)):
        if node.graph is graph and not node.users:
            graph.erase_node(node)
        elif node.users:
            raise RuntimeError(f"fxfuse: region node {node.name} still has users {list(node.users)}")


def _erase_dead_helpers(graph: fx.Graph) -> None:
    """Drop attribute reads and weight transposes that only the replaced ops used."""
    changed = True
    while changed:
        changed = False
        for node in reversed(graph.nodes):
            if node.users or node.op not in ("get_attr", "call_method", "call_function"):
                continue
            if node.op == "get_attr" or node.target in ("t", torch.t, torch.Tensor.t) or \
                    node.meta.get("fxfuse_helper"):
                graph.erase_node(node)
                changed = True
