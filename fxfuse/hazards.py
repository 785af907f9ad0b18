"""Hazards: the ops that may not run between a chain's first op and its last one.

A fused region runs as one call placed at the chain's last linear (:mod:`fxfuse.rewrite`), so it reads the
chain's input, weights, biases and operands later than the chain's first op did, and in the modes in force
there. That is the same computation only if nothing in between

* writes to a tensor in place (``x.add_(1)``, ``x += 1``, ``x[i] = v``, ``F.relu(t, inplace=True)``,
  ``out=``, an aten op whose schema mutates an argument): the write may reach the chain's input through
  an alias, or a weight, which the eager chain read before it; or may do so: a call kept whole whose code the
  graph does not show (a submodule that did not trace, a custom ``autograd.Function``, a wrapped function) on
  a tensor;
* switches a mode its ops depend on (``torch.no_grad()`` / ``enable_grad`` / ``set_grad_enabled``, which
  Dynamo records as ``torch._C._set_grad_enabled`` calls; autocast's enter and exit; inference mode): a
  chain that crosses ``with torch.no_grad():`` would record gradients for a frozen layer, or none for a
  trained one.

The planner (:mod:`fxfuse.plan`) drops a chain with such an op in between and says which op it was.
Whether the written tensor really aliases what the chain reads is not tracked: any write in between is
enough (real MLPs have none; a write there is rare and the unfused ops are always right).

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(lambda x: x.add_(1))
    >>> [hazard(n, gm) for n in gm.graph.nodes if n.op == "call_method"]
    ['an in-place op (add_)']
"""

from __future__ import annotations

import inspect
import operator
from typing import Optional

import torch.fx as fx

from .pointwise import is_known_activation

__all__ = ["hazard"]

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.setitem}
_MODE_WORDS = ("grad_enabled", "no_grad", "enable_grad", "inference_mode", "autocast")
_INPLACE_METHODS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


def hazard(node: fx.Node, gm: Optional[fx.GraphModule] = None) -> Optional[str]:
    """What ``node`` does that a fused chain may not run across (see the module doc), or ``None``.

    ``gm`` resolves ``call_module`` targets (a module with ``inplace=True``, such as ``nn.ReLU(inplace=True)``).
    """
    if node.meta.get("fxfuse_helper"):  # (normalize's own views of a weight: a transpose, a packed half)
        return None
    if node.op == "call_function":
        target = node.target
        name = getattr(target, "__name__", "") or str(target)
        if any(word in name for word in _MODE_WORDS):
            return f"a mode switch ({name}: torch.no_grad(), autocast or the like)"
        if target in _INPLACE_OPERATORS:
            return f"an in-place op ({name})"
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return f"an in-place op ({name})"
        if _writes(name, node):
            return f"an in-place op ({name})"
    elif node.op == "call_method":
        if node.target in _INPLACE_METHODS or _writes(node.target, node):
            return f"an in-place op ({node.target})"
    elif node.op == "call_module" and gm is not None:
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            return None
        if getattr(module, "inplace", False) is True:
            return f"an in-place module ({type(module).__name__}(inplace=True))"
        if node.all_input_nodes and not (_known(type(module)) or is_known_activation(module)):
            return f"a module call fxfuse cannot see into ({type(module).__name__}, which may write its inputs)"
    if node.op == "call_function" and node.all_input_nodes and not _known(node.target):
        return f"a call fxfuse cannot see into ({getattr(node.target, '__name__', node.target)}, which may write " \
            "its inputs)"
    return None


_KNOWN_MODULES = ("torch", "_operator", "operator", "builtins", "math")


def _known(target) -> bool:
    """Whether ``target`` (a function or a module class) is torch's or Python's: its effects are the ones the
    checks above see (an in-place name, a mutable schema, ``inplace=``). Anything else kept whole in a graph (a
    submodule that did not trace, a custom ``autograd.Function``, a wrapped function) may write its inputs."""
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in _KNOWN_MODULES


def _writes(name: str, node: fx.Node) -> bool:
    """Whether a torch function or tensor method writes to a tensor: a trailing ``_`` (``add_``, ``relu_``,
    ``copy_``), ``inplace=True`` or ``out=``."""
    if name.endswith("_") and not name.startswith("_"):
        return True
    if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    if node.op == "call_function" and callable(node.target) and len(node.args) > 1:  # F.relu(x, True)
        try:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
        except (TypeError, ValueError):
            return False
        return bound.arguments.get("inplace") is True
    return False
