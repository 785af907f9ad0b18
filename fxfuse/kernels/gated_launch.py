"""Python wrappers of the gated pointwise kernels (:mod:`fxfuse.kernels.gated_template`).

They run twice per training step of every gated block, so on the GPU a launch after the first of its kind
(kernel, element count, activation, dtypes, device) is bound (:func:`.fastlaunch.bind`): only the tensors change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from . import fastlaunch
from .gated_template import GATED_ACTIVATIONS, gated_backward_kernel, gated_forward_kernel

__all__ = ["run_gated_backward", "run_gated_forward"]

# (kernel, N, ACT, the tensors' dtypes, device index) -> a launch bound to everything but the tensors
_bound_launches = fastlaunch.Bindings()


def _launch(kernel, args: dict, slots: Sequence[str], n: int, device: torch.device) -> None:
    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK"]),)

    if device.type != "cuda":  # the interpreter
        kernel[grid](**args)
        return
    tensors = [args[name] for name in slots]
    if not (fastlaunch.may_bind(tensors[0]) and all(t.data_ptr() % 16 == 0 for t in tensors)):
        fastlaunch.launch(kernel, grid, args, varying=("N",))  # (a binding assumes 16-byte aligned tensors)
        return
    key = (kernel, n, args["ACT"], tuple(t.dtype for t in tensors), tensors[0].get_device())
    bound = _bound_launches.get(key)
    if bound is not None:
        bound(*tensors)
        return
    fastlaunch.launch(kernel, grid, args, varying=("N",))
    bound = fastlaunch.bind(kernel, grid, args, slots, varying=("N",))
    if bound is not None:
        _bound_launches.keep(key, bound)


def run_gated_forward(g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
    """``act(g) * u`` (``act`` a key of ``GATED_ACTIVATIONS``); g and u contiguous, same shape and dtype.

    Example:
        >>> h = run_gated_forward(g, u, "silu")  # doctest: +SKIP
    """
    h = torch.empty_like(g)
    n = g.numel()
    _launch(gated_forward_kernel, {"g_ptr": g, "u_ptr": u, "h_ptr": h, "N": n, "ACT": GATED_ACTIVATIONS[act]},
            ("g_ptr", "u_ptr", "h_ptr"), n, g.device)
    return h


def run_gated_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, act: str, overwrite_dh: bool = False) \
        -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients ``(dg, du)`` of ``act(g) * u`` for the output gradient ``dh`` (all contiguous, one dtype and
    element count), shaped like ``dh``. ``overwrite_dh``: ``dg`` is written over ``dh`` (returned as ``dg``), for a
    caller that owns dh and needs it no more: one ``[M, hidden]`` tensor less at the backward's peak."""
    dg = dh if overwrite_dh else torch.empty_like(dh)
    du = torch.empty_like(dh)
    n = g.numel()
    _launch(gated_backward_kernel, {"dh_ptr": dh, "g_ptr": g, "u_ptr": u, "dg_ptr": dg, "du_ptr": du, "N": n,
                                    "ACT": GATED_ACTIVATIONS[act]},
            ("dh_ptr", "g_ptr", "u_ptr", "dg_ptr", "du_ptr"), n, g.device)
    return dg, du
