"""``fxfuse.profile``: what each fused MLP region costs before and after, and what bounds it.

    rep = fxfuse.profile(model, (x,))      # runs the original and the optimized model
    print(rep)                             # per region: kernels, GPU µs, TFLOP/s, GB/s, floor, regime
    rep.save("profile/")                   # roofline.png, report.html, trace_before.json, trace_after.json

How: ``fxfuse.optimize`` turns every region into one ``torch.ops.fxfuse.mlp`` call. While the optimized
model runs under a ``TorchFunctionMode`` that intercepts that op, each call is named by the module its
weights live in (as ``fxfuse.report`` names regions) and runs inside
``record_function("fxfuse region <path>")``: either the fused op ("after") or
``fxfuse.ops.reference_mlp``, the region's original ops ("before"). MoE experts modules run their installed
forward instead: :mod:`fxfuse.profile_moe` intercepts those calls, the installed forward ("after") or the
class's own ("before") inside the same labels. Under ``torch.profiler`` every
kernel launched inside a label belongs to that region (:func:`attribute`). A first run records each
call's arguments, from which :func:`fxfuse.roofline.count_call` counts FLOPs and bytes. End-to-end
times are ``triton.testing.do_bench`` medians of the original and the optimized model themselves, with
nothing intercepted, as in ``benchmarks/bench_workloads.py``: each side's median over three interleaved
(before, after) rounds, and the same for the wall times.

Without a GPU (inputs on the CPU or the ``meta`` device) nothing is timed: the report has the
structure (regions, FLOPs, bytes, kernel counts) and the regime predicted for a named GPU.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .capture import leaving_unchanged
from .ops import reference_mlp
from .profile_moe import ExpertsSite, as_op, count_experts_call, experts_sites, intercept_experts
from .profile_render import fmt_us, html_page, roofline_points, text_lines
from .report import FusionReport
from .roofline import CallWork, Ceilings, Verdict, classify, count_call, measure_ceilings, named_ceilings
from .spec import MLPSpec

__all__ = ["ProfileReport", "RegionProfile", "Side", "profile"]

REGION = "fxfuse region "
ITERATION = "fxfuse iteration "
_HOST_TIMED = False  # tests only: run the timed path on the CPU (host timers, CPU ops as "kernels")
ROUNDS = 3  # interleaved (before, after) rounds of the end-to-end times; each side keeps its median
NEED_GPU = "timings need a GPU: run with the model and inputs on a CUDA device for kernels, times and regimes"


# ------------------------------------------------------------------------------------------ records

@dataclass
class Side:
    """One implementation of a region: ``before`` (the original ops) or ``after`` (fxfuse)."""

    launches: float  # kernels per forward: measured, or predicted without a GPU
    traffic_bytes: int  # estimated bytes moved (eager: every intermediate written and read back)
    verdict: Verdict
    kernels: dict[str, float] = field(default_factory=dict)  # kernel (or, predicted, op) name -> per forward
    gpu_us: Optional[float] = None  # median per forward of the region's kernel time
    # Host µs per forward of the region's own call path, timed outside the profiler (:func:`_call_host_us`): under
    # it every launch is slower and the fused op takes its full path, no replay (a seed GeGLU's fused region read
    # 313 µs of host there for 181 µs of kernels, where its real calls cost a fraction of that).
    host_us: Optional[float] = None
    tflops: Optional[float] = None
    gbps: Optional[float] = None  # minimum bytes / GPU time

    @property
    def regime(self) -> str:
        return self.verdict.regime


@dataclass
class RegionProfile:
    """One fused region: its work, its floor, and both sides."""

    module_path: str
    pattern: str
    spec: str
    strategy: str
    calls: int  # calls per forward
    m: int
    dims: str
    dtype: str
    flops: int  # per forward
    min_bytes: int
    compute_floor_us: float
    memory_floor_us: float
    before: Side
    after: Side

    @property
    def floor_us(self) -> float:
        return max(self.compute_floor_us, self.memory_floor_us)

    @property
    def bound(self) -> str:
        """Which floor is higher: what the work itself is bound by, whatever runs it."""
        return "compute" if self.compute_floor_us >= self.memory_floor_us else "memory"

    @property
    def intensity(self) -> float:
        return self.flops / self.min_bytes if self.min_bytes else 0.0

    @property
    def speedup(self) -> Optional[float]:
        b, a = self.before.gpu_us, self.after.gpu_us
        return b / a if b and a else None


@dataclass
class ProfileReport:
    """What :func:`profile` found. ``str()`` is a table; :meth:`save` writes the files."""

    model: str
    device: str
    ceilings: Ceilings
    regions: list[RegionProfile]
    timed: bool
    before_us: Optional[float] = None  # end to end, GPU median (do_bench; median of ROUNDS interleaved rounds)
    after_us: Optional[float] = None  # ... of the optimized model
    before_wall_us: Optional[float] = None  # wall time per call of back-to-back calls (the same rounds)
    after_wall_us: Optional[float] = None
    before_kernel_us: Optional[float] = None  # kernel time per forward under the profiler, whole model
    after_kernel_us: Optional[float] = None
    rounds: int = ROUNDS  # the interleaved rounds behind before_us / after_us
    notes: list[str] = field(default_factory=list)
    fusion: Optional[FusionReport] = field(default=None, repr=False)
    traces: dict[str, Any] = field(default_factory=dict, repr=False)  # "before"/"after" -> torch.profiler.profile

    @property
    def speedup(self) -> Optional[float]:
        return self.before_us / self.after_us if self.before_us and self.after_us else None

    def __str__(self) -> str:
        return "\n".join(text_lines(self))

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))

    def plot(self, path) -> None:
        """The roofline PNG: every region before (hollow) and after (filled) under the ceilings."""
        from .roofline import plot_roofline

        kind = "measured" if self.timed else f"predicted for {self.ceilings.name}"
        plot_roofline(roofline_points(self), self.ceilings, path, predicted=not self.timed,
                      title=f"{self.model}: {len(self.regions)} fused region(s), {kind} ({self.device})")

    def to_html(self, png: Optional[bytes] = None) -> str:
        return html_page(self, png)

    def save(self, out_dir) -> dict[str, Path]:
        """Write ``roofline.png``, ``report.html`` and (timed) ``trace_before.json``/``trace_after.json``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written: dict[str, Path] = {}
        png = None
        try:
            self.plot(out / "roofline.png")
            written["png"] = out / "roofline.png"
            png = written["png"].read_bytes()
        except ImportError:
            self.notes.append("no roofline.png: matplotlib is not installed")
        (out / "report.html").write_text(self.to_html(png), encoding="utf-8")
        written["html"] = out / "report.html"
        for side, prof in self.traces.items():
            path = out / f"trace_{side}.json"
            prof.export_chrome_trace(str(path))
            written[f"trace_{side}"] = path
        return written


