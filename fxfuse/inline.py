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
* nothing else reads ``h`` while it holds the token, and the last statement overwrites it (or assigns
  the result to another variable, and ``h`` is read neither after it nor in a closure).

A chain may also span sibling submodules called from the method (MPNet's, DeBERTa's, Data2VecVision's layers:
``x = self.intermediate(a)`` then ``y = self.output(x, a)``, the linears and the activation inside them).
Each such *group* is proven the same way in its own ``forward``: the group holding the first linear
returns the token (``return h`` right after the chain's statements), a later group takes it as its first
parameter, which the chain's statements consume from the method's first line on; in the method, a group
that takes the token may get other arguments, which do not read ``h``.

At run time the hand-off is armed only while the method runs, in eval mode, without autocast, hooks or an
instance ``forward`` on the chain's modules and groups, or compilation/export tracing, and while those
modules are still the ones it was installed on; otherwise every module runs its original forward. A
violation of the protocol raises instead of computing a wrong value (the token is a meta tensor).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import sys
import textwrap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from .autocast import any_autocast as _any_autocast
from .kernels.template import kernels_run
from .meta import param_getter
from .module_state import GLOBAL_HOOKS, Settings, original_because, runs_own_code, submodule
from .ops import fused_mlp
from .pointwise import is_identity_module, is_known_activation
from .transforms import checkpointed

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


def _self_call(node: ast.AST, self_name: str, groups: frozenset = frozenset()) -> Optional[str]:
    """``name`` if ``node`` is ``self.name(arg)`` with one positional argument and nothing else; a group (in
    ``groups``) may get more arguments, none of them ``*``/``**``."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    path = _attr_path(node.func)
    if path is None or len(path) != 2 or path[0] != self_name:
        return None
    if len(node.args) == 1 and not node.keywords:
        return path[1]
    if path[1] in groups and not any(isinstance(a, ast.Starred) for a in node.args) \
            and all(k.arg is not None for k in node.keywords):
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


def _carrier(expr: ast.AST, h: Optional[str], self_name: str, first: str, out: list[str],
             groups: frozenset = frozenset()) -> bool:
    """Walk ``expr`` from the outside in along the value of the chain; ``out`` gets the module names
    (inner last). ``h`` is the variable holding the token (``None`` in the statement that calls the
    first linear, whose argument is ordinary code)."""
    name = _self_call(expr, self_name, groups)
    if name is not None:
        out.append(name)
        if name == first and h is None:
            return True
        others = [*expr.args[1:], *(k.value for k in expr.keywords)]  # (a group's other arguments)
        if h is not None and any(h in _names_in(o) for o in others):
            return False
        return _carrier(expr.args[0], h, self_name, first, out, groups)
    if _is_eval_dropout_call(expr, self_name):
        others = [*expr.args[1:], *(k.value for k in expr.keywords)]
        if h is not None and any(h in _names_in(o) for o in others):
            return False
        out.append("<dropout>")
        return _carrier(expr.args[0], h, self_name, first, out, groups)
    return h is not None and isinstance(expr, ast.Name) and expr.id == h


def _find_call(expr: ast.AST, self_name: str, name: str, groups: frozenset = frozenset()) -> list[ast.Call]:
    return [n for n in ast.walk(expr) if _self_call(n, self_name, groups) == name]


def _dropouts(module: nn.Module) -> tuple:
    return tuple(n for n, m in module.named_children() if isinstance(m, nn.modules.dropout._DropoutNd))


def prove(module: nn.Module, method: str, chain: list[str]) -> tuple[Optional[str], list[str]]:
    """``(None, the modules on the way that are not the chain's: dropouts, and the groups whose forward calls the
    chain's modules)`` if ``type(module).<method>`` hands the value through ``chain`` (child names, or
    ``group.child`` for a child of a child) as described in the module doc, else ``(the reason it cannot be
    proven, [])``."""
    tops = [name.split(".")[0] for name in chain]
    outer = list(dict.fromkeys(tops))
    if [t for k, t in enumerate(tops) if k == 0 or t != tops[k - 1]] != outer:
        return "a submodule is entered twice along the chain", []
    if any(name.count(".") > 1 for name in chain):
        return "the chain's modules are not children of the method's module or of its children", []
    grouped = [g for g in outer if any(name.startswith(f"{g}.") for name in chain)]
    if any(g in chain for g in grouped):
        return "a module of the chain is also a group of it", []
    groups = tuple((g, type(module._modules[g]), _dropouts(module._modules[g])) for g in grouped)
    return _prove_cached(type(module), method, tuple(chain), _dropouts(module), groups)


@functools.lru_cache(maxsize=256)
def _prove_cached(cls: type, method: str, chain: tuple, dropouts: tuple, groups: tuple) \
        -> tuple[Optional[str], list[str]]:
    names = frozenset(g for g, _, _ in groups)
    outer = list(dict.fromkeys(name.split(".")[0] for name in chain))
    reason, passthrough = _prove(cls, method, outer, set(dropouts), names)
    if reason is not None:
        return reason, []
    for g, gcls, gdropouts in groups:
        inner = [name.split(".", 1)[1] for name in chain if name.startswith(f"{g}.")]
        # The group holding the first linear returns the token; a later one takes it as its first parameter.
        reason, more = _prove(gcls, "forward", inner, set(gdropouts), frozenset(),
                              entry="call" if g == outer[0] else "param", leave="value" if g == outer[-1] else "return")
        if reason is not None:
            return f"in {g} ({gcls.__name__}): {reason}", []
        passthrough += [f"{g}.{m}" for m in more]
    return None, passthrough + [g for g, _, _ in groups]


def _prove(cls: type, method: str, chain: list[str], dropouts: set[str], groups: frozenset = frozenset(),
           entry: str = "call", leave: str = "value"):
    """``entry``: ``"call"`` (the first module is called on ordinary code) or ``"param"`` (the token is the
    method's first argument); ``leave``: ``"value"`` (the last module's output is a real value) or ``"return"``
    (the method returns the token)."""
    raw = getattr(cls, method)
    fn = inspect.unwrap(raw)
    try:
        fdef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError) as err:
        return f"source of {cls.__name__}.{method} unavailable ({type(err).__name__})", []
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fdef.args.args:
        return "not a method", []
    if (entry, leave) != ("call", "value") and (fn is not raw or fdef.decorator_list):  # it sees the token
        return f"{cls.__name__}.{method} is decorated", []
    self_name = fdef.args.args[0].arg
    # 1. Each chain module is used once in the whole class (so only this statement sequence calls it).
    reason = _used_once(cls, set(chain))
    if reason:
        return reason, []
    # 2. Top-level straight-line statements h = <calls> from the first linear to the last.
    body = fdef.body
    first, last = chain[0], chain[-1]
    idx = {name: [i for i, s in enumerate(body) if _find_call(s, self_name, name, groups)] for name in (first, last)}
    if len(idx[first]) != 1 or len(idx[last]) != 1:
        return f"{first} / {last} are not called in top-level statements of {cls.__name__}.{method}", []
    i, j = idx[first][0], idx[last][0]
    if j < i:
        return "the chain's linears are called out of order", []
    h: Optional[str] = None
    if entry == "param":  # the token arrives as the first argument, consumed from the first line on
        params = fdef.args.args[1:]
        start = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
        if fdef.args.posonlyargs or not params:
            return f"{cls.__name__}.{method} has no first argument to take the chain's value", []
        if i != start:
            return f"{cls.__name__}.{method} does more than pass its first argument through the chain", []
        h = params[0].arg
    path: list[str] = []
    for k in range(i, j + 1):
        stmt = body[k]
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return f"line {stmt.lineno} of {cls.__name__}.{method} is not a plain assignment inside the chain", []
        target = stmt.targets[0].id
        if h is not None and target != h:
            if k != j:
                return f"the chain's value changes variable ({h} -> {target})", []
            if _read_after(fdef, h, body[j + 1:]):  # it still holds the token
                return f"{h} is read after line {stmt.lineno} of {cls.__name__}.{method}", []
        value = stmt.value
        if k == j and leave == "value":  # ordinary code may use the last linear's (real) output
            (call,) = _find_call(value, self_name, last, groups)
            outside = [n for n in ast.walk(value) if isinstance(n, ast.Name) and n.id == h and
                       not any(n is m for m in ast.walk(call))]
            if outside:
                return f"{h} is read outside the chain on line {stmt.lineno}", []
            if not _runs_once(value, call):
                return f"the last linear's call on line {stmt.lineno} may run other than once (inside a " \
                       "conditional, a boolean operator, a lambda or a comprehension)", []
            value = call
        steps: list[str] = []
        if not _carrier(value, h, self_name, first, steps, groups):
            return f"line {stmt.lineno} of {cls.__name__}.{method} does more than pass the value through the chain", []
        path += [s for s in reversed(steps)]
        h = target
    if leave == "return":
        after = body[j + 1] if j + 1 < len(body) else None
        if not (isinstance(after, ast.Return) and isinstance(after.value, ast.Name) and after.value.id == h):
            return f"{cls.__name__}.{method} does more than return the chain's value after line {body[j].lineno}", []
    modules = [p for p in path if p != "<dropout>"]
    passthrough = [m for m in modules if m not in chain]
    for m in passthrough:
        if m not in dropouts:
            return f"{m} on the chain's path is not part of the chain", []
    if [m for m in modules if m in chain] != chain:
        return f"the code calls {modules}, the chain is {chain}", []
    return None, passthrough


def _read_after(fdef: ast.AST, name: str, rest: list[ast.stmt]) -> bool:
    """Whether ``name`` is used after the chain's statements, or in a closure that may run then."""
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)
    nested = [n for n in ast.walk(fdef) if isinstance(n, scopes) and n is not fdef]
    return any(name in _names_in(n) for n in [*rest, *nested])


