"""Roofline arithmetic for fused regions: work, ceilings, regime, and the plot.

* :func:`count_call`: FLOPs and bytes of one ``torch.ops.fxfuse.mlp`` call, from its arguments (real
  or ``meta`` tensors). FLOPs = 2·M·ΣK·N over the linears (pointwise math is negligible); minimum
  bytes = input read once + every weight, bias and operand read once + output written once (the
  benchmark's definition). It also estimates the bytes each implementation moves: eager ops write
  and re-read every intermediate; a fused stage reads its input and writes its output once.
* :class:`Ceilings`: copy bandwidth and matmul rate of a GPU, measured (:func:`measure_ceilings`) or
  from the table of named devices (:func:`named_ceilings`).
* :func:`classify`: compute-, memory- or overhead-bound, and how close to that ceiling.
* :func:`plot_roofline`: the PNG.

Example:
    >>> c = named_ceilings("H200")
    >>> w = count_call("1-:a0", torch.empty(8192, 4096, device="meta", dtype=torch.bfloat16),
    ...                [torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)], [], [], launches=1)
    >>> str(classify(w.flops, w.fused_bytes, 1, c, "bfloat16"))
    'compute-bound (predicted 392 µs: matmul floor)'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import epilogue as ep
from .spec import MLPSpec

__all__ = ["Ceilings", "CallWork", "Verdict", "DEVICES", "classify", "count_call", "measure_ceilings",
           "named_ceilings", "plot_roofline"]

LAUNCH_US = 5.0  # what one kernel launch costs when little else does (host launch + GPU scheduling)


# ------------------------------------------------------------------------------------------ ceilings

@dataclass
class Ceilings:
    """What a GPU can do: copy bandwidth (read + write bytes/s) and matmul FLOP/s per dtype."""

    name: str
    copy_bytes_per_s: float
    matmul_flops_per_s: dict[str, float] = field(default_factory=dict)  # "bfloat16" -> FLOP/s
    source: str = ""
    launch_us: float = LAUNCH_US

    def matmul(self, dtype: str) -> float:
        dtype = str(dtype).replace("torch.", "")
        if dtype in self.matmul_flops_per_s:
            return self.matmul_flops_per_s[dtype]
        return self.matmul_flops_per_s.get("float32") or min(self.matmul_flops_per_s.values())

    def describe(self, dtypes: Sequence[str] = ()) -> str:
        rates = ", ".join(f"{d} matmul {self.matmul(d) / 1e12:.0f} TFLOP/s"
                          for d in (dtypes or self.matmul_flops_per_s))
        return f"{self.name}: copy {self.copy_bytes_per_s / 1e12:.2f} TB/s, {rates} ({self.source})"


# Named devices, for predictions without a GPU. H200 and H100: measured (/work/shared/workloads.md, the
# benchmark's runs); A100 and every float32 entry (no TF32): datasheet figures, which measured ceilings usually
# fall short of.
DEVICES: dict[str, Ceilings] = {
    "H200": Ceilings("H200", 4.23e12, {"bfloat16": 701e12, "float16": 707e12, "float32": 67e12},
                     "copy, bf16, fp16 measured on an H200 (1 GiB copy, 8192³ matmul); fp32 datasheet"),
    # Measured like the H200's (benchmarks/results_h100.md, three runs: copy 2.99-3.00 TB/s, bf16 717-780, fp16
    # 664-686 TFLOP/s). The datasheet's 3.35 TB/s and 989 TFLOP/s are not reached: the matmul runs power-capped.
    "H100": Ceilings("H100", 3.0e12, {"bfloat16": 731e12, "float16": 670e12, "float32": 67e12},
                     "copy, bf16, fp16 measured on an H100 SXM (1 GiB copy, 8192³ matmul; median of three runs); "
                     "fp32 datasheet"),
    "A100": Ceilings("A100", 2.0e12, {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                     "datasheet"),
}


def named_ceilings(name: str) -> Ceilings:
    """The table entry whose key occurs in ``name`` ("H200", "NVIDIA H100 80GB HBM3", "a100"...)."""
    for key, ceil in DEVICES.items():
        if key.lower() in name.lower():
            return ceil
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(DEVICES)}")


@functools.cache
def _measured(device_index: int, dtypes: tuple[str, ...]) -> Ceilings:
    from triton.testing import do_bench

    dev = torch.device("cuda", device_index)
    rng = torch.Generator(dev).manual_seed(0)  # (the user's random stream is theirs)

    def copy_ms(nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255, generator=rng)
        dst = torch.empty_like(src)
        return do_bench(lambda: dst.copy_(src), return_mode="median")

    def mm_ms(dt: torch.dtype) -> float:
        a, b, c = (torch.randn(8192, 8192, device=dev, dtype=dt, generator=rng) for _ in range(3))
        return do_bench(lambda: torch.mm(a, b, out=c), return_mode="median")

    nbytes = 1 << 30
    try:
        ms = copy_ms(nbytes)
    except torch.OutOfMemoryError:
        nbytes = 1 << 28
        ms = copy_ms(nbytes)
    rates = {name: 2 * 8192**3 / (mm_ms(getattr(torch, name)) * 1e-3) for name in dtypes}
    torch.cuda.empty_cache()
    return Ceilings(torch.cuda.get_device_name(dev), 2 * nbytes / (ms * 1e-3), rates,
                    f"measured now: {nbytes >> 20} MiB copy, 8192³ matmul, do_bench median")


def measure_ceilings(device: torch.device | str = "cuda", dtypes: Sequence[str] = ("bfloat16",)) -> Ceilings:
    """Measure copy bandwidth (read + write) and the 8192³ matmul rate of each dtype (cached per process)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measured(index, tuple(sorted({str(d).replace("torch.", "") for d in dtypes})))


