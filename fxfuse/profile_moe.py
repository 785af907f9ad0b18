"""``fxfuse.profile`` for MoE experts modules: each optimized experts module as a profiled region.

An experts module runs the forward ``fxfuse.optimize`` installed on it (:func:`fxfuse.moe.moe_forward`), not the
``fxfuse.mlp`` op :mod:`fxfuse.profile` intercepts. While a profile runs, :func:`intercept_experts` sets each such
module's ``forward`` (an instance attribute over its class's method, removed after) to a call of a handler,
which runs the installed forward ("after": what the optimized model runs, the kernels or, in a bucket where its
timing kept it, the module's own) or the class's original forward ("before": transformers' default experts
implementation), each inside ``record_function("fxfuse region <path>")`` as the dense regions are.
:func:`count_experts_call` counts a call's work: the routed pairs' products, the experts hit read once.

Example:
    >>> rep = fxfuse.profile(mixtral.cuda().bfloat16().eval(), (input_ids,))    # doctest: +SKIP
    >>> [r.pattern for r in rep.regions][:1]                                     # doctest: +SKIP
    ['moe_experts']
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .report import FusionReport
from .roofline import CallWork

__all__ = ["ExpertsSite", "as_op", "count_experts_call", "experts_sites", "intercept_experts"]

# ``fxfuse::profiled_call``: runs the call :func:`as_op` hands it, as one dispatcher op. torch.profiler links a kernel
# to the op around its launch: Triton launches made from Python outside any op (the experts' kernels) would
# belong to no region (a Mixtral's experts read 7.7 µs of kernels "after" on an H100: the per-token add alone).
_lib = torch.library.Library("fxfuse", "FRAGMENT")  # (kept alive with the module: it owns the registration)
_lib.define("profiled_call(Tensor anchor) -> Tensor")
_pending = threading.local()


def _profiled_call(anchor: torch.Tensor) -> torch.Tensor:
    return _pending.call()


_lib.impl("profiled_call", _profiled_call, "CompositeExplicitAutograd")


def as_op(call: Callable[[], torch.Tensor], anchor: torch.Tensor) -> torch.Tensor:
    """``call()`` inside the op ``fxfuse::profiled_call`` (``anchor``: any tensor of the call, for the dispatch),
    so that the profiler attributes the kernels it launches."""
    outer = getattr(_pending, "call", None)
    _pending.call = call
    try:
        return torch.ops.fxfuse.profiled_call.default(anchor)
    finally:
        _pending.call = outer

_FORWARD_LAUNCHES = 4  # routing, gate/up, down, the per-token sum (many pairs: the routing is two launches)
_ORIGINAL_LAUNCHES = 10  # transformers' grouped_mm path, about: routing sorts, gathers, two grouped GEMMs, pointwise


@dataclass
class ExpertsSite:
    """One optimized experts module, as :mod:`fxfuse.profile` names and assembles a region."""

    label: str
    path: str
    module: nn.Module
    pattern: str
    spec: str
    strategy: str
    launches: int = _FORWARD_LAUNCHES

    @property
    def installed(self) -> Callable:
        return type(self.module).forward

    @property
    def original(self) -> Callable:
        """The class's own forward (the installed one wraps it)."""
        forward = type(self.module).forward
        return getattr(forward, "__wrapped__", forward)

    def routing_args(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, top_k_index)`` of a call, by position or by name."""
        bound = inspect.signature(self.original).bind(self.module, *args, **kwargs).arguments
        values = list(bound.values())[1:]
        return values[0], values[1]


def experts_sites(model: nn.Module, fusion: FusionReport, label_prefix: str) -> dict[str, ExpertsSite]:
    """Each experts region of ``fusion`` found in ``model`` (the optimized copy), by its profile label."""
    sites = {}
    for r in fusion.regions:
        if not r.experts:
            continue
        try:
            module = model.get_submodule(r.module_path)
        except AttributeError:
            continue
        label = label_prefix + r.module_path
        sites[label] = ExpertsSite(label, r.module_path, module, r.pattern, r.spec, r.strategy)
    return sites


@contextlib.contextmanager
def intercept_experts(sites: dict[str, ExpertsSite], handler: Callable[..., Any]) -> Iterator[None]:
    """While active, a call of each site's module runs ``handler(site, args, kwargs)``."""
    patched = []
    try:
        for site in sites.values():
            if "forward" in vars(site.module):
                continue  # (an instance forward of its own: a CUDA-graphed module's; left as it is)
            site.module.forward = lambda *args, _site=site, **kwargs: handler(_site, args, kwargs)
            patched.append(site.module)
        yield
    finally:
        for module in patched:
            vars(module).pop("forward", None)


def count_experts_call(site: ExpertsSite, hidden: torch.Tensor, index: torch.Tensor) -> CallWork:
    """The work of one experts call on ``hidden`` ``[T, H]`` routed by ``index`` ``[T, top_k]``: FLOPs of each
    routed pair's gate/up and down products; minimum bytes: the experts hit read once, input and output once;
    traffic estimates of transformers' grouped_mm path (the input gathered per pair, the gate/up output and the
    product written and read back, each pair's output written and summed) and of the kernels (the intermediate
    written and read once, each pair's row written and summed)."""
    from .moe import _experts_work

    module = site.module
    flops, min_bytes = _experts_work(module, hidden, index, False)  # (one host sync: the experts hit)
    num = module.gate_up_proj.shape[0]
    width = hidden.shape[-1]
    inter = module.down_proj[0].numel() // width
    pairs = int(((index >= 0) & (index < num)).sum())
    elem = hidden.element_size()
    tokens = hidden.numel() // width
    weights = min_bytes - 2 * hidden.numel() * elem  # the experts hit, read once
    eager = weights + elem * (tokens * width + pairs * (4 * width + 6 * inter) + tokens * width)
    fused = weights + elem * (pairs * (3 * width + 2 * inter) + tokens * width)
    return CallWork(tokens, f"{width}→{num}×2×{inter}→{width} top-{index.shape[-1]}",
                    str(hidden.dtype).removeprefix("torch."), int(flops), int(min_bytes), int(eager), int(fused),
                    _ORIGINAL_LAUNCHES, ("routing", "gather", "grouped_mm", "act", "mul", "grouped_mm", "scale",
                                         "sum"))