_CONDITIONAL = (ast.IfExp, ast.BoolOp, ast.Compare, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                ast.GeneratorExp, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)


def _runs_once(root: ast.AST, call: ast.AST) -> bool:
    """Whether evaluating ``root`` evaluates ``call`` exactly once: no conditional, short-circuit, deferred or
    repeated evaluation on the way down to it (``y = self.fc2(h) if flag else x`` may skip it)."""
    parents = {child: node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}
    node = call
    while node is not root:
        node = parents[node]
        if isinstance(node, _CONDITIONAL):
            return False
    return True


@functools.lru_cache(maxsize=256)
def _class_tree(klass: type) -> ast.AST | str:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError) as err:
        return f"source of {klass.__name__} unavailable ({type(err).__name__})"


_SUBMODULE_WALKS = {"children", "named_children", "modules", "named_modules", "_modules", "apply"}


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
            elif isinstance(node, ast.Attribute) and node.attr in _SUBMODULE_WALKS:
                return f"{klass.__name__} reaches its submodules through .{node.attr} (a chain module may run twice)"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                return f"{klass.__name__} reads attributes by computed names (getattr)"
    many = sorted(n for n, c in counts.items() if c != 1)
    return f"{', '.join(many)} used more than once in {cls.__name__}" if many else None


