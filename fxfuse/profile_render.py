"""Rendering a :class:`fxfuse.profile.ProfileReport`: its text table, its HTML page and its roofline points.

Kept apart from the profiling itself (:mod:`fxfuse.profile`), which measures; everything here only formats
what was measured. ``str(report)``, ``report.to_html()`` and ``report.plot(path)`` call into this module.

Example:
    >>> fmt_us(1234.5), fmt_us(12.34), fmt_us(0.01234), fmt_us(None)
    ('1234', '12.3', '0.012', '—')
"""

from __future__ import annotations

import base64
import html
import statistics
from collections import defaultdict
from typing import TYPE_CHECKING, Optional

from .roofline import Point

if TYPE_CHECKING:
    from .profile import ProfileReport, RegionProfile

__all__ = ["fmt_us", "html_page", "roofline_points", "text_lines"]


def roofline_points(rep: ProfileReport) -> list[Point]:
    """One point per group of identical regions (``layers.*.mlp ×22``), at the median of the group."""
    groups: dict[tuple, list[RegionProfile]] = defaultdict(list)
    for r in rep.regions:
        groups[(r.pattern, r.spec, r.m, r.dims, r.dtype, r.calls)].append(r)
    points = []
    for members in groups.values():
        ys = {}
        for side in ("before", "after"):
            vals = []
            for r in members:
                s = getattr(r, side)
                t = s.gpu_us if s.gpu_us else s.verdict.predicted_us
                vals.append(r.flops / t / 1e6 if t else 0.0)
            ys[side] = statistics.median(vals)
        label = _group_label([rep.model if r.module_path == "<root>" else r.module_path for r in members])
        points.append(Point(label, members[0].intensity, ys["before"], ys["after"], members[0].dtype))
    return points


def _group_label(paths: list[str]) -> str:
    if len(paths) == 1:
        return paths[0]
    parts = [p.split(".") for p in paths]
    if len({len(p) for p in parts}) == 1:
        label = ".".join(col[0] if len(set(col)) == 1 else "*" for col in zip(*parts))
    else:
        label = paths[0] + ", …"
    return f"{label} ×{len(paths)}"


def fmt_us(v) -> str:
    """µs, TFLOP/s, counts: whole numbers from 100 up, one decimal from 1, two digits below; "—" for none."""
    if v is None:
        return "—"
    v = float(v)
    if v.is_integer() and abs(v) < 1e5:
        return str(int(v))
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.2g}"


def _x(ratio: Optional[float]) -> str:
    return f"{ratio:.2f}×" if ratio else "—"


def _summary(rep: ProfileReport) -> list[str]:
    head = (f"fxfuse profile: {rep.model} on {rep.device}, {len(rep.regions)} fused region(s)"
            + ("" if rep.timed else f"; structure only, regimes predicted for {rep.ceilings.name}"))
    dtypes = sorted({r.dtype for r in rep.regions})
    lines = [head, "ceilings: " + rep.ceilings.describe(dtypes)]
    if rep.timed:
        lines.append(f"end to end (GPU median, do_bench, {rep.rounds} interleaved rounds): "
                     f"before {fmt_us(rep.before_us)} µs → after {fmt_us(rep.after_us)} µs = {_x(rep.speedup)}; "
                     f"wall {fmt_us(rep.before_wall_us)} → {fmt_us(rep.after_wall_us)} µs/call")
        if rep.before_kernel_us and rep.after_kernel_us:
            rb = sum(r.before.gpu_us or 0 for r in rep.regions)
            ra = sum(r.after.gpu_us or 0 for r in rep.regions)
            rest_before, rest_after = rep.before_kernel_us - rb, rep.after_kernel_us - ra
            lines.append(f"kernel time per forward (profiled): regions {fmt_us(rb)} → {fmt_us(ra)} µs, "
                         f"rest of the model {fmt_us(rest_before)} → {fmt_us(rest_after)} µs")
    return lines


def _rows(rep: ProfileReport) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    t = "GPU µs" if rep.timed else "pred. µs"
    header = ("region", "pattern", "M", "dims", "dtype", "GFLOP", "min MB", "floor µs", "side", "kernels", t,
              "TFLOP/s", "GB/s", "speedup", "regime")
    rows = []
    for r in rep.regions:
        name = r.module_path + (f" ×{r.calls}" if r.calls > 1 else "")
        for side in ("before", "after"):
            s = getattr(r, side)
            first = side == "before"
            time_us = s.gpu_us if s.gpu_us is not None else (None if rep.timed else s.verdict.predicted_us)
            rows.append((
                name if first else "", r.pattern if first else "", str(r.m) if first else "",
                r.dims if first else "", r.dtype if first else "",
                f"{r.flops / 1e9:.3g}" if first else "", f"{r.min_bytes / 1e6:.3g}" if first else "",
                f"{fmt_us(r.floor_us)} {r.bound[0]}" if first else "",
                side, fmt_us(s.launches), fmt_us(time_us),
                fmt_us(s.tflops), fmt_us(s.gbps),
                _x(r.speedup) if not first else "", str(s.verdict)))
    return header, rows


def _kernel_lines(rep: ProfileReport) -> list[tuple[str, str, str]]:
    out = []
    for r in rep.regions:
        for side in ("before", "after"):
            s = getattr(r, side)
            out.append((r.module_path, side, ", ".join(f"{k} ×{fmt_us(v)}" for k, v in s.kernels.items())))
    return out


def _table(header, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*row).rstrip() for row in rows]


def _legend(rep: ProfileReport) -> str:
    timing = ("GPU µs: the region's kernel time per forward, median of the profiled runs (L2 flushed before "
              "each); GB/s: minimum bytes / GPU µs. " if rep.timed else
              "pred. µs: the largest of the regime terms. ")
    return (f"{timing}floor: max(FLOPs / matmul ceiling, minimum bytes / copy bandwidth), c/m: compute/memory. "
            "Regime: the largest of the matmul time, the estimated bytes moved at copy bandwidth, and the launch "
            f"overhead (launches × {rep.ceilings.launch_us:.0f} µs, or the host time when the GPU waits for it).")


def text_lines(rep: ProfileReport) -> list[str]:
    lines = _summary(rep)
    if rep.regions:
        lines += _table(*_rows(rep))
        lines.append("kernels per forward" + ("" if rep.timed else " (predicted: eager ops, fxfuse launches)") + ":")
        lines += [f"  {p} {side}: {k}" for p, side, k in _kernel_lines(rep)]
        lines.append(_legend(rep))
    lines += [f"note: {n}" for n in rep.notes]
    return lines


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;"
        "font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%}pre{background:#f7f7f7;padding:1em;font-size:12px}")


def _html_table(header, rows) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def html_page(rep: ProfileReport, png: Optional[bytes]) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>fxfuse profile: {html.escape(rep.model)}"
             f"</title><style>{_CSS}</style></head><body><h1>fxfuse profile: {html.escape(rep.model)}</h1>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in _summary(rep)]
    parts += [f"<p><b>{html.escape(n)}</b></p>" for n in rep.notes]
    if png:
        parts.append(f"<img alt='roofline' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    parts.append("<h2>Regions</h2>" + _html_table(*_rows(rep)))
    parts.append(f"<p>{html.escape(_legend(rep))}</p>")
    parts.append("<h2>Kernels per forward</h2>" + _html_table(("region", "side", "kernels"), _kernel_lines(rep)))
    if rep.fusion is not None:
        parts.append(f"<h2>Fusion report</h2><pre>{html.escape(str(rep.fusion))}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
