"""Chains written inline in a method that cannot be traced: fused by a proven hand-off between submodules.

BART-style layers (BART, mBART, Marian, Pegasus, Whisper, OPT...) write their MLP in the layer's
``forward``, next to attention calls with ``**kwargs`` and a data-dependent fp16 clamp, so no method
that contains the chain traces::

    hidden_states = self.activation_fn(self.fc1(hidden_states))
    hidden_states = nn.functional.dropout(hidden_states, p=self.activation_dropout, training=self.training)
    hidden_states = self.fc2(hidden_states)

Here the chain's submodules are replaced instead: in eval mode, ``fc1`` returns a *token* (an empty meta
tensor) and remembers its input, the activation (and dropout, identity in eval mode) pass the token on,
and ``fc2``, receiving the token, runs ``torch.ops.fxfuse.mlp`` on the remembered input. This is only
done when the method's source proves the hand-off safe (:func:`prove`):

* the chain's modules are referenced once each in the whole class, all in this method;
* the statements from the first linear to the last are top-level (no branch or loop around them), each
  ``h = <calls>`` on one variable ``h``, and the value flows only through the chain's modules and dropout
  calls (``training=self.training``), in the order of the chain the graph matcher found;
* nothing else reads ``h`` while it holds the token, and the last statement overwrites it.

At run time the hand-off is armed only while the method runs, in eval mode, without autocast, hooks on
the chain's modules, or compilation/export tracing; otherwise every module runs its original forward. A
violation of the protocol raises instead of computing a wrong value (the token is a meta tensor).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from .autocast import any_autocast as _any_autocast
from .meta import param_getter
from .ops import fused_mlp
from .pointwise import is_identity_module, is_known_activation

__all__ = ["InlineChain", "prove", "install_parts"]

_DROPOUT_FUNCS = {("nn", "functional", "dropout"), ("F", "dropout"), ("functional", "dropout"),
                  ("torch", "nn", "functional", "dropout"), ("torch", "dropout")}


@dataclass
class InlineChain:
    """A chain of the direct children of ``module_path`` handed off inside ``method``."""

    module_path: str
    method: str
    modules: list[str]  # child names along the chain, in order (first and last are linears)
    linears: list[str]  # child names of the linears, in order
    weights: list[str]  # attribute paths (relative to the parent) in the op's order
    biases: list[str]
    spec: str
    pattern: str
    checked: list[str] = field(default_factory=list)  # modules that must be in eval mode without hooks
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ proof

def _attr_path(node: ast.AST) -> Optional[tuple[str, ...]]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return tuple(reversed(parts))
    return None


def _self_call(node: ast.AST, self_name: str) -> Optional[str]:
    """``name`` if ``node`` is ``self.name(arg)`` with one positional argument and nothing else."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        path = _attr_path(node.func)
        if path is not None and len(path) == 2 and path[0] == self_name:
            return path[1]
    return None


def _is_eval_dropout_call(node: ast.AST, self_name: str) -> bool:
    """``F.dropout(arg, p=..., training=self.training)`` (identity when the module is in eval mode)."""
    if not (isinstance(node, ast.Call) and len(node.args) >= 1 and _attr_path(node.func) in _DROPOUT_FUNCS):
        return False
    training = [k.value for k in node.keywords if k.arg in ("training", "train")]
    if len(node.args) >= 3:
        training.append(node.args[2])
    if len(training) != 1 or any(k.arg == "inplace" for k in node.keywords) or len(node.args) > 3:
        return False
    t = training[0]
    return _attr_path(t) == (self_name, "training") or (isinstance(t, ast.Constant) and t.value is False)


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _carrier(expr: ast.AST, h: Optional[str], self_name: str, first: str, out: list[str]) -> bool:
    """Walk ``expr`` from the outside in along the value of the chain; ``out`` gets the module names
    (inner last). ``h`` is the variable holding the token (``None`` in the statement that calls the
    first linear, whose argument is ordinary code)."""
    name = _self_call(expr, self_name)
    if name is not None:
        out.append(name)
        if name == first and h is None:
            return True
        return _carrier(expr.args[0], h, self_name, first, out)
    if _is_eval_dropout_call(expr, self_name):
        others = [*expr.args[1:], *(k.value for k in expr.keywords)]
        if h is not None and any(h in _names_in(o) for o in others):
            return False
        out.append("<dropout>")
        return _carrier(expr.args[0], h, self_name, first, out)
    return h is not None and isinstance(expr, ast.Name) and expr.id == h


