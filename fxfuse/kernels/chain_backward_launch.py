"""Python wrappers of the fused-chain backward kernels: the one-kernel backward of a chain whose gradients fit
on chip (:mod:`fxfuse.kernels.chain_backward_template`), and a wide chain's forward-storing, walk and dW GEMMs
(:mod:`fxfuse.kernels.chain_walk_template`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch
import triton

from .. import codegen
from . import fastlaunch
from .chain_backward_template import gradient_layout, stores_gradient, walks
from .chain_launch import _num_sms, run_chain
from .chain_template import pad_width
from .chain_walk_template import walk_inputs
from .launch import _input_precision, launch_kernel
from .template import m_bucket

__all__ = ["ChainGradients", "run_chain_backward"]

logger = logging.getLogger(__name__)

# Backward launches bound to all but their per-call tensors, with their program count, by :func:`_bound_key`.
_bound_launches = fastlaunch.Bindings()

ChainGradients = tuple[Optional[torch.Tensor], list[torch.Tensor], list[Optional[torch.Tensor]]]


def run_chain_backward(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                       dy: torch.Tensor, epilogues: tuple[str, ...], need_dx: bool = True,
                       config: Optional[triton.Config] = None, walk: Optional[bool] = None,
                       saved: Optional[Sequence[torch.Tensor]] = None) -> ChainGradients:
    """Gradients of a narrow chain (``fused_chain``'s math): ``(dx, [dW_i], [db_i])``.

    Where the padded weight gradients fit in registers (:func:`walks` is False for the widths), one kernel
    recomputes the forward on chip from ``x`` and produces every gradient, so nothing but the op's inputs needs
    saving. Otherwise (the walk) the fused forward writes each layer's input, the walk kernel each layer's
    activation gradient, and each dW is one GEMM over the two (eager's dW, computed the same way). The bias (and
    in-register weight) gradients are summed in fp32 (per program, then over programs: deterministic) and
    returned in their parameter's dtype; ``dx`` (None unless ``need_dx``) in ``x``'s.

    Args:
        x: ``[M, D0]``, any strides; dy: ``[M, D_last]``, any strides, x's dtype.
        weights: one ``[D_{i+1}, D_i]`` weight per stage; biases: ``[D_{i+1}]`` or None per stage.
        epilogues: one canonical epilogue per stage, each with a derivative (see ``backward_fits``).
        config: run this variant (one of ``chain_backward_configs()``, or of ``chain_walk_configs()`` for the
            walk) instead of the autotuned choice.
        walk: take the walk (True) or the one kernel (False) whatever the widths (tests and probes).
        saved: for the walk, the forward's stored layer inputs ``h_1 .. h_{L-1}`` (``run_chain(..., hidden=...)``)
            and, where the walk reads it (``walk_inputs``), its output, all ``[M, D_i]`` in x's dtype: then the
            walk does not run the forward again.

    Example:
        >>> epilogues = ("relu(a0)", "a0")
        >>> dx, (dw1, dw2), (db1, db2) = run_chain_backward(x, [w1, w2], [b1, b2], dy, epilogues)  # doctest: +SKIP
    """
    dims = [x.shape[1]] + [w.shape[0] for w in weights]
    epilogues = tuple(epilogues)
    if walks(dims) if walk is None else walk:
        return _run_walk(x, weights, biases, dy, epilogues, need_dx, config, saved)
    off_w, off_b, total = gradient_layout(dims, [b is not None for b in biases])
    offsets = {f"OFF_W{i}": o for i, o in enumerate(off_w)}
    dx, sums = _backward_sums(lambda: codegen.generated_chain_backward_kernel(epilogues).fused_chain_backward_kernel,
                              "one kernel", x, weights, biases, dy, epilogues, dims, off_b, total, need_dx, offsets,
                              config)
    sums = _cast_once(sums, weights, biases)
    grad_w = [_in_dtype(sums[o:o + w.numel()].view(w.shape), w.dtype) for o, w in zip(off_w, weights)]
    return dx, grad_w, _bias_grads(sums, off_b, biases)


def _run_walk(x, weights, biases, dy, epilogues, need_dx, config, saved=None) -> ChainGradients:
    """A wide chain's gradients (:mod:`fxfuse.kernels.chain_walk_template`): the fused forward storing every
    layer's input (unless ``saved`` has them), the walk writing every activation gradient, then one dW GEMM per
    layer."""
    M, layers = x.shape[0], len(weights)
    dims = [x.shape[1]] + [w.shape[0] for w in weights]
    reads = walk_inputs(epilogues)
    if saved is None:
        hidden = [torch.empty((M, d), dtype=x.dtype, device=x.device) for d in dims[1:-1]]
        out = run_chain(x, weights, biases, [[] for _ in weights], epilogues, hidden=hidden)
        saved = [*hidden, out] if layers in reads else hidden  # unread, the output's memory is the walk's
    inputs = [x, *saved]
    grads = [torch.empty((M, dims[i + 1]), dtype=x.dtype, device=x.device) if stores_gradient(epilogues, i)
             else dy for i in range(layers)]
    _, off_b, total = gradient_layout(dims, [b is not None for b in biases], weights=False)
    stores = {f"hs{i}_ptr": inputs[i] for i in reads if i > 0}
    stores.update({f"ds{i}_ptr": g for i, g in enumerate(grads) if g is not dy})
    dx, sums = _backward_sums(lambda: codegen.generated_chain_walk_kernel(epilogues).chain_backward_walk_kernel,
                              "walk", x, weights, biases, dy, epilogues, dims, off_b, total, need_dx, stores, config)
    sums = _cast_once(sums, weights, biases)
    grad_w = [torch.mm(g.t(), h) for g, h in zip(grads, inputs)]  # eager's dW, in the (one) dtype
    return dx, grad_w, _bias_grads(sums, off_b, biases)


def _backward_sums(kernel_of, kind: str, x, weights, biases, dy, epilogues, dims, off_b, total, need_dx,
                   extra: dict, config) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """Launch a persistent backward kernel (``kernel_of()``; ``extra``: its arguments besides the common ones):
    ``(dx or None, the fp32 sums of its partials)``.

    After the first launch at a layout, the launch bound to all but its tensors that change from call to call
    (:func:`.fastlaunch.bind`): the argument dict of ~60 entries, the signature and the lookup cost ~80 µs of
    host per step on the H200 machine, more than nerf64's step leaves the host on a slow one.
    """
    moving = {k: v for k, v in extra.items() if isinstance(v, torch.Tensor)}
    key = _bound_key(kind, x, weights, biases, dy, epilogues, need_dx, moving.values()) if config is None else None
    bound = _bound_launches.get(key) if key is not None else None
    M = x.shape[0]
    if bound is not None:
        launch, programs = bound
        partials = torch.empty((programs, total), dtype=torch.float32, device=x.device)
        dx = torch.empty((M, dims[0]), dtype=x.dtype, device=x.device) if need_dx else None
        launch(x, dy, x if dx is None else dx, partials, *moving.values())
        return dx, partials.sum(0)
    kernel = kernel_of()
    dx, partials, args = _common_args(x, weights, biases, dy, dims, off_b, total, need_dx)
    args.update(extra)
    grid, programs = _persistent_grid(M, x.device, partials.shape[0])
    sums = _launch(kernel, grid, programs, args, config, x, partials)
    if key is not None:
        launch = fastlaunch.bind(kernel, grid, args, ("x_ptr", "dy_ptr", "dx_ptr", "part_ptr", *moving))
        if launch is not None:  # (binding ran the grid with the chosen config: programs is its count)
            _bound_launches.keep(key, (launch, programs[0]))
    return dx, sums


def _bound_key(kind, x, weights, biases, dy, epilogues, need_dx, moving) -> Optional[tuple]:
    """What a bound backward launch depends on (:func:`.fastlaunch.bound_key`, with dy's layout and the moving
    tensors' alignment), or None where launches are not bound (off the GPU, a launch hook, a CUDA graph capture).
    The moving tensors other than dy are fresh ``[M, D_i]`` buffers: M and the widths fix their layout."""
    if not fastlaunch.may_bind(x):
        return None
    tag = (kind, epilogues, need_dx, dy.shape, dy.stride(), dy.dtype, dy.data_ptr() % 16 == 0,
           tuple(t.data_ptr() % 16 == 0 for t in moving))
    return fastlaunch.bound_key(tag, x, weights, biases)


def _common_args(x, weights, biases, dy, dims, off_b, total, need_dx):
    """``dx`` (or None), the fp32 partial-sum buffer and the arguments both backward kernels take."""
    M = x.shape[0]
    max_programs = max(1, min(triton.cdiv(M, 16), _num_sms(x.device) * 4))  # the grid's bound over all configs
    partials = torch.empty((max_programs, total), dtype=torch.float32, device=x.device)
    dx = torch.empty((M, dims[0]), dtype=x.dtype, device=x.device) if need_dx else None
    args: dict = {"x_ptr": x, "dy_ptr": dy, "dx_ptr": dx if need_dx else x, "part_ptr": partials, "M": M,
                  "M_BUCKET": m_bucket(M), "stride_xm": x.stride(0), "stride_xk": x.stride(1),
                  "stride_dym": dy.stride(0), "stride_dyn": dy.stride(1),
                  "stride_dxm": dx.stride(0) if need_dx else 0, "stride_dxk": dx.stride(1) if need_dx else 0,
                  "TOTAL": total, "NEED_DX": need_dx, "INPUT_PRECISION": _input_precision(x.dtype)}
    for i, (w, b) in enumerate(zip(weights, biases)):
        args[f"w{i}_ptr"] = w
        args[f"stride_w{i}n"], args[f"stride_w{i}k"] = w.stride(0), w.stride(1)
        args[f"b{i}_ptr"] = b if b is not None else w  # any valid pointer; unread without bias
        args[f"stride_b{i}"] = b.stride(0) if b is not None else 0
        args[f"HAS_BIAS{i}"] = b is not None
        args[f"OFF_B{i}"] = off_b[i]
    for i, d in enumerate(dims):
        args[f"D{i}"], args[f"P{i}"] = d, pad_width(d)
    return dx, partials, args


def _persistent_grid(M: int, device: torch.device, max_programs: int):
    """A persistent backward kernel's grid, and a list whose one item is the program count of its last use."""
    programs = [max_programs]

    def grid(meta):
        # Persistent: PER_SM programs per SM, at most one per block of rows. Each writes its row of partials,
        # so only the rows of the launch that ran (the autotuner's last) are summed.
        programs[0] = max(1, min(triton.cdiv(M, meta["BLOCK_M"]), _num_sms(device) * meta["PER_SM"], max_programs))
        return (programs[0],)

    return grid, programs


def _launch(kernel, grid, programs: list[int], args: dict, config: Optional[triton.Config], x: torch.Tensor,
            partials: torch.Tensor):
    """Launch a persistent backward kernel (``config``, or the autotuned choice) on ``grid``
    (:func:`_persistent_grid`); the fp32 sums of its partials."""
    if config is not None:  # one variant, bypassing the autotuner (tests and probes)
        compiled = kernel.fn[grid](**args, **config.all_kwargs())
        logger.debug("chain backward %s: %s registers, %s spilled, %s B shared memory", config,
                     getattr(compiled, "n_regs", "?"), getattr(compiled, "n_spills", "?"),
                     getattr(getattr(compiled, "metadata", None), "shared", "?"))
    else:
        launch_kernel(kernel, grid, args, x)
    return partials[:programs[0]].sum(0)


def _cast_once(sums: torch.Tensor, weights, biases) -> torch.Tensor:
    dtypes = {t.dtype for t in (*weights, *biases) if t is not None}
    # One cast for all where the parameters share a dtype (each .to after it is then a no-op): a launch, not
    # one per gradient.
    return sums.to(dtypes.pop()) if len(dtypes) == 1 else sums


def _bias_grads(sums, off_b, biases) -> list:
    return [None if b is None else _in_dtype(sums[o:o + b.numel()], b.dtype) for o, b in zip(off_b, biases)]


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A .to that changes nothing still costs a dispatch: a few µs of host each, on every training step.
    return t if t.dtype == dtype else t.to(dtype)
