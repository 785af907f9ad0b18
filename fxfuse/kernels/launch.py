"""Python wrapper that validates one stage's arguments and launches its generated Triton kernel.

Meant to be called inside a ``torch.library.triton_op``: it reads only sizes, strides and dtypes,
allocates its output with ``torch.empty`` and launches through ``torch.library.wrap_triton``, so it
traces with FakeTensors (``torch.compile`` / ``make_fx``) as well as it runs eagerly.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
from torch.library import wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import codegen  # module import: codegen imports .template, which runs this package
from .. import epilogue as ep
from . import fastlaunch
from .template import interpreting as _interpreting
from .template import m_bucket

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_DTYPES", "check_placement", "launch_kernel", "operand_args", "run_stage"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1  # the kernel indexes with int32 offsets


@functools.lru_cache(maxsize=512)
def _parse(epilogue: str) -> ep.Expr:
    # The forward path calls this with the same few strings; expressions are frozen dataclasses.
    return ep.parse(epilogue)


def _check_extent(t: torch.Tensor, name: str) -> None:
    # Largest element offset the kernel can form: sum of (size - 1) * stride (torch strides are >= 0).
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    if extent > _INT32_MAX:
        raise ValueError(f"{name} spans more than 2**31 elements; int32 indexing would overflow")


def _validate(x, weights, biases, operands, expr) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, K], got shape {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}")
    if not 1 <= len(weights) <= 2:
        raise ValueError(f"a stage has 1 or 2 weights, got {len(weights)}")
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases (use None for no bias)")
    n_acc, n_ops = ep.num_accumulators(expr), ep.num_operands(expr)
    if n_acc != len(weights):
        raise ValueError(f"epilogue {expr} uses {n_acc} accumulator(s) but {len(weights)} weight(s) were given")
    if len(operands) != n_ops:
        raise ValueError(f"epilogue {expr} uses {n_ops} operand(s) but {len(operands)} were given")
    M, K = x.shape
    N = weights[0].shape[0] if weights[0].dim() == 2 else -1
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != K or w.shape[0] != N:
            raise ValueError(f"weight {i} has shape {tuple(w.shape)}, expected [N={N}, K={K}] for x of shape "
                             f"{tuple(x.shape)}")
        if w.dtype != x.dtype:
            raise ValueError(f"weight {i} dtype {w.dtype} differs from x dtype {x.dtype}")
    for i, b in enumerate(biases):
        if b is None:
            continue
        if b.dim() != 1 or b.shape[0] != N:
            raise ValueError(f"bias {i} has shape {tuple(b.shape)}, expected [{N}]")
        if b.dtype != x.dtype:
            raise ValueError(f"bias {i} dtype {b.dtype} differs from x dtype {x.dtype}")
    for i, v in enumerate(operands):
        if not (v.numel() == 1 or (v.dim() == 1 and v.shape[0] == N)):
            raise ValueError(f"operand v{i} has shape {tuple(v.shape)}, expected [{N}] or a single element")
        if v.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"operand v{i} dtype {v.dtype} must be {x.dtype} or torch.float32")
    check_placement(x, weights, [*(b for b in biases if b is not None), *operands])
    if M * N > _INT32_MAX:
        raise ValueError(f"output [{M}, {N}] has more than 2**31 elements; int32 indexing would overflow")
    return M, N, K


def check_placement(x: torch.Tensor, weights, others) -> None:
    """Every tensor on x's device, a CUDA one (or the interpreter), and x and the weights int32-indexable."""
    tensors = [x, *weights, *others]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if x.device.type != "cuda" and not _interpreting():
        raise ValueError(f"the Triton kernel needs a CUDA device (x is on {x.device}); "
                         "set TRITON_INTERPRET=1 to run it on the CPU")
    for name, t in [("x", x), *((f"weight {i}", w) for i, w in enumerate(weights))]:
        _check_extent(t, name)


def operand_args(operands, prefix: str = "v") -> dict:
    """Kernel arguments ``{prefix}{i}_ptr`` / ``stride_{prefix}{i}`` of epilogue operands (one element: stride 0)."""
    args = {}
    for i, v in enumerate(operands):
        args[f"{prefix}{i}_ptr"] = v
        args[f"stride_{prefix}{i}"] = 0 if v.numel() == 1 else v.stride(0)  # a single element is broadcast
    return args


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 matches eager: exact FMA ("ieee") unless the user opted into TF32 for matmuls.
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee" if dtype == torch.float32 else "tf32"


def _traced_in_interpreter(x: torch.Tensor) -> bool:
    """True when the interpreter would be handed FakeTensors or a tracer's tensors.

    On a GPU ``wrap_triton`` turns the launch into a graph node; under ``TRITON_INTERPRET=1`` it is a
    pass-through, so tracing (FakeTensor, make_fx, AOTAutograd) must not reach the interpreter.
    """
    from torch._subclasses.fake_tensor import is_fake

    return _interpreting() and (is_fake(x) or _get_current_dispatch_mode() is not None)


