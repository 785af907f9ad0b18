"""Python wrapper of the fused-chain kernel (:mod:`fxfuse.kernels.chain_template`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch
import triton

from .. import codegen
from .chain_template import pad_width
from .launch import _input_precision, launch_kernel, operand_args
from .template import m_bucket

__all__ = ["run_chain"]


def run_chain(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
              operands: Sequence[Sequence[torch.Tensor]], epilogues: tuple[str, ...],
              config: Optional[triton.Config] = None) -> torch.Tensor:
    """Every stage of a narrow chain in one kernel launch; returns a new ``[M, D_last]`` tensor.

    Args:
        x: ``[M, D0]``, any strides.
        weights: one ``[D_{i+1}, D_i]`` weight per stage, any strides (widths ≤ ``MAX_CHAIN_WIDTH``).
        biases: one per stage, ``[D_{i+1}]`` or ``None``.
        operands: per stage, the 1-D tensors (N elements or one) named ``v0, v1, ...`` in its epilogue.
        epilogues: one canonical epilogue text per stage, over ``a0`` (see :mod:`fxfuse.epilogue`).
        config: run this variant (one of ``chain_configs()``) instead of the autotuned choice.

    The caller (``torch.ops.fxfuse.mlp``) has checked shapes, dtypes and devices.

    Example:
        >>> run_chain(x, [w1, w2], [b1, b2], [[], []], ("relu(a0)", "a0"))  # doctest: +SKIP
    """
    M = x.shape[0]
    dims = [x.shape[1]] + [w.shape[0] for w in weights]
    out = torch.empty((M, dims[-1]), dtype=x.dtype, device=x.device)
    kernel = codegen.generated_chain_kernel(tuple(epilogues)).fused_chain_kernel
    args: dict = {"x_ptr": x, "out_ptr": out, "M": M, "M_BUCKET": m_bucket(M),
                  "stride_xm": x.stride(0), "stride_xk": x.stride(1),
                  "stride_om": out.stride(0), "stride_on": out.stride(1),
                  "INPUT_PRECISION": _input_precision(x.dtype)}
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
    else:
        launch_kernel(kernel, grid, args, x)
    return out


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so the persistent loop runs several tiles each
    return torch.cuda.get_device_properties(device).multi_processor_count
