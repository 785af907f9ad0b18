"""Pointwise clusters: maximal connected sets of supported pointwise nodes, and their epilogue.

After :func:`fxfuse.normalize.normalize`, every supported pointwise node carries a
:class:`~fxfuse.pointwise.PointwiseOp`. Two such nodes are connected when one reads the other.
A :class:`Cluster` is one connected component; the matcher contracts it into one node.

:func:`epilogue_of` turns the part of a cluster that computes one of its exit values into an epilogue
expression (substituting the nodes' expressions into each other): cluster inputs that are canonical
linears become accumulators ``a_i``, other tensor inputs operands ``v_i``, python numbers (and nodes
computing a number fixed for the graph, like Dynamo's ``x.size(-1) ** 0.5``) constants;
the result is put in canonical form (:func:`fxfuse.epilogue.canonicalize`).

Example:
    >>> gm = torch.fx.symbolic_trace(lambda x, w: torch.relu(F.linear(x, w, None)) ** 2)  # doctest: +SKIP
    >>> normalize(gm); (c,) = find_clusters(gm.graph)                                      # doctest: +SKIP
    >>> epilogue_of(c.exits[0], c).text                                                    # doctest: +SKIP
    'pow(relu(a0),2.0)'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

from . import epilogue as ep
from .meta import constant_value
from .normalize import is_linear
from .pointwise import PointwiseOp

__all__ = ["Cluster", "ClusterEpilogue", "find_clusters", "epilogue_of", "MAX_EPILOGUE_SIZE"]

# Larger expression trees (e.g. a residual stream's chain of adds) are not epilogues worth fusing.
MAX_EPILOGUE_SIZE = 64


@dataclass(eq=False)
class Cluster:
    """A maximal connected set of supported pointwise nodes (``nodes`` in graph order)."""

    nodes: list[fx.Node]
    node_set: frozenset[fx.Node] = field(repr=False)
    exits: list[fx.Node]  # cluster nodes whose value is used outside the cluster
    linear_inputs: list[fx.Node]  # distinct canonical linears read by the cluster
    wildcard: bool = False  # a pattern's ``pointwise(...)`` leaf

    def __repr__(self) -> str:
        return f"Cluster({[n.name for n in self.nodes]})"


@dataclass(frozen=True)
class ClusterEpilogue:
    """The canonical epilogue computing ``exit`` from the cluster's inputs.

    ``accs[k]`` is the linear node that is ``a_k``, ``operands[k]`` the tensor node that is ``v_k``;
    ``nodes`` are the cluster nodes the expression covers (graph order).
    """

    text: str
    expr: ep.Expr
    exit: fx.Node
    accs: tuple[fx.Node, ...]
    operands: tuple[fx.Node, ...]
    nodes: tuple[fx.Node, ...]


def pointwise_op(node: fx.Node) -> Optional[PointwiseOp]:
    return node.meta.get("fxfuse_pointwise")


def find_clusters(graph: fx.Graph, wildcard_target=None) -> list[Cluster]:
    """All pointwise clusters of ``graph``, in the order of their first node (one pass, union-find).

    A ``call_function`` of ``wildcard_target`` (the pattern wildcard) is a cluster on its own.
    """
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    members: list[fx.Node] = []
    wild: list[fx.Node] = []
    for node in graph.nodes:
        if wildcard_target is not None and node.op == "call_function" and node.target is wildcard_target:
            wild.append(node)
            continue
        op = pointwise_op(node)
        if op is None:
            continue
        parent[node] = node
        members.append(node)
        for inp in op.inputs:
            if inp in parent:
                ra, rb = find(inp), find(node)
                if ra is not rb:
                    parent[rb] = ra
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in members:
        groups.setdefault(find(node), []).append(node)
    clusters = [_make(nodes) for nodes in groups.values()]
    clusters += [_make([n], wildcard=True) for n in wild]
    return clusters


def _make(nodes: list[fx.Node], wildcard: bool = False) -> Cluster:
    node_set = frozenset(nodes)
    exits = [n for n in nodes if any(u not in node_set for u in n.users)]
    linears: list[fx.Node] = []
    for n in nodes:
        inputs = n.all_input_nodes if wildcard else pointwise_op(n).inputs
        for inp in inputs:
            if is_linear(inp) and inp not in linears:
                linears.append(inp)
    return Cluster(nodes, node_set, exits, linears, wildcard)


class EpilogueTooLarge(ValueError):
    pass


def epilogue_of(exit_node: fx.Node, cluster: Cluster) -> ClusterEpilogue:
    """The canonical epilogue of ``cluster`` that computes ``exit_node``.

    Raises ``ValueError`` when the expression is larger than ``MAX_EPILOGUE_SIZE`` ops or invalid.
    """
    leaves: dict[fx.Node, ep.Expr] = {}
    leaf_nodes: dict[ep.Expr, fx.Node] = {}
    memo: dict[fx.Node, tuple[ep.Expr, int]] = {}
    covered: set[fx.Node] = set()
    n_acc = [0, 0]

    def leaf(n: fx.Node) -> ep.Expr:
        if n not in leaves:
            const = constant_value(n)
            if const is not None:  # a size-derived number fixed for this graph: fold it
                return ep.Const(const)
            if is_linear(n):
                e: ep.Expr = ep.Acc(n_acc[0])
                n_acc[0] += 1
            else:
                e = ep.Operand(n_acc[1])
                n_acc[1] += 1
            leaves[n] = e
            leaf_nodes[e] = n
        return leaves[n]

    def build(n: fx.Node) -> tuple[ep.Expr, int]:
        if n not in cluster.node_set:
            return leaf(n), 0
        if n in memo:
            return memo[n]
        covered.add(n)
        op = pointwise_op(n)
        subs = [build(i) for i in op.inputs]
        size = 1 + sum(s for _, s in subs)
        if size > MAX_EPILOGUE_SIZE:
            raise EpilogueTooLarge(f"epilogue larger than {MAX_EPILOGUE_SIZE} ops")
        memo[n] = (_substitute(op.expr, [e for e, _ in subs]), size)
        return memo[n]

    if cluster.wildcard:
        raise ValueError("a wildcard cluster has no epilogue")
    expr, _ = build(exit_node)
    canon, order = ep.canonicalize(expr)
    nodes = [leaf_nodes[o] for o in order]
    accs = tuple(n for n, o in zip(nodes, order) if isinstance(o, ep.Acc))
    operands = tuple(n for n, o in zip(nodes, order) if isinstance(o, ep.Operand))
    ordered = tuple(n for n in cluster.nodes if n in covered)
    return ClusterEpilogue(str(canon), canon, exit_node, accs, operands, ordered)


def _substitute(expr: ep.Expr, args: list[ep.Expr]) -> ep.Expr:
    if isinstance(expr, ep.Operand):
        return args[expr.index]
    if isinstance(expr, ep.Call):
        return ep.Call(expr.op, tuple(_substitute(a, args) for a in expr.args))
    return expr
