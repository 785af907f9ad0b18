"""Capture: turn the user's model into FX graphs, as much of it as can be traced.

First the whole model goes through ``torch.fx.symbolic_trace``. Most real models have Python
control flow somewhere (on input values, shapes, optional arguments), so when that fails the
children are tried one by one, recursively: every submodule that traces becomes its own graph,
and the ones that do not are reported with the tracer's error.

The graphs share the user's parameters and submodules (nothing is copied), and each keeps every
parameter and buffer of the module it stands for, so ``state_dict()`` is unchanged.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

__all__ = ["Capture", "CaptureFailure", "CapturedGraph", "capture", "trace_module"]

log = logging.getLogger(__name__)


@dataclass
class CaptureFailure:
    module_path: str  # "" is the whole model
    error: str


@dataclass
class CapturedGraph:
    module_path: str  # where the graph stands in the model ("" is the whole model)
    gm: fx.GraphModule
    example_inputs: Optional[tuple] = None


@dataclass
class Capture:
    graphs: list[CapturedGraph] = field(default_factory=list)
    failures: list[CaptureFailure] = field(default_factory=list)


def trace_module(module: nn.Module) -> fx.GraphModule:
    """``symbolic_trace`` that keeps the module's class name and its whole state (see module doc)."""
    tracer = fx.Tracer()
    graph = tracer.trace(module)
    gm = fx.GraphModule(tracer.root, graph, module.__class__.__name__)
    _adopt_state(gm, module)
    return gm


def _adopt_state(gm: fx.GraphModule, module: nn.Module) -> None:
    """Give ``gm`` every child, parameter and buffer of ``module`` (shared), in the original order.

    GraphModule keeps only the attributes its graph uses; a dropped child (an eval-mode dropout,
    an unused layer) would otherwise vanish from ``state_dict()``.
    """
    for name, child in module.named_children():
        if name not in gm._modules:
            gm.add_module(name, child)
    for name, p in module.named_parameters(recurse=False):
        if name not in gm._parameters:
            gm.register_parameter(name, p)
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    for name, b in module.named_buffers(recurse=False):
        if name not in gm._buffers:
            gm.register_buffer(name, b, persistent=name not in non_persistent)
    # Same key order as the original (state_dict follows registration order).
    gm._modules = OrderedDict((k, gm._modules[k]) for k in _ordered(module._modules, gm._modules))
    gm._parameters = OrderedDict((k, gm._parameters[k]) for k in _ordered(module._parameters, gm._parameters))
    gm._buffers = OrderedDict((k, gm._buffers[k]) for k in _ordered(module._buffers, gm._buffers))
    gm.train(module.training)


def _ordered(original: dict, current: dict) -> list:
    return [k for k in original if k in current] + [k for k in current if k not in original]


def _may_hold_a_chain(module: nn.Module) -> bool:
    """Worth a graph of its own: callable and with at least two weight matrices below it."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    return sum(1 for p in module.parameters() if p.dim() == 2) >= 2


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def capture(model: nn.Module, example_inputs: Optional[tuple] = None) -> Capture:
    """Trace ``model`` whole, or else its largest traceable submodules (see module doc)."""
    result = Capture()
    try:
        result.graphs.append(CapturedGraph("", trace_module(model), example_inputs))
        return result
    except Exception as err:  # the tracer raises many kinds: TraceError, TypeError, NotImplementedError…
        result.failures.append(CaptureFailure("", _short(err)))
        log.info("fxfuse: the whole model could not be traced (%s); trying its submodules", _short(err))
    child_inputs = _record_inputs(model, example_inputs) if example_inputs is not None else {}
    _capture_children(model, "", child_inputs, result)
    return result


def _capture_children(module: nn.Module, prefix: str, inputs: dict[int, tuple], result: Capture) -> None:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if not _may_hold_a_chain(child):
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                _capture_children(child, path, inputs, result)
            continue
        try:
            gm = trace_module(child)
        except Exception as err:
            result.failures.append(CaptureFailure(path, _short(err)))
            log.debug("fxfuse: %s could not be traced: %s", path, _short(err))
            _capture_children(child, path, inputs, result)
            continue
        result.graphs.append(CapturedGraph(path, gm, inputs.get(id(child))))


def _record_inputs(model: nn.Module, example_inputs: tuple) -> dict[int, tuple]:
    """Run ``model`` once and keep the positional inputs each submodule saw (for shape propagation)."""
    seen: dict[int, tuple] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if not kwargs and id(mod) not in seen:
            seen[id(mod)] = args

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            model(*example_inputs)
    except Exception as err:
        log.info("fxfuse: running the example inputs failed (%s); shapes stay unknown", _short(err))
    finally:
        for h in handles:
            h.remove()
    return seen