# ---------------------------------------------------------------------------------------------- runtime

class _State:
    """Per parent instance: whether the hand-off is armed, and the pending input."""

    __slots__ = ("active", "x", "stage", "parent", "chain", "weights", "biases", "roles", "checked", "settings",
                 "callers")

    def __init__(self, chain: InlineChain, settings: Sequence[Optional[Settings]] = ()):
        self.chain = chain
        # (split once: read on every call) the role modules, and the other modules on the way
        self.roles = [tuple(p.split(".")) for p in chain.modules]
        self.checked = [tuple(p.split(".")) for p in chain.checked if p not in chain.modules]
        # (path parts, settings as proven) of those modules that have settings (an activation's)
        self.settings = [(parts, s) for parts, s in zip(self.roles + self.checked, settings) if s is not None]
        self.weights = param_getter(chain.weights)
        self.biases = param_getter(chain.biases) if chain.biases else None
        self.active = 0  # the id of the thread running the method, 0 when none
        self.x = None
        self.stage = -1
        self.parent = None
        self.callers: tuple = (None, frozenset())  # the code that may call the head: the method's, groups' forwards

    def __deepcopy__(self, memo):
        new = _State(self.chain)
        new.settings = self.settings
        new.callers = self.callers
        memo[id(self)] = new
        new.parent = copy.deepcopy(self.parent, memo)
        return new