def _torch_stage(x, weights, biases, operands, expr) -> torch.Tensor:
    """The same stage in torch ops (fp32 math, one cast): traceable, so a traced graph stays correct."""
    accs = [torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            for w, b in zip(weights, biases)]
    return ep.evaluate(expr, accs, [v.float().reshape(-1) for v in operands]).to(x.dtype).contiguous()


def run_stage(x: torch.Tensor, weights, biases, operands, epilogue: str, *, check: bool = True) -> torch.Tensor:
    """``epilogue(x @ W0^T + b0[, x @ W1^T + b1], v0, ...)`` in one generated Triton kernel.

    Args:
        x: ``[M, K]``, any strides (a transposed or sliced view is read in place).
        weights: one or two ``[N, K]`` tensors, any strides (a ``[K, N]`` parameter can be passed as ``.t()``).
            Two weights make a gated stage: each x tile is loaded once for both GEMMs.
        biases: one entry per weight, ``[N]`` or ``None``; added to the fp32 accumulator.
        operands: 1-D tensors of N elements, or single elements (broadcast), named ``v0, v1, ...`` in the
            epilogue; same dtype as x or fp32.
        epilogue: canonical epilogue text (:mod:`fxfuse.epilogue`) over ``a0[, a1]`` and the operands.
        check: validate the arguments first. ``torch.ops.fxfuse.mlp`` checks them once per call itself
            and passes False: this runs on every forward.

    Returns:
        A new contiguous ``[M, N]`` tensor with x's dtype (fp32, fp16 or bf16).

    Under ``TRITON_INTERPRET=1`` (CPU), FakeTensors or an active tracing mode get the same math in torch
    ops instead of the kernel (the interpreter cannot be traced); on a GPU the launch is always traced
    as a ``triton_kernel_wrapper`` node.

    Raises:
        ValueError: bad shapes, dtypes, devices or epilogue (the caller falls back to eager).

    Example:
        >>> x, w = torch.randn(8, 32, device="cuda"), torch.randn(64, 32, device="cuda")  # doctest: +SKIP
        >>> run_stage(x, [w], [None], [], "gelu_tanh(a0)").shape  # doctest: +SKIP
        torch.Size([8, 64])
    """
    if check:
        M, N, K = _validate(x, weights, biases, operands, _parse(epilogue))
    else:
        (M, K), N = x.shape, weights[0].shape[0]
    kernel = codegen.generated_kernel(len(weights), epilogue).fused_stage_kernel
    if _interpreting() and _traced_in_interpreter(x):
        return _torch_stage(x, weights, biases, operands, _parse(epilogue))
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out

    gated = len(weights) == 2
    args = {
        "x_ptr": x,
        "w0_ptr": weights[0],
        "b0_ptr": biases[0] if biases[0] is not None else x,  # any valid pointer; unread
        "out_ptr": out,
        "M": M,
        "N": N,
        "K": K,
        "M_BUCKET": m_bucket(M),
        "stride_xm": x.stride(0),
        "stride_xk": x.stride(1),
        "stride_w0n": weights[0].stride(0),
        "stride_w0k": weights[0].stride(1),
        "stride_b0": biases[0].stride(0) if biases[0] is not None else 0,
        "stride_om": out.stride(0),
        "stride_on": out.stride(1),
        "HAS_BIAS0": biases[0] is not None,
        "INPUT_PRECISION": _input_precision(x.dtype),
    }
    if gated:
        args.update({
            "w1_ptr": weights[1],
            "b1_ptr": biases[1] if biases[1] is not None else x,
            "stride_w1n": weights[1].stride(0),
            "stride_w1k": weights[1].stride(1),
            "stride_b1": biases[1].stride(0) if biases[1] is not None else 0,
            "HAS_BIAS1": biases[1] is not None,
        })
    args.update(operand_args(operands))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    launch_kernel(kernel, grid, args, x)
    if fastlaunch.recording_open():  # a replay step (fxfuse.replay): this launch bound to all but x and out
        bound = fastlaunch.bind(kernel, grid, args, ("x_ptr", "out_ptr")) if fastlaunch.may_bind(x) else None
        fastlaunch.record(None if bound is None else fastlaunch.output_step(bound, M, N, x.dtype, x.device, x))
    return out


def _tracing(x: torch.Tensor) -> bool:
    return type(x) not in (torch.Tensor, torch.nn.Parameter) or _get_current_dispatch_mode() is not None


def launch_kernel(kernel, grid, args: dict, x: torch.Tensor) -> None:
    """``kernel[grid](**args)``, the way that suits ``x``.

    A tracer (FakeTensor, FunctionalTensor, make_fx) gets a ``wrap_triton`` node. Eager calls launch
    directly: through ``wrap_triton`` they would take the slow higher-order-op path. On a GPU, repeated
    launches with the same signature skip Triton's Python launch path (:mod:`.fastlaunch`).
    """
    if _tracing(x):
        wrap_triton(kernel)[grid](**args)
    elif x.device.type == "cuda":
        fastlaunch.launch(kernel, grid, args)
    else:
        kernel[grid](**args)
