"""The user's entry points: ``optimize`` and ``report``."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from .capture import MOE_NOTE, CaptureFailure, discover, record_inputs
from .cudagraphs import cuda_graphed
from .hosts import place
from .install import assemble, fused_graphs
from .moe import MOE_PATTERN, experts_installs
from .pointwise_convs import pointwise_conv_mlps
from .report import FusionReport, OriginalRuns, RegionReport

__all__ = ["fused_graphs", "optimize", "report"]

log = logging.getLogger(__name__)

_REPORT_ATTR = "_fxfuse_report"
# The backend's reports, by the Dynamo frame whose graph they fused (a recompile of a frame, for new shapes or
# another grad mode, merges into its frame's report instead of counting its regions again).
_backend_reports: dict[Any, FusionReport] = {}


def optimize(model: nn.Module, example_inputs: Optional[Sequence[torch.Tensor]] = None, *,
             cuda_graphs: Union[bool, str] = False) -> nn.Module:
    """Return a module that computes what ``model`` computes, its MLP chains fused into Triton kernels.

    The result is a shallow copy of ``model``, of the same class, with the same methods (``generate``),
    attributes (``config``) and ``state_dict()``: parameters and buffers are shared (no tensor is copied);
    every module is a new object with its own training flag and hooks, so ``.eval()`` on one model does not
    switch the other.
    Each chain runs from the smallest method that contains it (``LlamaMLP.forward``,
    ``BertLayer.feed_forward_chunk``...), so models that cannot be traced whole are fused too; a call
    that is not one the fused graph stands for (another training mode, other arguments) runs the original
    method; under autocast the fused graph runs, each region fused on autocast's casts or as its original ops
    (see the README's Autocast section). ``model`` itself is not modified.

    ``example_inputs``, if given, are run once so that every shape and dtype is known when deciding what
    to fuse. ``fxfuse.report(result)`` says what was fused, what was not and why.

    ``cuda_graphs=True`` (for static shapes, e.g. decoding): the result's ``forward`` replays a CUDA graph per
    input signature (shapes, strides, dtypes) instead of running its Python, for calls in eval mode without
    grad whose tensors are on the GPU; other calls run the plain forward (see :func:`fxfuse.cuda_graphed`). A
    graph whose replay is not at least 3% faster than the plain call (timed right after its capture) is dropped,
    logged at INFO.
    Outputs are clones. ``cuda_graphs="static"`` returns the graph's own output tensors instead (lowest
    latency, as ``torch.compile(mode="reduce-overhead")``): the next call overwrites them, clone what you keep.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        >>> fast = fxfuse.optimize(mlp)                       # doctest: +SKIP
        >>> print(fxfuse.report(fast))                        # doctest: +SKIP
        fxfuse: 1 region(s) fused, ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxfuse.optimize takes an nn.Module, got {type(model).__name__}")
    if cuda_graphs not in (False, True, "static"):
        raise ValueError(f"cuda_graphs must be False, True or 'static', got {cuda_graphs!r}")
    start = time.perf_counter()
    example_inputs = tuple(example_inputs) if example_inputs is not None else None
    module_inputs = record_inputs(model, example_inputs) if example_inputs is not None else {}
    found = discover(model)
    found.failures += pointwise_conv_mlps(model)
    placement = place(model, found, module_inputs)  # (adds the graphs it could not analyze to found.failures)
    experts, experts_acts = experts_installs(model)  # MoE experts: the grouped kernels (fxfuse.moe)
    found.failures = [f for f in found.failures if not (f.error == MOE_NOTE and f.module_path in experts)]
    try:
        result = assemble(model, placement.hosts, placement.inline, experts)
    except Exception as err:  # pragma: no cover - a module that cannot be copied: nothing is fused
        log.info("fxfuse: could not install the fused methods (%s: %s)", type(err).__name__, err,
                 exc_info=log.isEnabledFor(logging.DEBUG))
        found.failures.append(CaptureFailure("", f"not installed: {type(err).__name__}: {err}"))
        placement.hosts, placement.inline, placement.inline_reports, experts_acts = [], [], [], {}
        result = assemble(model, [], [])
    full_report = FusionReport(rejections=placement.rejections, capture_failures=_summarize(found.failures),
                               graphs=placement.graphs)
    reported: set[frozenset[int]] = set()
    for host in placement.hosts:
        for region, weights in zip(host.report.regions, host.fused):
            if weights in reported:
                continue
            reported.add(weights)
            region.host_path = host.module_path
            if host.method != "forward":
                cls = type(model.get_submodule(host.module_path)).__name__
                region.notes.append(f"runs from {cls}.{host.method}")
            if host.scope.mode_dependent:
                region.notes.append(_mode_note(model.get_submodule(host.module_path).training))
            full_report.regions.append(region)
        full_report.graphs += all(host.scope is not s for s in found.scopes)  # (a discovery graph reused)
    for chain, region in zip(placement.inline, placement.inline_reports):
        region.host_path = chain.module_path
    full_report.regions += placement.inline_reports
    for path, act in experts_acts.items():
        experts_module = model.get_submodule(path)
        full_report.regions.append(RegionReport(path, MOE_PATTERN, f"moe:{act}", "moe_grouped (routing + 2 kernels)", [
            "the (token, expert) pairs routed by expert, then two grouped kernels (training: one autograd node "
            "whose backward runs G, the gate's derivative, dx and the weight gradients, these on the Triton kernel "
            "or torch._grouped_mm, whichever measured faster); checked against the module's forward at its first "
            "call (kept if they differ) and timed against it at each power-of-two token bucket's first call, "
            "forward and training step apart (the faster runs; logged, and measured here)"],
            experts=(type(experts_module), tuple(experts_module.gate_up_proj.shape))))
    if cuda_graphs:
        full_report.cuda_graphs = cuda_graphed(result, static_outputs=cuda_graphs == "static").forward.describe()
    earlier = model.__dict__.get(_REPORT_ATTR)
    if isinstance(earlier, FusionReport):  # (a model optimized before: its regions still run, from its copies)
        again = {r.module_path for r in full_report.regions}
        full_report.regions = [*(r for r in earlier.regions if r.module_path not in again), *full_report.regions]
    full_report.seconds = time.perf_counter() - start
    setattr(result, _REPORT_ATTR, full_report)
    log.info("%s", full_report)
    return result


