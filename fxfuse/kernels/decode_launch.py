"""Python wrapper of the decode kernel (:mod:`fxfuse.kernels.decode_template`): a two-stage MLP, M ≤ 16, one launch.

The kernel sums partial products in an fp32 workspace and counts finished programs in an int32 counter;
the last program leaves both at zero (:mod:`.workspace`: one pair per device, stream and N, with
``DECODE_MAX_M`` rows; a launch uses the first M).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Optional

import torch
import triton

from .. import codegen
from .. import epilogue as ep
from .decode_template import DECODE_BLOCK_M
from .launch import (
    SUPPORTED_DTYPES,
    _input_precision,
    _parse,
    _torch_stage,
    _traced_in_interpreter,
    check_placement,
    launch_kernel,
)
from .template import interpreting as _interpreting
from .template import m_bucket
from .workspace import zeroed_workspace

logger = logging.getLogger(__name__)

__all__ = ["DECODE_MAX_M", "run_decode"]

# Rows the decode kernel takes: one BLOCK_M tile holds them all.
DECODE_MAX_M = DECODE_BLOCK_M
_INT32_MAX = 2**31 - 1  # the kernel indexes with int32 offsets
_WORKSPACE_SEMS = ("acq_rel", "relaxed")


def _validate(x, weights, biases, operands, exprs) -> tuple[int, int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got shape {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    M, K = x.shape
    if M > DECODE_MAX_M:
        raise ValueError(f"the decode kernel takes at most {DECODE_MAX_M} rows, got {M}")
    if len(exprs) != 2 or len(operands) != 2:
        raise ValueError("the decode kernel runs exactly two stages (two epilogues, two operand lists)")
    n_lin0 = ep.num_accumulators(exprs[0])
    if n_lin0 not in (1, 2) or len(weights) != n_lin0 + 1 or ep.num_accumulators(exprs[1]) != 1:
        raise ValueError(f"epilogues {exprs[0]} ; {exprs[1]} need {n_lin0} + 1 weights, got {len(weights)}")
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases (use None for no bias)")
    H, N = weights[0].shape[0], weights[-1].shape[0]
    expected = [(H, K)] * n_lin0 + [(N, H)]
    for i, (w, b, shape) in enumerate(zip(weights, biases, expected)):
        if tuple(w.shape) != shape or w.dtype != x.dtype:
            raise ValueError(f"weight {i} is {tuple(w.shape)} {w.dtype}, expected {list(shape)} {x.dtype}")
        if b is not None and (tuple(b.shape) != shape[:1] or b.dtype != x.dtype):
            raise ValueError(f"bias {i} is {tuple(b.shape)} {b.dtype}, expected [{shape[0]}] {x.dtype}")
    for stage, (ops, expr, width) in enumerate(zip(operands, exprs, (H, N))):
        if len(ops) != ep.num_operands(expr):
            raise ValueError(f"epilogue {expr} uses {ep.num_operands(expr)} operand(s) but {len(ops)} were given")
        for j, v in enumerate(ops):
            if not (v.numel() == 1 or (v.dim() == 1 and v.shape[0] == width)):
                raise ValueError(f"stage {stage} operand v{j} has shape {tuple(v.shape)}, expected [{width}] or one")
            if v.dtype not in (x.dtype, torch.float32):
                raise ValueError(f"stage {stage} operand v{j} dtype {v.dtype} must be {x.dtype} or torch.float32")
    check_placement(x, weights, [*(b for b in biases if b is not None), *(v for ops in operands for v in ops)])
    if DECODE_MAX_M * N > _INT32_MAX:
        raise ValueError(f"output width {N} is too large for int32 indexing")
    return M, K, H, N


def _torch_decode(x, weights, biases, operands, epilogues) -> torch.Tensor:
    """The same math in torch ops (fp32 per stage, h rounded to x's dtype): traceable."""
    h = _torch_stage(x, weights[:-1], biases[:-1], operands[0], _parse(epilogues[0]))
    return _torch_stage(h, weights[-1:], biases[-1:], operands[1], _parse(epilogues[1]))


def _alert_not_deterministic() -> None:
    """What torch's own nondeterministic ops do under ``torch.use_deterministic_algorithms(True)``: raise, or warn
    with ``warn_only=True`` (torch has no public Python entry for its alert)."""
    msg = ("fxfuse.kernels.run_decode does not have a deterministic implementation (its fp32 partial sums meet in "
           "atomic adds), but you set 'torch.use_deterministic_algorithms(True)'. fxfuse.optimize never runs it "
           "then; call fxfuse.kernels.run_stage_gemv per stage instead.")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(msg, stacklevel=3)
    else:
        raise RuntimeError(msg)


def run_decode(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
               operands: Sequence[Sequence[torch.Tensor]], epilogues: tuple[str, str], *,
               check: bool = True, workspace_sem: str = "relaxed",
               config: Optional[triton.Config] = None) -> torch.Tensor:
    """A whole two-stage MLP for a few rows in ONE kernel launch; returns a new ``[M, N]`` tensor.

    ``out = epi1(h @ W2^T + b2, ...)`` with ``h = epi0(x @ W0^T + b0[, x @ W1^T + b1], ...)`` rounded to
    x's dtype. Every weight is streamed from memory once.

    Args:
        x: ``[M, K]`` with ``M <= DECODE_MAX_M``, any strides.
        weights: the flat list: stage 0's ``[H, K]`` weight (two for a gated stage), then stage 1's ``[N, H]``;
            any strides.
        biases: one entry per weight, ``[H]`` / ``[N]`` or ``None``.
        operands: two lists (stage 0, stage 1) of 1-D tensors named ``v0, v1, ...`` in that stage's epilogue:
            ``[H]`` (stage 0) or ``[N]`` (stage 1) elements, or one element (broadcast); x's dtype or fp32.
        epilogues: ``(epilogue0, epilogue1)``, canonical texts over ``a0[, a1]`` and over ``a0``.
        check: validate the arguments first (``torch.ops.fxfuse.mlp`` checks them itself and may pass False).
        workspace_sem: memory semantics of the kernel's workspace adds: ``"relaxed"`` (default: the CTA barrier
            and the program counter's acq_rel order the sums before the last program reads them; 10% faster
            on the H200) or ``"acq_rel"`` (Triton's default for atomics).
        config: run this config (e.g. one of ``gpu_decode_configs()``) instead of the autotuned one (probes).

    Raises:
        ValueError: bad shapes, dtypes, devices, M > ``DECODE_MAX_M`` or epilogues (the caller falls back).
        RuntimeError: under ``torch.use_deterministic_algorithms(True)`` (a warning instead with
            ``warn_only=True``): its fp32 partial sums meet in atomic adds, whose order changes from call to call.
            (The planner never picks this kernel under the flag.)

    Example:
        >>> x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> run_decode(x, [wg, wu, wd], [None] * 3, [[], []], ("mul(silu(a0),a1)", "a0")).shape  # doctest: +SKIP
        torch.Size([1, 4096])
    """
    if workspace_sem not in _WORKSPACE_SEMS:
        raise ValueError(f"workspace_sem must be one of {_WORKSPACE_SEMS}, got {workspace_sem!r}")
    if torch.are_deterministic_algorithms_enabled():
        _alert_not_deterministic()
    if check:
        M, K, H, N = _validate(x, weights, biases, operands, [_parse(e) for e in epilogues])
    else:
        (M, K), H, N = x.shape, weights[0].shape[0], weights[-1].shape[0]
        if M > DECODE_MAX_M:  # rows past the one tile would be silently dropped
            raise ValueError(f"the decode kernel takes at most {DECODE_MAX_M} rows, got {M}")
    # The interpreter cannot be traced, and a zero-wide hidden layer launches no program: torch ops instead.
    if H == 0 or (_interpreting() and _traced_in_interpreter(x)):
        return _torch_decode(x, weights, biases, operands, epilogues)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    n_lin0 = len(weights) - 1
    kernel = codegen.generated_decode_kernel(n_lin0, epilogues[0], epilogues[1]).fused_decode_kernel
    ws, counter = zeroed_workspace(x, "decode", (DECODE_MAX_M, N), 1)
    w2, b2 = weights[-1], biases[-1]
    # Stage 0's weights / biases are w0 (, w1) / b0 (, b1); stage 1's are always w2 / b2.
    stage_w = {**{i: weights[i] for i in range(n_lin0)}, 2: w2}
    stage_b = {**{i: biases[i] for i in range(n_lin0)}, 2: b2}
    args: dict = {"x_ptr": x}
    args.update({f"w{i}_ptr": w for i, w in stage_w.items()})
    args.update({f"b{i}_ptr": (b if b is not None else x) for i, b in stage_b.items()})  # x: valid, unread
    for stage, ops in enumerate(operands):
        args.update({f"v{stage}_{j}_ptr": v for j, v in enumerate(ops)})
    args.update({"out_ptr": out, "ws_ptr": ws, "counter_ptr": counter, "M": M, "K": K, "H": H, "N": N,
                 "M_BUCKET": m_bucket(M), "stride_xm": x.stride(0), "stride_xk": x.stride(1)})
    for i in range(n_lin0):
        args[f"stride_w{i}h"], args[f"stride_w{i}k"] = weights[i].stride(0), weights[i].stride(1)
    args["stride_w2n"], args["stride_w2h"] = w2.stride(0), w2.stride(1)
    args.update({f"stride_b{i}": (b.stride(0) if b is not None else 0) for i, b in stage_b.items()})
    for stage, ops in enumerate(operands):
        # A single element is broadcast with stride 0 (whatever its shape/stride).
        args.update({f"stride_v{stage}_{j}": (0 if v.numel() == 1 else v.stride(0)) for j, v in enumerate(ops)})
    args["stride_om"], args["stride_on"] = out.stride(0), out.stride(1)
    args.update({f"HAS_BIAS{i}": b is not None for i, b in stage_b.items()})
    args.update({"INPUT_PRECISION": _input_precision(x.dtype), "WS_SEM": workspace_sem, "BLOCK_M": DECODE_BLOCK_M})

    def grid(meta):
        return (triton.cdiv(H, meta["BLOCK_H"]),)

    if config is not None:  # one variant, bypassing the autotuner
        kernel.fn[grid](**args, **config.all_kwargs())
    else:
        launch_kernel(kernel, grid, args, x)
    return out
