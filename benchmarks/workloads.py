"""The benchmark workloads of ``/work/shared/workloads.md``: module classes, table rows, FLOP/byte counts.

Importable without CUDA and without fxfuse. Every module is a plain ``nn.Module`` built from ``nn.Linear``:

* gated (GeGLU / SwiGLU): ``down(act(gate(x)) * up(x))``, no bias anywhere;
* GPT-2 MLP: ``Linear+bias -> GELU(tanh) -> Linear+bias``;
* NeRF MLP: ``Linear+bias`` layers with ReLU between (none after the last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GeGLUMLP",
    "SwiGLUMLP",
    "GPT2MLP",
    "NerfMLP",
    "Workload",
    "WORKLOADS",
    "REF_CEILINGS",
    "build_module",
    "make_input",
    "count_work",
    "table_work",
    "floor_us",
    "EAGER_SLACK",
    "TOL",
    "DECODE_CALLS",
    "DECODE_LOOPS",
    "Verdict",
    "judge",
    "target_text",
]


class GeGLUMLP(nn.Module):
    """``down(gelu(gate(x), approximate="tanh") * up(x))``, no biases."""

    def __init__(self, d: int, h: int, device=None, dtype=None):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(h, d, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases (the Llama MLP)."""

    def __init__(self, d: int, h: int, device=None, dtype=None):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(d, h, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(h, d, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GPT2MLP(nn.Module):
    """``Linear+bias -> GELU(tanh) -> Linear+bias``."""

    def __init__(self, d: int, h: int, device=None, dtype=None):
        super().__init__()
        self.fc = nn.Linear(d, h, bias=True, device=device, dtype=dtype)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(h, d, bias=True, device=device, dtype=dtype)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class NerfMLP(nn.Module):
    """``len(widths)-1`` Linear+bias layers with ReLU between them (no activation after the last)."""

    def __init__(self, widths: tuple[int, ...], device=None, dtype=None):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=True, device=device, dtype=dtype) for a, b in zip(widths[:-1], widths[1:])
        )

    def forward(self, x):
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < n - 1:
                x = F.relu(x)
        return x


@dataclass(frozen=True)
class Workload:
    """One row of workloads.md (plus its reference figures and target)."""

    name: str
    kind: str  # "geglu" | "swiglu" | "gpt2" | "nerf"
    m: int  # rows
    dims: tuple[int, ...]  # (D, H) for gated/gpt2 (D -> H -> D); layer widths for nerf
    dtype: torch.dtype
    input_shape: tuple[int, ...]
    target_us: Optional[float]  # fxfuse GPU median target (µs)
    target_wall_us: Optional[float] = None  # fxfuse wall-per-call target (µs), decode rows
    decode: bool = False  # also time 200 back-to-back calls (wall)
    ref_floor_us: Optional[float] = None  # the floor quoted in workloads.md
    ref_eager_us: Optional[float] = None
    ref_compile_us: Optional[float] = None

    @property
    def dims_str(self) -> str:
        if self.kind == "nerf":
            return " → ".join(str(w) for w in self.dims)
        d, h = self.dims
        return f"{d} → {h} → {d}"

    @property
    def linears(self) -> list[tuple[int, int, bool]]:
        """(K, N, has_bias) for every linear of the module, from the table (not from the module)."""
        if self.kind in ("geglu", "swiglu"):
            d, h = self.dims
            return [(d, h, False), (d, h, False), (h, d, False)]
        if self.kind == "gpt2":
            d, h = self.dims
            return [(d, h, True), (h, d, True)]
        w = self.dims
        return [(a, b, True) for a, b in zip(w[:-1], w[1:])]


BF16, FP16 = torch.bfloat16, torch.float16

