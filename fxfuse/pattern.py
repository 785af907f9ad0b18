"""Fusion patterns: plain Python functions over torch ops, traced once, matched as graphs.

A pattern is written like the ones ``torch.fx.replace_pattern`` takes. It is traced ONCE with
``torch.fx.symbolic_trace``, normalized with :func:`fxfuse.normalize.normalize`, and turned into the same
kind of ``networkx`` view as the model (:func:`fxfuse.match.build_view`); the result is cached on the
:class:`Pattern`. :func:`pointwise` is the wildcard: it matches any supported pointwise cluster that reads
as many linears as it has arguments::

    def mlp(x, w1, b1, w2, b2):
        return F.linear(pointwise(F.linear(x, w1, b1)), w2, b2)

A concrete middle matches only the same math (compared as canonical epilogue text)::

    def relu_scale(x, w1, b1, scale, w2, b2):
        return F.linear(torch.relu(F.linear(x, w1, b1)) * scale, w2, b2)

    fxfuse.register_pattern(relu_scale)                     # fused with epilogue mul(relu(a0),v0)
    fxfuse.register_pattern(relu_scale, replacement=my_fn)  # or: my_fn(x=..., w1=..., ...) is called instead

User patterns are tried before the built-ins (``fxfuse.patterns``), the most recently registered first.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from .match import GraphView, build_view
from .normalize import is_linear, normalize

__all__ = ["Pattern", "all_patterns", "pointwise", "register_pattern", "registered", "unregister_pattern"]

log = logging.getLogger(__name__)


def pointwise(*inputs: torch.Tensor) -> torch.Tensor:
    """Pattern wildcard: any supported pointwise computation of ``inputs`` (the linears it reads).

    Only meaningful inside a pattern declaration; it is a leaf when the pattern is traced.
    """
    raise RuntimeError("fxfuse.pattern.pointwise is a pattern wildcard; it cannot be called on tensors")


torch.fx.wrap("pointwise")


@dataclass(eq=False)
class Pattern:
    """A traced, normalized pattern and its matcher view (built once, reused for every model)."""

    name: str
    fn: Callable
    replacement: Optional[Callable]
    gm: fx.GraphModule = field(repr=False)
    view: GraphView = field(repr=False)
    params: tuple[str, ...]
    builtin: bool = False

    @property
    def sink(self) -> fx.Node:
        """The pattern's output linear."""
        return self.gm.graph.output_node().args[0]


def _trace(fn: Callable) -> fx.GraphModule:
    tracer = fx.Tracer(autowrap_functions=(pointwise,))
    graph = tracer.trace(fn)
    return fx.GraphModule(tracer.root, graph, getattr(fn, "__name__", "pattern"))


def compile_pattern(fn: Callable, *, name: Optional[str] = None, replacement: Optional[Callable] = None,
                    builtin: bool = False) -> Pattern:
    """Trace, normalize and check ``fn``; raise ``ValueError`` if it is not a Linear→…→Linear chain, ``TypeError``
    if ``fn``, ``name`` or ``replacement`` is not what a pattern takes."""
    if not inspect.isfunction(fn):
        raise TypeError(f"a pattern is a plain function over tensors (def mlp(x, w1, b1, w2, b2): ...), got "
                        f"{type(fn).__name__}")
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"a pattern's name is a non-empty string, got {name!r}")
    name = name or fn.__name__
    gm = _trace(fn)
    normalize(gm)
    view = build_view(gm, wildcard_target=pointwise)
    params = tuple(n.target for n in gm.graph.nodes if n.op == "placeholder")
    out = gm.graph.output_node().args[0]
    if not (isinstance(out, fx.Node) and is_linear(out)):
        raise ValueError(f"pattern {name!r} must return the result of a linear (spelled F.linear(x, w, b) in a "
                         "pattern: it matches x @ w.t() + b, nn.Linear and addmm in models alike)")
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or is_linear(node) or node in view.cluster_of:
            continue
        raise ValueError(f"pattern {name!r}: unsupported op {node.format_node()} (only linears, spelled "
                         "F.linear(x, w, b), and supported pointwise ops may appear)")
    for c in view.clusters:
        if len(c.exits) != 1 or not c.linear_inputs:
            raise ValueError(f"pattern {name!r}: each pointwise middle must read a linear and feed one linear")
        if not c.wildcard:
            view.epilogue(c, c.exits[0])  # raises if the middle is not an epilogue
        elif any(not is_linear(a) for a in c.nodes[0].all_input_nodes):
            raise ValueError(f"pattern {name!r}: pointwise(...) takes linear outputs only")
    for lin in view.linears:
        if any(a is not None and a.op != "placeholder" for a in lin.args[1:]):
            raise ValueError(f"pattern {name!r}: weights and biases must be pattern arguments")
    if replacement is not None:
        _check_replacement(name, replacement, view, params)
    return Pattern(name, fn, replacement, gm, view, params, builtin)


