"""Hosts: run each fused chain from the smallest method of the model that contains it.

:func:`fxfuse.capture.discover` says where the chains are; every op of a discovered chain knows the
Python frames it was traced in. A chain's *host* is the innermost method of a module that encloses
the whole chain: ``LlamaMLP.forward``, ``GPT2MLP.forward``, ``BertLayer.feed_forward_chunk`` (BERT's
chain spans its sibling ``intermediate`` and ``output`` submodules), ``Sequential.forward``. The host
is traced again, strictly, and fused with :func:`fxfuse.pipeline.fuse_graph`; if that does not fuse
the chain, the next enclosing method is tried. A chain written inline in a method that cannot be
traced (BART-style layers) is fused by a proven hand-off between its submodules instead
(:mod:`fxfuse.inline`).

The result is a shallow copy of the user's model in which only the modules on the way to a host are
copied; each host copy gets a subclass of its own class that overrides the host method with a
*guarded* call of the fused graph. The guards check, on each call, what the strict trace assumed:

* the arguments: required ones are not ``None``; those traced with their default still have it
  (``None``, a flag); ``*args`` / ``**kwargs`` are empty;
* the module's training mode is the one it was traced in (dropout was removed in eval mode);
* the fused weights share one dtype (code like T5's ``if hidden.dtype != self.wo.weight.dtype: cast`` is
  traced for the uniform case); under autocast, only a graph whose trace touched no autocast state runs (a
  method that reads or sets it is not a host at all, :class:`fxfuse.capture.AutocastStateError`; one traced
  while another profiler hid that runs only without autocast), and each fused region in it follows autocast
  itself (:mod:`fxfuse.autocast`).

A call that fails a guard runs the original method, so the result is always the original function.
Everything else (class, methods such as ``generate``, ``config``, parameters, buffers, hooks) is the
user's model: ``state_dict()`` has the same keys and tensors, ``.to()`` / ``.eval()`` act on the same
modules, and the fused graph reads the parameters through ``self`` on every call.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import operator
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

from .autocast import any_autocast as _any_autocast
from .capture import ArgSpec, CaptureFailure, Discovery, Scope, trace_scope
from .inline import InlineChain, chain_modules, install_parts, prove
from .lift import lift_params
from .meta import param_getter
from .normalize import normalize
from .ops import is_fused_call
from .pipeline import fuse_graph
from .plan import find_regions
from .records import Rejection
from .report import FusionReport, RegionReport
from .rewrite import fused_call_args
from .shortcut import Shortcut, region_call

__all__ = ["Host", "Install", "Placement", "assemble", "fused_graphs", "place"]

log = logging.getLogger(__name__)

_GRAPHS_ATTR = "_fxfuse_graphs"


@dataclass
class Host:
    module_path: str
    method: str
    scope: Scope  # the strict trace, fused in place
    report: FusionReport
    fused: list[frozenset[int]]  # ids of the weights of each fused call
    weight_targets: list[str] = field(default_factory=list)


@dataclass
class Placement:
    hosts: list[Host] = field(default_factory=list)
    inline: list[InlineChain] = field(default_factory=list)
    inline_reports: list[RegionReport] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    graphs: int = 0


@dataclass
class _Found:
    """A chain found by discovery, read before any graph is rewritten."""

    pattern: str
    path: str
    names: list[str]
    weights: frozenset[int]
    candidates: list[tuple[str, str]]
    inline: Any  # () -> (an InlineChain and its report, or the reason it cannot be one and None)


# --------------------------------------------------------------------------------------------- placing

def place(model: nn.Module, discovery: Discovery, module_inputs: Optional[dict] = None) -> Placement:
    """Find and fuse the host of every chain ``discovery`` found (see the module doc)."""
    module_inputs = module_inputs or {}
    out = Placement(graphs=len(discovery.scopes))
    attempts: dict[tuple[str, str], Any] = {}
    # Discovery's traces serve as hosts' when strict would give the same graph (a strict trace of code that uses
    # the autocast state fails: traced again, it says so).
    reuse = {(s.module_path, s.method): s for s in discovery.scopes if not s.permissive_used and not s.autocast_used}
    failing: dict = {}
    chosen: dict[tuple[str, str], Host] = {}
    seen_rejections: set[tuple] = set()
    found: list[_Found] = []
    for scope in discovery.scopes:
        try:
            normalize(scope.gm)
            regions, rejections = find_regions(scope.gm)
        except Exception as err:  # a graph fxfuse cannot read: leave that part of the model as it is
            log.info("fxfuse: %s.%s skipped: %s", scope.module_path or "<root>", scope.method, _short(err),
                     exc_info=log.isEnabledFor(logging.DEBUG))
            discovery.failures.append(CaptureFailure(scope.module_path, f"not analyzed: {_short(err)}"))
            continue
        for rej in rejections:
            _add_rejection(out, seen_rejections, rej, scope.module_path)
        for region in regions:
            path = ".".join(p for p in (scope.module_path, region.module_path) if p)
            candidates = _host_candidates(model, scope, region.nodes)
            inline = functools.partial(_safely, _inline_chain, model, scope, region, candidates)  # when needed
            found.append(_Found(region.pattern, path, [n.name for n in region.nodes],
                                _param_ids(scope.gm, region.weights), candidates, inline))
    for f in found:
        # Innermost method first. A graph host whose guards every call passes wins; one that specializes
        # arguments (defaults, *args) only runs for some calls, so a proven inline hand-off is preferred to
        # it; such a host is the last resort.
        reasons: list[str] = []
        speculative = None
        inline: Any = None
        placed = False
        for key in f.candidates:
            if inline is None and _needs_guards(model, key) and not _called_plainly(model, key, module_inputs):
                inline, report = f.inline()
                if isinstance(inline, Exception):
                    inline = f"inline hand-off failed: {_short(inline)}"
                if isinstance(inline, InlineChain):
                    break
            host = attempts.get(key)
            if host is None:
                host = attempts[key] = _try_host(model, key, reuse.pop(key, None), module_inputs, failing)
            if isinstance(host, Host) and any(f.weights <= w for w in host.fused):
                if _solid(model, host, module_inputs):
                    chosen.setdefault(key, host)
                    placed = True
                    break
                speculative = speculative or (key, host)
            reasons.append(_why_not(key, host, model, f.weights))
        if placed:
            continue
        if inline is None:
            inline, report = f.inline()
        if isinstance(inline, Exception):
            inline = f"inline hand-off failed: {_short(inline)}"
        if isinstance(inline, InlineChain):
            out.inline.append(inline)
            out.inline_reports.append(report)
            continue
        reasons.append(inline)
        if speculative is not None:
            key, host = speculative
            if key not in chosen:
                chosen[key] = host
                for r in host.report.regions:
                    r.notes.append("fused only for calls with " + _guard_text(host.scope.args))
            continue
        _add_rejection(out, seen_rejections, Rejection(f.pattern, f.path, f"not captured: {'; '.join(reasons)}",
                                                       f.names), "")
    out.hosts = _unnest(model, list(chosen.values()), module_inputs, failing, out, seen_rejections)
    for host in out.hosts:
        for rej in host.report.rejections:
            _add_rejection(out, seen_rejections, rej, "")
    return out


def _safely(fn, *args):
    try:
        return fn(*args)
    except Exception as err:
        log.debug("fxfuse: %s failed", getattr(fn, "__name__", fn), exc_info=True)
        return err, None


def _add_rejection(out: Placement, seen: set, rej: Rejection, prefix: str) -> None:
    path = ".".join(p for p in (prefix, rej.module_path) if p)
    key = (path, rej.pattern, rej.reason)
    if key not in seen:
        seen.add(key)
        out.rejections.append(Rejection(rej.pattern, path, rej.reason, list(rej.nodes)))


def _why_not(key: tuple[str, str], host: Any, model: nn.Module, weights: frozenset[int]) -> str:
    path, method = key
    name = f"{type(model.get_submodule(path)).__name__}.{method}" + (f" at {path}" if path else "")
    if isinstance(host, Exception):
        return f"{name} cannot be traced ({_short(host)})"
    if any(weights <= w for w in host.fused):
        return f"{name} is fused only for calls with {_guard_text(host.scope.args)}"
    reasons = {r.reason for r in host.report.rejections}
    return f"{name} does not fuse it" + (f" ({'; '.join(sorted(reasons))})" if reasons else "")


def _guard_text(specs: list[ArgSpec]) -> str:
    parts = []
    for s in specs:
        if s.mode == "const":
            parts.append(f"{s.name}={s.value!r}")
        elif s.mode == "empty":
            parts.append(f"no {'*' if s.kind is inspect.Parameter.VAR_POSITIONAL else '**'}{s.name}")
    return ", ".join(parts)


def _needs_guards(model: nn.Module, key: tuple[str, str]) -> bool:
    """Whether a strict trace of this method would specialize some argument (a default, ``*args``)."""
    path, method = key
    fn = getattr(type(model.get_submodule(path)), method, None)
    try:
        params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())[1:]
    except (TypeError, ValueError):
        return True
    return any(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _called_plainly(model: nn.Module, key: tuple[str, str], module_inputs: dict) -> bool:
    """The recorded call of this ``forward`` (example inputs) leaves every defaulted argument alone."""
    path, method = key
    recorded = module_inputs.get(id(model.get_submodule(path)))
    if recorded is None or method != "forward":
        return False
    fn = getattr(type(model.get_submodule(path)), method)
    sig = inspect.signature(inspect.unwrap(fn))
    try:
        bound = sig.bind(None, *recorded[0], **recorded[1]).arguments
    except TypeError:
        return False
    return all(p.name not in bound for p in list(sig.parameters.values())[1:]
               if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def _solid(model: nn.Module, host: Host, module_inputs: dict) -> bool:
    """A host whose guards real calls pass: only required arguments, or the recorded call passes them."""
    if all(s.mode == "proxy" for s in host.scope.args):
        return True
    recorded = module_inputs.get(id(model.get_submodule(host.module_path)))
    return recorded is not None and host.method == "forward" and _bind(host.scope, *recorded) is not None


def _inline_chain(model: nn.Module, scope: Scope, region: Any, candidates: list[tuple[str, str]]) \
        -> tuple[Any, Optional[RegionReport]]:
    """The chain as an inline hand-off in its innermost method (see :mod:`fxfuse.inline`), or why not."""
    if not candidates:
        return "no method of one module contains the whole chain", None
    path, method = candidates[0]
    if region.replacement is not None or region.operands or any(s.num_linears != 1 for s in region.spec.stages):
        return "only serial chains without operands are handed off inline", None
    rel = path[len(scope.module_path):].lstrip(".") if path.startswith(scope.module_path) else None
    if rel is None:
        return "the chain is outside its scope", None
    prefix = f"{rel}." if rel else ""
    parent = model.get_submodule(path)
    direct = set(parent._modules)

    def child_of(target: Any) -> Optional[str]:
        t = str(target)
        if not t.startswith(prefix) or t[len(prefix):] not in direct:
            return None
        return t[len(prefix):]

    innermost = None
    linears, middles = [], []
    for node in region.nodes:
        frames = node.meta.get("fxfuse_frames") or ()
        if not frames or (innermost is not None and frames[-1] != innermost):
            return f"the chain is not called directly in {type(parent).__name__}.{method}", None
        innermost = frames[-1]
        if node in region.weights or node.op == "call_function" and node.target is torch.nn.functional.linear:
            name = child_of(node.meta.get("fxfuse_module_path", ""))
            if name is None or not isinstance(parent._modules[name], nn.Linear):
                return "a linear of the chain is not a direct nn.Linear child", None
            linears.append(name)
            middles.append([])
        elif node.op == "call_module" and child_of(node.target) is not None and linears:
            middles[-1].append(child_of(node.target))
        else:
            return f"{node.format_node()} is not a submodule call", None
    chain_mods = chain_modules(parent, linears, middles[:-1]) if not middles[-1] else None
    if chain_mods is None:
        return "the chain's pointwise ops are not activation modules", None
    reason, passthrough = prove(parent, method, chain_mods)
    if reason is not None:
        return f"inline hand-off in {type(parent).__name__}.{method} not provable: {reason}", None
    spec = fused_call_args(region)[-1]
    weights = [f"{name}.weight" for name in linears]
    biases = [f"{name}.bias" for name, b in zip(linears, region.biases) if b is not None]
    chain = InlineChain(path, method, chain_mods, linears, weights, biases, spec, region.pattern,
                        checked=chain_mods + passthrough)
    report = RegionReport(path or "<root>", region.pattern, spec, _strategy(parent, region, weights),
                          [f"runs as a hand-off between {', '.join(chain_mods)} in {type(parent).__name__}.{method}"])
    return chain, report


def _strategy(parent: nn.Module, region: Any, weights: list[str]) -> str:
    try:
        from .strategy import choose_strategy, launches

        shapes = [operator.attrgetter(w)(parent).shape for w in weights]
        strategy = choose_strategy(region.spec, (shapes[0][1], *(s[0] for s in shapes)))
        n = launches(region.spec, strategy)
        return f"{strategy} ({n} launch{'es' if n > 1 else ''})"
    except Exception:  # the report only
        return region.strategy


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def _host_candidates(model: nn.Module, scope: Scope, nodes: Sequence[fx.Node]) -> list[tuple[str, str]]:
    """``(module path, method)`` of the methods enclosing all of ``nodes``, innermost first."""
    frames = [n.meta.get("fxfuse_frames") for n in nodes if n.meta.get("fxfuse_frames")]
    if not frames:
        return [(scope.module_path, scope.method)]
    common = list(frames[0])
    for f in frames[1:]:
        i = 0
        while i < min(len(common), len(f)) and common[i] == f[i]:
            i += 1
        common = common[:i]
    out = []
    for rel, code in reversed(common):
        path = ".".join(p for p in (scope.module_path, rel) if p)
        method = _method_of(model.get_submodule(path), code)
        if method is not None and (path, method) not in out:
            out.append((path, method))
    return out


def _method_of(module: nn.Module, code: types.CodeType) -> Optional[str]:
    """The name of the method of ``type(module)`` whose (unwrapped) code is ``code``."""
    fn = inspect.getattr_static(type(module), code.co_name, None)
    if not inspect.isfunction(fn):
        return None
    f: Any = fn
    while f is not None:
        if getattr(f, "__code__", None) is code:
            return code.co_name
        f = getattr(f, "__wrapped__", None)
    return None


def _try_host(model: nn.Module, key: tuple[str, str], reusable: Optional[Scope], module_inputs: dict,
              failing: dict, leaves: Optional[set[int]] = None) -> Host | Exception:
    path, method = key
    module = model.get_submodule(path)
    known = failing.get(("strict", type(module), method))
    if known is not None:
        return known
    try:
        scope = reusable if reusable is not None and not leaves else \
            trace_scope(module, path, method, leaves=leaves, failing=failing)
    except Exception as err:
        log.debug("fxfuse: host %s.%s cannot be traced: %s", path or "<root>", method, _short(err))
        if not getattr(err, "_fxfuse_module", None):  # its own code fails: so will every instance
            failing[("strict", type(module), method)] = err
        return err
    example = _example_for(scope, module_inputs.get(id(module)))
    try:
        report = fuse_graph(scope.gm, example, prefix=path)
        fused, targets = _fused_weights(scope.gm)
    except Exception as err:  # never let one region break optimize(): that method stays as it is
        log.info("fxfuse: fusing %s.%s failed: %s", path or "<root>", method, _short(err),
                 exc_info=log.isEnabledFor(logging.DEBUG))
        return err
    return Host(path, method, scope, report, fused, targets)


def _example_for(scope: Scope, recorded: Optional[tuple]) -> Optional[list]:
    """The values of the graph's placeholders in the recorded call, if that call passes the guards."""
    if recorded is None or scope.method != "forward":
        return None
    args, kwargs = recorded
    values = _bind(scope, args, kwargs)
    return values if values is not None and all(isinstance(v, torch.Tensor) for v in values) else None


