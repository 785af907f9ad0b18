"""Launcher of the Hopper TMA stage kernel (:mod:`fxfuse.kernels.tma_template`): same contract as ``run_stage``.

``run_stage_tma`` returns ``None`` whenever the TMA kernel does not apply (no Hopper GPU, a Triton without host
tensor descriptors, strides or addresses TMA cannot describe, a tracer active), so the caller falls back to
:func:`fxfuse.kernels.launch.run_stage`:

    out = run_stage_tma(x, ws, bs, ops, epi)
    if out is None:
        out = run_stage(x, ws, bs, ops, epi)
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import triton

from .. import codegen
from . import fastlaunch, tma_template
from .launch import _input_precision, _parse, _tracing, _validate, operand_args
from .template import fast_math_enabled, interpreting, m_bucket

logger = logging.getLogger(__name__)

__all__ = ["launch_with_descriptors", "run_stage_tma", "tma_applicable", "tma_supported"]

_TMA_ALIGN = 16  # bytes: TMA needs the base address and every stride but the last 16-byte aligned
_TMA_MAX_STRIDE = 1 << 40  # bytes: the largest stride a TMA descriptor can hold
_INTERPRETER_SMS = 4  # programs in the interpreter: few enough that each one walks several tiles


@functools.lru_cache(maxsize=1)
def _tensor_descriptor():
    """``triton.tools.tensor_descriptor.TensorDescriptor``, or None on a Triton without host descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


_supported: dict[torch.device, bool] = {}  # tma_supported per device: it runs on every launch


@functools.lru_cache(maxsize=16)
def _cuda_props(index: int) -> tuple[int, int]:
    """(major compute capability, SM count) of CUDA device ``index``."""
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def tma_supported(device) -> bool:
    """Whether the TMA stage kernel can run on ``device``: Hopper or newer and a Triton with ``TensorDescriptor``.

    Under ``TRITON_INTERPRET=1`` a CPU device counts as supported (the interpreter emulates TMA).

    Example:
        >>> tma_supported(torch.device("cuda"))  # doctest: +SKIP
        True
    """
    device = torch.device(device)
    ok = _supported.get(device)
    if ok is None:
        ok = _supported[device] = _tma_supported(device)
    return ok and interpreting() == (device.type == "cpu")


def _tma_supported(device: torch.device) -> bool:
    if _tensor_descriptor() is None:
        return False
    if device.type == "cpu":
        return True  # in the interpreter
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _cuda_props(_device_index(device))[0] >= 9


