"""The pass on one graph: shapes → normalize → match/plan → rewrite, with a report.

``fxfuse.optimize`` runs it on each captured graph; the torch.compile backend on Dynamo's graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata

from .backward import fused_backward_enabled, fused_backward_reason
from .capture import leaving_unchanged
from .gated_training import gated_form, gated_training_enabled
from .kernels.chain_backward_template import walks
from .meta import records_grad, tensor_info
from .normalize import normalize
from .plan import find_regions
from .records import Rejection
from .report import FusionReport, RegionReport
from .rewrite import fused_call_args, replace_regions
from .strategy import FUSED_CHAIN, choose_strategy

__all__ = ["fuse_graph"]

log = logging.getLogger(__name__)

_TRAINING_NOTE = ("training: calls without gradients run fused; once a backward has run, calls that record "
                  "gradients run the original ops (no fused backward: {reason})")
_FUSED_BACKWARD_NOTE = ("training: the backward is one fused kernel too (forward recomputed on chip; "
                        "fxfuse/backward.py)")
_WALK_BACKWARD_NOTE = ("training: the backward is fused too (the forward kernel stores each layer's input, a walk "
                       "kernel writes the activation gradients, one GEMM per weight gradient; fxfuse/backward.py)")
_GATED_NOTE = ("; FXFUSE_GATED_TRAINING=1 runs its act(g) * u as one kernel each way, saving g and u only (a "
               "whole gated MLP as one autograd node): less GPU work and memory (fxfuse/gated_mlp_training.py, "
               "fxfuse/gated_training.py)")
_GATED_ON_NOTE = ("training: calls without gradients run fused; once a backward has run, calls that record gradients "
                  "run the linears as eager's and act(g) * u as one kernel each way, saving g and u only (a whole "
                  "gated MLP as one autograd node; FXFUSE_GATED_TRAINING=1: fxfuse/gated_mlp_training.py, "
                  "fxfuse/gated_training.py)")
_TRAINED_REASON = ("gradients are recorded through its weights: left to the compiler, whose backward keeps the "
                   "intermediates (fxfuse's op would recompute the forward); for inference, call the compiled model "
                   "under torch.no_grad() or torch.inference_mode(), or freeze its weights, and the chain is fused")


def fuse_graph(gm: fx.GraphModule, example_inputs: Optional[Sequence] = None, *, prefix: str = "",
               fuse_differentiable: bool = True) -> FusionReport:
    """Fuse every supported chain of ``gm`` in place and say what was done.

    ``example_inputs`` (real tensors) give every node its shape and dtype, so the planner can check
    more before fusing; without them it decides from the parameters, and the op checks the rest when
    it runs. ``prefix`` is where ``gm`` stands in the user's model (for the report).
    ``fuse_differentiable=False`` leaves chains whose weights require grad as they are where the graph records
    their gradients (a training graph that a compiler differentiates: its own backward keeps the intermediates;
    the op's would recompute the forward). Where the graph's nodes carry Dynamo's fake values, those say whether
    a chain records gradients (:func:`fxfuse.meta.records_grad`): a chain called under ``torch.no_grad()`` inside
    the compiled code records none and is fused.
    """
    start = time.perf_counter()
    if example_inputs is not None and not _has_value_meta(gm):
        _propagate_shapes(gm, example_inputs)
    normalize(gm)
    regions, rejections = find_regions(gm)
    if not fuse_differentiable:
        # (a graph without fake values: the grad mode it is compiled under decides, for all of its chains)
        trained = [r for r in regions if _trains(gm, r, unknown=torch.is_grad_enabled())]
        regions = [r for r in regions if r not in trained]
        rejections += [Rejection(r.pattern, r.module_path, _TRAINED_REASON, [n.name for n in r.nodes])
                       for r in trained]
    for region in regions:
        _refine_strategy(gm, region)
    for region in regions:
        if _trains(gm, region, unknown=gm.training):
            region.notes.append(_training_note(gm, region))
    reports = [RegionReport.from_region(r, fused_call_args(r)[-1], prefix, _kernel_files(r)) for r in regions]
    replace_regions(gm, regions)
    for rej in rejections:
        rej.module_path = ".".join(p for p in (prefix, rej.module_path) if p)
    for r in reports:
        log.info("fxfuse: fused %s at %s (%s): %s", r.pattern, r.module_path, r.strategy, r.spec)
    for rej in rejections:
        log.info("fxfuse: not fused %s at %s: %s", rej.pattern, rej.module_path or "<root>", rej.reason)
    return FusionReport(regions=reports, rejections=rejections, graphs=1, seconds=time.perf_counter() - start)


def _refine_strategy(gm: fx.GraphModule, region) -> None:
    """With every weight's shape known, say which kernels will run (the op decides the same way)."""
    if region.replacement is not None:
        return
    infos = _weight_infos(gm, region)
    if infos is not None:
        region.strategy = choose_strategy(region.spec, _widths(infos))


def _weight_infos(gm: fx.GraphModule, region) -> Optional[list]:
    """The region's weights' static facts, or None unless every one is a 2-D tensor of known shape."""
    infos = [tensor_info(gm, w) for w in region.weights]
    if any(i is None or len(i.shape) != 2 or None in i.shape for i in infos):
        return None
    return infos


def _widths(infos: list) -> tuple[int, ...]:
    """The chain's widths from its weights' shapes: the input, then each stage's output."""
    return (infos[0].shape[1], *(i.shape[0] for i in infos))


def _training_note(gm: fx.GraphModule, region) -> str:
    """What a training step of this region runs: the fused chain backward, or why not (the op decides the same
    way when the backward runs, from the tensors it gets)."""
    infos = _weight_infos(gm, region)
    if infos is None:
        return _TRAINING_NOTE.format(reason="weight shapes unknown here")
    if len({i.dtype for i in infos}) != 1:
        return _TRAINING_NOTE.format(reason="mixed weight dtypes")
    widths = _widths(infos)
    reason = fused_backward_reason(region.spec.dumps(), widths, infos[0].dtype.itemsize) \
        if fused_backward_enabled() else "turned off by FXFUSE_FUSED_BACKWARD=0"
    if reason is not None:
        gated = any(s.num_linears == 2 and gated_form(s.expr) for s in region.spec.stages)
        if gated and gated_training_enabled():  # (read at optimize time; the op reads it on every call)
            return _GATED_ON_NOTE
        return _TRAINING_NOTE.format(reason=reason) + (_GATED_NOTE if gated else "")
    return _WALK_BACKWARD_NOTE if walks(widths) else _FUSED_BACKWARD_NOTE


def _kernel_files(region) -> list[str]:
    """Where the region's generated kernels are (written now, so the user can read them)."""
    if region.replacement is not None:
        return []
    from .codegen import generated_chain_kernel, kernel_path

    try:
        if region.strategy == FUSED_CHAIN:
            return [generated_chain_kernel(tuple(s.epilogue for s in region.spec.stages)).__file__]
        return [str(kernel_path(s.num_linears, s.epilogue)) for s in region.spec.stages]
    except Exception as err:  # a report must not break optimize(); the op reports real errors when run
        log.debug("fxfuse: could not generate the kernel source for the report: %s", err)
        return []


def _has_value_meta(gm: fx.GraphModule) -> bool:
    return any("val" in n.meta or "example_value" in n.meta for n in gm.graph.nodes if n.op == "placeholder")


class _ShapeProp(ShapeProp):
    """:class:`ShapeProp` (no fake mode) recording the same ``tensor_meta`` and ``type``, but raising a failing node's
    error as it is: torch's prints the traceback first, and wrong example inputs are the caller's to report."""

    def run_node(self, n: fx.Node):
        result = fx.Interpreter.run_node(self, n)
        found = False

        def meta_of(value):
            nonlocal found
            if isinstance(value, torch.Tensor):
                found = True
                return _extract_tensor_metadata(value)
            return value

        meta = map_aggregate(result, meta_of)
        if found:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        return result


def _propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence) -> None:
    # (the graph runs the user's modules and buffers: a training-mode BatchNorm, a buffer written in place, a
    # dropout would change them or the random state; all is put back as it was)
    try:
        with leaving_unchanged(gm, example_inputs), torch.no_grad():
            _ShapeProp(gm).propagate(*example_inputs)
    except Exception as err:  # shapes are a help, not a requirement
        log.info("fxfuse: shape propagation failed (%s: %s); planning from parameters only",
                 type(err).__name__, err)


def _trains(gm: fx.GraphModule, region, unknown: bool) -> bool:
    """Whether ``region``'s weights get gradients from this graph: some of them require grad, and the region's
    output records gradients where the graph computes it (Dynamo's fake values say so: not inside a
    ``torch.no_grad()`` block or a forward decorated with it). ``unknown``: the answer where the graph carries no
    such values (a traced module's graph: its training mode)."""
    if not any(_requires_grad(gm, w) for w in region.weights):
        return False
    recorded = records_grad(region.output)
    return unknown if recorded is None else recorded


def _requires_grad(gm: fx.GraphModule, node: fx.Node) -> bool:
    info = tensor_info(gm, node)
    return bool(info is not None and info.requires_grad)