def _unnest(model: nn.Module, hosts: list[Host], module_inputs: dict, failing: dict,
            out: Placement, seen: set) -> list[Host]:
    """A host that contains another host's module traces it as a leaf (so each chain runs once)."""
    kept = []
    for host in hosts:
        inner = [h for h in hosts if h is not host and _inside(h.module_path, host.module_path)]
        if inner:
            leaves = {id(model.get_submodule(h.module_path)) for h in inner}
            again = _try_host(model, (host.module_path, host.method), None, module_inputs, failing, leaves)
            if isinstance(again, Exception) or not again.fused:
                for r in host.report.regions:
                    _add_rejection(out, seen, Rejection(r.pattern, r.module_path, "not captured: its host contains "
                                                        "another host and does not trace around it", []), "")
                continue
            host = again
        kept.append(host)
    return kept


def _inside(path: str, outer: str) -> bool:
    return path != outer and (outer == "" or path.startswith(outer + "."))


def _resolve_param(gm: fx.GraphModule, node: Any) -> Optional[tuple[str, torch.Tensor]]:
    """The parameter a weight argument reads: a ``get_attr``, or its transpose."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.args and \
            (node.meta.get("fxfuse_helper") or (node.target in (torch.t, "t") and len(node.args) == 1)):
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr":
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor):
            return str(node.target), value
    return None


def _param_ids(gm: fx.GraphModule, weights: Sequence[Any]) -> frozenset[int]:
    out = set()
    for w in weights:
        found = _resolve_param(gm, w)
        out.add(id(found[1]) if found else id(w))
    return frozenset(out)


def _fused_weights(gm: fx.GraphModule) -> tuple[list[frozenset[int]], list[str]]:
    """Ids of the weights read by each fused call of ``gm``, and their attribute paths."""
    sets, targets = [], []
    for node in gm.graph.nodes:
        if "fxfuse_region" not in node.meta:
            continue
        ids = set()
        args = node.args[1] if is_fused_call(node) else list(node.kwargs.values())  # else: a user replacement
        for a in args:
            found = _resolve_param(gm, a)
            if found is not None and found[1].dim() == 2:
                ids.add(id(found[1]))
                targets.append(found[0])
        sets.append(frozenset(ids))
    return sets, list(dict.fromkeys(targets))


# ------------------------------------------------------------------------------------------ guarded call

def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(a) in (int, float, str) and a == b)


def _bind(scope_or_specs: Any, args: tuple, kwargs: dict, sig: Optional[inspect.Signature] = None) \
        -> Optional[list]:
    """The placeholder values for a call, or ``None`` when the call is not one the graph stands for."""
    specs: list[ArgSpec] = scope_or_specs.args if isinstance(scope_or_specs, Scope) else scope_or_specs
    if sig is None:
        sig = _signature_of(specs)
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    values = []
    for s in specs:
        if s.mode == "empty":
            if bound.get(s.name):
                return None
        elif s.mode == "const":
            if s.name in bound and not _same(bound[s.name], s.value):
                return None
        else:
            v = bound.get(s.name)
            if v is None:
                return None
            values.append(v)
    return values


def _signature_of(specs: list[ArgSpec]) -> inspect.Signature:
    params = [inspect.Parameter(s.name, s.kind, default=s.value if s.has_default else inspect.Parameter.empty)
              for s in specs]
    return inspect.Signature(params)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _make_method(orig: Any, specs: list[ArgSpec], fused: Any, training: Optional[bool], weight_paths: list[str],
                 lifted_paths: Sequence[str] = (), autocast_free: bool = False, shortcut_attr: Optional[str] = None):
    """The host method: the fused graph when the guards hold, else the original method.

    ``training``: the mode the graph was traced in, ``None`` when the graph is the same in both.
    ``autocast_free``: the graph may run under autocast (its trace touched no autocast state; each fused region
    then follows autocast itself, :mod:`fxfuse.autocast`).
    ``lifted_paths``: the parameters the fused graph takes as trailing arguments (:mod:`fxfuse.lift`), read
    here through the modules' dicts on every call.
    ``shortcut_attr``: the instance attribute holding the module's :class:`fxfuse.shortcut.Shortcut` (a graph
    that is one region on one input): a call of that input alone tries it first, and teaches it afterwards."""
    sig = _signature_of(specs)
    # A positional call of exactly the leading required parameters needs no binding.
    n_fast = 0
    for s in specs:
        if s.mode == "proxy" and s.kind in _POSITIONAL and not s.has_default:
            n_fast += 1
        else:
            break
    if any(s.mode == "proxy" for s in specs[n_fast:]):
        n_fast = -1
    get_lifted = param_getter(list(lifted_paths)) if lifted_paths else None
    get_weights = param_getter(weight_paths) if len(weight_paths) > 1 else None
    # The dtype guard's weights among the lifted tensors (read once per call), when all of them are.
    in_lifted = [lifted_paths.index(p) for p in weight_paths] if get_weights is not None and \
        all(p in lifted_paths for p in weight_paths) else None
    weight_at = in_lifted if in_lifted is not None else range(len(weight_paths))  # the weights' places in ws

    def method(self, *args, **kwargs):
        if (training is None or self.training is training) and (autocast_free or not _any_autocast()):
            extra = get_lifted(self) if get_lifted is not None else ()
            shortcut = None
            if shortcut_attr is not None and not kwargs and len(args) == 1:
                shortcut = self.__dict__.get(shortcut_attr)
                if shortcut is not None:  # (its entries check the dtype of every region tensor, among the rest)
                    out = shortcut(args[0], extra)
                    if out is not None:
                        return out
            if get_weights is not None:
                ws = extra if in_lifted is not None else get_weights(self)
                dtype = ws[weight_at[0]].dtype
                for i in weight_at:
                    if ws[i].dtype is not dtype:
                        return orig(self, *args, **kwargs)
            if not kwargs and len(args) == n_fast:
                for a in args:
                    if a is None:
                        return orig(self, *args, **kwargs)
                if shortcut is not None:
                    out = fused(self, *args, *extra)
                    shortcut.learn(args[0], extra)
                    return out
                return fused(self, *args, *extra)
            values = _bind(specs, args, kwargs, sig)
            if values is not None:
                return fused(self, *values, *extra)
        return orig(self, *args, **kwargs)

    functools.update_wrapper(method, orig)
    return method


_class_cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _host_class(orig_cls: type, methods: dict[str, tuple], graphs: dict[str, fx.GraphModule]) -> type:
    """A subclass of ``orig_cls`` overriding ``methods`` (``name -> (key, function)``); cached per key."""
    key = (orig_cls, tuple(sorted((name, k) for name, (k, _) in methods.items())))
    try:
        cached = _class_cache.get(key)
    except TypeError:  # an unhashable default value in a key: no caching
        key, cached = None, None
    if cached is not None:
        return cached

    def body(ns: dict) -> None:
        for name, (_, fn) in methods.items():
            ns[name] = fn
        ns[_GRAPHS_ATTR] = graphs
        ns["__module__"] = orig_cls.__module__
        ns["__qualname__"] = orig_cls.__qualname__
        ns["__reduce_ex__"] = _reduce_as_original
        ns["__copy__"] = _copy_same_class
        ns["__deepcopy__"] = _deepcopy_same_class
        ns["_fxfuse_original_class"] = orig_cls

    cls = types.new_class(orig_cls.__name__, (orig_cls,), exec_body=body)
    if key is not None:
        _class_cache[key] = cls
    return cls


def _reduce_as_original(self, protocol):
    """Pickle (``torch.save(model)``) an optimized module as the original one: optimize again after loading."""
    state = {k: v for k, v in self.__dict__.items() if not k.startswith("_fxfuse")}
    return _rebuild, (self._fxfuse_original_class, state)


def _rebuild(cls: type, state: dict) -> nn.Module:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _copy_same_class(self):
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    return new


def _deepcopy_same_class(self, memo):
    new = object.__new__(type(self))
    memo[id(self)] = new
    for k, v in self.__dict__.items():
        new.__dict__[k] = copy.deepcopy(v, memo)
    return new


def _code_key(gm: fx.GraphModule) -> tuple:
    fn = type(gm).forward
    glob = tuple(sorted((k, id(v)) for k, v in fn.__globals__.items() if not k.startswith("__")))
    return gm.code, glob


# --------------------------------------------------------------------------------------------- assembly

@dataclass
class Install:
    """What one module of the result gets: overridden methods (``name -> (cache key, function)``),
    fused graphs (for inspection) and instance attributes."""

    methods: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)


def assemble(model: nn.Module, hosts: list[Host], inline: Sequence[InlineChain] = ()) -> nn.Module:
    """A shallow copy of ``model`` with each host's method replaced (see the module doc)."""
    by_path: dict[str, list[Install]] = {}
    for h in hosts:
        by_path.setdefault(h.module_path, []).append(_host_install(model.get_submodule(h.module_path), h))
    for chain in inline:
        for path, (methods, attrs) in install_parts(model, chain).items():
            by_path.setdefault(path, []).append(Install(methods, {}, attrs))
    copies: dict[str, nn.Module] = {"": _copy_module(model, by_path.get("", []))}

    def ensure(path: str) -> nn.Module:
        if path in copies:
            return copies[path]
        parent_path, _, name = path.rpartition(".")
        parent = ensure(parent_path)
        child = _copy_module(parent._modules[name], by_path.get(path, []))
        parent._modules[name] = child
        copies[path] = child
        return child

    for path in sorted(by_path, key=lambda p: (p.count(".") if p else -1, p)):
        ensure(path)
    return copies[""]