# ------------------------------------------------------------------------------------------ work

@dataclass(frozen=True)
class CallWork:
    """FLOPs and bytes of one fused-region call (see the module docstring)."""

    m: int
    dims: str  # "768→2×3072→768": input width, then each stage's output width (×2 for a gated pair)
    dtype: str
    flops: int
    min_bytes: int
    eager_bytes: int  # estimated bytes moved by the original ops, each a kernel of its own
    fused_bytes: int  # estimated bytes moved by the fused kernels
    eager_launches: int  # kernels the original ops launch (one per linear, one per pointwise op)
    eager_ops: tuple[str, ...]  # those ops' names, e.g. ("linear", "linear", "gelu_tanh", "mul", "linear")

    @property
    def intensity(self) -> float:
        return self.flops / self.min_bytes if self.min_bytes else 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def count_call(spec: str, x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor],
               operands: Sequence[torch.Tensor], *, launches: int) -> CallWork:
    """Work of ``torch.ops.fxfuse.mlp(x, weights, biases, operands, spec)`` run as ``launches`` kernels."""
    from .ops import expand_biases

    parsed = MLPSpec.loads(spec)
    all_biases = expand_biases(biases, parsed)
    es = x.element_size()
    m = x.numel() // x.shape[-1] if x.dim() else 1
    k = x.shape[-1]
    flops = min_extra = eager = fused = 0
    ops: list[str] = []
    dims = [str(k)]
    w = o = 0
    for stage in parsed.stages:
        n = weights[w].shape[0]
        stage_params = 0
        for j in range(stage.num_linears):
            flops += 2 * m * k * n
            p = _nbytes(weights[w + j]) + (_nbytes(all_biases[w + j]) if all_biases[w + j] is not None else 0)
            stage_params += p
            eager += m * k * es + p + m * n * es
            ops.append("linear")
        op_bytes = [_nbytes(t) for t in operands[o:o + stage.num_operands]]
        stage_params += sum(op_bytes)
        for call in _calls(stage.expr):
            ops.append(call.op)
            reads = sum(m * n * es if isinstance(a, (ep.Acc, ep.Call)) else
                        op_bytes[a.index] if isinstance(a, ep.Operand) else 0 for a in call.args)
            eager += reads + m * n * es
        fused += m * k * es + stage_params + m * n * es
        min_extra += stage_params
        dims.append(f"2×{n}" if stage.num_linears == 2 else str(n))
        k = n
        w += stage.num_linears
        o += stage.num_operands
    min_bytes = m * x.shape[-1] * es + min_extra + m * k * es
    if launches == 1:  # the whole chain in one kernel: intermediates stay on chip
        fused = min_bytes
    return CallWork(m, "→".join(dims), str(x.dtype).replace("torch.", ""), flops, min_bytes, eager, fused,
                    len(ops), tuple(ops))


