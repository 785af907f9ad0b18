"""``torch.compile(model, backend="fxfuse")``: the pass as a Dynamo backend.

Found by name through the ``torch_dynamo_backends`` entry point (no ``import fxfuse`` needed).
Dynamo hands over the graph with parameters as placeholders and ``nn.Linear`` inlined as
``torch._C._nn.linear``; the pass normalizes both. By default the rewritten graph goes on to
Inductor, which compiles the rest and keeps each fused region as an opaque call of ``torch.ops.fxfuse.mlp_infer``
(``mlp_extern`` in a graph compiled with grad mode on; :mod:`fxfuse.extern`): at run time fxfuse plans and
replays the region as ``fxfuse.optimize`` does, instead of Inductor compiling the op's kernels untimed. Under
``mode="reduce-overhead"`` the call is ``mlp_graphed``, whose kernels Inductor's CUDA graphs capture. With
``options={"inductor": False}`` the rewritten graph runs as it is: no compile wait. So does a graph that is
nothing but its fused regions (an MLP module compiled on its own; not under CUDA graphs): Inductor would only wrap
the calls, which cost ~30-40 µs of host per call on the H200 machine (``benchmarks/probes/probe_backend_host.py``),
a decode MLP's whole GPU time. In a graph compiled for training, chains whose weights get gradients stay Inductor's
(one called under ``torch.no_grad()`` inside the compiled code, or in a forward decorated with it, is fused).

Example:
    >>> fast = torch.compile(model, backend="fxfuse")                                # doctest: +SKIP
    >>> quick = torch.compile(model, backend="fxfuse", options={"inductor": False})  # doctest: +SKIP
    >>> decode = torch.compile(model, backend="fxfuse", mode="reduce-overhead")   # doctest: +SKIP
    >>> tuned = torch.compile(model, backend="fxfuse", options={"max_autotune": True})  # Inductor's  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.fx as fx

from . import pattern
from .api import record_backend_report
from .extern import externalize
from .ops import is_fused_call
from .pipeline import fuse_graph
from .shortcut import Shortcut, graph_region

__all__ = ["fxfuse_backend", "only_regions", "run_as_is"]

log = logging.getLogger(__name__)

# What a graph may do beside its fused regions and still leave Inductor nothing to compile: pick or reshape values.
_VIEW_FUNCTIONS = frozenset({operator.getitem, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze})
_VIEW_METHODS = frozenset({"view", "reshape", "flatten", "squeeze", "unsqueeze", "size", "dim"})


def _inductor_patches(options: dict) -> dict:
    """``options`` less fxfuse's own, checked against Inductor's settings (a typo is an error, not ignored)."""
    if not options:
        return {}
    from torch._inductor import list_options

    unknown = sorted(set(options) - set(list_options()))
    if unknown:
        raise ValueError(f"fxfuse backend: unknown option(s) {unknown}; known: 'inductor' (fxfuse's) and "
                         "Inductor's settings (torch._inductor.list_options())")
    return options


def only_regions(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` computes nothing but its fused regions (at least one), its other calls only views and
    picks of their inputs and outputs.

    Example:
        >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
        >>> only_regions(gm)  # the chain is not fused yet
        False
    """
    fused = False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_fused_call(node):
            fused = True
        elif not ((node.op == "call_function" and node.target in _VIEW_FUNCTIONS)
                  or (node.op == "call_method" and node.target in _VIEW_METHODS)):
            return False
    return fused


def run_as_is(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s forward; for a graph that is one region on its arguments (:func:`fxfuse.shortcut.graph_region`),
    tried first through a :class:`~fxfuse.shortcut.Shortcut` (as ``fxfuse.optimize``'s one-region modules are), which
    calls the region's replay with the same checks in fewer frames."""
    region = graph_region(gm)
    forward = gm.forward
    if region is None:
        return forward
    shortcut = Shortcut(region.call, autocast_free=True)  # (it checks autocast itself: then the full path runs)
    x_at, tupled = region.x, region.tupled

    def run(*args):
        x = args[x_at]
        out = shortcut(x, args)
        if out is not None:
            return (out,) if tupled else out
        result = forward(*args)
        shortcut.learn(x, args)
        return result

    return run


def fxfuse_backend(gm: fx.GraphModule, example_inputs: list[Any], options: Optional[dict] = None,
                   mode: Optional[str] = None):
    """Dynamo backend: fuse the MLP chains of ``gm``, then hand it to Inductor (or run it as is).

    ``mode`` (``torch.compile(..., mode=...)``) is Inductor's, e.g. ``"max-autotune-no-cudagraphs"``. ``options``:
    ``"inductor"`` (fxfuse's: False runs the rewritten graph as it is) and any of Inductor's own settings
    (``torch._inductor.list_options()``, e.g. ``{"max_autotune": True, "triton.cudagraphs": True}``), which
    Inductor gets for the rest of the graph, as ``backend="inductor"`` would.
    """
    pattern.compiled_with_backend = True  # (a pattern registered from now on resets Dynamo's caches)
    options = dict(options or {})
    inductor = options.pop("inductor", True)
    if not isinstance(inductor, bool):
        raise ValueError(f"fxfuse backend: options={{'inductor': ...}} takes True or False, not {inductor!r}")
    inductor_patches = _inductor_patches(options)
    if inductor_patches and not inductor:
        raise ValueError(f"fxfuse backend: Inductor options {sorted(inductor_patches)} given with "
                         "options={'inductor': False}, which runs the graph without Inductor")
    # A graph that records gradients is differentiated by AOTAutograd: there the chains that train stay
    # Inductor's, whose backward keeps the intermediates (the op's would recompute the forward). Which chains
    # train, Dynamo's fake values say node by node, not the grad mode at compile time: a chain under
    # torch.no_grad() inside the compiled code (a forward decorated with it, a frozen teacher) is fused, and one
    # under torch.enable_grad() in a graph compiled without grad mode stays Inductor's. Without Inductor the
    # graph runs eagerly and the op itself switches to the original ops once trained.
    report = fuse_graph(gm, fuse_differentiable=not inductor)
    record_backend_report(report)  # Dynamo's nodes carry their example values: no shape propagation needed
    if not inductor:
        return run_as_is(gm)
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**(list_mode_options(mode) if mode else {}), **inductor_patches}
    # (mode="reduce-overhead": Inductor CUDA-graphs the graph, and the regions' kernels can be captured in it)
    graphed = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    if not graphed and only_regions(gm):
        log.debug("fxfuse backend: the graph is its fused regions only: it runs as it is (Inductor would only wrap "
                  "the region calls)")
        return run_as_is(gm)
    externalize(gm, inference=not torch.is_grad_enabled(), graphed=graphed)
    return compile_fx(gm, example_inputs, config_patches=patches or None)