def _find_call(expr: ast.AST, self_name: str, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(expr) if _self_call(n, self_name) == name]


def prove(module: nn.Module, method: str, chain: list[str]) -> tuple[Optional[str], list[str]]:
    """``(None, dropout modules on the way)`` if ``type(module).<method>`` hands the value through ``chain``
    (child names) as described in the module doc, else ``(the reason it cannot be proven, [])``."""
    dropouts = tuple(n for n, m in module.named_children() if isinstance(m, nn.modules.dropout._DropoutNd))
    return _prove_cached(type(module), method, tuple(chain), dropouts)


@functools.lru_cache(maxsize=256)
def _prove_cached(cls: type, method: str, chain: tuple, dropouts: tuple) -> tuple[Optional[str], list[str]]:
    reason, passthrough = _prove(cls, method, list(chain), set(dropouts))
    return reason, passthrough if reason is None else []


def _prove(cls: type, method: str, chain: list[str], dropouts: set[str]):
    fn = inspect.unwrap(getattr(cls, method))
    try:
        fdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError) as err:
        return f"source of {cls.__name__}.{method} unavailable ({type(err).__name__})", []
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fdef.args.args:
        return "not a method", []
    self_name = fdef.args.args[0].arg
    # 1. Each chain module is used once in the whole class (so only this statement sequence calls it).
    reason = _used_once(cls, set(chain))
    if reason:
        return reason, []
    # 2. Top-level straight-line statements h = <calls> from the first linear to the last.
    body = fdef.body
    first, last = chain[0], chain[-1]
    idx = {name: [i for i, s in enumerate(body) if _find_call(s, self_name, name)] for name in (first, last)}
    if len(idx[first]) != 1 or len(idx[last]) != 1:
        return f"{first} / {last} are not called in top-level statements of {cls.__name__}.{method}", []
    i, j = idx[first][0], idx[last][0]
    if j < i:
        return "the chain's linears are called out of order", []
    path: list[str] = []
    h: Optional[str] = None
    for k in range(i, j + 1):
        stmt = body[k]
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return f"line {stmt.lineno} of {cls.__name__}.{method} is not a plain assignment inside the chain", []
        target = stmt.targets[0].id
        if h is not None and target != h:
            return f"the chain's value changes variable ({h} -> {target})", []
        value = stmt.value
        if k == j:  # ordinary code may use the last linear's (real) output
            (call,) = _find_call(value, self_name, last)
            outside = [n for n in ast.walk(value) if isinstance(n, ast.Name) and n.id == h and
                       not any(n is m for m in ast.walk(call))]
            if outside:
                return f"{h} is read outside the chain on line {stmt.lineno}", []
            value = call
        steps: list[str] = []
        if not _carrier(value, h, self_name, first, steps):
            return f"line {stmt.lineno} of {cls.__name__}.{method} does more than pass the value through the chain", []
        path += [s for s in reversed(steps)]
        h = target
    modules = [p for p in path if p != "<dropout>"]
    passthrough = [m for m in modules if m not in chain]
    for m in passthrough:
        if m not in dropouts:
            return f"{m} on the chain's path is not part of the chain", []
    if [m for m in modules if m in chain] != chain:
        return f"the code calls {modules}, the chain is {chain}", []
    return None, passthrough


@functools.lru_cache(maxsize=256)
def _class_tree(klass: type) -> ast.AST | str:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError) as err:
        return f"source of {klass.__name__} unavailable ({type(err).__name__})"


def _used_once(cls: type, names: set[str]) -> Optional[str]:
    counts = dict.fromkeys(names, 0)
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.nn") or klass is object:
            break
        tree = _class_tree(klass)
        if isinstance(tree, str):
            return tree
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.ctx, ast.Load):
                counts[node.attr] += 1
            elif isinstance(node, ast.Constant) and node.value in names:
                return f"{node.value!r} is referenced by name in {klass.__name__}"
    many = sorted(n for n, c in counts.items() if c != 1)
    return f"{', '.join(many)} used more than once in {cls.__name__}" if many else None


# ---------------------------------------------------------------------------------------------- runtime