def _summarize(failures: list[CaptureFailure]) -> list[CaptureFailure]:
    """One line per kind of failure: ``layers.*.self_attn (x12)`` instead of twelve lines (a kind seen once keeps
    its path)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for f in failures:
        key = (re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", f.module_path), f.error)
        groups.setdefault(key, []).append(f.module_path)
    return [CaptureFailure(paths[0] if len(paths) == 1 else f"{path} (x{len(paths)})", err)
            for (path, err), paths in groups.items()]


def _mode_note(training: bool) -> str:
    mode, other = ("training", "eval") if training else ("eval", "training")
    return (f"fused for {mode} mode (the traced code depends on it: dropout): calls in {other} mode run the original "
            f"code; for both, optimize the model in each mode (the copies share its parameters)")


def report(model: Optional[nn.Module] = None) -> FusionReport:
    """What fxfuse did to ``model`` (the result of :func:`optimize`, or what ``torch.compile`` made: the compiled
    module, a module after ``model.compile(...)``, a compiled ``model.forward`` or function).

    For ``torch.compile(model, backend="fxfuse")`` the report covers every graph the backend has
    compiled in this process since the last ``torch._dynamo.reset()`` (Dynamo does not tell a backend which module
    a graph came from), a frame's recompiles (new shapes, another grad mode) counting its regions once.

    For a result of :func:`optimize`, each call sets the report's ``original_runs`` to the calls, as of now, that
    its fused methods' guards turned away to the original code (hooks, settings changed in place, arguments
    other than traced).

    Example:
        >>> print(fxfuse.report(fast))                        # doctest: +SKIP
    """
    found = getattr(model, _REPORT_ATTR, None) if model is not None else None
    if isinstance(found, FusionReport):  # (the one optimize kept: callers may hold it; its counts are read now)
        found.original_runs = OriginalRuns.of(getattr(model, "_orig_mod", model))
        return found
    if model is None or _compiled(model):
        _forget_if_dynamo_was_reset()
        merged = FusionReport()
        for r in _backend_reports.values():
            merged.extend(r)
        return merged
    raise ValueError("this module was not produced by fxfuse.optimize or the fxfuse backend")


def _compiled(model: object) -> bool:
    """Whether ``model`` is what ``torch.compile`` made: an ``OptimizedModule`` (``_orig_mod``), a module compiled
    in place by ``model.compile()`` (``_compiled_call_impl``), or a compiled function or bound method."""
    return (hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
            or hasattr(model, "_torchdynamo_orig_callable"))


def _dynamo_reset_marker(args: Any) -> None:
    """A compile-end callback that does nothing: ``torch._dynamo.reset()`` clears Dynamo's callbacks, so this one
    missing means a reset came since the reports were made."""


def _forget_if_dynamo_was_reset() -> None:
    """Drop the backend's reports if ``torch._dynamo.reset()`` ran since they were made (it drops the graphs)."""
    from torch._dynamo.callback import callback_handler

    callbacks = getattr(callback_handler, "end_callbacks", None)
    if callbacks is None:
        return
    if _dynamo_reset_marker not in callbacks:  # (never registered, or cleared by a reset)
        _backend_reports.clear()
        callback_handler.register_end_callback(_dynamo_reset_marker)


def record_backend_report(r: FusionReport) -> None:
    """Keep the backend's report of one graph: merged with the report of earlier graphs of the same Dynamo frame
    (recompiles: each region and rejection once), beside those of other frames. After ``torch._dynamo.reset()``
    (every compiled graph dropped) the reports of before are dropped too."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    frame = (compile_id.compiled_autograd_id, compile_id.frame_id) if compile_id is not None else object()
    _forget_if_dynamo_was_reset()
    kept = _backend_reports.get(frame)
    if kept is None:
        _backend_reports[frame] = r
        return
    seen = {(g.module_path, g.pattern, g.spec) for g in kept.regions}
    kept.regions += [g for g in r.regions if (g.module_path, g.pattern, g.spec) not in seen]
    said = {(j.module_path, j.pattern, j.reason) for j in kept.rejections}
    kept.rejections += [j for j in r.rejections if (j.module_path, j.pattern, j.reason) not in said]
    kept.graphs += r.graphs
    kept.seconds += r.seconds
