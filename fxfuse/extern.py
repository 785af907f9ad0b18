"""``fxfuse::mlp_infer``, ``mlp_graphed`` and ``mlp_extern``: a fused region as a call Inductor makes, not code it
compiles.

``torch.ops.fxfuse.mlp`` is a ``triton_op``: a tracer sees its Triton launches, so ``torch.export`` and
AOTInductor can carry the kernels. But Inductor traces *into* it too, with fake tensors, where fxfuse's runtime
cannot work: the planner cannot time candidates (it takes the cost model's first guess), replays and bound
launches do not exist, and the kernels' self-resetting workspaces become fresh ``zeros`` kernels on every call.
On the H200 (``benchmarks/probes/probe_backend.py``), ``torch.compile(model, backend="fxfuse")`` through that path read
GPT-2-medium's MLP at one row at 89.5 µs on the GPU (``fxfuse.optimize``: 14.6; eager 26.0) and 116 µs per call
on the wall (eager 59.5), Llama's at 108 µs (91.9), seed_geglu at 244 µs (198).

The compile backend therefore hands Inductor a graph whose fused regions call one of these ops instead
(:func:`externalize`), which Inductor keeps as opaque calls (fallback kernels) and compiles everything around. At
run time the call is fxfuse's own: the region is planned on real tensors at its first call, then replayed.

* ``fxfuse::mlp_infer`` for a region whose result records no gradients (a graph compiled without grad mode, or a
  ``torch.no_grad()`` block inside one compiled with it; Dynamo's fake values say which, and Dynamo guards on the
  grad mode and on the inputs' ``requires_grad``): defined with ``torch.library.Library`` and no autograd kernel,
  so a call is the dispatcher and one Python kernel. A ``torch.library.custom_op`` layers Python wrappers around
  its kernel (autograd, then checks of the result): ~36 µs of host per call on the H200 machine around fxfuse's ~17.
* ``fxfuse::mlp_extern`` for a region whose result records gradients: a ``custom_op`` with the triton_op's
  autograd (the vjp of the original ops), for regions whose weights are frozen but whose input wants gradients.
* ``fxfuse::mlp_graphed`` for an inference graph that Inductor CUDA-graphs (``mode="reduce-overhead"``, or
  ``triton.cudagraphs`` on): the region's kernels are captured with the rest of the graph, so a decode step is one
  graph replay. Its calls during the trees' warm-up run off the graphs' memory pool (:mod:`fxfuse.graph_pool`): a
  region's first calls keep state (its timed plan, replays, workspaces) that must not live in that pool.

The other two are tagged ``cudagraph_unsafe``: where CUDA graphs cover a graph that holds them anyway (mlp_extern
in a graph compiled with grad mode and ``mode="reduce-overhead"``), Inductor graphs the rest around them and calls
them plainly.

Example (what :func:`fxfuse.backend.fxfuse_backend` does with Dynamo's graph ``gm``):
    >>> report = fxfuse.pipeline.fuse_graph(gm)  # one region: a fused_mlp(...) call    # doctest: +SKIP
    >>> externalize(gm, inference=True, graphed=False)  # now torch.ops.fxfuse.mlp_infer.default(...)  # doctest: +SKIP
    1
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch import Tensor

from . import graph_pool, ops
from .meta import records_grad

__all__ = ["externalize", "mlp_extern"]

log = logging.getLogger(__name__)

_SCHEMA = "(Tensor x, Tensor[] weights, Tensor[] biases, Tensor[] operands, str spec) -> Tensor"
# (the tag exists from torch 2.8; without it Inductor's CUDA graphs would capture the calls)
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_lib = torch.library.Library("fxfuse", "FRAGMENT")  # (kept alive with the module: it owns the registrations)
_lib.define("mlp_infer" + _SCHEMA, tags=_TAGS)
_lib.define("mlp_graphed" + _SCHEMA)


def _run(x: Tensor, weights: list[Tensor], biases: list[Tensor], operands: list[Tensor], spec: str) -> Tensor:
    """The region by fxfuse's runtime on real tensors, as ``torch.ops.fxfuse.mlp`` runs it."""
    if not ops.on_its_device(x):  # (another GPU's input: under that GPU, as the op does)
        with torch.cuda.device(x.device):
            return _run(x, weights, biases, operands, spec)
    if ops._autocast_on(x):
        return _reference(_AUTOCAST_REASON, x, weights, biases, operands, spec)
    if x.is_cpu and not ops._interpreting():
        return _reference(_CPU_REASON, x, weights, biases, operands, spec)
    # (every path returns a fresh tensor, as an op must: kernels, replays and the original ops' last linear)
    return ops._not_a_view(ops._dispatch(x, weights, biases, operands, spec))


