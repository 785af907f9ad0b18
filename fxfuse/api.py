"""The user's entry points: ``optimize`` and ``report``."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from .capture import capture
from .pipeline import fuse_graph
from .report import FusionReport

__all__ = ["optimize", "report"]

log = logging.getLogger(__name__)

_REPORT_ATTR = "_fxfuse_report"
_backend_reports: list[FusionReport] = []


def optimize(model: nn.Module, example_inputs: Optional[Sequence[torch.Tensor]] = None) -> nn.Module:
    """Return a module that computes what ``model`` computes, its MLP chains fused into Triton kernels.

    ``model`` itself is not modified; the result shares its parameters (nothing is copied) and has
    the same ``state_dict()``. ``example_inputs``, if given, are run once so that every shape and
    dtype is known when deciding what to fuse. ``fxfuse.report(result)`` says what was fused and why
    the rest was not.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        >>> fast = fxfuse.optimize(mlp)                       # doctest: +SKIP
        >>> print(fxfuse.report(fast))                        # doctest: +SKIP
        fxfuse: 1 region(s) fused, ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxfuse.optimize takes an nn.Module, got {type(model).__name__}")
    start = time.perf_counter()
    example_inputs = tuple(example_inputs) if example_inputs is not None else None
    captured = capture(model, example_inputs)
    full_report = FusionReport(capture_failures=captured.failures)
    replacements: dict[str, nn.Module] = {}
    for unit in captured.graphs:
        unit_report = fuse_graph(unit.gm, unit.example_inputs, prefix=unit.module_path)
        full_report.extend(unit_report)
        if unit.module_path == "" or unit_report.num_fused:
            replacements[unit.module_path] = unit.gm
    full_report.seconds = time.perf_counter() - start

    if "" in replacements:
        result = replacements[""]
    else:
        result = _with_children_replaced(model, replacements)
    setattr(result, _REPORT_ATTR, full_report)
    log.info("%s", full_report)
    return result


def _with_children_replaced(model: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``model`` in which the modules at these paths are swapped.

    Only the modules on the way to a replaced child are copied (with their own ``_modules`` dict);
    everything else, parameters included, is shared with ``model``, which stays as it was.
    """
    root = copy.copy(model)
    root._modules = dict(model._modules)
    for path, new_child in replacements.items():
        parent = root
        *parents, leaf = path.split(".")
        for name in parents:
            child = copy.copy(parent._modules[name])
            child._modules = dict(child._modules)
            parent._modules[name] = child
            parent = child
        parent._modules[leaf] = new_child
    return root


def report(model: Optional[nn.Module] = None) -> FusionReport:
    """What fxfuse did to ``model`` (the result of :func:`optimize` or a ``torch.compile``'d module).

    For ``torch.compile(model, backend="fxfuse")`` the report covers every graph the backend has
    compiled in this process (Dynamo does not tell a backend which module a graph came from).

    Example:
        >>> print(fxfuse.report(fast))                        # doctest: +SKIP
    """
    found = getattr(model, _REPORT_ATTR, None) if model is not None else None
    if isinstance(found, FusionReport):
        return found
    if model is None or hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
        merged = FusionReport()
        for r in _backend_reports:
            merged.extend(r)
        return merged
    raise ValueError("this module was not produced by fxfuse.optimize or the fxfuse backend")


def record_backend_report(r: FusionReport) -> None:
    _backend_reports.append(r)
