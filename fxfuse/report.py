"""What fxfuse did to a model: fused regions, chains left alone (and why), parts not captured.

Each fused region also shows the cost model's time (:mod:`fxfuse.cost`) of its kernels and of its
original ops at the M seen when optimizing, and, once the region has run on a GPU, the two measured
times (:func:`fxfuse.strategy.measurements`, read when the report is printed). Its strategy column says
what runs: the plan until the first GPU call, then the strategy that call measured fastest (at one row a
one-launch decode kernel can overrule a per-stage plan; slower than the original ops: "original ops").

A call that a fused method's guards turn away (a hook, a setting changed in place, arguments other than traced)
runs the original code: ``fxfuse.report(model)`` counts those calls when asked (:class:`OriginalRuns`), lists
them, and marks the strategy of each region whose host ran them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
from torch import nn

from .capture import CaptureFailure
from .kernels.template import choice_bucket, interpreting
from .meta import tensor_info
from .module_state import original_runs
from .records import FusionRegion, Rejection
from .strategy import ONE_LAUNCH, ORIGINAL_OPS, Measurement, choose_strategy, launches, measurements

__all__ = ["FusedVsOriginal", "FusionReport", "OriginalRuns", "RegionReport"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedVsOriginal:
    """Two times of one region, in µs: its fused kernels and its original ops."""

    fused_us: float
    original_us: float

    def __str__(self) -> str:
        return f"{_us(self.fused_us)} / {_us(self.original_us)}"


def _with_launches(strategy: str, n: int) -> str:
    return f"{strategy} ({n} launch{'es' if n > 1 else ''})"


@dataclass
class RegionReport:
    """One fused region, as the user sees it."""

    module_path: str
    pattern: str
    spec: str
    strategy: str
    notes: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # generated Triton source files, one per stage
    m: Optional[int] = None  # rows of the call seen when optimizing (example inputs, Dynamo's); None: unknown
    widths: tuple[int, ...] = ()  # input width, then each linear's N (as the op's measurements are keyed)
    dtype: str = ""
    predicted_us: Optional[FusedVsOriginal] = None  # the cost model at ``m`` (None: M unknown, or no model)
    predicted_regime: str = ""  # of the fused kernels: "compute", "memory" or "launch"
    predicted_on: str = ""  # the GPU whose ceilings the prediction used
    stages: int = 0  # GEMM stages of the region (what a per-stage strategy launches)
    experts: tuple = ()  # a MoE experts region: (its class, gate_up_proj's shape), whose timed choices it shows
    host_path: Optional[str] = None  # the module whose fused method runs this region ("": the root); None: unknown

    @classmethod
    def from_region(cls, region: FusionRegion, spec: str, prefix: str = "",
                    kernels: Sequence[str] = ()) -> RegionReport:
        path = ".".join(p for p in (prefix, region.module_path) if p)
        if region.replacement is not None:
            strategy = "user replacement"
        else:
            strategy = _with_launches(region.strategy, launches(region.spec, region.strategy))
        report = cls(path or "<root>", region.pattern, spec, strategy, list(region.notes), list(kernels),
                     stages=len(region.spec.stages) if region.replacement is None else 0)
        if region.replacement is None:
            report._predict(region)
        return report

    @property
    def measurements(self) -> list[Measurement]:
        """This region's shape measured on a GPU so far in this process, one per M bucket (and one more per bucket
        planned for a CUDA graph), read now."""
        found = {(r.m_bucket, r.for_cuda_graph): r for r in measurements()
                 if (r.spec, r.widths, r.dtype) == (self.spec, self.widths, self.dtype)}
        return [found[b] for b in sorted(found)]

    @property
    def running(self) -> str:
        """What runs on plain calls: the strategy the first GPU call chose at the bucket of ``m`` (at each bucket
        measured, when M was unknown at optimize time), with its launches; before any GPU call, ``strategy``
        (the plan, which the first GPU call may overrule: at one row a one-launch decode kernel can win).

        Example: ``decode_grid_sync (1 launch)``, ``gemm_epilogue (2 launches) at M~8; original ops at M~16``.
        """
        return self.running_at(self.m)

    def running_at(self, m: Optional[int]) -> str:
        """:attr:`running` for calls of ``m`` rows (None: every bucket this region's shape has run at)."""
        found = [r for r in self.measurements if not r.for_cuda_graph]
        if m is not None:
            found = [r for r in found if r.m_bucket == choice_bucket(m)]
        if not found or not self.stages:
            return self.strategy
        def cell(strategy: str) -> str:
            return "original ops" if strategy == ORIGINAL_OPS else \
                _with_launches(strategy, 1 if strategy in ONE_LAUNCH else self.stages)

        cells = [cell(r.split.pick(m)) if r.split and m is not None
                 else f"{cell(r.split.below)} below M={r.split.at_m}, {cell(r.split.above)} from it" if r.split
                 else cell(r.strategy if r.fused else ORIGINAL_OPS) for r in found]
        if len(found) == 1:
            return cells[0]
        return "; ".join(f"{c} at M~{r.m_bucket}" for c, r in zip(cells, found))

    @property
    def measured_us(self) -> Optional[FusedVsOriginal]:
        """The measured times at the bucket of ``m`` (M unknown: the latest), or None before any GPU call."""
        found = self.measurements
        if self.m is not None:
            found = [r for r in found if r.m_bucket == choice_bucket(self.m)]
        return FusedVsOriginal(found[-1].fused_us, found[-1].original_us) if found else None

    def _predict(self, region: FusionRegion) -> None:
        """Fill ``m``, ``widths``, ``dtype`` from the graph's metadata and predict both times at ``m``."""
        from .cost import predict

        try:
            gm = region.input.graph.owning_module if isinstance(region.input, fx.Node) else None
            x = tensor_info(gm, region.input) if gm is not None else None
            ws = [tensor_info(gm, w) for w in region.weights] if gm is not None else []
            if ws and all(w is not None and w.ndim == 2 and None not in w.shape for w in ws):
                self.widths = (ws[0].shape[1], *(w.shape[0] for w in ws))
                self.dtype = str(ws[0].dtype).replace("torch.", "")
            if x is not None and x.ndim and None not in x.shape:
                self.m = math.prod(x.shape[:-1])
            if not self.widths or self.m is None:
                return
            chosen = choose_strategy(region.spec, self.widths, self.m)  # M known now: the decode kernel may run
            fused = predict(region.spec, self.widths, self.m, self.dtype, chosen)
            original = predict(region.spec, self.widths, self.m, self.dtype, ORIGINAL_OPS)
        except Exception as err:  # a report must not break optimize()
            log.debug("fxfuse: no prediction for %s: %s", self.module_path, err)
            return
        self.predicted_us = FusedVsOriginal(fused.predicted_us, original.predicted_us)
        self.predicted_regime = fused.regime
        self.predicted_on = fused.device

    def predicted_cell(self) -> str:
        """The table's text, e.g. ``97.6 / 117.6 at M=1, memory-bound``; when M was unknown at optimize time, the
        prediction at each M the region has run at since (``... at M=8192, compute-bound``), or ``M unknown``."""
        if self.predicted_us is not None:
            return f"{self.predicted_us} at M={self.m}, {self.predicted_regime}-bound"
        if not self.widths:
            return "—"
        cells = [f"{FusedVsOriginal(r.predicted_us, r.predicted_original_us)} at M={r.m}"
                 + (" in a CUDA graph" if r.for_cuda_graph else "")
                 + (f", {r.predicted_regime}-bound" if r.predicted_regime else "")
                 for r in self.measurements if r.predicted_us is not None and r.predicted_original_us is not None]
        return "; ".join(cells) or ("M unknown" if self.m is None else "—")

    def measured_cell(self) -> str:
        """The table's text, read now, e.g. ``95.1 / 110.4 at M~1; 120.3 / 115.0 at M~16 (original ops kept)``
        (``at M~1 in a CUDA graph``: planned by GPU time for a graph's replays). A MoE experts region: the
        kernels' and its own forward's times at each token bucket timed, with what bounds the kernels, the
        gate/up GEMM's timed form (TMA or pointer) and the weight gradients' timed choices (training)."""
        if self.experts:
            from .kernels.moe_launch import gate_up_timings
            from .kernels.moe_weight_grads import weight_grad_timings
            from .moe import experts_timings

            cells = [*map(str, experts_timings(*self.experts)), *gate_up_timings(self.experts[1]),
                     *weight_grad_timings(self.experts[1])]
            return "; ".join(cells) or "not yet"
        if not self.widths:  # shapes unknown here: the measurements cannot be told apart
            return "—"
        cells = [f"{_at_ends(r)}{' in a CUDA graph' if r.for_cuda_graph else ''} "
                 f"({r.split or (r.strategy if r.fused else 'original ops kept')})"
                 for r in self.measurements]
        return "; ".join(cells) or "not yet"


def _at_ends(r: Measurement) -> str:
    """Fused / original µs of a measurement at its bucket, or at both of its ends where both were timed."""
    if not r.top_times:
        return f"{FusedVsOriginal(r.fused_us, r.original_us)} at M~{r.m_bucket}"
    top = dict(r.top_times)
    fused_top = min((t for s, t in top.items() if s != ORIGINAL_OPS), default=math.inf)
    return (f"{FusedVsOriginal(r.fused_us, r.original_us)} at M={r.m}, "
            f"{FusedVsOriginal(fused_top, top.get(ORIGINAL_OPS, math.inf))} at M={r.m_bucket}")


@dataclass(frozen=True)
class OriginalRuns:
    """Calls of fused methods that ran the original code instead, for one host class and reason, summed over the
    model's modules of that class (``modules``: their paths) since :func:`fxfuse.optimize` made them."""

    host: str  # the class's name
    calls: int
    reason: str
    modules: tuple[str, ...] = ()
    counts: tuple[int, ...] = ()  # the calls of each of ``modules``

    @staticmethod
    def of(model: nn.Module) -> list[OriginalRuns]:
        """Those of ``model``'s modules, counted now (in this process), in module order."""
        found: dict[tuple[str, str], tuple[list[int], list[str]]] = {}  # (class, reason) -> (calls, paths)
        for path, m in model.named_modules():
            if hasattr(type(m), "_fxfuse_original_class"):  # (an fxfuse host: fxfuse.install._host_class)
                for why, n in original_runs(m).items():
                    calls, paths = found.setdefault((type(m).__name__, why), ([], []))
                    calls.append(n)
                    paths.append(path)
        return [OriginalRuns(host, sum(calls), why, tuple(paths), tuple(calls))
                for (host, why), (calls, paths) in found.items()]


@dataclass
class FusionReport:
    """The result of :func:`fxfuse.optimize` (or of the ``fxfuse`` torch.compile backend).

    ``str(report)`` prints a table; the fields hold the same facts as records.
    """

    regions: list[RegionReport] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    capture_failures: list[CaptureFailure] = field(default_factory=list)
    graphs: int = 0
    seconds: float = 0.0
    cuda_graphs: str = ""  # how optimize(cuda_graphs=...) set CUDA graphs up; "" when off
    # calls of fused methods that ran the original code instead, as the latest fxfuse.report(model) counted them
    original_runs: list[OriginalRuns] = field(default_factory=list)

    @property
    def num_fused(self) -> int:
        return len(self.regions)

    def extend(self, other: FusionReport) -> None:
        self.regions += other.regions
        self.rejections += other.rejections
        self.capture_failures += other.capture_failures
        self.graphs += other.graphs
        self.seconds += other.seconds

    def __str__(self) -> str:
        lines = [f"fxfuse: {len(self.regions)} region(s) fused, {len(self.rejections)} candidate(s) left unfused, "
                 f"{self.graphs} graph(s) captured in {self.seconds * 1e3:.0f} ms"]
        if self.cuda_graphs:
            lines.append(f"CUDA graphs: {self.cuda_graphs}")
        if self.regions:
            lines.append("fused:")
            rows = [(r.module_path, r.pattern, r.running + self._original_note(r) + _trained_note(r),
                     r.predicted_cell(), r.measured_cell(), r.spec) for r in self.regions]
            lines += _table(("module", "pattern", "strategy", "predicted µs (fused / original)",
                             "measured µs (fused / original)", "spec"), rows)
            # The GPUs whose ceilings the predictions used: at optimize time (example inputs) and at each first call.
            from .cost import ceilings_for

            devices = sorted({r.predicted_on for r in self.regions if r.predicted_on}
                             | {ceilings_for(m.device).name for r in self.regions for m in r.measurements
                                if m.predicted_us is not None})
            predicted = (f"cost model on {', '.join(devices)} ceilings (fxfuse.cost)" if devices
                         else "none yet (M unknown: no example inputs, or none recorded for a method other than "
                              "forward that runs a region; and no GPU call)")
            lines.append(f"  predicted: {predicted}; measured: on the first GPU call at each M bucket")
            if any(_trained_note(r) for r in self.regions):
                lines.append("  trained: a backward that the fused kernels do not take has run (create_graph=True for "
                             "a gradient penalty, a chain without a fused backward, tensors they do not take); from "
                             "then on, in this process, calls of the region that record gradients run the original "
                             "ops, which keep what their backward needs; calls without gradients stay fused")
            for r in self.regions:
                lines += [f"  note ({r.module_path}): {n}" for n in r.notes]
            kernels = sorted({k for r in self.regions for k in r.kernels})
            if kernels:
                lines.append("generated kernels: " + ", ".join(kernels))
            if not torch.cuda.is_available() and not interpreting():
                lines.append("  no CUDA device in this process: CPU calls run the regions' original ops "
                             "(TRITON_INTERPRET=1 runs the kernels in Triton's interpreter)")
        if self.rejections:
            lines.append("not fused:")
            lines += _table(("module", "pattern", "reason"),
                            [(r.module_path or "<root>", r.pattern, r.reason) for r in self.rejections])
        if self.capture_failures:
            lines.append("not captured (left as they are):")
            lines += _table(("module", "why"), [(f.module_path or "<whole model>", f.error)
                                                for f in self.capture_failures])
        if self.original_runs:
            lines.append("ran the original code instead (calls since optimize, in this process):")
            lines += _table(("class", "calls", "why"), [(o.host, o.calls, o.reason) for o in self.original_runs])
        return "\n".join(lines)

    def _original_note(self, region: RegionReport) -> str:
        """``"; 3 calls ran the original code (see below)"`` for a region whose host turned calls away, else ""."""
        n = sum(c for o in self.original_runs for path, c in zip(o.modules, o.counts) if path == region.host_path)
        return f"; {n} call{'s' if n > 1 else ''} ran the original code (see below)" if n else ""

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


def _us(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*map(str, row)).rstrip() for row in rows]


def _trained_note(region: RegionReport) -> str:
    """``"; trained (float16): ..."`` for a region whose op has been marked trained in this process
    (:data:`fxfuse.ops._trained`, by spec, dtype and widths), else ""."""
    from . import ops

    dtypes = sorted({str(key[1]).replace("torch.", "") for key in ops._trained if key[0] == region.spec
                     and (not region.widths or tuple(key[2:]) == tuple(region.widths))})
    if not dtypes:
        return ""
    from .gated_training import gated_training_enabled

    runs = "the gated training node (FXFUSE_GATED_TRAINING=1)" if region.pattern == "gated_mlp" and \
        gated_training_enabled() else "the original ops"
    return f"; trained ({', '.join(dtypes)}): calls that record gradients run {runs} (see below)"