class _State:
    """Per parent instance: whether the hand-off is armed, and the pending input."""

    __slots__ = ("active", "x", "stage", "parent", "chain", "weights", "biases")

    def __init__(self, chain: InlineChain):
        self.chain = chain
        self.weights = param_getter(chain.weights)
        self.biases = param_getter(chain.biases) if chain.biases else None
        self.active = 0  # the id of the thread running the method, 0 when none
        self.x = None
        self.stage = -1
        self.parent = None

    def __deepcopy__(self, memo):
        new = _State(self.chain)
        memo[id(self)] = new
        new.parent = copy.deepcopy(self.parent, memo)
        return new


_TOKEN = torch.empty(0, device="meta")


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None))


def _global_hooks() -> bool:
    mm = torch.nn.modules.module
    return bool(mm._global_forward_hooks or mm._global_forward_pre_hooks)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def _parent_method(orig: Any, state_attr: str):
    def method(self, *args, **kwargs):
        st: _State = self.__dict__[state_attr]
        if self.training or st.active or _tracing() or _global_hooks() or _any_autocast():
            return orig(self, *args, **kwargs)  # (another call in progress: recursion or another thread)
        mods = self._modules
        for name in st.chain.checked:
            m = mods[name]
            if m.training or _hooked(m):
                return orig(self, *args, **kwargs)
        st.active, st.x, st.stage, st.parent = threading.get_ident(), None, -1, self
        try:
            out = orig(self, *args, **kwargs)
            if st.x is not None:
                raise RuntimeError("fxfuse: inline chain hand-off not completed (the token was not consumed)")
            return out
        finally:
            st.active, st.x, st.stage = 0, None, -1

    functools.update_wrapper(method, orig)
    return method


def _attrs(obj: Any, getter: Any) -> Sequence:
    return getter(obj) if getter is not None else []


def _role_forward(orig: Any, role: str):
    """``forward`` of a chain module: ``head`` defers, ``pass`` forwards the token, ``tail`` runs the op."""

    def forward(self, *args, **kwargs):
        st, index = self.__dict__["_fxfuse_inline_role"]
        if not st.active or st.active != threading.get_ident() or kwargs or len(args) != 1:
            return orig(self, *args, **kwargs)
        x = args[0]
        if role == "head":
            if st.x is not None:
                raise RuntimeError("fxfuse: inline chain entered twice")
            ws = _attrs(st.parent, st.weights)
            # (None: a weight or bias set to None or removed since, which only the original code takes)
            if not isinstance(x, torch.Tensor) or ws is None or any(w.dtype != ws[0].dtype for w in ws) \
                    or _attrs(st.parent, st.biases) is None:
                return orig(self, x)
            st.x, st.stage = x, index
            return _TOKEN
        if x is not _TOKEN:
            return orig(self, x)
        if st.x is None or st.stage != index - 1:
            raise RuntimeError("fxfuse: inline chain hand-off out of order")
        if role == "pass":
            st.stage = index
            return _TOKEN
        chain = st.chain
        h, st.x, st.stage = st.x, None, -1
        return fused_mlp(h, list(_attrs(st.parent, st.weights)),
                         list(_attrs(st.parent, st.biases)), [], chain.spec)

    functools.update_wrapper(forward, orig)
    return forward


def install_parts(model: nn.Module, chain: InlineChain) -> dict[str, tuple[dict, dict]]:
    """``{module path: (methods, instance attributes)}`` to install for ``chain`` (see install.assemble)."""
    parent = model.get_submodule(chain.module_path)
    state = _State(chain)
    attr = "_fxfuse_inline_state"
    parts: dict[str, tuple[dict, dict]] = {}
    orig = getattr(type(parent), chain.method)
    parts[chain.module_path] = ({chain.method: (("inline-parent", chain.method, attr), _parent_method(orig, attr))},
                                {attr: state})
    for index, name in enumerate(chain.modules):
        child = getattr(parent, name)
        role = "head" if index == 0 else "tail" if index == len(chain.modules) - 1 else "pass"
        path = f"{chain.module_path}.{name}" if chain.module_path else name
        fwd = _role_forward(type(child).forward, role)
        parts[path] = ({"forward": (("inline", role), fwd)}, {"_fxfuse_inline_role": (state, index)})
    return parts


def chain_modules(parent: nn.Module, linears: list[str], middles: list[list[str]]) -> Optional[list[str]]:
    """The child names along a serial chain: linear, its activation modules, linear, ... (or ``None``)."""
    out = []
    for k, lin in enumerate(linears):
        out.append(lin)
        if k < len(middles):
            for m in middles[k]:
                mod = getattr(parent, m, None)
                if not (is_known_activation(mod) or is_identity_module(mod)):
                    return None
                out.append(m)
    return out
