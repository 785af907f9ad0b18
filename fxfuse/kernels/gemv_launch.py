"""Python wrapper of the small-M stage kernel (:mod:`fxfuse.kernels.gemv_template`): one stage, M ≤ 64.

Split-K launches store their partial sums in an fp32 workspace ``[num_linears, splits, BLOCK_M, N]`` (a slice
per split, as many as its configs may take: ``gemv_workspace_splits``) and count finished splits per column
tile; the last split adds the slices in order and leaves the counters at zero (:mod:`.workspace`).

At decode sizes the kernel takes a few µs, so the host path matters as much: after the first launch at a
given call (the same weights, biases, operands, row count, strides, dtype, stream), the next ones skip the
argument dict, the workspace lookup and the launcher's signature and call a launch bound to everything but
``x`` and ``out`` (:func:`.fastlaunch.bind`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Optional

import torch
import triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import codegen
from . import fastlaunch
from .gemv_template import GEMV_MAX_ROWS, gemv_block_m, gemv_workspace_splits
from .launch import (
    _input_precision,
    _parse,
    _torch_stage,
    _traced_in_interpreter,
    _validate,
    launch_kernel,
    operand_args,
)
from .template import interpreting as _interpreting
from .template import m_bucket
from .workspace import zeroed_workspace

logger = logging.getLogger(__name__)

__all__ = ["GEMV_MAX_M", "run_stage_gemv"]

# Rows the kernel takes: one padded BLOCK_M tile (16, 32 or 64 rows: gemv_block_m) holds them all.
GEMV_MAX_M = GEMV_MAX_ROWS
_bound = fastlaunch.Bindings(limit=1024)  # bound launches by call key; past the limit all are dropped
# A one-row stage after another small-M stage loads its first weights before waiting for it (``after_gemv``).
# Probes turn it off to measure it (then drop ``_bound`` and the replays, which hold the choice).
prefetch_weights = True


def _pdl_supported(x: torch.Tensor) -> bool:
    """Programmatic dependent launch: Hopper or newer, not in the interpreter, not inside a CUDA graph capture."""
    if not x.is_cuda or _interpreting() or torch.cuda.is_current_stream_capturing():
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def run_stage_gemv(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                   operands: Sequence[torch.Tensor], epilogue: str, *, check: bool = True,
                   config: Optional[triton.Config] = None, after_gemv: bool = False) -> torch.Tensor:
    """``epilogue(x @ W0^T + b0[, x @ W1^T + b1], v0, ...)`` for a few rows, streaming the weights once.

    The same contract as :func:`fxfuse.kernels.run_stage` (any strides, one or two ``[N, K]`` weights,
    ``[N]`` biases or ``None``, operands of N elements or one), for ``M <= GEMV_MAX_M`` rows.

    Args:
        check: validate the arguments first (``torch.ops.fxfuse.mlp`` checks them itself and passes False).
        config: run this config (one of ``gpu_gemv_configs()``) instead of the autotuned one (probes).
        after_gemv: the previous kernel on this stream is this kernel (the region's previous stage, run by
            ``run_stage_gemv``): a one-row launch then loads its first weights before waiting for it
            (``PREFETCH``; ``prefetch_weights`` turns that off for probes).

    Raises:
        ValueError: bad shapes, dtypes, devices, epilogue, or more than ``GEMV_MAX_M`` rows.

    Example:
        >>> x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> run_stage_gemv(x, [wg, wu], [None, None], [], "mul(silu(a0),a1)").shape  # doctest: +SKIP
        torch.Size([1, 14336])
    """
    if check:
        M, N, K = _validate(x, weights, biases, operands, _parse(epilogue))
    else:
        (M, K), N = x.shape, weights[0].shape[0]
    if M > GEMV_MAX_M:  # rows past the one tile would be silently dropped
        raise ValueError(f"the small-M stage kernel takes at most {GEMV_MAX_M} rows, got {M}")
    if _interpreting() and _traced_in_interpreter(x):
        return _torch_stage(x, weights, biases, operands, _parse(epilogue))
    call_key = None
    # Not while tracing (the launch must become a graph node) nor capturing (the capture owns its workspace).
    if config is None and x.is_cuda and type(x) is torch.Tensor and _get_current_dispatch_mode() is None \
            and not torch.cuda.is_current_stream_capturing():
        call_key = fastlaunch.bound_key((epilogue, after_gemv and prefetch_weights), x, weights, biases, operands)
        bound = _bound.get(call_key)
        if bound is not None:
            out = fastlaunch.new_output(M, N, x.dtype, x.device)
            bound(x, out)
            if fastlaunch.recording_open():
                fastlaunch.record(fastlaunch.output_step(bound, M, N, x.dtype, x.device, x))
            return out
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    kernel = codegen.generated_gemv_kernel(len(weights), epilogue).fused_gemv_kernel
    n_lin = len(weights)
    # One counter per column tile of the narrowest BLOCK_N (a ONE_ROW tile may be one column).
    block_m = gemv_block_m(M)
    ws_splits = gemv_workspace_splits(block_m)
    # (the slices are written before they are read: only the counters need zeros, and a capture records no fill of
    # the slices, which would run on every replay)
    ws, counters = zeroed_workspace(x, "gemv", (n_lin, ws_splits, block_m, N), N, zero_sums=False)
    args: dict = {"x_ptr": x}
    args.update({f"w{i}_ptr": w for i, w in enumerate(weights)})
    args.update({f"b{i}_ptr": (b if b is not None else x) for i, b in enumerate(biases)})  # x: valid, unread
    args.update(operand_args(operands))
    args.update({"out_ptr": out, "ws_ptr": ws, "counter_ptr": counters, "M": M, "N": N, "K": K,
                 "M_BUCKET": m_bucket(M), "stride_xm": x.stride(0), "stride_xk": x.stride(1)})
    for i, w in enumerate(weights):
        args[f"stride_w{i}n"], args[f"stride_w{i}k"] = w.stride(0), w.stride(1)
    args.update({f"stride_b{i}": (b.stride(0) if b is not None else 0) for i, b in enumerate(biases)})
    args["stride_om"], args["stride_on"] = out.stride(0), out.stride(1)
    args.update({f"HAS_BIAS{i}": b is not None for i, b in enumerate(biases)})
    pdl = _pdl_supported(x)
    # PREFETCH is only safe after the wait-then-release of the same kernel's previous launch (see the template);
    # without PDL (a CUDA graph capture) the launch starts after that kernel anyway. It does not depend on ``pdl``
    # so that a capture asks the autotuner for the keys the plain calls before it tuned (none is tuned inside).
    args.update({"INPUT_PRECISION": _input_precision(x.dtype), "BLOCK_M": block_m, "WS_SPLITS": ws_splits,
                 "USE_PDL": pdl,
                 "PREFETCH": after_gemv and prefetch_weights and M == 1})
    if pdl:
        args["launch_pdl"] = True  # a launch option (compiled into the kernel's metadata), not a kernel argument

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is not None:  # one variant, bypassing the autotuner
        if config.kwargs.get("ONE_ROW") and M > config.kwargs["ONE_ROW"]:
            raise ValueError(f"a register-stream config computes at most ONE_ROW={config.kwargs['ONE_ROW']:d} rows; "
                             f"got {M}")
        if config.kwargs["SPLIT_K"] > ws_splits:  # its splits past the workspace's slices would write others'
            raise ValueError(f"a launch of {block_m} padded rows takes at most {ws_splits} K splits; the config asks "
                             f"{config.kwargs['SPLIT_K']}")
        kernel.fn[grid](**{**args, **config.all_kwargs()})  # (a probe's config may set PREFETCH too)
        return out
    launch_kernel(kernel, grid, args, x)
    bound = None
    if call_key is not None:
        bound = fastlaunch.bind(kernel, grid, args, ("x_ptr", "out_ptr"))
        if bound is not None:
            _bound.keep(call_key, bound)
    if fastlaunch.recording_open():
        fastlaunch.record(None if bound is None else fastlaunch.output_step(bound, M, N, x.dtype, x.device, x))
    return out
