"""``torch.compile(model, backend="fxfuse")``: the pass as a Dynamo backend.

Found by name through the ``torch_dynamo_backends`` entry point (no ``import fxfuse`` needed).
Dynamo hands over the graph with parameters as placeholders and ``nn.Linear`` inlined as
``torch._C._nn.linear``; the pass normalizes both. By default the rewritten graph goes on to
Inductor, which compiles the rest and keeps each fused region as an opaque call of ``torch.ops.fxfuse.mlp_infer``
(``mlp_extern`` in a graph compiled with grad mode on; :mod:`fxfuse.extern`): at run time fxfuse plans and
replays the region as ``fxfuse.optimize`` does, instead of Inductor compiling the op's kernels untimed. Under
``mode="reduce-overhead"`` the call is ``mlp_graphed``, whose kernels Inductor's CUDA graphs capture. With
``options={"inductor": False}`` the rewritten graph runs as it is: no compile wait. A graph
compiled for training (grad mode on, weights that require grad) keeps its chains for Inductor.

Example:
    >>> fast = torch.compile(model, backend="fxfuse")                                # doctest: +SKIP
    >>> quick = torch.compile(model, backend="fxfuse", options={"inductor": False})  # doctest: +SKIP
    >>> decode = torch.compile(model, backend="fxfuse", mode="reduce-overhead")   # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.fx as fx

from .api import record_backend_report
from .extern import externalize
from .pipeline import fuse_graph

__all__ = ["fxfuse_backend"]

log = logging.getLogger(__name__)

_OPTIONS = {"inductor"}


def fxfuse_backend(gm: fx.GraphModule, example_inputs: list[Any], options: Optional[dict] = None,
                   mode: Optional[str] = None):
    """Dynamo backend: fuse the MLP chains of ``gm``, then hand it to Inductor (or run it as is).

    ``mode`` (``torch.compile(..., mode=...)``) is Inductor's, e.g. ``"max-autotune-no-cudagraphs"``.
    """
    options = dict(options or {})
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"fxfuse backend: unknown option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    inductor = options.get("inductor", True)
    # A graph compiled with grad mode on is differentiated by AOTAutograd: there the chains that train stay
    # Inductor's, whose backward keeps the intermediates (the op's would recompute the forward). Without
    # Inductor the graph runs eagerly and the op itself switches to the original ops once trained.
    report = fuse_graph(gm, fuse_differentiable=not (inductor and torch.is_grad_enabled()))
    record_backend_report(report)  # Dynamo's nodes carry their example values: no shape propagation needed
    if not inductor:
        return gm.forward
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options(mode) if mode else {}
    # (mode="reduce-overhead": Inductor CUDA-graphs the graph, and the regions' kernels can be captured in it)
    graphed = patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs)
    externalize(gm, inference=not torch.is_grad_enabled(), graphed=graphed)
    return compile_fx(gm, example_inputs, config_patches=patches or None)