# Why a region's call runs its original ops here (logged once each, as fxfuse.ops logs its own fallbacks).
_AUTOCAST_REASON = "autocast is on: the original ops run, as autocast casts them"
_CPU_REASON = "cpu tensors run the reference ops (the kernels need CUDA)"  # (the text fxfuse.ops gives the op's)


def _reference(reason: str, x: Tensor, weights: list[Tensor], biases: list[Tensor], operands: list[Tensor],
               spec: str) -> Tensor:
    """The region's original ops, saying why once (the report calls the region fused: the log says what runs)."""
    if reason not in ops._logged_fallbacks:
        ops._logged_fallbacks.add(reason)
        log.info("fxfuse.mlp falls back to the reference ops: %s", reason)
    return ops.reference_mlp(x, weights, biases, operands, spec)


def _run_graphed(x: Tensor, weights: list[Tensor], biases: list[Tensor], operands: list[Tensor], spec: str) -> Tensor:
    """:func:`_run`; during a cudagraph tree's warm-up on a helper thread, off the graphs' memory pool."""
    if x.is_cuda and graph_pool.warming_up_into_pool(x.device):
        return graph_pool.off_pool(_run, x, weights, biases, operands, spec)
    return _run(x, weights, biases, operands, spec)


def _fake(x, weights, biases, operands, spec):
    return x.new_empty((*x.shape[:-1], weights[-1].shape[0]))


for _key in ("CUDA", "CPU", "XPU", "MPS"):  # (off CUDA, _dispatch runs the original ops, as the op does)
    _lib.impl("mlp_infer", _run, _key)
    _lib.impl("mlp_graphed", _run_graphed, _key)
torch.library.register_fake("fxfuse::mlp_infer", _fake, lib=_lib)
torch.library.register_fake("fxfuse::mlp_graphed", _fake, lib=_lib)


@torch.library.custom_op("fxfuse::mlp_extern", mutates_args=(), tags=_TAGS)
def mlp_extern(x: Tensor, weights: list[Tensor], biases: list[Tensor], operands: list[Tensor], spec: str) -> Tensor:
    """``torch.ops.fxfuse.mlp`` (same arguments, same result) as an opaque op: see the module doc."""
    return _run(x, weights, biases, operands, spec)


mlp_extern.register_fake(_fake)
mlp_extern.register_autograd(ops._backward, setup_context=ops._setup_context)


def externalize(gm: fx.GraphModule, inference: bool, graphed: bool = False) -> int:
    """Point ``gm``'s fused region calls at ``fxfuse::mlp_infer`` or ``fxfuse::mlp_extern``, lint and recompile;
    the number of calls changed.

    A call whose result records gradients where the graph computes it (Dynamo's fake value says so:
    :func:`fxfuse.meta.records_grad`) gets ``mlp_extern``, the one with an autograd formula, and any other
    ``mlp_infer``: a region under ``torch.no_grad()`` inside a graph compiled with grad mode records nothing, and
    one under ``torch.enable_grad()`` inside a graph compiled without it does. Without a fake value, ``inference``
    (the graph was compiled without grad mode) decides. In an ``inference`` graph that Inductor will CUDA-graph
    (``graphed``), ``mlp_infer`` becomes ``fxfuse::mlp_graphed``.
    """
    infer = torch.ops.fxfuse.mlp_graphed.default if inference and graphed else torch.ops.fxfuse.mlp_infer.default
    changed = 0
    for node in gm.graph.nodes:
        if ops.is_fused_call(node):
            recorded = records_grad(node)
            node.target = torch.ops.fxfuse.mlp_extern.default if (not inference if recorded is None else recorded) \
                else infer
            changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
        log.debug("fxfuse backend: %d fused region call(s) handed to Inductor as opaque calls", changed)
    return changed
