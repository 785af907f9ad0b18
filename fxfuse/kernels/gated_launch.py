"""Python wrappers of the gated pointwise kernels (:mod:`fxfuse.kernels.gated_template`)."""

from __future__ import annotations

import torch
import triton

from . import fastlaunch
from .gated_template import GATED_ACTIVATIONS, gated_backward_kernel, gated_forward_kernel

__all__ = ["run_gated_backward", "run_gated_forward"]


def _launch(kernel, args: dict, n: int, device: torch.device) -> None:
    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK"]),)

    if device.type == "cuda":
        fastlaunch.launch(kernel, grid, args, varying=("N",))
    else:  # the interpreter
        kernel[grid](**args)


def run_gated_forward(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    """``act(g) * u`` (``act`` a key of ``GATED_ACTIVATIONS``); g and u contiguous, same shape and dtype.

    Example:
        >>> h = run_gated_forward(g, u, "silu")  # doctest: +SKIP
    """
    h = torch.empty_like(g)
    n = g.numel()
    _launch(gated_forward_kernel, {"g_ptr": g, "u_ptr": u, "h_ptr": h, "N": n, "ACT": GATED_ACTIVATIONS[act]},
            n, g.device)
    return h


def run_gated_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients ``(dg, du)`` of ``act(g) * u`` for the output gradient ``dh`` (all contiguous, one shape and
    dtype)."""
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    _launch(gated_backward_kernel, {"dh_ptr": dh, "g_ptr": g, "u_ptr": u, "dg_ptr": dg, "du_ptr": du, "N": n,
                                    "ACT": GATED_ACTIVATIONS[act]}, n, g.device)
    return dg, du
