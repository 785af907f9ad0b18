"""Hosts: run each fused chain from the smallest method of the model that contains it.

:func:`fxfuse.capture.discover` says where the chains are; every op of a discovered chain knows the
Python frames it was traced in. A chain's *host* is the innermost method of a module that encloses
the whole chain: ``LlamaMLP.forward``, ``GPT2MLP.forward``, ``BertLayer.feed_forward_chunk`` (BERT's
chain spans its sibling ``intermediate`` and ``output`` submodules), ``Sequential.forward``. The host
is traced again, strictly, and fused with :func:`fxfuse.pipeline.fuse_graph`; if that does not fuse
the chain, the next enclosing method is tried. A chain written inline in a method that cannot be
traced (BART-style layers), or whose trace stands only for calls that leave its defaulted arguments alone
(MPNet's, DeBERTa's and Data2VecVision's layers, whose models pass them on every call; the chain spans their
sibling ``intermediate`` and ``output``), is fused by a proven hand-off between its submodules instead
(:mod:`fxfuse.inline`).

The fused hosts are installed in a copy of the model by :mod:`fxfuse.install`, whose guarded
methods fall back to the original method on any call the strict trace does not stand for.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize

from .capture import CaptureFailure, Discovery, Scope, trace_scope
from .inline import InlineChain, chain_modules, prove
from .install import bind_call, guard_text
from .normalize import normalize
from .ops import is_fused_call
from .pipeline import fuse_graph
from .plan import find_regions
from .records import Rejection
from .report import FusionReport, RegionReport
from .rewrite import fused_call_args

__all__ = ["Host", "Placement", "place"]

log = logging.getLogger(__name__)



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
    computed: list[str]  # weights that are not a parameter read (e.g. a weight_norm parametrization's output)
    candidates: list[tuple[str, str]]
    inline: Any  # () -> (an InlineChain and its report, or the reason it cannot be one and None)


# --------------------------------------------------------------------------------------------- placing

def place(model: nn.Module, discovery: Discovery, module_inputs: Optional[dict] = None) -> Placement:
    """Find and fuse the host of every chain ``discovery`` found (see the module doc)."""
    module_inputs = module_inputs or {}
    out = Placement(graphs=len(discovery.scopes))
    attempts: dict[tuple[str, str], Any] = {}
    # Discovery's traces serve as hosts' when strict would give the same graph (a strict trace of code that uses
    # the autocast state, switches or reads grad mode or changes Python state fails: traced again, it says so).
    reuse = {(s.module_path, s.method): s for s in discovery.scopes
             if not (s.permissive_used or s.autocast_used or s.modes_used or s.side_effects)}
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
            computed = [c for c in (_computed_weight(scope.gm, w) for w in region.weights) if c]
            found.append(_Found(region.pattern, path, [n.name for n in region.nodes],
                                _param_ids(scope.gm, region.weights), computed, candidates, inline))
    for f in found:
        if f.computed:  # no host can fuse it: a fused graph reads its weights as parameters
            _add_rejection(out, seen_rejections, Rejection(
                f.pattern, f.path, f"weight computed on every call: {', '.join(f.computed)}; "
                "fxfuse fuses chains whose weights are parameters", f.names), "")
            continue
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
            if not any(_same_chain(inline, kept) for kept in out.inline):  # (one layer reached by several calls)
                out.inline.append(inline)
                out.inline_reports.append(report)
            continue
        reasons.append(inline)
        if speculative is not None:
            key, host = speculative
            if key not in chosen:
                chosen[key] = host
                for r in host.report.regions:
                    r.notes.append("fused only for calls with " + guard_text(host.scope.args))
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
        return f"{name} is fused only for calls with {guard_text(host.scope.args)}"
    reasons = {r.reason for r in host.report.rejections}
    return f"{name} does not fuse it" + (f" ({'; '.join(sorted(reasons))})" if reasons else "")


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
    return recorded is not None and host.method == "forward" and bind_call(host.scope, *recorded) is not None


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

    def child_of(target: Any, group: Optional[str] = None) -> Optional[str]:
        """``target``'s name relative to ``parent`` if it is a child of it (or of its child ``group``)."""
        t, pre = str(target), prefix + (f"{group}." if group else "")
        if not t.startswith(pre) or t[len(pre):] not in (parent._modules[group]._modules if group else direct):
            return None
        return f"{group}.{t[len(pre):]}" if group else t[len(pre):]

    def group_of(frames: tuple) -> Optional[str] | bool:
        """The child of ``parent`` whose ``forward`` (called by ``method``) ran the node, ``None`` when ``method``
        itself ran it, ``False`` when some other frame is between them."""
        at = [k for k, (r, code) in enumerate(frames) if r == rel and code.co_name == method]
        inner = [f for f in frames[at[-1] + 1:] if f[1] not in _CALL_FRAMES] if at else [None, None]
        if not inner:
            return None
        group = child_of(inner[0][0]) if len(inner) == 1 and inner[0] == frames[-1] else None
        return group if group is not None and _method_of(parent._modules[group], inner[0][1]) == "forward" else False

    innermost: dict[Optional[str], Any] = {}
    linears, middles = [], []
    for node in region.nodes:
        frames = node.meta.get("fxfuse_frames") or ()
        group = group_of(frames) if frames else False
        if group is False or innermost.setdefault(group, frames[-1]) != frames[-1]:
            return f"the chain is not called directly in {type(parent).__name__}.{method} or in the forward " \
                "of a child it calls", None
        if node in region.weights or node.op == "call_function" and node.target is torch.nn.functional.linear:
            name = child_of(node.meta.get("fxfuse_module_path", ""), group)
            if name is None or not isinstance(parent.get_submodule(name), nn.Linear):
                return "a linear of the chain is not an nn.Linear child (or a child's child)", None
            linears.append(name)
            middles.append([])
        elif node.op == "call_module" and child_of(node.target, group) is not None and linears:
            middles[-1].append(child_of(node.target, group))
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
                          [f"runs as a hand-off between {', '.join(chain_mods)} in {type(parent).__name__}.{method}",
                           "fused for eval mode (the hand-off's): calls in training mode run the original code"])
    # (as the op's measurements are keyed: the report shows what the first GPU call chose)
    shapes = [parent.get_submodule(name).weight for name in linears]
    report.widths = (shapes[0].shape[1], *(w.shape[0] for w in shapes))
    report.dtype = str(shapes[0].dtype).replace("torch.", "")
    report.stages = len(region.spec.stages)
    return chain, report


# A module's __call__ between a method and the forward it calls.
_CALL_FRAMES = (nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__)


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
    values = bind_call(scope, args, kwargs)
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


def _same_chain(a: InlineChain, b: InlineChain) -> bool:
    return (a.module_path, a.method, a.modules) == (b.module_path, b.method, b.modules)


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


def _computed_weight(gm: fx.GraphModule, node: Any) -> Optional[str]:
    """What a weight argument is, if it is computed on every call rather than read from a parameter: an op's
    output, or the attribute of a parametrized module (``weight_norm``, ``spectral_norm``: a fresh tensor on
    every access, so no fused graph can bind it)."""
    found = _resolve_param(gm, node)
    if found is None:
        return f"{node} (an op's output)"
    owner, _, attr = found[0].rpartition(".")
    try:
        if parametrize.is_parametrized(gm.get_submodule(owner), attr):
            return f"{found[0]} (a parametrization such as weight_norm)"
    except AttributeError:
        pass
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