def _calls(expr: ep.Expr) -> list[ep.Call]:
    """Every op of the expression tree, inputs first (what ``epilogue.evaluate`` runs, one kernel each)."""
    if not isinstance(expr, ep.Call):
        return []
    return [c for a in expr.args for c in _calls(a)] + [expr]


# ------------------------------------------------------------------------------------------ regime

@dataclass(frozen=True)
class Verdict:
    """Which limit dominates a region's time, and how close to it it runs."""

    regime: str  # "compute" | "memory" | "overhead"
    detail: str
    predicted_us: float  # max of the three terms: what the model of the hardware expects

    def __str__(self) -> str:
        return f"{self.regime}-bound ({self.detail})"


def classify(flops: float, traffic_bytes: float, launches: int, ceil: Ceilings, dtype: str,
             gpu_us: Optional[float] = None, host_us: Optional[float] = None) -> Verdict:
    """Compare the compute floor, the memory time of ``traffic_bytes`` and the launch overhead.

    Without ``gpu_us`` the verdict is a prediction. With it, "overhead" also covers a host slower than
    the GPU (``host_us > gpu_us``: the GPU waits for launches), and the detail says how close the
    region runs to the dominating ceiling.
    """
    t_c = flops / ceil.matmul(dtype) * 1e6
    t_m = traffic_bytes / ceil.copy_bytes_per_s * 1e6
    t_o = launches * ceil.launch_us
    host_bound = gpu_us is not None and host_us is not None and host_us > gpu_us
    terms = {"compute": t_c, "memory": t_m, "overhead": max(t_o, host_us if host_bound else 0.0)}
    regime = max(terms, key=terms.get)
    predicted = max(t_c, t_m, t_o)
    if gpu_us is None:
        what = {"compute": "matmul floor", "memory": f"{_mb(traffic_bytes)} at copy bandwidth",
                "overhead": f"{launches} launch{'es' if launches != 1 else ''} × {ceil.launch_us:.0f} µs"}[regime]
        return Verdict(regime, f"predicted {_us(predicted)} µs: {what}", predicted)
    if regime == "compute":
        detail = f"{t_c / gpu_us:.0%} of the matmul ceiling"
    elif regime == "memory":
        detail = f"{_mb(traffic_bytes)} moved at {t_m / gpu_us:.0%} of copy bandwidth"
    elif host_bound:
        detail = f"host {_us(host_us)} µs for {_us(gpu_us)} µs of GPU work"
    else:
        detail = f"{launches} launches ≈ {_us(t_o)} µs vs a {_us(max(t_c, t_m))} µs floor"
    return Verdict(regime, detail, predicted)


def _us(v: float) -> str:
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


# ------------------------------------------------------------------------------------------ plot

@dataclass(frozen=True)
class Point:
    label: str
    intensity: float  # FLOP/byte (minimum bytes)
    before_tflops: float
    after_tflops: float
    dtype: str


