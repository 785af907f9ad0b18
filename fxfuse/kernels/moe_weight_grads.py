"""The MoE backward's two weight gradients on ``torch._grouped_mm``, and the measured choice between it and the
Triton kernel (:func:`~fxfuse.kernels.moe_backward_template.moe_weight_grad_kernel`).

Each weight gradient is, per expert, a sum over the expert's rows of outer products: a GEMM whose reduction runs
over the expert's ~``T * top_k / E`` rows of the pair layout. ``torch._grouped_mm`` (CUTLASS's grouped GEMM on
Hopper; bf16 only) takes that form directly: two 2-D operands, K split at each expert's end row. It reads its
operands in the layout's sorted rows, so x and the output gradient are gathered into them first (two ``[rows, H]``
copies, one launch each; the output gradient's is the one the backward's G took where it ran by TMA), and the
other operands' padding rows must be zeros (the gate backward writes them so).

Neither wins everywhere (H100, bf16, forward + backward of one layer, ``probe_moe.py --train
--weight-grads``): grouped_mm at Mixtral-8x7B's shapes at every token count (4096 tokens: 17.8 against
20.8 ms), the Triton kernel at Qwen3-30B-A3B's 128 experts at 4096 tokens (3.6 against 5.5 ms) and at
gpt-oss-20b's at 64-256 tokens. So the first backward at each shape and pair bucket times both,
for each weight apart (:func:`weight_grads_by`, logged at INFO), and keeps the faster for that key.

Example:
    >>> d_w1 = weight_grads_by("d gate_up", shape, pairs, grouped, triton)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

from .measured import faster, may_time, store_times, stored_times, time_runners
from .moe_launch import PairLayout, gather_rows
from .template import next_pow2

__all__ = ["GROUPED_WEIGHT_GRADS", "WEIGHT_GRAD_CHOICES", "grouped_down_grad", "grouped_gate_up_grad",
           "grouped_mm_takes", "weight_grad_timings", "weight_grads_by"]

logger = logging.getLogger(__name__)

# "enabled": whether the weight gradients may run on torch._grouped_mm; turned off for the process, with a log line,
# the first time it fails (a torch without this GPU's kernel), and the Triton kernel runs instead. "force": None
# (the measured choice) or "grouped_mm" / "triton" for every shape (probes and tests compare the two).
GROUPED_WEIGHT_GRADS: dict = {"enabled": True, "force": None}
# (weight, E, 2I, H, transposed, rows per block, pair bucket) -> "grouped_mm" or "triton"
WEIGHT_GRAD_CHOICES: dict[tuple, str] = {}
# The same keys -> (grouped_mm µs, Triton µs) where they were timed, for fxfuse.report (weight_grad_timings)
_TIMES: dict[tuple, tuple[float, float]] = {}


def grouped_mm_takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` may compute the weight gradients here: bf16 on CUDA, unless it failed before."""
    return (GROUPED_WEIGHT_GRADS["enabled"] and dtype == torch.bfloat16 and device.type == "cuda"
            and hasattr(torch, "_grouped_mm"))