_TOKEN = torch.empty(0, device="meta")


def _altered(m: nn.Module) -> bool:
    """Whether ``m`` runs some other code than its class's ``forward`` in eval mode."""
    return m.training or runs_own_code(m)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing()


_ARMING = threading.Lock()


def _parent_method(orig: Any, state_attr: str, owner: tuple[type, str]):
    owner_cls, name = owner

    def method(self, *args, **kwargs):
        if getattr(owner_cls, name) is not orig:  # (the class's method patched since)
            original_because(self, f"{owner_cls.__qualname__}.{name} was replaced since the hand-off was proven")
            return getattr(owner_cls, name)(self, *args, **kwargs)
        if not kernels_run():  # (a CPU-only process: the chain would run its original ops)
            return orig(self, *args, **kwargs)
        st: _State = self.__dict__[state_attr]
        if self.training or st.active or _tracing() or any(GLOBAL_HOOKS) or _any_autocast() or checkpointed():
            if not (st.active or _tracing()):  # (another call in progress, recursion or another thread, is no news)
                why = "it runs in training mode (the hand-off is for eval)" if self.training else \
                    "a global module hook is registered" if any(GLOBAL_HOOKS) else \
                    "it runs under autocast" if _any_autocast() else \
                    "it records gradients inside activation checkpointing"
                original_because(self, why)
            return orig(self, *args, **kwargs)
        for parts in st.roles:  # still the modules the roles were installed on (not replaced since)
            m = submodule(self, parts)
            if m is None or m.__dict__.get("_fxfuse_inline_role", (None,))[0] is not st or _altered(m):
                return _original(orig, self, st, args, kwargs)
        for parts in st.checked:  # dropouts (identity in eval mode) and groups, whose forward the proof read
            m = submodule(self, parts)
            if m is None or _altered(m):
                return _original(orig, self, st, args, kwargs)
        for parts, kept in st.settings:  # (an activation's setting changed in place: the fused op baked it in)
            if kept.changed(submodule(self, parts)):
                return _original(orig, self, st, args, kwargs)
        with _ARMING:  # (two threads calling one model: only one arms the hand-off, the other runs the original)
            armed = not st.active
            if armed:
                st.active, st.x, st.stage, st.parent = threading.get_ident(), None, -1, self
        if not armed:
            return orig(self, *args, **kwargs)
        try:
            out = orig(self, *args, **kwargs)
            if st.x is not None:
                raise RuntimeError("fxfuse: inline chain hand-off not completed (the token was not consumed)")
            return out
        finally:
            st.active, st.x, st.stage = 0, None, -1

    functools.update_wrapper(method, orig)
    return method


def _original(orig: Any, parent: nn.Module, st: _State, args: tuple, kwargs: dict) -> Any:
    """The original method, for a parent whose chain modules changed since the hand-off was proven; says why."""
    why = "a chain module changed"
    for parts in st.roles + st.checked:
        m, name = submodule(parent, parts), ".".join(parts)
        if m is None or (parts in st.roles and m.__dict__.get("_fxfuse_inline_role", (None,))[0] is not st):
            why = f"{name} was replaced or removed"
        elif runs_own_code(m):
            why = f"{name} has hooks or its own forward"
        elif m.training:
            why = f"{name} is in training mode"
        else:
            continue
        break
    else:
        for parts, kept in st.settings:
            if kept.changed(submodule(parent, parts)):
                why = f"{'.'.join(parts)}.{kept.what_changed(submodule(parent, parts))}"
                break
    original_because(parent, f"{why} since the hand-off was proven")
    return orig(parent, *args, **kwargs)