def plot_roofline(points: Sequence[Point], ceil: Ceilings, path, *, title: str, predicted: bool = False) -> None:
    """Log-log roofline: the copy and matmul ceilings, each region before (hollow) and after (filled)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    fig = Figure(figsize=(8, 5.2), dpi=130, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bw = ceil.copy_bytes_per_s / 1e12
    peaks: dict[float, list[str]] = {}  # one roof per distinct matmul rate
    for d in sorted({p.dtype for p in points}) or ["bfloat16"]:
        rate = ceil.matmul(d) / 1e12
        near = next((r for r in peaks if abs(r / rate - 1) < 0.1), None)
        peaks.setdefault(near or rate, []).append(f"{d} {rate:.0f}")
    top = max(peaks)
    ais = [p.intensity for p in points if p.intensity > 0]
    lo = min([*ais, top / bw]) / 8
    hi = max([*ais, top / bw]) * 8
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    for peak, names in peaks.items():
        ax.plot(xs, [min(peak, bw * x) for x in xs], color="0.25", lw=1.5)
        ax.annotate(f"matmul {', '.join(names)} TFLOP/s", (hi, peak), xytext=(-4, 4), textcoords="offset points",
                    ha="right", va="bottom", fontsize=8, color="0.25")
    ys = []
    for i, p in enumerate(points):
        c = f"C{i % 10}"
        ax.scatter([p.intensity], [p.before_tflops], s=130, facecolors="none", edgecolors=c, linewidths=1.6, zorder=3)
        ax.scatter([p.intensity], [p.after_tflops], s=45, color=c, zorder=4)
        if p.before_tflops > 0 and p.after_tflops > 0 and abs(p.after_tflops / p.before_tflops - 1) > 0.05:
            ax.annotate("", (p.intensity, p.after_tflops), (p.intensity, p.before_tflops),
                        arrowprops={"arrowstyle": "->", "color": c, "lw": 1}, zorder=2)
        ys += [p.before_tflops, p.after_tflops]
    ax.scatter([], [], s=130, facecolors="none", edgecolors="0.3", label="before (original ops)")
    ax.scatter([], [], s=45, color="0.3", label="after (fxfuse)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    positive = [y for y in ys if y > 0]
    ax.set_ylim(min([*positive, bw * lo]) / 3, top * 2.5)
    ax.set_xlabel("arithmetic intensity (FLOP / minimum byte)")
    ax.set_ylabel("TFLOP/s" + (" (predicted)" if predicted else " (measured)"))
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(loc="lower right", fontsize=8)
    fig.canvas.draw()  # lay out first: label positions on screen depend on the final axes box
    _labels(ax, points)
    x0 = lo * 2
    (px, py), (qx, qy) = ax.transData.transform([(x0, bw * x0), (x0 * 10, bw * x0 * 10)])
    ax.annotate(f"copy {bw:.2f} TB/s", (x0, bw * x0), xytext=(0, 5), textcoords="offset points", fontsize=8,
                color="0.25", rotation=math.degrees(math.atan2(qy - py, qx - px)), rotation_mode="anchor")
    fig.savefig(path)


def _labels(ax, points: Sequence[Point]) -> None:
    """Each point's label beside it, at the first of four offsets that does not cover a label already placed."""
    placed: list[tuple[float, float, float, float]] = []
    offsets = [(9, -14, "left"), (9, 6, "left"), (-9, -14, "right"), (-9, 6, "right")]
    scale = ax.figure.dpi / 72  # points -> pixels
    for i, p in enumerate(points):
        y = min(p.after_tflops, p.before_tflops) if min(p.after_tflops, p.before_tflops) > 0 else p.after_tflops
        if y <= 0:
            continue
        ax_, ay = ax.transData.transform((p.intensity, y))
        w, h = 5.2 * len(p.label) * scale, 10 * scale
        box = None
        for dx, dy, ha in offsets:
            x0 = ax_ + dx * scale - (w if ha == "right" else 0)
            box = (x0, ay + dy * scale, x0 + w, ay + dy * scale + h)
            if not any(b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3] for b in placed):
                break
        placed.append(box)
        ax.annotate(p.label, (p.intensity, y), xytext=(dx, dy), textcoords="offset points", fontsize=8,
                    color=f"C{i % 10}", ha=ha, bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                                                     "alpha": 0.8})