def _grouped_sum(layout: PairLayout, segments: torch.Tensor, top_k: int, by_token: torch.Tensor,
                 by_row: torch.Tensor, by_token_first: bool, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each expert's sum over its rows of ``by_token[row's token]^T by_row[row]`` (``by_token_first``) or of
    ``by_row[row]^T by_token[row's token]``, by ``torch._grouped_mm`` with K split at each expert's end row.
    ``rows``: ``by_token``'s rows already gathered into the layout (:func:`~fxfuse.kernels.moe_launch.gather_rows`:
    zeros at padding; the grouped GEMM reads no row past the last expert's end)."""
    offs = (segments[1:] * layout.block_m).to(torch.int32)
    rows = gather_rows(by_token, layout, top_k) if rows is None else rows
    return (torch._grouped_mm(rows.t(), by_row, offs=offs) if by_token_first
            else torch._grouped_mm(by_row.t(), rows, offs=offs))


def grouped_gate_up_grad(layout: PairLayout, segments: torch.Tensor, top_k: int, x: torch.Tensor,
                         dgu: torch.Tensor, transposed: bool) -> torch.Tensor:
    """d gate_up in the parameter's layout (``[E, 2I, H]``, or ``[E, H, 2I]`` when ``transposed``) by
    ``torch._grouped_mm``, K split at each expert's end row (``segments[1:] * block_m``): ``d gate_up[e] =
    dgu[e's rows]^T x[their tokens]``. ``dgu`` must be zero at padding rows; an expert with no rows gets zeros (an
    empty group of the sum).

    Example:
        >>> d_w1 = grouped_gate_up_grad(layout, segments, 2, x, dgu, False)  # doctest: +SKIP
    """
    return _grouped_sum(layout, segments, top_k, x, dgu, by_token_first=transposed)


def grouped_down_grad(layout: PairLayout, segments: torch.Tensor, top_k: int, dout: torch.Tensor,
                      rh: torch.Tensor, transposed: bool, dout_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """d down in the parameter's layout (``[E, H, I]``, or ``[E, I, H]`` when ``transposed``) as
    :func:`grouped_gate_up_grad`: ``d down[e] = dout[e's tokens]^T rh[e's rows]`` (``rh``: h scaled by the routing
    weights, zero at padding rows; ``dout_rows``: dout's rows already gathered into the layout, if the backward's G
    took them)."""
    return _grouped_sum(layout, segments, top_k, dout, rh, by_token_first=not transposed, rows=dout_rows)


def weight_grads_by(what: str, shape: tuple, pairs: int, grouped: Callable[[], Any],
                    triton: Callable[[], Any]) -> Any:
    """A weight gradient by ``grouped`` (torch._grouped_mm) or ``triton`` (the Triton kernel), whichever was
    faster at the first backward of ``shape`` (the weight and what sets its sums' work) and ``pairs`` bucketed to
    a power of two: both timed there in interleaved rounds, the choice logged at INFO (``what``: its name there)
    and kept. Untimed (``FXFUSE_AUTOTUNE=0``, or inside a CUDA graph capture): grouped_mm. A grouped_mm that raises
    turns it off for the process (logged); the Triton kernel runs.
    """
    key = tuple(shape) + (next_pow2(pairs),)
    choice = GROUPED_WEIGHT_GRADS["force"] or WEIGHT_GRAD_CHOICES.get(key)
    if choice is None and may_time():
        choice = _time_choice(what, key, grouped, triton)
    if choice == "triton" or not GROUPED_WEIGHT_GRADS["enabled"]:
        return triton()
    try:
        return grouped()
    except RuntimeError as exc:
        _grouped_failed(exc)
        return triton()


def _time_choice(what: str, key: tuple, grouped: Callable[[], Any], triton: Callable[[], Any]) -> str:
    times = stored_times("moe weight gradient", key, ("grouped_mm", "triton"))  # (an earlier process's, this GPU)
    cached = times is not None
    if not cached:
        try:
            grouped()  # (a failure here is grouped_mm's own: the Triton kernel from now on)
        except RuntimeError as exc:
            _grouped_failed(exc)
            return "triton"
        triton()  # (its first call autotunes)
        times = time_runners({"grouped_mm": grouped, "triton": triton})
        store_times("moe weight gradient", key, times)
    choice = faster(times, "triton", "grouped_mm")  # (the Triton kernel: one lean launch, no torch glue)
    WEIGHT_GRAD_CHOICES[key] = choice
    _TIMES[key] = (times["grouped_mm"], times["triton"])
    logger.info("fxfuse.moe: experts' weight gradient %s, up to %d pairs: grouped_mm %.1f us, the Triton kernel "
                "%.1f us%s: runs %s", what, key[-1], times["grouped_mm"], times["triton"],
                " (from the tuning cache)" if cached else "", choice)
    return choice


def weight_grad_timings(gate_up_shape: tuple[int, ...]) -> list[str]:
    """The weight gradients' timed choices so far in this process for experts whose ``gate_up_proj`` has
    ``gate_up_shape`` (either layout), as :func:`fxfuse.report` lists them: ``d gate_up up to 8192 pairs:
    grouped_mm (3296 / 5410 µs grouped_mm / Triton)``."""
    num, a, b = gate_up_shape
    found = [key for key in _TIMES if key[1] == num and {key[2], key[3]} == {a, b}]
    return [f"d {key[0]} up to {key[-1]} pairs: {WEIGHT_GRAD_CHOICES.get(key, '?')} ({_TIMES[key][0]:.0f} / "
            f"{_TIMES[key][1]:.0f} µs grouped_mm / Triton)" for key in sorted(found, key=lambda k: (k[-1], k[0]))]


def _grouped_failed(exc: Exception) -> None:
    GROUPED_WEIGHT_GRADS["enabled"] = False
    logger.warning("fxfuse.moe: torch._grouped_mm failed for the experts' weight gradients (%s: %s); the Triton "
                   "kernel computes them from now on", type(exc).__name__, exc)
