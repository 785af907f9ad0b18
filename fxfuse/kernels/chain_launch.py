"""Python wrapper of the fused-chain kernel (:mod:`fxfuse.kernels.chain_template`).

Inside a region recording (:mod:`fxfuse.replay`), a GPU launch also leaves its replay step: the launch bound
to everything but x and out (:func:`.fastlaunch.bind`), so a call like it skips the argument dict, the
signature and the autotuner's lookup (tens of µs of host time, more than the kernel at NeRF sizes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch
import triton

from .. import codegen
from . import fastlaunch
from .chain_template import pad_width
from .launch import _input_precision, launch_kernel, operand_args
from .template import m_bucket

__all__ = ["run_chain", "storing_step"]


def run_chain(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
              operands: Sequence[Sequence[torch.Tensor]], epilogues: tuple[str, ...],
              config: Optional[triton.Config] = None,
              hidden: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """Every stage of a narrow chain in one kernel launch; returns a new ``[M, D_last]`` tensor.

    Args:
        x: ``[M, D0]``, any strides; the weights' dtype, or fp32 under autocast (rounded to theirs as it is
            loaded; the output has the weights' dtype).
        weights: one ``[D_{i+1}, D_i]`` weight per stage, any strides (widths ≤ ``MAX_CHAIN_WIDTH``).
        biases: one per stage, ``[D_{i+1}]`` or ``None``.
        operands: per stage, the 1-D tensors (N elements or one) named ``v0, v1, ...`` in its epilogue.
        epilogues: one canonical epilogue text per stage, over ``a0`` (see :mod:`fxfuse.epilogue`).
        config: run this variant (one of ``chain_configs()``) instead of the autotuned choice.
        hidden: contiguous ``[M, D_i]`` tensors in the weights' dtype, one per layer after the first, that receive each
            layer's input as the kernel computes it (the wide-chain backward's forward). A recording then keeps
            a :func:`storing_step` (``x -> (out, hidden)``), not a region replay step.

    The caller (``torch.ops.fxfuse.mlp``) has checked shapes, dtypes and devices.

    Example:
        >>> run_chain(x, [w1, w2], [b1, b2], [[], []], ("relu(a0)", "a0"))  # doctest: +SKIP
    """
    M = x.shape[0]
    dims = [x.shape[1]] + [w.shape[0] for w in weights]
    dtype = weights[0].dtype  # x's, or an fp32 x under autocast, rounded to it on load
    out = torch.empty((M, dims[-1]), dtype=dtype, device=x.device)
    kernel = codegen.generated_chain_kernel(tuple(epilogues)).fused_chain_kernel
    args: dict = {"x_ptr": x, "out_ptr": out, "M": M, "M_BUCKET": m_bucket(M),
                  "stride_xm": x.stride(0), "stride_xk": x.stride(1),
                  "stride_om": out.stride(0), "stride_on": out.stride(1),
                  "STORE_HIDDEN": hidden is not None, "INPUT_PRECISION": _input_precision(dtype)}
    for i in range(1, len(weights)):
        args[f"hs{i}_ptr"] = weights[0] if hidden is None else hidden[i - 1]  # unread unless stored
    for i, (w, b, ops) in enumerate(zip(weights, biases, operands)):
        args[f"w{i}_ptr"] = w
        args[f"stride_w{i}n"], args[f"stride_w{i}k"] = w.stride(0), w.stride(1)
        args[f"b{i}_ptr"] = b if b is not None else w  # any valid pointer; unread without bias
        args[f"stride_b{i}"] = b.stride(0) if b is not None else 0
        args[f"HAS_BIAS{i}"] = b is not None
        args.update(operand_args(ops, prefix=f"v{i}_"))
    for i, d in enumerate(dims):
        args[f"D{i}"], args[f"P{i}"] = d, pad_width(d)

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"])
        if meta["PERSISTENT"]:
            return (max(1, min(tiles, _num_sms(x.device) * meta["PER_SM"])),)
        return (tiles,)

    if config is not None:  # one variant, bypassing the autotuner (tests and probes)
        kernel.fn[grid](**args, **config.all_kwargs())
        return out
    launch_kernel(kernel, grid, args, x)
    if fastlaunch.recording_open() and x.is_cuda and type(x) is torch.Tensor:
        # A region replay (fxfuse.replay) keeps this launch bound to all but x and out (and the stores): its key
        # fixes x's shape and strides, so M, the grid and the fresh outputs' strides stay those bound here.
        if hidden is None:
            bound = fastlaunch.bind(kernel, grid, args, ("x_ptr", "out_ptr"))
            fastlaunch.record(None if bound is None else fastlaunch.output_step(bound, M, dims[-1], dtype,
                                                                                x.device, x))
        else:
            stores = tuple(f"hs{i}_ptr" for i in range(1, len(weights)))
            bound = fastlaunch.bind(kernel, grid, args, ("x_ptr", "out_ptr", *stores))
            fastlaunch.record(None if bound is None else storing_step(bound, M, dims, dtype, x.device))
    return out


def storing_step(bound, rows: int, dims: Sequence[int], dtype: torch.dtype, device: torch.device):
    """The forward storing the layer inputs, bound (:func:`.fastlaunch.bind`) to all but x, out and the stores:
    ``x -> (out, [h_1 .. h_{L-1}])``, fresh outputs each call."""
    def step(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = fastlaunch.new_output(rows, dims[-1], dtype, device)
        hidden = [fastlaunch.new_output(rows, d, dtype, device) for d in dims[1:-1]]
        bound(x, out, *hidden)
        return out, hidden

    return step


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so the persistent loop runs several tiles each
    return torch.cuda.get_device_properties(device).multi_processor_count