def _describable(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can address: last dim contiguous, 16-byte aligned base and row stride."""
    elem = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * elem) % _TMA_ALIGN == 0
            and t.data_ptr() % _TMA_ALIGN == 0)


def _pair_layout(w0: torch.Tensor, w1: torch.Tensor) -> Optional[tuple[torch.Tensor, int, bool]]:
    """``(base, dim-0 stride in elements, swapped)`` of one ``[2, N, K]`` TMA view over two weights, or None.

    The weights need not share an allocation: the view's dim-0 stride is the distance between them (the base
    is the one at the lower address; ``swapped`` when that is W1), and TMA reads only the in-bounds rows of
    each. The distance must be a positive multiple of 16 bytes, at least one whole weight (no overlap) and
    below TMA's stride limit; the row strides must match.

    Example:
        >>> packed = torch.randn(2 * 64, 32)  # Phi-3 style gate_up weight, split in two views
        >>> base, stride, swapped = _pair_layout(packed[:64], packed[64:])
        >>> base.data_ptr() == packed.data_ptr(), stride, swapped
        (True, 2048, False)
    """
    if w0.stride() != w1.stride():
        return None
    elem = w0.element_size()
    distance = w1.data_ptr() - w0.data_ptr()
    span = abs(distance)
    if span % _TMA_ALIGN or span < w0.shape[0] * w0.stride(0) * elem or span >= _TMA_MAX_STRIDE:
        return None
    return (w1, span // elem, True) if distance < 0 else (w0, span // elem, False)


def tma_applicable(x: torch.Tensor, weights) -> bool:
    """Whether ``run_stage_tma`` would launch for these (already valid) arguments rather than return None.

    Example:
        >>> x, w = torch.randn(64, 70), torch.randn(32, 70)  # K=70 floats: row stride 280 B, not 16-B aligned
        >>> tma_applicable(x, [w])
        False
    """
    if _tracing(x) or not tma_supported(x.device):
        return False
    M, K = x.shape
    N = weights[0].shape[0]
    if min(M, N, K) == 0:  # a descriptor needs positive sizes; the pointer kernel handles empty problems
        return False
    if (N * x.element_size()) % _TMA_ALIGN:  # the output's row stride
        return False
    if not all(_describable(t) for t in (x, *weights)):
        return False
    return len(weights) == 1 or _pair_layout(*weights) is not None


def run_stage_tma(x: torch.Tensor, weights, biases, operands, epilogue: str, *,
                  check: bool = True, config: Optional[triton.Config] = None) -> Optional[torch.Tensor]:
    """``epilogue(x @ W0^T + b0[, x @ W1^T + b1], v0, ...)`` with the persistent TMA kernel, or None.

    Same arguments and result as :func:`fxfuse.kernels.launch.run_stage`; additionally x and the weights
    must have a contiguous last dim and 16-byte aligned addresses and row strides, N * itemsize must be
    a multiple of 16 (the output's row stride), and two weights must fit one ``[2, N, K]`` TMA view (see
    :func:`_pair_layout`: true of separate parameters and of the halves of a packed gate_up weight). Returns
    ``None`` when that, or :func:`tma_supported`, does not hold, or when a tracer (FakeTensor, make_fx) is
    active: the caller then runs ``run_stage``. ``config`` runs that config (one of ``tma_template.sweep_configs()``,
    pruned) instead of the autotuned choice (probes).

    Raises:
        ValueError: bad shapes, dtypes, devices or epilogue (with ``check``), as ``run_stage`` does.

    Example:
        >>> x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> w = torch.randn(3072, 768, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> run_stage_tma(x, [w], [None], [], "gelu_tanh(a0)").shape  # doctest: +SKIP
        torch.Size([8192, 3072])
    """
    if check:
        _validate(x, weights, biases, operands, _parse(epilogue))
    if not tma_applicable(x, weights):
        return None
    TensorDescriptor = _tensor_descriptor()
    (M, K), N = x.shape, weights[0].shape[0]
    module = codegen.generated_tma_kernel(len(weights), epilogue)
    kernel = module.fused_stage_tma_kernel
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    num_sms = _INTERPRETER_SMS if x.device.type == "cpu" else _cuda_props(_device_index(x.device))[1]

    # Block shapes are placeholders: each config's pre_hook (tma_template.set_block_shapes) sets its own.
    def desc(t: torch.Tensor):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])

    args = {
        "x_desc": desc(x),
        "w_desc": desc(weights[0]),
        "b0_ptr": biases[0] if biases[0] is not None else x,  # any valid pointer; unread
        "out_desc": desc(out),
        "M": M,
        "N": N,
        "K": K,
        "M_BUCKET": m_bucket(M),
        "stride_b0": biases[0].stride(0) if biases[0] is not None else 0,
        "HAS_BIAS0": biases[0] is not None,
        "DTYPE": str(x.dtype).removeprefix("torch."),
        "INPUT_PRECISION": _input_precision(x.dtype),
        # Hardware tanh where its error (2^-11) is below the output's rounding (bf16: 2^-9); not in the interpreter.
        "FAST_MATH": module.HAS_FAST_FORMS and x.dtype == torch.bfloat16 and x.device.type == "cuda"
        and fast_math_enabled(),
    }
    if len(weights) == 2:
        base, pair_stride, swapped = _pair_layout(*weights)
        args.update({
            "w_desc": TensorDescriptor(base, [2, N, K], [pair_stride, weights[0].stride(0), 1], [2, 16, 16]),
            "b1_ptr": biases[1] if biases[1] is not None else x,
            "stride_b1": biases[1].stride(0) if biases[1] is not None else 0,
            "HAS_BIAS1": biases[1] is not None,
            "SWAP_PAIR": swapped,
        })
    args.update(operand_args(operands))

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(meta["CTAS_PER_SM"] * num_sms, tiles),)

    if config is not None:  # one variant, bypassing the autotuner and its pre-hook
        full = {**args, **config.all_kwargs()}
        tma_template.set_block_shapes(full)
        kernel.fn[grid](**full)
    elif x.device.type == "cuda":
        lean = _lean_launcher(kernel)
        lean.launch(grid, args)
        if fastlaunch.recording_open():
            fastlaunch.record(_bound_step(lean, grid, args, out))
    else:
        kernel[grid](**args)
    return out


class _Address:
    """A stand-in ``base`` for a descriptor of a weight: its address, dtype and GPU, no reference to the tensor.
    It answers what the lean launcher's key reads of a descriptor's base (:meth:`_TmaLeanLauncher.other_key`)."""

    __slots__ = ("address", "dtype", "device_index")

    def __init__(self, t: torch.Tensor):
        self.address, self.dtype, self.device_index = t.data_ptr(), t.dtype, t.get_device()

    def data_ptr(self) -> int:
        return self.address

    def get_device(self) -> int:
        return self.device_index


def _bound_step(lean: _TmaLeanLauncher, grid, args: dict, out: torch.Tensor):
    """This launch as a replay step (:mod:`fxfuse.replay`), or None: a launch bound to everything but x and
    out, whose descriptors are made per call with the block shapes of the config this signature runs. The
    weight descriptor points at the weights by address (the replay's key checks it), keeping nothing alive."""
    meta = lean.entry_meta(args)
    if meta is None:
        return None
    TensorDescriptor = _tensor_descriptor()
    full = {**args, **meta}
    tma_template.set_block_shapes(full)  # fills the block shapes of this call's descriptors

    def by_address(d):  # the same descriptor over a stand-in base: the binding keeps no tensor alive
        return TensorDescriptor(_Address(d.base), list(d.shape), list(d.strides), list(d.block_shape))

    # x and out are the slots (replaced on every call); their placeholders must not hold this call's tensors.
    weak = dict(args, x_desc=by_address(args["x_desc"]), w_desc=by_address(args["w_desc"]),
                out_desc=by_address(args["out_desc"]))
    bound = lean.bind(grid, weak, ("x_desc", "out_desc"))
    if bound is None:
        return None
    x_block, out_block = list(args["x_desc"].block_shape), list(args["out_desc"].block_shape)
    n, dtype, device = out.shape[1], out.dtype, out.device

    def step(h: torch.Tensor) -> torch.Tensor:
        o = torch.empty(h.shape[0], n, dtype=dtype, device=device)  # unpacked: see fastlaunch.new_output
        bound(_unchecked(TensorDescriptor, h, x_block), _unchecked(TensorDescriptor, o, out_block))
        return o

    return step


def _unchecked(cls, t: torch.Tensor, block: list) -> object:
    """``cls(t, shape, strides, block)`` without its checks (~1 µs of a replayed launch's host time): a replay's x
    has the layout and alignment its key fixed, and its out is a fresh contiguous tensor."""
    d = object.__new__(cls)
    d.__dict__.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=block)
    return d


class _TmaLeanLauncher(fastlaunch.LeanLauncher):
    """The lean launch path (:mod:`.fastlaunch`) for the TMA kernel: a descriptor is keyed by its tensor.

    Triton specializes a host ``TensorDescriptor`` on its dtype and block shape only; the block shape follows
    from the config, which the autotuning key (part of the signature, by value) fixes; and the compiled launcher
    encodes the TMA descriptor from the kernel's metadata, not from ``block_shape``. So a repeated launch can
    skip the autotuner, its ``pre_hook`` and the binder (Triton's Python path costs ~50 µs with descriptors).
    """

    pre_hook_is_launch_free = True  # set_block_shapes only fills block_shape, which the launcher does not read

    def other_key(self, value) -> Optional[tuple]:
        # A descriptor is keyed as its tensor is: dtype, 16-byte alignment and GPU.
        if type(value) is _tensor_descriptor():
            return (value.base.dtype, value.base.data_ptr() % 16 == 0, value.base.get_device())
        return None


def _lean_launcher(kernel, varying: tuple = ("M",)) -> _TmaLeanLauncher:
    lean = getattr(kernel, "_fxfuse_tma_lean", None)
    if lean is None:
        lean = kernel._fxfuse_tma_lean = _TmaLeanLauncher(kernel, varying=varying)
    return lean


def launch_with_descriptors(kernel, grid, args: dict, varying: tuple = ()) -> None:
    """:func:`fxfuse.kernels.fastlaunch.launch` for a kernel that takes host TMA descriptors (its configs' pre-hooks
    only set the descriptors' block shapes): Triton's path on a GPU's first launch of a signature, then the lean
    one (the interpreter always takes Triton's: it records nothing there)."""
    _lean_launcher(kernel, varying).launch(grid, args)