# ------------------------------------------------------------------------------------------ the API

def profile(model: nn.Module, example_inputs: Sequence, *, gpu: Optional[str] = None,
            optimized: Optional[nn.Module] = None, iters: int = 10, warmup: int = 3) -> ProfileReport:
    """Run ``model`` and its fxfuse-optimized version on ``example_inputs``; report every fused region.

    On a CUDA device (the inputs' device): GPU time of each region and end to end, its kernels, achieved
    TFLOP/s and GB/s against ceilings measured now (``gpu="H200"`` uses the table instead), and traces.
    Elsewhere (CPU, ``meta`` tensors: nothing is allocated): the structure and the regime predicted for
    ``gpu`` (default "H200"). ``optimized``: a result of ``fxfuse.optimize(model)`` to use instead of
    optimizing here. Inference only: runs under ``torch.no_grad()``; put the model in ``eval()`` first.

    Example:
        >>> rep = fxfuse.profile(model.cuda().bfloat16(), (x,))          # doctest: +SKIP
        >>> print(rep); rep.save("profile")                               # doctest: +SKIP
    """
    from .api import optimize, report

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"fxfuse.profile: example_inputs is the model's positional inputs as a tuple, such as (x,); "
                        f"got {type(example_inputs).__name__}")
    inputs = tuple(example_inputs)
    # (a model left in training mode: what its forwards update, BatchNorm's statistics, the RNG, is put back)
    with leaving_unchanged(model, inputs):
        return _profile(model, inputs, gpu, optimized, iters, warmup, optimize, report)


