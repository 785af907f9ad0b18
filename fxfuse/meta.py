"""What is known about the tensor a graph node produces: shape, dtype, device.

The facts come, in order of preference, from

  * ``node.meta["fxfuse_info"]``: set by :mod:`fxfuse.normalize` on the nodes it creates,
  * ``node.meta["val"]`` / ``node.meta["example_value"]``: the fake tensors Dynamo (and AOT/export) record,
  * ``node.meta["tensor_meta"]``: what :class:`torch.fx.passes.shape_prop.ShapeProp` records (no device),
  * the real tensor behind a ``get_attr`` node (parameters and buffers of a traced module).

Symbolic dimensions (dynamic shapes) are reported as ``None``.

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    >>> lin = next(n for n in gm.graph.nodes if n.op == "call_module")
    >>> tensor_info(gm, lin) is None  # no metadata without example inputs
    True
    >>> w = gm.graph.create_node("get_attr", "0.weight")
    >>> tensor_info(gm, w).shape      # a get_attr reads the real parameter
    (3, 4)
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

__all__ = ["TensorInfo", "constant_value", "get_attr_value", "info_of_value", "param_getter", "records_grad",
           "tensor_info"]


@dataclass(frozen=True)
class TensorInfo:
    """Static facts about one tensor value; ``shape`` entries are ``None`` where symbolic."""

    shape: tuple[Optional[int], ...]
    dtype: torch.dtype
    device: Optional[torch.device]
    requires_grad: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> Optional[int]:
        """Number of elements, or ``None`` if a dimension is symbolic."""
        if any(d is None for d in self.shape):
            return None
        return int(functools.reduce(lambda a, b: a * b, self.shape, 1))


def _dim(d: Any) -> Optional[int]:
    if isinstance(d, int):
        return d
    try:  # a SymInt whose value is fixed (e.g. a static dim seen through a symbolic shape env)
        if d.node.is_constant():
            return int(d)
    except AttributeError:
        pass
    return None


def info_of_value(value: Any) -> Optional[TensorInfo]:
    """Facts about a (real or fake) tensor; ``None`` for anything that is not a tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    return TensorInfo(tuple(_dim(d) for d in value.shape), value.dtype, value.device, bool(value.requires_grad))


def get_attr_value(gm: torch.nn.Module, target: str) -> Any:
    """The object a ``get_attr`` target names (``"blocks.0.fc1.weight"``), or ``None`` if absent."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def tensor_info(gm: torch.nn.Module, node: fx.Node) -> Optional[TensorInfo]:
    """Return what is statically known about the tensor ``node`` produces, or ``None`` if unknown.

    ``None`` also means "not a tensor" (e.g. a ``size()`` result) when metadata says so.
    """
    meta = node.meta
    info = meta.get("fxfuse_info")
    if info is not None:
        return info
    for key in ("val", "example_value"):
        if key in meta:
            return info_of_value(meta[key])
    tm = meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape") and hasattr(tm, "dtype"):
        return TensorInfo(tuple(_dim(d) for d in tm.shape), tm.dtype, None, bool(getattr(tm, "requires_grad", False)))
    if node.op == "get_attr":
        return info_of_value(get_attr_value(gm, node.target))
    return None


def records_grad(node: fx.Node) -> Optional[bool]:
    """Whether the value ``node`` produces records gradients where the graph computes it, as the fake tensor that
    Dynamo (or AOT, export) recorded for it says; ``None`` when the node has none (a traced module's graph: its
    shapes come from ``ShapeProp``, which runs without grad mode).

    Dynamo computes each node's fake value under the grad mode that part of the graph runs in: an MLP called inside
    ``torch.no_grad()`` (or a forward decorated with it) records nothing although its weights require grad, and one
    inside ``torch.enable_grad()`` of a graph compiled without grad mode records gradients.

    Example:
        >>> node = fx.Graph().placeholder("x")
        >>> records_grad(node) is None  # no fake value
        True
        >>> node.meta["example_value"] = torch.zeros(2, requires_grad=True)
        >>> records_grad(node)
        True
    """
    for key in ("val", "example_value"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            return bool(value.requires_grad)
    return None


def constant_value(node: Any) -> Optional[float]:
    """The value of a node that computes a python number fixed for this graph (e.g. ``x.size(-1) ** 0.5``
    with a static last dim, as Dynamo records it), else ``None``."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    expr = getattr(getattr(value, "node", None), "expr", None)
    if isinstance(value, (torch.SymInt, torch.SymFloat)) and expr is not None and getattr(expr, "is_number", False):
        return float(expr)
    return None


def param_getter(paths: list[str]) -> Callable[[torch.nn.Module], Optional[Sequence[torch.Tensor]]]:
    """``self -> [tensors at paths]`` through the modules' own dicts (``getattr`` on modules is slow); None when one
    of them is None or gone now (a bias set to None after the graph was traced: only the original code takes that)."""
    # (owner module path, tensor name) per path, split once: this runs on every call of a fused method.
    split = [(tuple(p.split(".")[:-1]), p.split(".")[-1]) for p in paths]
    getters = [operator.attrgetter(p) for p in paths]

    def get(module: torch.nn.Module) -> Optional[Sequence[torch.Tensor]]:
        out = []
        try:
            for owner, name in split:
                m = module
                for part in owner:
                    m = m._modules[part]
                t = m._parameters.get(name)
                if t is None:
                    t = m._buffers[name]
                    if t is None:
                        raise KeyError(name)
                out.append(t)
        except (KeyError, AttributeError):  # not a plain parameter/buffer path (or a None one): the slow way
            try:
                out = [g(module) for g in getters]
            except AttributeError:  # a tensor removed since: the original code says what that means
                return None
            return None if any(t is None for t in out) else out
        return out

    return get
