"""What code that skips a module's ``__call__`` assumed about it: no hooks, no instance ``forward``, same settings.

A fused graph (:mod:`fxfuse.install`) and the inline hand-off (:mod:`fxfuse.inline`) stand in for calls of
submodules they never call: ``fc1``, ``act``, ``dropout``. They are right only while calling such a module would
run its class's ``forward`` on the settings it had when fused, so they check, on every call:

* :func:`runs_own_code`: hooks of its own (forward, pre, backward), an instance ``forward`` (accelerate's), or
  one of torch's :data:`GLOBAL_HOOKS`;
* :class:`Settings`: the plain values in its ``__dict__`` that its ``forward`` may read and the trace baked
  into the kernel (``GELU.approximate``, ``LeakyReLU.negative_slope``, a Hugging Face activation's function):
  one changed in place since (``act.approximate = "none"``) makes the original code run.

Each call that runs the original code instead goes through :func:`original_because`, which logs why once and
counts it per module instance; :func:`original_runs` reads those counts (``fxfuse.report`` lists them).

Example:
    >>> act = torch.nn.GELU(approximate="tanh")
    >>> kept = Settings.of(act)
    >>> kept.keys, kept.changed(act)
    (('approximate',), False)
    >>> act.approximate = "none"
    >>> kept.changed(act), kept.what_changed(act)
    (True, "approximate was 'tanh', is 'none'")
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["GLOBAL_HOOKS", "GlobalReads", "Settings", "original_because", "original_runs", "runs_own_code",
           "self_reads", "submodule"]

log = logging.getLogger(__name__)

# torch's global module hooks (dicts it mutates, never rebinds): any of them runs in every module's __call__
GLOBAL_HOOKS = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks,
                torch.nn.modules.module._global_backward_hooks, torch.nn.modules.module._global_backward_pre_hooks)


def runs_own_code(m: nn.Module) -> bool:
    """Whether calling ``m`` runs more than its class's ``forward``: hooks of its own, or an instance ``forward``
    (accelerate's). Code that skips ``m.__call__`` (a fused graph, the hand-off) is only right without them."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks) \
        or "forward" in m.__dict__


def submodule(module: nn.Module, parts: tuple) -> Optional[nn.Module]:
    """``module``'s submodule at the path ``parts`` through the modules' dicts, or None."""
    for part in parts:
        module = module._modules.get(part)
        if module is None:
            return None
    return module


_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)
# Modules whose forward reads no setting (their attributes follow from their weights): nothing to compare.
_NO_SETTINGS = (nn.Linear, nn.Identity)


# nn.Module's own bookkeeping (hook dicts, ``_modules``...): never a setting, even where code reads it.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

_MAX_CONTAINER = 64  # a longer list or dict (a vocabulary) is not a setting a forward bakes in