def _profile(model: nn.Module, inputs: tuple, gpu: Optional[str], optimized: Optional[nn.Module], iters: int,
             warmup: int, optimize: Callable, report: Callable) -> ProfileReport:
    device = _device_of(model, inputs)
    timed = device.type == "cuda" or (device.type == "cpu" and _HOST_TIMED)
    with torch.no_grad():
        opt = optimized if optimized is not None else optimize(model, inputs)
        fusion = report(opt)
        regions = _Regions(opt, fusion)
        experts = experts_sites(opt, fusion, REGION)
        work: dict[str, list[CallWork]] = defaultdict(list)
        first_args: dict[str, tuple] = {}  # each region's first call's arguments (its host path is timed on them)
        experts_calls: dict[str, dict[str, Callable]] = {}  # an experts site's first call, each side, to time

        def record(site, x, weights, biases, operands, spec):
            if not isinstance(x, torch.Tensor) or x.dim() == 0:  # (the original ops raise eager's error)
                return reference_mlp(x, weights, biases, operands, spec)
            work[site.label].append(count_call(spec, x, weights, biases, operands, launches=site.launches))
            first_args.setdefault(site.label, (x, weights, biases, operands, spec))
            return reference_mlp(x, weights, biases, operands, spec)

        def record_experts(site: ExpertsSite, args: tuple, kwargs: dict):
            hidden, index = site.routing_args(args, kwargs)
            work[site.label].append(count_experts_call(site, hidden, index))
            experts_calls.setdefault(site.label, {
                "before": lambda: site.original(site.module, *args, **kwargs),
                "after": lambda: site.installed(site.module, *args, **kwargs)})
            return site.installed(site.module, *args, **kwargs)

        with _Intercept(regions, record), intercept_experts(experts, record_experts):
            opt(*inputs)
    dtypes = sorted({w.dtype for calls in work.values() for w in calls}) or ["bfloat16"]
    if gpu is None and device.type == "cuda":
        ceil = measure_ceilings(device, dtypes)
    else:
        ceil = named_ceilings(gpu or "H200")
    rep = ProfileReport(type(model).__name__, _device_name(device), ceil, [], timed, fusion=fusion)
    skipped = [r.module_path for r in fusion.regions if r.strategy == "user replacement"]
    if skipped:
        rep.notes.append(f"not profiled (user replacements): {', '.join(skipped)}")
    measured: dict[str, dict[str, _Measured]] = {}
    if timed:
        with torch.no_grad():
            measured = _time(rep, model, opt, regions, experts, inputs, device, iters, warmup)
            for side, measures in measured.items():
                for label, meas in measures.items():
                    if label in first_args:
                        meas.host_us = _call_host_us(side, first_args[label], device) * len(work[label])
                    elif label in experts_calls:
                        meas.host_us = _fn_host_us(experts_calls[label][side], device) * len(work[label])
    else:
        rep.notes.append(NEED_GPU)
    for label, site in (*regions.sites.items(), *experts.items()):
        if work[label]:  # (a call seen only while timing, not in the first run, has no shapes: skipped)
            rep.regions.append(_region(site, work[label], ceil, measured.get("before", {}).get(label),
                                       measured.get("after", {}).get(label), timed))
    profiled = {site.path for label, site in experts.items() if work[label]}
    for r in regions.unclaimed:
        if r.experts and r.module_path in profiled:
            continue
        if r.experts and r.module_path not in {site.path for site in experts.values()}:
            rep.notes.append(f"{r.module_path}: MoE experts, not found in the optimized model to profile; each token "
                             f"bucket's times and bound: {r.measured_cell()} (fxfuse.report)")
        else:
            rep.notes.append(f"{r.module_path}: fused, but not run by these inputs")
    return rep


# ------------------------------------------------------------------------------------------ intercepting

@dataclass
class _Site:
    label: str
    path: str
    pattern: str
    spec: str
    strategy: str
    launches: int


