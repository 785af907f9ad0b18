"""Predicted GPU time of one fused region under each strategy: FLOPs and bytes against the GPU's ceilings.

A strategy runs a region as a sequence of kernels, one after another (each needs the previous one's
output), so their times add; inside one kernel compute and memory overlap. Hence, per strategy::

    kernel time   = max(FLOPs / (matmul rate · its GEMM efficiency), bytes / (copy bandwidth · BANDWIDTH_EFFICIENCY))
    predicted µs  = Σ kernel times + launches × per-launch overhead

The GEMM efficiency is the library's (``CUBLAS_EFFICIENCY``) for the original ops' linears and for a stage with no
pointwise op to fuse (the planner times cuBLAS for every stage, and it wins those), the generated GEMM kernel's
(``FUSED_GEMM_EFFICIENCY``: Hopper's TMA kernel, else ``TRITON_GEMM_EFFICIENCY``) for a stage with its epilogue,
and ``TRITON_GEMM_EFFICIENCY`` for the one-kernel strategies.

The kernels (and the bytes each moves) of every strategy:

* ``original_ops``: the ops the region replaced, one launch per linear and per pointwise op; every
  intermediate is written by one kernel and read back by the next (what ``torch`` eager does).
* ``gemm_epilogue`` / ``gated_gemm_epilogue``: one GEMM kernel per stage with bias and epilogue fused;
  the intermediate between two stages is written once and read once.
* ``fused_chain``, ``decode_split_hidden`` and ``decode_grid_sync``: ONE kernel: input read once, every weight
  once, output written once (the intermediates stay on chip).

Ceilings come from :mod:`fxfuse.roofline` (the named GPU's table entry, or measured ones passed as
``ceilings=``). The regime says where most of the predicted time goes: the matmul rate (``compute``),
the bandwidth (``memory``) or the launches (``launch``).

Example:
    >>> p = predict("2--:mul(silu(a0),a1);1-:a0", (4096, 14336, 14336, 4096), 1, "bfloat16",
    ...             "gated_gemm_epilogue", device_name="H200")
    >>> p.regime, round(p.memory_us)  # the 352 MB of weights at 90% of 4.23 TB/s
    ('memory', 93)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import epilogue as ep
from .kernels.chain_template import MAX_CHAIN_WIDTH
from .roofline import DEVICES, Ceilings, named_ceilings
from .spec import MLPSpec
from .strategy import DECODE, DECODE_GRID_SYNC, FUSED_CHAIN, GATED_GEMM_EPILOGUE, GEMM_EPILOGUE, ORIGINAL_OPS

__all__ = ["BANDWIDTH_EFFICIENCY", "CUBLAS_EFFICIENCY", "DECODE_MAX_ROWS", "FUSED_GEMM_EFFICIENCY", "STRATEGIES",
           "TRITON_GEMM_EFFICIENCY", "Kernel", "Prediction", "ceilings_for", "predict", "rank"]

log = logging.getLogger(__name__)

# The efficiency factors: the share of a ceiling a real kernel reaches. The ceilings are best cases (an
# 8192³ cuBLAS matmul, a 1 GiB copy). On the H200 (README table), eager's cuBLAS GEMMs of MLP shapes run at
# about 0.95 of the first, fxfuse's chain kernel at 0.7-0.8; streaming kernels (weights at decode,
# pointwise ops) at about 0.9 of the second.
CUBLAS_EFFICIENCY = 0.95  # the original ops' GEMMs, and a stage cuBLAS runs whole (no pointwise op to fuse)
TRITON_GEMM_EFFICIENCY = 0.8  # the generated kernels' GEMMs where no better figure is known
# A stage's GEMM with its epilogue fused, per GPU (a name in the ceilings' name). Hopper runs the persistent TMA
# kernel (fxfuse.kernels.tma_template): on the H200 at 0.94 of the measured bf16 rate for seed's gated gate+up
# (116.8 µs), 1.0 for Llama's at 4096 rows (1374 µs), 0.82 for gpt2's fc1 with its GELU (67.2 µs; session 47,
# benchmarks/probes/probe_fast_forms.py). With 0.8 for it, Llama's region at 4096 rows read as slower fused than
# as the original ops (2583 against 2346 µs predicted; 2031 against 2258 measured).
FUSED_GEMM_EFFICIENCY = {"H200": 0.9, "H100": 0.9}
BANDWIDTH_EFFICIENCY = 0.9
# Rows one decode launch takes (fxfuse.kernels.decode_template.DECODE_BLOCK_M): above, the decode kernel
# is no candidate.
DECODE_MAX_ROWS = 16

STRATEGIES = (ORIGINAL_OPS, GEMM_EPILOGUE, GATED_GEMM_EPILOGUE, FUSED_CHAIN, DECODE, DECODE_GRID_SYNC)


@dataclass(frozen=True)
class Kernel:
    """One launch of a strategy: what it computes and what it moves to and from HBM."""

    name: str  # "linear", "gelu_tanh", "stage 0", "chain", ...
    flops: int
    bytes: int
    library: bool = False  # its GEMMs run in cuBLAS (CUBLAS_EFFICIENCY), not in a generated kernel


@dataclass(frozen=True)
class Prediction:
    """What the cost model expects of one strategy for one region at ``m`` rows."""

    strategy: str
    m: int
    dtype: str
    device: str  # the ceilings used (a GPU name)
    kernels: tuple[Kernel, ...]
    compute_us: float  # all FLOPs at each kernel's GEMM efficiency (cuBLAS or generated) of the matmul rate
    memory_us: float  # all bytes at BANDWIDTH_EFFICIENCY of the copy bandwidth
    launch_us: float  # launches × per-launch overhead
    predicted_us: float  # Σ per kernel max(compute, memory) + launch_us
    regime: str  # "compute" | "memory" | "launch": the largest of the three terms above

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def launches(self) -> int:
        return len(self.kernels)

    def __str__(self) -> str:
        n = self.launches
        return (f"{self.strategy}: {self.predicted_us:.1f} µs predicted on {self.device}, {self.regime}-bound "
                f"({n} launch{'es' if n != 1 else ''}, {self.bytes / 1e6:.1f} MB, {self.flops / 1e9:.2f} GFLOP)")


def ceilings_for(device_name: Optional[str] = None) -> Ceilings:
    """The named ceilings of ``device_name`` (default: the current CUDA device, else an H200).

    An unknown GPU gets the H200's figures (the prediction says which ceilings it used).

    Example:
        >>> ceilings_for("NVIDIA H200").copy_bytes_per_s
        4230000000000.0
    """
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    try:
        return named_ceilings(device_name)
    except ValueError:
        log.debug("fxfuse: no ceilings for %r; predicting with the H200's", device_name)
        return DEVICES["H200"]


def predict(spec: Union[MLPSpec, str], widths: Sequence[int], m: int, dtype: Union[torch.dtype, str],
            strategy: str, device_name: Optional[str] = None, *, ceilings: Optional[Ceilings] = None) -> Prediction:
    """The predicted GPU time of ``strategy`` on ``m`` rows (``widths``: input width, then each linear's N).

    ``ceilings`` overrides the named ones (e.g. :func:`fxfuse.roofline.measure_ceilings`). Raises
    ``ValueError`` for a strategy that cannot run this region (a gated stage in ``fused_chain``...).

    Example:
        >>> p = predict("1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0", (32, 64, 64, 64, 16), 1 << 20,
        ...             torch.float16, "fused_chain", "H200")
        >>> p.launches, p.regime
        (1, 'compute')
    """
    spec = MLPSpec.loads(spec) if isinstance(spec, str) else spec
    widths = tuple(int(w) for w in widths)
    if len(widths) != spec.num_linears + 1:
        raise ValueError(f"{spec.dumps()} needs {spec.num_linears + 1} widths, got {widths}")
    reason = _cannot_run(spec, widths, m, strategy)
    if reason:
        raise ValueError(f"{strategy} cannot run {spec.dumps()} at M={m}: {reason}")
    dtype_name = str(dtype).replace("torch.", "")
    ceil = ceilings or ceilings_for(device_name)
    kernels = tuple(_kernels(spec, widths, m, getattr(torch, dtype_name).itemsize, strategy))
    generated = TRITON_GEMM_EFFICIENCY
    if strategy in (GEMM_EPILOGUE, GATED_GEMM_EPILOGUE):
        generated = next((e for gpu, e in FUSED_GEMM_EFFICIENCY.items() if gpu.lower() in ceil.name.lower()),
                         TRITON_GEMM_EFFICIENCY)
    rate = ceil.matmul(dtype_name)
    bandwidth = ceil.copy_bytes_per_s * BANDWIDTH_EFFICIENCY
    compute = [k.flops / (rate * (CUBLAS_EFFICIENCY if k.library else generated)) * 1e6 for k in kernels]
    memory = [k.bytes / bandwidth * 1e6 for k in kernels]
    launch_us = len(kernels) * ceil.launch_us
    terms = {"compute": sum(compute), "memory": sum(memory), "launch": launch_us}
    return Prediction(strategy, m, dtype_name, ceil.name, kernels, terms["compute"], terms["memory"], launch_us,
                      sum(map(max, compute, memory)) + launch_us, max(terms, key=terms.get))


def rank(spec: Union[MLPSpec, str], widths: Sequence[int], m: int, dtype: Union[torch.dtype, str],
         candidates: Iterable[str] = STRATEGIES, device_name: Optional[str] = None, *,
         ceilings: Optional[Ceilings] = None) -> list[Prediction]:
    """Predictions of the ``candidates`` that can run this region, fastest first.

    Example:
        >>> [p.strategy for p in rank("1b:gelu_tanh(a0);1b:a0", (1024, 4096, 1024), 1, "bfloat16",
        ...                           device_name="H200")]
        ['decode_grid_sync', 'gemm_epilogue', 'original_ops']
    """
    spec = MLPSpec.loads(spec) if isinstance(spec, str) else spec
    ceil = ceilings or ceilings_for(device_name)
    preds = [predict(spec, widths, m, dtype, s, ceilings=ceil) for s in dict.fromkeys(candidates)
             if not _cannot_run(spec, tuple(widths), m, s)]
    return sorted(preds, key=lambda p: p.predicted_us)


def _cannot_run(spec: MLPSpec, widths: tuple[int, ...], m: int, strategy: str) -> Optional[str]:
    if strategy not in STRATEGIES:
        return f"unknown strategy (known: {', '.join(STRATEGIES)})"
    if strategy == GEMM_EPILOGUE and spec.is_gated:
        return f"a gated stage: that is {GATED_GEMM_EPILOGUE}"
    if strategy == GATED_GEMM_EPILOGUE and not spec.is_gated:
        return f"no gated stage: that is {GEMM_EPILOGUE}"
    if strategy == FUSED_CHAIN:
        if spec.is_gated:
            return "the chain kernel has no gated stage"
        if max(widths) > MAX_CHAIN_WIDTH:
            return f"a width above {MAX_CHAIN_WIDTH}"
    if strategy in (DECODE, DECODE_GRID_SYNC):
        if len(spec.stages) != 2 or spec.stages[1].num_linears != 1:
            return "the decode kernels take two stages, the second one linear"
        if strategy == DECODE and m > DECODE_MAX_ROWS:
            return f"more than {DECODE_MAX_ROWS} rows"
        if strategy == DECODE and m == 1:
            return f"one row runs {DECODE_GRID_SYNC}"
        if strategy == DECODE_GRID_SYNC and m != 1:
            return "the grid-sync kernel takes one row"
    return None


def _kernels(spec: MLPSpec, widths: tuple[int, ...], m: int, es: int, strategy: str) -> list[Kernel]:
    """The launches of ``strategy``, each with its FLOPs and the bytes it reads and writes."""
    eager: list[Kernel] = []
    stages: list[Kernel] = []
    k, w, all_params = widths[0], 0, 0
    for i, stage in enumerate(spec.stages):
        n = widths[w + 1]
        params = flops = 0
        for has_bias in stage.has_bias:
            p = n * k * es + (n * es if has_bias else 0)
            eager.append(Kernel("linear", 2 * m * k * n, m * k * es + p + m * n * es, library=True))
            params += p
            flops += 2 * m * k * n
        params += stage.num_operands * n * es  # operands broadcast along N: at most N elements each
        calls = _calls(stage.expr)
        for call in calls:
            reads = sum(m * n * es if isinstance(a, (ep.Acc, ep.Call)) else n * es if isinstance(a, ep.Operand)
                        else 0 for a in call.args)
            eager.append(Kernel(call.op, 0, reads + m * n * es))
        # A stage with nothing to fuse but a bias (``a0``) is one cuBLAS GEMM, as the planner finds it.
        stages.append(Kernel(f"stage {i}", flops, m * k * es + params + m * n * es, library=not calls))
        all_params += params
        k = n
        w += stage.num_linears
    if strategy == ORIGINAL_OPS:
        return eager
    if strategy in (GEMM_EPILOGUE, GATED_GEMM_EPILOGUE):
        return stages
    # One kernel: the input read once, every parameter once, the output written once.
    once = m * widths[0] * es + all_params + m * widths[-1] * es
    return [Kernel("chain" if strategy == FUSED_CHAIN else "decode", sum(s.flops for s in stages), once)]


def _calls(expr: ep.Expr) -> list[ep.Call]:
    """Every op of an epilogue, inputs first: what the original ops launch, one kernel each."""
    if not isinstance(expr, ep.Call):
        return []
    return [c for a in expr.args for c in _calls(a)] + [expr]