def _check_replacement(name: str, replacement: Any, view: GraphView, params: tuple[str, ...]) -> None:
    """A replacement is called with the pattern's arguments by name: it must take them, and see all of the math."""
    if not callable(replacement):
        raise TypeError(f"pattern {name!r}: replacement must be callable, got {type(replacement).__name__}")
    if any(c.wildcard for c in view.clusters):
        raise ValueError(f"pattern {name!r}: a pattern with pointwise(...) cannot take a replacement (it would be "
                         "called without the model's middle); spell the middle out, e.g. torch.relu(...) * scale")
    try:
        inspect.signature(replacement).bind(**dict.fromkeys(params))
    except TypeError as err:
        call = ", ".join(f"{p}=..." for p in params)
        raise TypeError(f"pattern {name!r}: replacement is called as replacement({call}) and cannot take that "
                        f"({err})") from None
    except ValueError:  # no signature to read (a builtin): checked when called
        pass


_lock = threading.Lock()
_user: list[Pattern] = []
_builtins: Optional[list[Pattern]] = None


def register_pattern(pattern_fn: Callable, *, name: Optional[str] = None,
                     replacement: Optional[Callable] = None) -> Pattern:
    """Register a user pattern (tried before the built-ins; the most recent first). Returns the :class:`Pattern`.

    A pattern already registered under the same name is replaced. ``replacement`` (optional) is called instead of
    the generated kernel, with the pattern's arguments by name (``replacement(x=..., w1=..., ...)``); a pattern
    with a replacement matches only models whose linears have a bias exactly where the pattern's have one.
    Models already compiled with ``torch.compile(backend="fxfuse")`` are compiled again on their next call
    (Dynamo's caches are reset), so they see the change.

    Example:
        >>> import torch.nn.functional as F
        >>> def relu_scale(x, w1, b1, scale, w2, b2):
        ...     return F.linear(torch.relu(F.linear(x, w1, b1)) * scale, w2, b2)
        >>> p = register_pattern(relu_scale); p.name
        'relu_scale'
        >>> unregister_pattern("relu_scale")
    """
    pat = compile_pattern(pattern_fn, name=name, replacement=replacement)
    if pat.name in {p.name for p in builtin_patterns()}:
        raise ValueError(f"pattern name {pat.name!r} is a built-in pattern's; pass name=... to register it")
    with _lock:
        _user[:] = [p for p in _user if p.name != pat.name]
        _user.insert(0, pat)
    _patterns_changed()
    return pat


def unregister_pattern(pattern: Union[str, Callable, Pattern]) -> None:
    """Remove a user pattern: by name, or the :class:`Pattern` or function that was registered (no error if absent)."""
    if isinstance(pattern, Pattern):
        name = pattern.name
    elif isinstance(pattern, str):
        name = pattern
    else:
        with _lock:
            names = [p.name for p in _user if p.fn is pattern]
        name = names[0] if names else getattr(pattern, "__name__", None)
    with _lock:
        before = len(_user)
        _user[:] = [p for p in _user if p.name != name]
        removed = len(_user) != before
    if removed:
        _patterns_changed()
    else:
        log.debug("fxfuse: unregister_pattern(%r): no user pattern of that name", name)


# Set by the torch.compile backend on its first compile: only then can Dynamo hold graphs fused by old patterns.
compiled_with_backend = False


def _patterns_changed() -> None:
    """Dynamo caches what the backend returned per code object: drop that, so the patterns in force now apply."""
    if compiled_with_backend:
        log.info("fxfuse: patterns changed: torch._dynamo.reset() so compiled models use them")
        torch._dynamo.reset()


@contextlib.contextmanager
def registered(pattern_fn: Callable, **kwargs) -> Iterator[Pattern]:
    """``with registered(fn) as p:`` registers ``fn`` for the duration of the block (handy in tests)."""
    pat = register_pattern(pattern_fn, **kwargs)
    try:
        yield pat
    finally:
        unregister_pattern(pat.name)


def builtin_patterns() -> list[Pattern]:
    """The built-in patterns declared in ``fxfuse.patterns`` (compiled once, on first use)."""
    global _builtins
    with _lock:
        if _builtins is None:
            module = _builtin_module()
            _builtins = [compile_pattern(fn, builtin=True) for fn in module.BUILTINS]
        return list(_builtins)


def _builtin_module() -> ModuleType:
    """``fxfuse.patterns``: installed, the top-level ``patterns/`` folder ships under that name; from a source
    checkout on ``sys.path`` (not installed) it is loaded from that folder, so the checkout fuses as well."""
    try:
        return importlib.import_module("fxfuse.patterns")
    except ModuleNotFoundError as err:
        folder = Path(__file__).resolve().parent.parent / "patterns"
        if err.name != "fxfuse.patterns" or not (folder / "__init__.py").is_file():
            raise
    spec = importlib.util.spec_from_file_location("fxfuse.patterns", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fxfuse.patterns"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["fxfuse.patterns"]
        raise
    return module


def all_patterns() -> list[Pattern]:
    """Every pattern in priority order: user patterns (most recent first), then the built-ins."""
    with _lock:
        user = list(_user)
    return user + builtin_patterns()
