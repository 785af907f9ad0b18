"""Which kernels run a fused region: one fused-chain kernel, or one GEMM+epilogue kernel per stage.

The choice depends only on the region's structure and widths, so the op (at run time) and the
report (at optimize time, when the widths are known) agree.

Example:
    >>> from fxfuse.spec import MLPSpec
    >>> choose_strategy(MLPSpec.loads("1b:relu(a0);1b:relu(a0);1b:a0"), (32, 64, 64, 16))
    'fused_chain'
    >>> choose_strategy(MLPSpec.loads("1b:gelu_tanh(a0);1b:a0"), (768, 3072, 768))
    'gemm_epilogue'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from .kernels.chain_template import MAX_CHAIN_WIDTH
from .kernels.template import autotune_enabled
from .spec import MLPSpec

__all__ = ["DECODE", "FUSED_CHAIN", "GATED_GEMM_EPILOGUE", "GEMM_EPILOGUE", "ORIGINAL_OPS", "Measurement",
           "choose_strategy", "kernels_are_faster", "launches", "measured_choice_enabled", "measurements"]

log = logging.getLogger(__name__)

FUSED_CHAIN = "fused_chain"  # the whole chain in one kernel, intermediates on chip
GEMM_EPILOGUE = "gemm_epilogue"  # one GEMM kernel per stage, bias + epilogue fused
GATED_GEMM_EPILOGUE = "gated_gemm_epilogue"  # the same, gate and up in one kernel
DECODE = "decode_split_hidden"  # a two-stage MLP on a few rows in one launch, split over the hidden dim
ORIGINAL_OPS = "original_ops"  # the ops the region replaced (cuBLAS GEMMs + eager pointwise): always a candidate


def choose_strategy(spec: MLPSpec, widths: Sequence[int]) -> str:
    """``widths``: the input width, then each stage's output width."""
    narrow = max(widths) <= MAX_CHAIN_WIDTH
    if narrow and all(s.num_linears == 1 for s in spec.stages):
        return FUSED_CHAIN
    return GATED_GEMM_EPILOGUE if spec.is_gated else GEMM_EPILOGUE


def launches(spec: MLPSpec, strategy: str) -> int:
    return 1 if strategy == FUSED_CHAIN else len(spec.stages)


# The original ops (cuBLAS GEMMs + eager pointwise) stay a candidate: the first time a region runs on
# the GPU at a new shape bucket, both are timed and the faster is kept, so fusing never makes a region
# slower than it was. Keyed by (spec, M bucket, weight shapes, dtype, device); the choice is also kept on
# disk (fxfuse.tuning_cache), the times and the cost model's prediction in _measured (for the report).
_choices: dict[tuple, bool] = {}
_measured: dict[tuple, Measurement] = {}


@dataclass(frozen=True)
class Measurement:
    """The fused kernels vs the original ops of one region shape, timed (or read from the tuning cache)."""

    spec: str
    m_bucket: int  # the key: M rounded up to a power of two
    m: int  # the rows of the call that decided
    widths: tuple[int, ...]  # input width, then each linear's N
    dtype: str
    device: str  # GPU name
    strategy: str  # the fused kernels that ran
    fused_us: float
    original_us: float
    source: str  # "timed" or "tuning cache"
    predicted_us: Optional[float] = None  # the cost model's time of ``strategy`` at ``m``
    predicted_original_us: Optional[float] = None  # ... and of the original ops

    @property
    def fused(self) -> bool:
        return self.fused_us <= self.original_us


def measurements() -> list[Measurement]:
    """Every measured choice of this process, in the order made.

    Example:
        >>> [(r.spec, r.m_bucket, r.fused_us, r.original_us) for r in measurements()]  # doctest: +SKIP
        [('1b:gelu_tanh(a0);1b:a0', 16, 9.8, 20.1)]
    """
    return list(_measured.values())


def measured_choice_enabled() -> bool:
    """Off with ``FXFUSE_AUTOTUNE=0`` (then the kernels always run: what the GPU tests check)."""
    return autotune_enabled()


def kernels_are_faster(args: tuple, run_kernels: Callable[[], torch.Tensor],
                       run_reference: Callable[[], torch.Tensor]) -> bool:
    """Whether the fused kernels beat the original ops on inputs like ``args`` (measured once per key)."""
    x, weights, _, _, spec = args
    m = x.numel() // x.shape[-1]
    key = (spec, 1 << max(m - 1, 0).bit_length(), tuple(w.shape for w in weights), x.dtype, x.device)
    choice = _choices.get(key)
    if choice is not None:
        return choice
    from . import tuning_cache

    widths = (x.shape[-1], *(w.shape[0] for w in weights))
    dtype = str(x.dtype).replace("torch.", "")
    device = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
    disk_key = f"{spec} | M~{key[1]} | {','.join('x'.join(map(str, w.shape)) for w in weights)} | {dtype}"
    stored = tuning_cache.lookup(disk_key, device)
    if stored is not None:
        fused, original, source = stored.fused_us, stored.original_us, "tuning cache"
    elif x.is_cuda and torch.cuda.is_current_stream_capturing():
        return True  # cannot time inside a CUDA graph capture; decide on a later eager call
    else:
        from triton.testing import do_bench

        log.info("fxfuse: %s at M~%d: first call at this shape bucket, compiling and timing the fused kernels "
                 "against the original ops", spec, key[1])
        run_kernels()  # compile and autotune outside the timing
        fused = do_bench(run_kernels, warmup=5, rep=20, return_mode="median") * 1e3
        original = do_bench(run_reference, warmup=5, rep=20, return_mode="median") * 1e3
        tuning_cache.store(disk_key, device, tuning_cache.TunedChoice(fused <= original, fused, original))
        source = "timed"
    ran = choose_strategy(MLPSpec.loads(spec), widths)  # what ops._run_kernels runs
    predicted = _predict(spec, widths, m, dtype, device, (ran, ORIGINAL_OPS))
    _measured[key] = Measurement(spec, key[1], m, widths, dtype, device, ran, fused, original, source, *predicted)
    choice = _choices[key] = fused <= original
    log.info("fxfuse: %s at M~%d (%s): fused kernels %.1f us, original ops %.1f us -> %s", spec, key[1], source,
             fused, original, "fused" if choice else "keeping the original ops")
    return choice


def _predict(spec: str, widths: tuple[int, ...], m: int, dtype: str, device: str,
             strategies: Sequence[str]) -> list[Optional[float]]:
    """The cost model's µs for each strategy (None where it has none: this runs on the forward path)."""
    from .cost import predict

    out: list[Optional[float]] = []
    for s in strategies:
        try:
            out.append(predict(spec, widths, m, dtype, s, device).predicted_us)
        except Exception as err:  # a model that cannot say must not stop the forward
            log.debug("fxfuse: no prediction for %s with %s: %s", spec, s, err)
            out.append(None)
    return out