class _Regions:
    """Names each ``fxfuse.mlp`` call by the module its weights live in, as the fusion report does."""

    def __init__(self, model: nn.Module, fusion: FusionReport):
        self.names: dict[int, str] = {}
        for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers()):
            self.names.setdefault(id(t), name)
        self.unclaimed = [r for r in fusion.regions if r.strategy != "user replacement"]
        self.sites: dict[str, _Site] = {}
        self._by_key: dict[tuple, _Site] = {}

    def site(self, weights: Sequence[torch.Tensor], spec: str) -> _Site:
        idents = tuple(self._ident(w) for w in weights)
        found = self._by_key.get((idents, spec))
        if found is not None:
            return found
        paths = [self.names[i].split(".")[:-1] for i in idents if i in self.names]
        path = (".".join(_common(paths)) or "<root>") if len(paths) == len(idents) else f"region {len(self.sites)}"
        rep = next((r for r in self.unclaimed if r.module_path == path and r.spec == spec), None) or \
            next((r for r in self.unclaimed if r.spec == spec), None)
        if rep is not None:
            self.unclaimed.remove(rep)
            path = rep.module_path
        label = REGION + path
        if label in self.sites:
            label += f" #{sum(s.path == path for s in self.sites.values()) + 1}"
        # What runs (the first GPU call's choice), unless it differs between M buckets: then the plan.
        running = rep.running if rep is not None else "?"
        strategy = rep.strategy if " at M~" in running else running
        n = re.search(r"\((\d+) launch", strategy)
        site = _Site(label, path, rep.pattern if rep else "?", spec, strategy,
                     int(n.group(1)) if n else len(MLPSpec.loads(spec).stages))
        self._by_key[(idents, spec)] = self.sites[label] = site
        return site

    def _ident(self, t: torch.Tensor) -> int:
        while id(t) not in self.names and getattr(t, "_base", None) is not None:  # a transposed weight
            t = t._base
        return id(t)


def _common(paths: list[list[str]]) -> list[str]:
    common = paths[0] if paths else []
    for p in paths[1:]:
        i = 0
        while i < min(len(common), len(p)) and common[i] == p[i]:
            i += 1
        common = common[:i]
    return common


_MLP_NAMES = ("x", "weights", "biases", "operands", "spec")


class _Intercept(TorchFunctionMode):
    """While active, every ``torch.ops.fxfuse.mlp`` call runs ``handler(site, *args)`` instead.

    Inside the handler the mode is off: the op or the reference ops it calls run as usual.
    """

    def __init__(self, regions: _Regions, handler: Callable):
        super().__init__()
        self.regions, self.handler = regions, handler

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.fxfuse.mlp.default or func is torch.ops.fxfuse.mlp:
            a = dict(zip(_MLP_NAMES, args), **kwargs)
            x, weights, biases, operands, spec = (a[k] for k in _MLP_NAMES)
            return self.handler(self.regions.site(weights, spec), x, weights, biases, operands, spec)
        return func(*args, **kwargs)


def _before(site, x, weights, biases, operands, spec):
    with torch.profiler.record_function(site.label):
        return reference_mlp(x, weights, biases, operands, spec)


def _after(site, x, weights, biases, operands, spec):
    with torch.profiler.record_function(site.label):
        return torch.ops.fxfuse.mlp.default(x, weights, biases, operands, spec)


def _device_of(model: nn.Module, inputs: tuple) -> torch.device:
    for t in (*inputs, *model.parameters(), *model.buffers()):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


# ------------------------------------------------------------------------------------------ timing

@dataclass
class _Measured:
    gpu_us: float
    host_us: float  # from the profiler (attribute); profile() then sets the region's own, timed without it
    kernels: dict[str, float]
    launches: float


def _time(rep: ProfileReport, model, opt, regions: _Regions, experts: dict[str, ExpertsSite], inputs,
          device: torch.device, iters: int, warmup: int) -> dict[str, dict[str, _Measured]]:
    for m in (model, opt):  # first calls: Triton compiles and autotunes here
        m(*inputs)
    _sync(device)
    before, after = (lambda: model(*inputs)), (lambda: opt(*inputs))
    rep.before_us, rep.after_us = _interleaved(lambda: _median_us(before, device), lambda: _median_us(after, device))
    rep.before_wall_us, rep.after_wall_us = _interleaved(lambda: _wall_us(before, rep.before_us, device),
                                                         lambda: _wall_us(after, rep.after_us, device))
    cuda = device.type == "cuda"
    flush = torch.empty((256 if cuda else 1) << 20, dtype=torch.int8, device=device)  # as do_bench: cold L2
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for side, handler in (("before", _before), ("after", _after)):
        with _Intercept(regions, handler), intercept_experts(experts, _experts_side(side)):
            for _ in range(warmup):
                opt(*inputs)
            _sync(device)
            with torch.profiler.profile(activities=acts) as prof:
                for i in range(iters):
                    flush.zero_()
                    with torch.profiler.record_function(f"{ITERATION}{i}"):
                        opt(*inputs)
                    _sync(device)
        rep.traces[side] = prof
        out[side], total = attribute(prof.events(), iters, host_ops=not cuda)
        setattr(rep, f"{side}_kernel_us", total)
        if not out[side]:
            rep.notes.append(f"{side}: no kernel could be attributed to a region (see trace_{side}.json)")
    for side in ("before", "after"):  # do_bench times the GPU from launch to end: idle gaps are host time
        busy, span = getattr(rep, f"{side}_kernel_us"), getattr(rep, f"{side}_us")
        if busy and span > 1.3 * busy:
            rep.notes.append(f"{side}: the GPU is busy {busy / span:.0%} of the time ({fmt_us(busy)} µs of kernels in "
                             f"{fmt_us(span)} µs): launch and host overhead dominate end to end")
    return out