def _attrs(obj: Any, getter: Any) -> Sequence:
    return getter(obj) if getter is not None else []


_MODULE_CALL_FILE = nn.Module.__call__.__code__.co_filename  # (torch's __call__ frames between a caller and forward)


def _code_of(fn: Any) -> Any:
    return inspect.unwrap(fn).__code__  # (the decorated method's own code: transformers wraps forwards)


def _called_from(callers: tuple) -> bool:
    """Whether the module call in progress was made by the code the hand-off was proven on: the parent's method,
    or a group's forward (``self.intermediate(x)`` holding the head) called by the parent's method; not by a hook
    or a helper function that calls the head, or its group, itself. ``callers``: (the method's code, the groups'
    forwards' codes)."""
    method, groups = callers
    frame = sys._getframe(2)
    while True:
        while frame is not None and frame.f_code.co_filename == _MODULE_CALL_FILE:
            frame = frame.f_back
        if frame is None or frame.f_code is method:
            return frame is not None
        if frame.f_code not in groups:
            return False
        frame = frame.f_back  # (a group's forward: who called the group?)


def _role_forward(orig: Any, role: str):
    """``forward`` of a chain module: ``head`` defers, ``pass`` forwards the token, ``tail`` runs the op."""

    def forward(self, *args, **kwargs):
        st, index = self.__dict__["_fxfuse_inline_role"]
        if not st.active or st.active != threading.get_ident() or kwargs or len(args) != 1:
            return orig(self, *args, **kwargs)
        x = args[0]
        if role == "head":
            if not _called_from(st.callers):  # (a hook's, a helper's call: the module's own forward, no token)
                return orig(self, *args)
            if st.x is not None:
                raise RuntimeError("fxfuse: inline chain entered twice")
            ws = _attrs(st.parent, st.weights)
            # (None: a weight or bias set to None or removed since, which only the original code takes)
            if not isinstance(x, torch.Tensor) or ws is None or any(w.dtype != ws[0].dtype for w in ws) \
                    or _attrs(st.parent, st.biases) is None:
                original_because(st.parent, "a chain weight or bias is None or gone, their dtypes differ, or the "
                                            "chain's input is not a tensor")
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
    on_the_way = chain.modules + [p for p in chain.checked if p not in chain.modules]
    state = _State(chain, [Settings.of(parent.get_submodule(p)) for p in on_the_way])
    attr = "_fxfuse_inline_state"
    parts: dict[str, tuple[dict, dict]] = {}
    orig = getattr(type(parent), chain.method)
    groups = {p.rpartition(".")[0] for p in chain.modules if "." in p}
    state.callers = (_code_of(orig), frozenset(_code_of(type(parent.get_submodule(g)).forward) for g in groups))
    method = _parent_method(orig, attr, (type(parent), chain.method))
    parts[chain.module_path] = ({chain.method: (("inline-parent", chain.method, attr), method)}, {attr: state})
    for index, name in enumerate(chain.modules):
        child = parent.get_submodule(name)
        role = "head" if index == 0 else "tail" if index == len(chain.modules) - 1 else "pass"
        path = f"{chain.module_path}.{name}" if chain.module_path else name
        fwd = _role_forward(type(child).forward, role)
        parts[path] = ({"forward": (("inline", role), fwd)}, {"_fxfuse_inline_role": (state, index)})
    return parts


def chain_modules(parent: nn.Module, linears: list[str], middles: list[list[str]]) -> Optional[list[str]]:
    """The child names (or ``group.child``) along a serial chain: linear, its activation modules, linear, ...
    (or ``None``)."""
    out = []
    for k, lin in enumerate(linears):
        out.append(lin)
        if k < len(middles):
            for m in middles[k]:
                mod = submodule(parent, tuple(m.split(".")))
                if not (is_known_activation(mod) or is_identity_module(mod)):
                    return None
                out.append(m)
    return out
