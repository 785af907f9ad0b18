"""Why linears were not fused: the rejection records of :func:`fxfuse.plan.find_regions`, and near misses.

A pattern match that fails a check is rejected with that check's reason (:func:`reject`). Linears that no
pattern matched but that look like an MLP are reported too (:func:`near_misses`): two linears linked by a short
single-use path with an op that cannot be fused in it, and blocks (one or two linears reading one input, then the
last linear, nothing else reading what lies between) kept apart by a submodule whose ops are not pointwise (an
activation with parameters such as Apertus' XIELU, a norm between BitNet's gated product and ``down_proj``),
however many nodes and users lie between. Without them such a block would be neither fused nor explained.

Example:
    >>> import torch
    >>> from fxfuse.normalize import normalize
    >>> from fxfuse.plan import find_regions
    >>> class Odd(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
    ...     def forward(self, x):
    ...         return self.down(torch.cumsum(self.up(x), -1))
    >>> gm = torch.fx.symbolic_trace(Odd()); normalize(gm)
    >>> [r.reason for r in find_regions(gm)[1]]
    ['unsupported op in the middle: torch.cumsum']
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Optional

import torch.fx as fx
from torch import nn

from .match import GraphView
from .meta import tensor_info
from .normalize import is_linear, module_path_of
from .pointwise import describe
from .records import Rejection

__all__ = ["common_path", "near_misses", "reject", "sorted_nodes"]

log = logging.getLogger(__name__)

NEAR_MISS_MAX_NODES = 4
BLOCK_MAX_NODES = 48  # nodes between a block's linears searched for its near miss


def near_misses(view: GraphView, fused: set[fx.Node], out: dict[tuple[str, ...], Rejection]) -> None:
    """Linears whose (single-use) output reaches another linear's input within a few nodes, through an
    op that cannot be fused; and blocks (:func:`_block_before`) whose middle cannot be fused."""
    blocked: set[fx.Node] = set()
    matched = {name for rej in out.values() for name in rej.nodes}  # a match's rejection says why already
    for last in view.linears:
        block = _block_before(view, last) if last.name not in matched else None
        # (a block whose first linears end a fused region, ``head(norm(fc2(...)))``, is no MLP left unfused)
        if block is None or any(lin in fused for lin in block[0]):
            continue
        reason = _block_reason(view, *block, last)
        if reason is not None:
            blocked.add(last)
            reject(view, out, "gated_mlp (near miss)" if len(block[0]) == 2 else "mlp (near miss)", reason,
                    sorted_nodes(view, {*block[0], *block[1], last}))
    kept = _kept_linears(view)
    for first in [*view.linears, *kept]:
        path: list[fx.Node] = []
        node = first
        while len(node.users) == 1 and len(path) <= NEAR_MISS_MAX_NODES:
            (user,) = node.users
            if is_linear(user) or user in kept:
                if user.args[0] is node and path:
                    blocker = next((n for n in (first, *path, user) if n in kept or
                                    (n is not first and n is not user and "fxfuse_pointwise" not in n.meta)), None)
                    if blocker is not None and not (first in fused and user in fused) and user not in blocked:
                        reason = blocker.meta.get("fxfuse_unsupported") or \
                            f"unsupported op in the middle: {describe(blocker, view.gm)}"
                        reject(view, out, "mlp (near miss)", reason, [first, *path, user])
                break
            if user.op not in ("call_function", "call_method", "call_module"):
                break
            path.append(user)
            node = user


def _linear_call(view: GraphView, node: fx.Node) -> bool:
    """A call of an ``nn.Linear`` module that normalize left a call (hooks or an instance ``forward`` of its own)."""
    return node.op == "call_module" and isinstance(view.gm.get_submodule(node.target), nn.Linear)


def _kept_linears(view: GraphView) -> set[fx.Node]:
    """Those :func:`_linear_call` nodes, which normalize marked with why they stay calls."""
    return {n for n in view.gm.graph.nodes if "fxfuse_unsupported" in n.meta and _linear_call(view, n)}


def _block_before(view: GraphView, last: fx.Node) -> Optional[tuple[list[fx.Node], list[fx.Node]]]:
    """``(linears, middle)`` when ``last``'s input is computed from one linear, or from two that read the same input
    (``down(f(up(x)))``, ``down(f(gate(x), up(x)))``), each as wide as ``last``'s input, whose outputs and the nodes
    computed from them (``middle``, at most :data:`BLOCK_MAX_NODES`) are used by nothing but ``last``'s input;
    else None (a residual stream read in the middle, attention's three linears, a packed projection...)."""
    x = last.args[0]
    if not isinstance(x, fx.Node) or is_linear(x):
        return None
    cone: set[fx.Node] = set()
    linears: set[fx.Node] = set()
    stack = [x]
    while stack:  # back from last's input to the linears it is computed from
        node = stack.pop()
        if node in cone or node in linears:
            continue
        if is_linear(node):
            linears.add(node)
            continue
        if node.op in ("placeholder", "get_attr"):
            continue
        if len(cone) == BLOCK_MAX_NODES:
            return None
        cone.add(node)
        # (a size read of a tensor other than a linear's output is a number the block reads, not a path back to
        # other linears: SegFormer's later stages take height and width from tensors computed after earlier blocks)
        stack.extend(a for a in node.all_input_nodes if not _size_read(node) or _size_read(a) or is_linear(a))
    if not 1 <= len(linears) <= 2 or len({lin.args[0] for lin in linears}) != 1:
        return None
    width = tensor_info(view.gm, last.args[1]) if isinstance(last.args[1], fx.Node) else None
    for lin in linears:
        w = tensor_info(view.gm, lin.args[1]) if isinstance(lin.args[1], fx.Node) else None
        if w is not None and width is not None and w.ndim == width.ndim == 2 and w.shape[0] != width.shape[1]:
            return None
    middle: set[fx.Node] = set()
    for node in sorted_nodes(view, cone):  # what is computed from the linears (the rest: operands)
        if any(a in linears or a in middle for a in node.all_input_nodes):
            middle.add(node)
    if x not in middle or any(u not in middle and u is not last and not _unused_read(u)
                              for n in (*linears, *middle) for u in n.users) or any(a is x for a in last.args[1:]):
        return None
    return sorted_nodes(view, linears), sorted_nodes(view, middle)


def _size_read(node: fx.Node) -> bool:
    """``h.shape``, ``h.size()``, ``h.dim()`` and items of those: what a block reads of its tensors' sizes."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _size_read(node.args[0])
    return (node.op == "call_function" and node.target is getattr) or \
        (node.op == "call_method" and node.target in ("size", "dim"))


def _leaf_frames(target: str) -> list[tuple[str, None]]:
    """A leaf module call's ``fxfuse_frames``-like list: the paths of the modules it runs inside, outermost first
    (not its own: a leaf that is the block's own child is one of the block's ops)."""
    parts = target.split(".")
    return [(".".join(parts[:i]), None) for i in range(1, len(parts))]


def _unused_read(node: fx.Node) -> bool:
    """A size or item read whose value nobody uses (``b, _, c = h.shape``'s ``_``)."""
    return not node.users and node.op == "call_function" and node.target in (operator.getitem, getattr)


def _block_reason(view: GraphView, linears: list[fx.Node], middle: list[fx.Node], last: fx.Node) -> Optional[str]:
    """Why a block's middle cannot be fused: a submodule it calls whose ops are not pointwise (named, with its class
    and parameters), or, in a middle of a few nodes, the first op that is not; None when neither (not a near miss)."""
    blockers = [n for n in middle if "fxfuse_pointwise" not in n.meta and not _size_read(n)]
    if not blockers:
        return None
    base = common_path([*linears, last])
    owned = [lin_path + "." for lin_path in map(module_path_of, (*linears, last))]
    by_module: dict[str, list[fx.Node]] = {}
    frame_of: dict[str, Any] = {}
    for n in blockers:  # the submodule (below the block's module, holding none of its linears) each op ran in
        # (a leaf module: inside the submodules its path names)
        frames = n.meta.get("fxfuse_frames", ()) if n.op != "call_module" else _leaf_frames(str(n.target))
        path = next((p for p, _ in frames if p != base and p.startswith(f"{base}." if base else "")
                     and not any(o.startswith(p + ".") for o in owned)), None)
        if path is not None:
            by_module.setdefault(path, []).append(n)
            if frame_of.get(path) is None:
                frame_of[path] = next((c for p, c in frames if p == path and c not in _MODULE_CALLS), None)

    def rel(p: str) -> str:  # relative to the block's module ("": the module itself)
        return "" if p == base else p[len(base) + 1:] if base and p.startswith(base + ".") else p

    sources = " and ".join([", ".join(rel(module_path_of(lin)) or lin.name for lin in linears),
                            rel(module_path_of(last)) or last.name])
    if not by_module:
        # A module with parameters called in the block's own code (SegFormer's Mix-FFN written inline: its
        # depthwise conv between reshapes), however long the middle around it.
        weighted = next((n for n in blockers if n.op == "call_module" and
                         any(True for _ in view.gm.get_submodule(str(n.target)).parameters())), None)
        if weighted is not None:
            return (f"{rel(str(weighted.target))} ({describe(weighted, view.gm)}) between {sources} is not a "
                    f"supported epilogue")
        if len(middle) > NEAR_MISS_MAX_NODES + 1:
            return None
        return blockers[0].meta.get("fxfuse_unsupported") or \
            f"unsupported op in the middle: {describe(blockers[0], view.gm)}"
    path, ops = next(iter(by_module.items()))
    qualname = getattr(frame_of.get(path), "co_qualname", "")
    params = dict.fromkeys(str(n.target)[len(path) + 1:] for n in view.gm.graph.nodes if n.op == "get_attr" and
                           str(n.target).startswith(path + ".") and isinstance(_attr(view.gm, n.target), nn.Parameter))
    what = ", ".join(([qualname.split(".")[0]] if "." in qualname else [])  # (Python 3.10: no co_qualname)
                     + ([f"parameters {', '.join(params)}"] if params else []))
    names = list(dict.fromkeys(describe(n, view.gm).replace("_operator.", "operator.") for n in ops))
    return (f"{rel(path)}{f' ({what})' if what else ''} between {sources} is not a supported epilogue: it calls "
            f"{', '.join(names)}, which fxfuse does not fuse")


_MODULE_CALLS = (nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__)  # __call__'s frames


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def reject(view: GraphView, out: dict, pattern: str, reason: str, nodes: list[fx.Node], logged=False) -> None:
    key = tuple(n.name for n in nodes)
    if key in out:
        return
    path = common_path([n for n in nodes if is_linear(n) or _linear_call(view, n)])
    if not logged:
        log.debug("dropped %s match at %r %s: %s", pattern, path, list(key), reason)
    out[key] = Rejection(pattern=pattern, module_path=path, reason=reason, nodes=list(key))


def sorted_nodes(view: GraphView, nodes) -> list[fx.Node]:
    """``nodes`` in graph order."""
    return sorted(nodes, key=view.order.__getitem__)


def common_path(linears: list[fx.Node]) -> str:
    """The module path the linears share (``layers.0.mlp`` for its ``up_proj`` and ``down_proj``)."""
    paths = [module_path_of(lin).split(".") for lin in linears]
    paths = [p for p in paths if p != [""]]
    if not paths:
        return ""
    common = paths[0]
    for p in paths[1:]:
        i = 0
        while i < min(len(common), len(p)) and common[i] == p[i]:
            i += 1
        common = common[:i]
    return ".".join(common)