# Targets (fxfuse GPU median µs; gpt2m_mlp_m1 also wall µs per call) are the "Targets" table of workloads.md;
# gpt2m_mlp_m8 has none. The ref_* figures are its "Reference figures" table.
WORKLOADS: list[Workload] = [
    Workload("seed_geglu", "geglu", 8192, (768, 3072), BF16, (64, 128, 768), target_us=180,
             ref_floor_us=165, ref_eager_us=241, ref_compile_us=216),
    Workload("gpt2_mlp", "gpt2", 8192, (768, 3072), BF16, (8192, 768), target_us=118,
             ref_floor_us=110, ref_eager_us=148, ref_compile_us=169),
    Workload("llama_swiglu_m1", "swiglu", 1, (4096, 14336), BF16, (1, 4096), target_us=92, decode=True,
             ref_floor_us=83, ref_eager_us=110, ref_compile_us=155),
    Workload("llama_swiglu_m16", "swiglu", 16, (4096, 14336), BF16, (16, 4096), target_us=92, decode=True,
             ref_floor_us=83, ref_eager_us=113, ref_compile_us=132),
    Workload("llama_swiglu_4096", "swiglu", 4096, (4096, 14336), BF16, (4096, 4096), target_us=1900,
             ref_floor_us=2060, ref_eager_us=2158, ref_compile_us=1919),
    Workload("gpt2m_mlp_m1", "gpt2", 1, (1024, 4096), BF16, (1, 1024), target_us=8, target_wall_us=15, decode=True,
             ref_floor_us=4, ref_eager_us=36, ref_compile_us=63),
    Workload("gpt2m_mlp_m8", "gpt2", 8, (1024, 4096), BF16, (8, 1024), target_us=None, decode=True,
             ref_floor_us=4, ref_eager_us=20, ref_compile_us=186),
    Workload("nerf64", "nerf", 1 << 20, (32, 64, 64, 64, 16), FP16, (1 << 20, 32), target_us=60,
             ref_floor_us=33, ref_eager_us=469, ref_compile_us=561),
    Workload("nerf128", "nerf", 1 << 20, (64, 128, 128, 128, 64), FP16, (1 << 20, 64), target_us=220,
             ref_floor_us=146, ref_eager_us=924, ref_compile_us=910),
]

# Ceilings quoted in workloads.md (one H200): used by --dry-run only; the GPU run measures its own.
REF_CEILINGS = {"copy_Bps": 4.23e12, "bf16_flops": 701e12, "fp16_flops": 707e12}


def build_module(w: Workload, device="cuda", seed: int = 0) -> nn.Module:
    """The row's module, random (default nn.Linear init) weights from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    if w.kind == "geglu":
        mod = GeGLUMLP(*w.dims, device=device, dtype=w.dtype)
    elif w.kind == "swiglu":
        mod = SwiGLUMLP(*w.dims, device=device, dtype=w.dtype)
    elif w.kind == "gpt2":
        mod = GPT2MLP(*w.dims, device=device, dtype=w.dtype)
    elif w.kind == "nerf":
        mod = NerfMLP(w.dims, device=device, dtype=w.dtype)
    else:
        raise ValueError(w.kind)
    return mod.eval()


def make_input(w: Workload, device="cuda", seed: int = 0, m: Optional[int] = None) -> torch.Tensor:
    """Standard-normal input of the row's shape (``m`` overrides the row count, keeping the last dim)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = w.input_shape if m is None else (m, w.input_shape[-1])
    return torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=w.dtype)


def optimized_row(name: str) -> tuple[Workload, nn.Module, nn.Module, torch.Tensor]:
    """The named row, its module, ``fxfuse.optimize`` of it after a first (planning, tuning) inference call,
    and the row's input (probes)."""
    import fxfuse

    w = next(w for w in WORKLOADS if w.name == name)
    mod, x = build_module(w), make_input(w)
    fast = fxfuse.optimize(mod)
    with torch.no_grad():
        fast(x)
    return w, mod, fast, x


def count_work(mod: nn.Module, m: int, d_in: int, d_out: int, elem_bytes: int) -> tuple[int, int]:
    """(FLOPs, minimum bytes) counted from the module's nn.Linear layers.

    FLOPs = 2·M·Σ K·N; bytes = input read once + every weight/bias read once + output written once.
    """
    flops = 0
    param_elems = 0
    for lin in mod.modules():
        if isinstance(lin, nn.Linear):
            flops += 2 * m * lin.in_features * lin.out_features
            param_elems += lin.weight.numel() + (lin.bias.numel() if lin.bias is not None else 0)
    nbytes = (m * d_in + param_elems + m * d_out) * elem_bytes
    return flops, nbytes


def table_work(w: Workload) -> tuple[int, int]:
    """(FLOPs, minimum bytes) from the table's dims alone (cross-check of :func:`count_work`)."""
    es = torch.empty((), dtype=w.dtype).element_size()
    lins = w.linears
    flops = sum(2 * w.m * k * n for k, n, _ in lins)
    params = sum(k * n + (n if b else 0) for k, n, b in lins)
    d_in, d_out = lins[0][0], lins[-1][1]
    return flops, (w.m * d_in + params + w.m * d_out) * es


def floor_us(flops: int, nbytes: int, flops_per_s: float, bytes_per_s: float) -> tuple[float, str, float, float]:
    """(floor µs, "compute"|"memory", compute µs, memory µs)."""
    t_c = flops / flops_per_s * 1e6
    t_m = nbytes / bytes_per_s * 1e6
    return max(t_c, t_m), ("compute" if t_c >= t_m else "memory"), t_c, t_m