def _experts_side(side: str) -> Callable:
    """The experts sites' handler of a timed side: the class's own forward ("before") or the installed one."""

    def handler(site: ExpertsSite, args: tuple, kwargs: dict):
        forward = site.original if side == "before" else site.installed
        hidden, _ = site.routing_args(args, kwargs)
        with torch.profiler.record_function(site.label):
            return as_op(lambda: forward(site.module, *args, **kwargs), hidden)

    return handler


def _fn_host_us(fn: Callable, device: torch.device) -> float:
    """Host µs per call of ``fn`` outside the profiler, as :func:`_call_host_us` times a region's call."""
    from .strategy import host_us

    fn()
    _sync(device)
    return host_us(fn, calls=10, bursts=5)


def _call_host_us(side: str, args: tuple, device: torch.device) -> float:
    """Host µs per call of one region's call on ``args`` outside the profiler: the original ops (``before``) or
    the fused op (``after``, which replays its launches as a model's later calls do), 10 calls back to back,
    the fastest of 5 bursts."""
    from .strategy import host_us

    fn = (lambda: reference_mlp(*args)) if side == "before" else (lambda: torch.ops.fxfuse.mlp.default(*args))
    fn()
    fn()  # (the fused op's second call records its replay)
    _sync(device)
    return host_us(fn, calls=10, bursts=5)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(*measures: Callable[[], float]) -> list[float]:
    """Each measure's median over ``ROUNDS`` rounds that call every measure once, in turn.

    Timings drift within a run (clocks, power state): two sides measured one after the other get a bias from
    when they ran (a host-bound LlamaModel read 0.92x in one run, 1.03x in another). Interleaving shares it.
    """
    rounds = [[m() for m in measures] for _ in range(ROUNDS)]
    return [statistics.median(side) for side in zip(*rounds)]