def _host_install(module: nn.Module, h: Host) -> Install:
    getattr(h.scope.gm, "real_recompile", lambda: None)()  # a lazy GraphModule: generate its code now
    orig = getattr(type(module), h.method)
    training = module.training if h.scope.mode_dependent else None
    # Parameters as arguments (fxfuse.lift): the module's own __getattr__ per read costs more than the dicts.
    gm, lifted = lift_params(h.scope.gm)
    autocast_free = h.scope.autocast_free
    attrs = dict(h.scope.constants)
    call = region_call(gm) if len(h.scope.args) == 1 else None
    shortcut_attr = None
    if call is not None:  # one region on the method's one input (fxfuse.shortcut): each instance keeps its own
        shortcut_attr = f"_fxfuse_shortcut_{h.method}"
        attrs[shortcut_attr] = Shortcut(call, autocast_free)
    key = (_code_key(gm), tuple(h.scope.args), training, autocast_free, tuple(h.weight_targets), tuple(lifted),
           shortcut_attr)
    fn = _make_method(orig, h.scope.args, type(gm).forward, training, h.weight_targets, lifted, autocast_free,
                      shortcut_attr)
    return Install({h.method: (key, fn)}, {h.method: h.scope.gm}, attrs)


def _copy_module(module: nn.Module, installs: list[Install]) -> nn.Module:
    new = copy.copy(module) if not hasattr(type(module), _GRAPHS_ATTR) else _copy_same_class(module)
    new._modules = type(module._modules)(module._modules)
    if not installs:
        return new
    methods, graphs = {}, {}
    for inst in installs:
        methods.update(inst.methods)
        graphs.update(inst.graphs)
        new.__dict__.update(inst.attrs)
    new.__class__ = _host_class(type(module), methods, graphs)
    return new


def fused_graphs(module: nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """``(module path, graph)`` of every fused method in ``module`` (for inspection and tests)."""
    out = []
    for path, m in module.named_modules():
        graphs = getattr(type(m), _GRAPHS_ATTR, None)
        if graphs:
            out += [(f"{path}.{name}" if path else name, gm) for name, gm in graphs.items()]
    return out
