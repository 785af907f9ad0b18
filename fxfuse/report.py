"""What fxfuse did to a model: fused regions, chains left alone (and why), parts not captured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .capture import CaptureFailure
from .records import FusionRegion, Rejection
from .strategy import launches

__all__ = ["FusionReport", "RegionReport"]


@dataclass
class RegionReport:
    """One fused region, as the user sees it."""

    module_path: str
    pattern: str
    spec: str
    strategy: str
    notes: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # generated Triton source files, one per stage

    @classmethod
    def from_region(cls, region: FusionRegion, spec: str, prefix: str = "",
                    kernels: Sequence[str] = ()) -> RegionReport:
        path = ".".join(p for p in (prefix, region.module_path) if p)
        if region.replacement is not None:
            strategy = "user replacement"
        else:
            n = launches(region.spec, region.strategy)
            strategy = f"{region.strategy} ({n} launch{'es' if n > 1 else ''})"
        return cls(path or "<root>", region.pattern, spec, strategy, list(region.notes), list(kernels))


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
        if self.regions:
            lines.append("fused:")
            rows = [(r.module_path, r.pattern, r.strategy, r.spec) for r in self.regions]
            lines += _table(("module", "pattern", "strategy", "spec"), rows)
            for r in self.regions:
                lines += [f"  note ({r.module_path}): {n}" for n in r.notes]
            kernels = sorted({k for r in self.regions for k in r.kernels})
            if kernels:
                lines.append("generated kernels: " + ", ".join(kernels))
        if self.rejections:
            lines.append("not fused:")
            lines += _table(("module", "pattern", "reason"),
                            [(r.module_path or "<root>", r.pattern, r.reason) for r in self.rejections])
        if self.capture_failures:
            lines.append("not captured (left as they are):")
            lines += _table(("module", "error"), [(f.module_path or "<whole model>", f.error)
                                                  for f in self.capture_failures])
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*map(str, row)).rstrip() for row in rows]
