"""The matcher's view of a normalized graph, and subgraph matching with networkx.

:func:`build_view` turns a normalized fx graph into a small ``networkx.DiGraph``:

* one node per canonical linear (the ``fx.Node`` itself; weight and bias are attributes, not edges),
* one node per pointwise :class:`~fxfuse.cluster.Cluster` (contracted; it carries its canonical epilogue
  text when it has a single exit value),
* edges ``linear -> cluster`` with ``role="acc"`` (the linear's output is read by the cluster) and
  ``cluster -> linear`` / ``linear -> linear`` with ``role="input"`` (it is the linear's input ``x``).

Patterns (:mod:`fxfuse.pattern`) are turned into the same kind of view, and :func:`match` finds them with
``networkx.algorithms.isomorphism.DiGraphMatcher`` (subgraph monomorphisms). A pattern's wildcard cluster
matches any model cluster reading the same number of linears; a concrete pattern cluster matches a model
cluster with the same canonical epilogue text; a pattern linear matches a linear with or without bias.

Example:
    >>> view = build_view(gm)                                   # doctest: +SKIP
    >>> for mapping in match(view, pattern.view): ...           # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import networkx as nx
import torch.fx as fx
from networkx.algorithms.isomorphism import DiGraphMatcher

from .cluster import Cluster, ClusterEpilogue, epilogue_of, find_clusters
from .normalize import is_linear

__all__ = ["GraphView", "build_view", "match"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class GraphView:
    """A normalized graph as the matcher sees it."""

    gm: fx.GraphModule
    graph: nx.DiGraph
    linears: list[fx.Node]
    clusters: list[Cluster]
    cluster_of: dict[fx.Node, Cluster]
    order: dict[fx.Node, int]  # position of every fx node in the graph
    _epilogues: dict[tuple[int, fx.Node], Any] = field(default_factory=dict, repr=False)
    _components: Optional[list[set]] = field(default=None, repr=False)

    def components(self) -> list[set]:
        """Weakly connected components of the view, in graph order (computed once)."""
        if self._components is None:
            comps = list(nx.weakly_connected_components(self.graph))
            self._components = sorted(comps, key=lambda c: min(self._position(n) for n in c))
        return self._components

    def _position(self, node) -> int:
        return self.order[node] if isinstance(node, fx.Node) else min(self.order[n] for n in node.nodes)

    def epilogue(self, cluster: Cluster, exit_node: fx.Node) -> ClusterEpilogue:
        """The (cached) epilogue of ``cluster`` computing ``exit_node``; raises ``ValueError`` if none."""
        key = (id(cluster), exit_node)
        if key not in self._epilogues:
            try:
                self._epilogues[key] = epilogue_of(exit_node, cluster)
            except ValueError as err:
                self._epilogues[key] = err
        result = self._epilogues[key]
        if isinstance(result, Exception):
            raise result
        return result


def build_view(gm: fx.GraphModule, wildcard_target=None) -> GraphView:
    """Build the matcher's ``DiGraph`` of a normalized ``gm`` (linear and cluster nodes only)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    linears = [n for n in gm.graph.nodes if is_linear(n)]
    clusters = find_clusters(gm.graph, wildcard_target)
    cluster_of = {n: c for c in clusters for n in c.nodes}
    view = GraphView(gm, nx.DiGraph(), linears, clusters, cluster_of, order)
    g = view.graph
    for lin in linears:
        g.add_node(lin, kind="linear", has_bias=lin.args[2] is not None)
    for c in clusters:
        text: Optional[str] = None
        if not c.wildcard and len(c.exits) == 1:
            try:
                text = view.epilogue(c, c.exits[0]).text
            except ValueError:
                text = None
        g.add_node(c, kind="cluster", wildcard=c.wildcard, n_acc=len(c.linear_inputs), text=text)
        for lin in c.linear_inputs:
            g.add_edge(lin, c, role="acc")
    for lin in linears:
        x = lin.args[0]
        if isinstance(x, fx.Node):
            if is_linear(x):
                g.add_edge(x, lin, role="input")
            elif x in cluster_of:
                g.add_edge(cluster_of[x], lin, role="input")
    return view


def _node_match(model: dict, pattern: dict) -> bool:
    if model["kind"] != pattern["kind"]:
        return False
    if model["kind"] == "linear":
        return True
    if model["wildcard"] or model["n_acc"] != pattern["n_acc"]:
        return False
    return pattern["wildcard"] or (model["text"] is not None and model["text"] == pattern["text"])


def _edge_match(model: dict, pattern: dict) -> bool:
    return model["role"] == pattern["role"]


def match(view: GraphView, pattern_graph: nx.DiGraph) -> Iterator[dict[Any, Any]]:
    """Yield every embedding of ``pattern_graph`` in ``view.graph`` as ``{pattern node: model node}``.

    Embeddings that differ only by an automorphism of the pattern (gate/up swapped) are all yielded;
    the planner keeps the first that passes its checks.
    """
    # Patterns are connected, so each embedding lies in one weakly connected component of the view.
    # Matching component by component keeps VF2's search local (a 12-block model is 12+ small
    # components, not one graph of a hundred nodes to pair against every pattern node).
    size = pattern_graph.number_of_nodes()
    for component in view.components():
        if len(component) < size:
            continue
        sub = view.graph.subgraph(component)
        matcher = DiGraphMatcher(sub, pattern_graph, node_match=_node_match, edge_match=_edge_match)
        for mapping in matcher.subgraph_monomorphisms_iter():
            yield {p: m for m, p in mapping.items()}