# The measurement protocol: relative Frobenius error tolerance of bf16/fp16 results against float64, and the wall
# time of a decode row as µs per call of DECODE_CALLS back-to-back calls, the median of DECODE_LOOPS such loops.
TOL = 2e-2
DECODE_CALLS = 200
DECODE_LOOPS = 5

# "No workload gets slower than eager": fxfuse may be at most this fraction slower than eager before the row
# fails. 2% is about the spread of two eager medians of one run (the bench prints that spread per row).
EAGER_SLACK = 0.02


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _us(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _us_over(v: float, limit: float) -> str:
    """``v`` (above ``limit``) with the digits it takes to read as above it: 92.03 against 92, not "92 > 92"."""
    text = _us(v)
    for digits in range(4, 10):
        if float(text) > limit:
            break
        text = f"{v:.{digits}g}"
    return text


@dataclass(frozen=True)
class Verdict:
    """One row against issue 3: the target (None: the row has none) and "not slower than eager"."""

    meets_target: Optional[bool]
    not_slower_than_eager: bool
    passed: bool
    why: str  # what failed, "" when passed


def judge(fxfuse_us, eager_us, target_us: Optional[float], *, target_wall_us: Optional[float] = None,
          fxfuse_wall_us=None, eager_wall_us=None, correct: bool = True,
          eager_slack: float = EAGER_SLACK) -> Verdict:
    """Pass/fail of one row. Pure: numbers in, verdict out (a missing or non-numeric time fails its check).

    * meets_target: fxfuse GPU median ≤ ``target_us`` and, if ``target_wall_us`` is set, fxfuse wall µs/call ≤ it;
      None when the row has no target (it cannot fail on one).
    * not_slower_than_eager: fxfuse GPU median ≤ eager × (1 + slack) and, when an eager wall time is given (decode
      rows), the fxfuse wall time too: host overhead is what a decode caller pays.
    * passed: correct results, target met (or none), not slower than eager.

    Example:
        >>> judge(170, 240, 180).passed
        True
        >>> judge(170, 240, None).meets_target is None
        True
        >>> judge(7, 20, 8, target_wall_us=15, fxfuse_wall_us=16, eager_wall_us=50).why
        'wall 16 > 15'
        >>> judge(92.03, 112, 92).why  # as many digits as it takes to differ from the target
        '92.03 > 92'
    """
    fails = []
    fx_ok = _num(fxfuse_us)
    if not fx_ok:
        fails.append("no fxfuse time")
    elif not correct:
        fails.append("wrong results")

    meets = None
    if target_us is not None:
        meets = fx_ok and fxfuse_us <= target_us
        if fx_ok and not meets:
            fails.append(f"{_us_over(fxfuse_us, target_us)} > {target_us:g}")
        if target_wall_us is not None:
            wall_ok = _num(fxfuse_wall_us) and fxfuse_wall_us <= target_wall_us
            if not wall_ok:
                fails.append(f"wall {_us_over(fxfuse_wall_us, target_wall_us)} > {target_wall_us:g}"
                             if _num(fxfuse_wall_us)
                             else "no fxfuse wall time")
            meets = meets and wall_ok
        meets = bool(meets and correct)

    limit = 1.0 + eager_slack
    not_slower = fx_ok and _num(eager_us) and fxfuse_us <= eager_us * limit
    if fx_ok and not _num(eager_us):
        fails.append("no eager time")
    elif fx_ok and not not_slower:
        fails.append(f"slower than eager ({eager_us / fxfuse_us:.2f}×)")
    if _num(eager_wall_us):
        wall_not_slower = _num(fxfuse_wall_us) and fxfuse_wall_us <= eager_wall_us * limit
        if not wall_not_slower:
            fails.append(f"wall slower than eager ({eager_wall_us / fxfuse_wall_us:.2f}×)" if _num(fxfuse_wall_us)
                         else "no fxfuse wall time")
        not_slower = not_slower and wall_not_slower
    not_slower = bool(not_slower and correct)

    passed = bool(correct and meets is not False and not_slower)
    # one reason once (a missing wall time can fail both checks)
    return Verdict(meets, not_slower, passed, "" if passed else "; ".join(dict.fromkeys(fails)))


def target_text(target_us: Optional[float], target_wall_us: Optional[float] = None) -> str:
    """``≤ 8, wall ≤ 15``; ``—`` for a row without a target."""
    if target_us is None:
        return "—"
    return f"≤ {target_us:g}" + (f", wall ≤ {target_wall_us:g}" if target_wall_us is not None else "")