def _median_us(fn, device: torch.device) -> float:
    """GPU median by ``triton.testing.do_bench`` (L2 flushed), as the benchmark; a host timer elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") * 1e3
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _wall_us(fn, gpu_us: float, device: torch.device) -> float:
    """Wall µs per call of back-to-back calls, synchronized before and after (median of 3 loops)."""
    calls = max(10, min(200, int(50_000 / max(gpu_us, 1.0)))) if device.type == "cuda" else 2
    vals = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        vals.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(vals)


def attribute(events, iters: int, host_ops: bool = False) -> tuple[dict[str, _Measured], Optional[float]]:
    """Per region label: median GPU and host µs per iteration, and the kernels, from profiler events.

    A device event (kernel, memcpy, memset) belongs to the CPU op that launched it (its
    ``linked_correlation_id``), hence to the region and iteration labels around that op; without that
    link, to the labels around its launch call (the runtime event of the same correlation id).
    Also returns the median kernel time per iteration of the whole model. ``host_ops`` (tests on the
    CPU): the leaf CPU ops stand in for kernels.
    """
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    labels = [e for e in cpu if e.name.startswith(REGION)]
    iterations = [e for e in cpu if e.name.startswith(ITERATION)]
    if host_ops:
        device = [e for e in cpu if not e.cpu_children and not e.name.startswith("fxfuse ")]
    else:
        device = [e for e in events if e.device_type != DeviceType.CPU
                  and not getattr(e, "is_user_annotation", False) and not e.name.startswith("fxfuse ")
                  and getattr(e, "activity_type", "kernel") != "gpu_user_annotation"]
    ops = {e.id: e for e in cpu if not getattr(e, "linked_correlation_id", 0)}
    launches = {e.id: e for e in cpu if getattr(e, "linked_correlation_id", 0)}

    def around(e, prefix: str, candidates):
        walk = e
        while walk is not None:
            if walk.name.startswith(prefix):
                return walk
            walk = walk.cpu_parent
        t = e.time_range.start
        return next((c for c in candidates if c.time_range.start <= t <= c.time_range.end), None)

    def index(it) -> int:
        return int(it.name[len(ITERATION):])

    gpu: dict[str, list[float]] = defaultdict(lambda: [0.0] * iters)
    host: dict[str, list[float]] = defaultdict(lambda: [0.0] * iters)
    names: dict[str, Counter] = defaultdict(Counter)
    total = [0.0] * iters
    found = []  # (owner CPU event, kernel name, µs)
    for d in device:
        linked = getattr(d, "linked_correlation_id", 0)
        owner = d if host_ops else (ops.get(linked) if linked else None) or launches.get(d.id)
        if owner is not None:
            found.append((owner, d.name, d.time_range.end - d.time_range.start))
    if not found:  # no device events of their own: the kernels torch attached to the ops that launched them
        found = [(e, k.name, k.duration) for e in cpu for k in getattr(e, "kernels", ())]
    for owner, name, dur in found:
        it = around(owner, ITERATION, iterations)
        if it is None or not 0 <= index(it) < iters:
            continue  # outside the timed iterations (the L2 flush)
        total[index(it)] += dur
        label = around(owner, REGION, labels)
        if label is not None:
            gpu[label.name][index(it)] += dur
            names[label.name][short_kernel_name(name)] += 1
    for lab in labels:
        it = around(lab, ITERATION, iterations)
        if it is not None and 0 <= index(it) < iters:
            host[lab.name][index(it)] += lab.time_range.end - lab.time_range.start
    result = {
        name: _Measured(statistics.median(gpu[name]), statistics.median(host[name]),
                        {k: v / iters for k, v in names[name].most_common()}, sum(names[name].values()) / iters)
        for name in gpu
    }
    return result, (statistics.median(total) if any(total) else None)


def short_kernel_name(name: str, width: int = 60) -> str:
    """``void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl…>(…)`` →
    ``vectorized_elementwise_kernel<GeluCUDAKernelImpl>``; short names stay as they are."""
    s = name.removeprefix("void ").strip()
    head = re.split(r"[<(]", s, maxsplit=1)[0]
    base = head.split("::")[-1] or head
    if "<" in s[len(head):len(head) + 1]:
        generic = {"BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor", "UnaryFunctor", base}
        tags = [t for t in re.findall(r"(\w+(?:Functor|Impl|_kernel))\b", s[len(head):]) if t not in generic]
        if tags:
            base = f"{base}<{tags[0]}>"
    return base if len(base) <= width else base[:width - 1] + "…"


# ------------------------------------------------------------------------------------------ assembling

def _region(site: _Site, calls: list[CallWork], ceil: Ceilings, before: Optional[_Measured],
            after: Optional[_Measured], timed: bool) -> RegionProfile:
    first = calls[0]
    flops = sum(c.flops for c in calls)
    min_bytes = sum(c.min_bytes for c in calls)
    dtype = first.dtype
    sides = {}
    for side, traffic, launches, meas in (
            ("before", sum(c.eager_bytes for c in calls), sum(c.eager_launches for c in calls), before),
            ("after", sum(c.fused_bytes for c in calls), site.launches * len(calls), after)):
        if meas is not None:
            verdict = classify(flops, traffic, round(meas.launches), ceil, dtype, meas.gpu_us, meas.host_us)
            t = meas.gpu_us
            sides[side] = Side(meas.launches, traffic, verdict, meas.kernels, t, meas.host_us,
                               flops / t / 1e6 if t else None, min_bytes / t / 1e3 if t else None)
        else:
            verdict = classify(flops, traffic, launches, ceil, dtype)
            if side == "before":
                kernels = dict(Counter(op for c in calls for op in c.eager_ops))
            else:
                kernels = {f"{site.strategy.split(' (')[0]} kernel": float(launches)}
            sides[side] = Side(launches, traffic, verdict, kernels)
            if timed:
                sides[side].verdict = Verdict(verdict.regime, "not measured: no kernel attributed",
                                              verdict.predicted_us)
    return RegionProfile(site.path, site.pattern, site.spec, site.strategy, len(calls), first.m, first.dims,
                         dtype, flops, min_bytes, flops / ceil.matmul(dtype) * 1e6,
                         min_bytes / ceil.copy_bytes_per_s * 1e6, sides["before"], sides["after"])
