"""Python wrapper of the grid-synchronized decode kernel (:mod:`.grid_sync_template`): a one-row MLP, one launch.

On the GPU the kernel is launched cooperatively (``launch_cooperative_grid``): the driver either makes every
program resident at once, which the grid barrier needs, or refuses the launch with an error (the caller then
runs another strategy); it never deadlocks. The Triton interpreter runs programs one after another, so
there (and with ``phases=2``) the two stages are two launches without the barrier.

The scratch (H fp32 values of the intermediate, two int32 barrier counters) is one zeroed pair per device,
stream and H (:mod:`.workspace`): launches on one stream run in order, and the kernel leaves the arrival
counter at zero.

After the first launch at a given call (weights, biases, operands, strides, dtype, stream), the next ones
call a launch bound to everything but ``x`` and ``out`` (:func:`.fastlaunch.bind`), and a region replay
(:mod:`fxfuse.replay`) records it as its one step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch
import triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import codegen
from . import fastlaunch
from .decode_launch import _torch_decode
from .decode_launch import _validate as _validate_decode
from .gemv_launch import _pdl_supported
from .grid_sync_template import grid_sync_programs
from .launch import _parse, _traced_in_interpreter, launch_kernel
from .template import interpreting as _interpreting
from .template import sm_count
from .workspace import zeroed_workspace

logger = logging.getLogger(__name__)

__all__ = ["run_grid_sync"]

# Launch cooperatively (the driver guarantees that every program is resident, or refuses the launch).
COOPERATIVE = True
_bound = fastlaunch.Bindings(limit=1024)  # bound launches by call key; past the limit all are dropped


def _kernel_args(x, weights, biases, operands, out, scratch, sync, K, H, N) -> dict:
    n_lin0 = len(weights) - 1
    stage_w = {**{i: weights[i] for i in range(n_lin0)}, 2: weights[-1]}
    stage_b = {**{i: biases[i] for i in range(n_lin0)}, 2: biases[-1]}
    args: dict = {"x_ptr": x}
    args.update({f"w{i}_ptr": w for i, w in stage_w.items()})
    args.update({f"b{i}_ptr": (b if b is not None else x) for i, b in stage_b.items()})  # x: valid, unread
    for stage, ops in enumerate(operands):
        args.update({f"v{stage}_{j}_ptr": v for j, v in enumerate(ops)})
    args.update({"out_ptr": out, "h_ptr": scratch, "sync_ptr": sync, "K": K, "H": H, "N": N,
                 "stride_xk": x.stride(1)})
    for i in range(n_lin0):
        args[f"stride_w{i}h"], args[f"stride_w{i}k"] = weights[i].stride(0), weights[i].stride(1)
    args["stride_w2n"], args["stride_w2h"] = weights[-1].stride(0), weights[-1].stride(1)
    args.update({f"stride_b{i}": (b.stride(0) if b is not None else 0) for i, b in stage_b.items()})
    for stage, ops in enumerate(operands):
        args.update({f"stride_v{stage}_{j}": (0 if v.numel() == 1 else v.stride(0)) for j, v in enumerate(ops)})
    args["stride_on"] = out.stride(1)
    args.update({f"HAS_BIAS{i}": b is not None for i, b in stage_b.items()})
    return args


def run_grid_sync(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                  operands: Sequence[Sequence[torch.Tensor]], epilogues: tuple[str, str], *, check: bool = True,
                  phases: Optional[int] = None, config: Optional[triton.Config] = None) -> torch.Tensor:
    """A whole two-stage MLP for ONE row in one launch, the stages separated by a grid barrier.

    The same contract as :func:`fxfuse.kernels.run_decode` (flat weights ``[W0 (, W1), W2]``, one bias entry
    per weight, two operand lists, two epilogues), for ``x`` of shape ``[1, K]``.

    Args:
        check: validate the arguments first (``torch.ops.fxfuse.mlp`` checks them itself and passes False).
        phases: 1 (one cooperative launch, the GPU default) or 2 (two launches, no barrier: the interpreter's
            only way, and a fallback).
        config: run this config (one of ``gpu_grid_sync_configs()``, BLOCK_HH set) instead of the autotuned one.

    Raises:
        ValueError: bad shapes, dtypes, devices or epilogues, or more than one row.
        RuntimeError: the driver refused the cooperative launch (more programs than can be resident).

    Example:
        >>> x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> run_grid_sync(x, [w1, w2], [b1, b2], [[], []], ("gelu_tanh(a0)", "a0")).shape  # doctest: +SKIP
        torch.Size([1, 1024])
    """
    if check:
        M, K, H, N = _validate_decode(x, weights, biases, operands, [_parse(e) for e in epilogues])
    else:
        (M, K), H, N = x.shape, weights[0].shape[0], weights[-1].shape[0]
    if M != 1:
        raise ValueError(f"the grid-sync decode kernel takes one row, got {M}")
    if phases is None:
        phases = 2 if _interpreting() else 1
    if phases not in (1, 2):
        raise ValueError(f"phases must be 1 or 2, got {phases}")
    if _interpreting() and phases == 1:
        raise ValueError("the Triton interpreter runs programs one at a time: the grid barrier needs phases=2")
    if H == 0 or (_interpreting() and _traced_in_interpreter(x)):
        return _torch_decode(x, weights, biases, operands, epilogues)
    call_key = None
    if phases == 1 and config is None and x.is_cuda and type(x) is torch.Tensor \
            and _get_current_dispatch_mode() is None and not torch.cuda.is_current_stream_capturing():
        call_key = fastlaunch.bound_key(epilogues, x, weights, biases, [v for ops in operands for v in ops])
        bound = _bound.get(call_key)
        if bound is not None:
            out = fastlaunch.new_output(1, N, x.dtype, x.device)
            bound(x, out)
            if fastlaunch.recording_open():
                fastlaunch.record(fastlaunch.output_step(bound, 1, N, x.dtype, x.device, x))
            return out
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    kernel = codegen.generated_grid_sync_kernel(len(weights) - 1, epilogues[0], epilogues[1]).fused_grid_sync_kernel
    scratch, sync = zeroed_workspace(x, "grid_sync", (H,), 2)
    args = _kernel_args(x, weights, biases, operands, out, scratch, sync, K, H, N)
    sms = sm_count(x.device)

    def grid(meta):
        return (grid_sync_programs(meta, H, N, sms),)

    if phases == 2:
        for phase in (1, 2):
            args.update({"PHASE": phase, "USE_PDL": False})
            if config is not None:
                kernel.fn[grid](**args, **config.all_kwargs())
            else:
                launch_kernel(kernel, grid, args, x)
        return out
    pdl = _pdl_supported(x)
    args.update({"PHASE": 0, "USE_PDL": pdl})
    if COOPERATIVE:
        args["launch_cooperative_grid"] = True
    if pdl:
        args["launch_pdl"] = True  # launch options (compiled into the kernel's metadata), not kernel arguments
    if config is not None:
        kernel.fn[grid](**args, **config.all_kwargs())
        return out
    launch_kernel(kernel, grid, args, x)
    bound = None
    if call_key is not None:
        bound = fastlaunch.bind(kernel, grid, args, ("x_ptr", "out_ptr"), varying=())
        if bound is not None:
            _bound.keep(call_key, bound)
    if fastlaunch.recording_open():
        fastlaunch.record(None if bound is None else fastlaunch.output_step(bound, 1, N, x.dtype, x.device, x))
    return out