def _is_setting(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(type(v) in _PLAIN for v in value)
    if type(value) is dict:  # ({"scale": 2.0}: kept as a copy, so a change in place is seen)
        return len(value) <= _MAX_CONTAINER and all(type(k) in _PLAIN and _is_plain(v) for k, v in value.items())
    if type(value) is list:
        return len(value) <= _MAX_CONTAINER and all(_is_plain(v) for v in value)
    return type(value) in _PLAIN or isinstance(value, _FUNCTIONS)


def _is_plain(value: Any) -> bool:
    return type(value) in _PLAIN or (type(value) is tuple and all(type(v) in _PLAIN for v in value))


def _snapshot(value: Any) -> Any:
    """``value`` as kept: a list or dict copied (its items are immutable), so that comparing it with the live one
    compares contents."""
    return type(value)(value) if type(value) in (list, dict) else value


def _no_keys(d: dict) -> tuple:
    return ()


def _is_holder(value: Any) -> bool:
    """A plain object whose attributes a method may read through it (``self.config.scale``): not a module, tensor,
    class, function or Python module."""
    return hasattr(value, "__dict__") and not isinstance(
        value, (nn.Module, torch.Tensor, type, types.ModuleType, *_FUNCTIONS))


@dataclass(frozen=True, slots=True)
class Settings:
    """A module's settings as fused: its public ``__dict__`` entries that are plain values (numbers, strings,
    ``None``, dtypes, tuples of them; short lists and dicts of them, kept as copies) or functions, except
    ``training`` (checked on its own, where the graph depends on the mode). ``read`` is an
    ``operator.itemgetter`` of ``keys``: one C call per check.

    ``nested``: with ``only`` (a host's, :func:`self_reads`), the same for plain objects the method reads through
    (``self.config.scale``: ``(("config", Settings of the config's attributes named in only),)``): a trace bakes
    those in as well."""

    keys: tuple[str, ...]
    read: Callable[[dict], Any]
    values: Any
    nested: tuple = ()
    absent: tuple[tuple[str, str], ...] = ()  # ("_parameters" | "_buffers", name): slots that held None

    def filled(self, state: dict) -> bool:
        """Whether a parameter or buffer slot that held ``None`` when fused holds a tensor now, in the module whose
        ``__dict__`` is ``state`` (``fc2.bias = nn.Parameter(...)`` on a linear built without one: a trace baked
        "no bias" in)."""
        for which, name in self.absent:
            if state[which].get(name) is not None:
                return True
        return False

    @staticmethod
    def of(m: Any, only: Optional[frozenset[str]] = None, holders: bool = True,
           reads: Optional[frozenset[str]] = None) -> Optional[Settings]:
        """``m``'s settings now (those named in ``only``, when given), or None when it has none worth checking.

        ``reads``: without ``only``, the names ``m``'s own code reads (:func:`self_reads` of a submodule's
        ``forward``): every public setting is kept, and those names add private ones (``self._omega``, or one a
        property reads) and the objects read through (``self.cfg.omega_0``). With ``only``, private names in it
        count too."""
        state = m.__dict__
        absent = tuple((which, k) for which in ("_parameters", "_buffers") for k, v in state.get(which, {}).items()
                       if v is None and (only is None or k in only))
        if type(m) in _NO_SETTINGS:
            return Settings((), _no_keys, (), (), absent) if absent else None
        named = only if only is not None else reads or frozenset()

        def wanted(k: str) -> bool:  # public ones (all, or those in only), and private ones the code reads
            if k.startswith("_"):
                return k in named and k not in _MODULE_INTERNALS
            return only is None or k in only

        keys = tuple(sorted(k for k, v in state.items() if k != "training" and wanted(k) and _is_setting(v)))
        nested = ()
        if named and holders:  # (one level: self.config.x, not self.config.sub.x)
            found = ((k, Settings.of(v, named, holders=False)) for k, v in sorted(state.items())
                     if k in named and k not in _MODULE_INTERNALS and _is_holder(v))
            nested = tuple((k, s) for k, s in found if s is not None)
        if not keys and not nested and not absent:
            return None
        read = operator.itemgetter(*keys) if keys else _no_keys
        now = read(state)
        values = _snapshot(now) if len(keys) == 1 else tuple(_snapshot(v) for v in now)
        return Settings(keys, read, values, nested, absent)

    def nested_changed(self, state: dict) -> bool:
        """Whether a setting of an object read through ``state``'s owner (``config.scale``) changed (may raise
        KeyError: an attribute deleted)."""
        for key, kept in self.nested:
            inner = getattr(state[key], "__dict__", None)
            if inner is None or kept.read(inner) != kept.values:  # (one level: kept has no nested of its own)
                return True
        return False

    def changed(self, m: Any) -> bool:
        """Whether a setting of ``m`` differs from (or is no longer) what it was: the check on every call."""
        try:
            state = m.__dict__
            return self.read(state) != self.values or (bool(self.nested) and self.nested_changed(state)) \
                or (bool(self.absent) and self.filled(state))
        except KeyError:  # (deleted, or moved out of the dict to a property)
            return True

    def what_changed(self, m: Any) -> str:
        """Which setting changed, as text (for the log)."""
        now = m.__dict__
        old = self.values if len(self.keys) > 1 else (self.values,)
        for key, was in zip(self.keys, old):
            if key not in now:
                return f"{key} was removed"
            if now[key] != was:
                return f"{key} was {was!r}, is {now[key]!r}"
        for which, name in self.absent:
            if now[which].get(name) is not None:
                return f"{name} was None, is a tensor"
        for key, kept in self.nested:
            if key not in now:
                return f"{key} was removed"
            if not hasattr(now[key], "__dict__"):
                return f"{key} was replaced"
            if kept.changed(now[key]):
                return f"{key}.{kept.what_changed(now[key])}"
        return "a setting changed"


@functools.cache
def self_reads(fn: Callable, cls: Optional[type] = None) -> Optional[frozenset[str]]:
    """The names ``fn`` may read off an object (``self.scale``, ``getattr(self, "scale")``), or None when it has no
    Python code. A host's own settings that its fused method never reads (a flag another method uses, such as
    ``gradient_checkpointing``) need no check.

    Read from the bytecode, not the source (a source file edited since import cannot hide a read): every attribute
    and global name loaded and every string constant, nested functions' included, and, with ``cls``, those of the
    methods and properties of ``cls`` (outside torch) that ``fn`` reaches by name: a setting the trace inlined from
    ``self.helper()`` or a property is checked too. A superset of the reads: one more name costs only a key.

    Example:
        >>> class Host(torch.nn.Module):
        ...     def forward(self, x):
        ...         return self.helper(x) + getattr(self, "bias_value")
        ...     def helper(self, x):
        ...         return x * self.scale
        >>> sorted({"scale", "bias_value", "flag"} & self_reads(Host.forward, Host))
        ['bias_value', 'scale']
    """
    codes = _reached_code(fn, cls)
    if codes is None:
        return None
    names: set[str] = set()
    for c, _ in codes:
        names.update(c.co_names)
        names.update(k for k in c.co_consts if isinstance(k, str))
    return frozenset(names)


@functools.cache
def _reached_code(fn: Callable, cls: Optional[type] = None) -> Optional[tuple[tuple[types.CodeType, dict], ...]]:
    """``(code, its function's globals)`` of ``fn``, its nested functions and, with ``cls``, the methods and
    properties of ``cls`` (outside torch) it reaches by name (see :func:`self_reads`); None without Python code."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    out, seen, todo = [], set(), [(code, getattr(fn, "__globals__", None))]
    while todo:
        c, glob = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        out.append((c, glob))
        todo += [(k, glob) for k in c.co_consts if isinstance(k, types.CodeType)]
        for name in c.co_names if cls is not None else ():
            member = inspect.getattr_static(cls, name, None)
            member = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            called = inspect.unwrap(member) if callable(member) else None
            if getattr(called, "__code__", None) is not None \
                    and not getattr(member, "__module__", "").startswith("torch"):
                todo.append((called.__code__, getattr(called, "__globals__", None)))
    return tuple(out)


@dataclass(frozen=True)
class GlobalReads:
    """The module-level names (``SCALE = 2.0``, a flag, a function) and class attributes (``self.SCALE`` where the
    class defines it) that fused code read while it was traced, as they were: a trace bakes their values into the
    graph, so one rebound since makes the original code run. ``spaces``: ``(namespace, names, itemgetter of them,
    values, what they are)`` per module globals dict or class ``__dict__`` (a live view); plain values and functions
    only (:func:`_is_setting`)."""

    spaces: tuple

    @staticmethod
    def of(functions: Sequence[tuple[Callable, Optional[type]]]) -> Optional[GlobalReads]:
        """For ``(function, its class)`` pairs (a host method, the forwards its graph traced into), or None when they
        read no such name. torch's own code and classes are left out (their globals are not settings)."""
        by_space: dict[int, tuple[Any, set, str]] = {}
        for fn, cls in functions:
            if getattr(fn, "__module__", "").startswith("torch"):
                continue
            names_read: set[str] = set()
            for code, glob in _reached_code(fn, cls) or ():
                names_read.update(code.co_names)
                if glob is not None:
                    names = by_space.setdefault(id(glob), (glob, set(), "module-level"))[1]
                    names.update(n for n in code.co_names if n in glob and _is_setting(glob[n]))
            for klass in (cls.__mro__ if cls is not None else ()):
                if klass.__module__.startswith("torch") or klass is object:
                    continue
                space = vars(klass)
                names = by_space.setdefault(id(klass), (space, set(), f"class attribute {klass.__name__}."))[1]
                names.update(n for n in names_read if n in space and not n.startswith("__")
                             and type(space[n]) in _PLAIN + (tuple,) and _is_setting(space[n]))
        spaces = []
        for space, names, what in by_space.values():
            if names:
                keys = tuple(sorted(names))
                read = operator.itemgetter(*keys)
                spaces.append((space, keys, read, read(space), what))
        return GlobalReads(tuple(spaces)) if spaces else None

    def __deepcopy__(self, memo: dict) -> GlobalReads:
        return self  # (the globals are the process's: a copied model reads the same ones)

    def changed(self) -> bool:
        """Whether one of the names was rebound or deleted since: the check on every call."""
        try:
            return any(read(space) != values for space, _, read, values, _ in self.spaces)
        except KeyError:
            return True

    def what_changed(self) -> str:
        """Which name changed, as text (for the log)."""
        for space, keys, _, values, what in self.spaces:
            label = what if what.endswith(".") else what + " "
            for key, was in zip(keys, values if len(keys) > 1 else (values,)):
                if key not in space:
                    return f"{label}{key} was removed"
                if space[key] != was:
                    return f"{label}{key} was {was!r}, is {space[key]!r}"
        return "a module-level name changed"


_said: set[tuple[type, str]] = set()
# Per host instance, weakly (a dropped model takes its counts along): reason -> calls that ran the original code.
# Per instance, not per class: the host classes are cached, so two optimized models of one class share theirs.
_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def original_because(module: nn.Module, why: str) -> None:
    """Count a call of a fused method of ``module`` that runs its original code instead, and log why (INFO, once
    per class and reason). Only the fallback path calls it: the fused path pays nothing."""
    runs = _runs.get(module)
    if runs is None:
        runs = _runs[module] = {}
    runs[why] = runs.get(why, 0) + 1
    cls = type(module)
    if (cls, why) not in _said:
        _said.add((cls, why))
        log.info("fxfuse: %s runs its original method: %s", cls.__qualname__, why)


def original_runs(module: nn.Module) -> dict[str, int]:
    """The calls of ``module``'s fused methods that ran its original code since it was made, by reason (a copy)."""
    return dict(_runs.get(module, {}))
