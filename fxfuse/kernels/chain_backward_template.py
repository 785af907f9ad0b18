"""Source generator for the fused-chain BACKWARD kernel: a narrow chain's gradients in one launch.

The forward op saves only its inputs. This kernel gets ``x``, the weights and ``dy`` and, per block of rows:

1. recomputes the forward on chip (the chain kernel's math: fp32 accumulators, each intermediate rounded to
   the activation dtype as eager does);
2. walks back through the layers: ``d_i = (g * act_i'(a_i))`` rounded to the dtype (eager's grad of the
   activation), ``dW_i += d_i^T @ h_i`` and ``db_i += sum(d_i)`` into fp32 accumulators that stay in
   registers for the whole program, ``g = d_i @ W_i`` (rounded) for the layer below, and ``dx`` at the end;
3. after its last block, writes its fp32 ``dW``/``db`` partial sums to its row of a ``[programs, TOTAL]``
   buffer, which the launcher sums over programs (deterministic: no atomics).

So no intermediate ever reaches memory: a step reads x, dy and the weights and writes dx and one partial
gradient per program, where eager writes and reads every activation and its gradient. The programs are
persistent (``PER_SM`` per SM) so each holds its weights and accumulators once.

Wider chains do not fit: nerf128's 64-128-128-128-64 weights need 49152 fp32 accumulators, three times what a
program's registers hold beside the intermediates. Their backward (:func:`walks`) is the forward storing each
layer's input, a walk kernel writing each activation gradient (:mod:`fxfuse.kernels.chain_walk_template`) and
one dW GEMM per layer, as eager computes dW (and as tiny-cuda-nn's fully fused MLPs do).

Activations with a derivative here (:data:`DERIVATIVES`): identity, relu (from its output, like eager's
``threshold_backward``), silu, sigmoid, tanh, gelu (erf and tanh forms; from the pre-activation rounded to
the dtype, like eager's saved linear output); any other epilogue over one accumulator built from smooth ops
(SIREN's sin, QuickGELU) from the pre-activation, its derivative written by :mod:`fxfuse.derivative`. Epilogues
with a kink inside a larger expression, or with operands, keep the op's generic backward.

Example:
    >>> src = render_chain_backward(["relu(a0)", "a0"])
    >>> src.count("tl.dot(")  # forward: layer 0 (the identity's output is not needed); dW and dh of each layer
    5
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import triton

from .. import epilogue as ep
from ..derivative import derivative_text
from .chain_template import MAX_CHAIN_WIDTH, pad_width
from .fast_math import IMPORT_LINE, epilogue_lines, uses_trig
from .template import autotune_enabled
from .template import interpreting as _interpreting

__all__ = ["CHAIN_BACKWARD_TEMPLATE_VERSION", "DERIVATIVES", "MAX_BACKWARD_WIDTH", "backward_fits", "canonical",
           "chain_backward_configs", "derivative_kind", "gradient_layout", "gradient_lines", "render_chain_backward",
           "stores_gradient", "walks"]

CHAIN_BACKWARD_TEMPLATE_VERSION = 4

# act'(a) times the incoming gradient g, as Triton on fp32 values. "out": from the activation's output h
# (the dtype-rounded value the next layer reads); "pre": from the pre-activation a rounded to the dtype.
DERIVATIVES: dict[str, tuple[str, str]] = {
    "a0": ("out", "{g}"),
    "relu(a0)": ("out", "tl.where({h} <= 0.0, 0.0, {g})"),  # (NaN passes the gradient, as in eager)
    "sigmoid(a0)": ("out", "{g} * {h} * (1.0 - {h})"),
    "tanh(a0)": ("out", "{g} * (1.0 - {h} * {h})"),
    "silu(a0)": ("pre", "{g} * tl.sigmoid({a}) * (1.0 + {a} * (1.0 - tl.sigmoid({a})))"),
    "gelu(a0)": ("pre", "{g} * (0.5 * (1.0 + tl.erf({a} * 0.7071067811865476))"
                        " + {a} * 0.3989422804014327 * tl.exp(-0.5 * {a} * {a}))"),
    # u = c (a + 0.044715 a^3), t = tanh(u): 0.5 (1 + t) + 0.5 a (1 - t^2) c (1 + 3 * 0.044715 a^2)
    "gelu_tanh(a0)": ("pre", "{g} * _gelu_tanh_grad({a})"),
}



def derivative_kind(epilogue: str) -> Optional[str]:
    """How the backward gets act'(a) for this canonical epilogue: "out" (from the activation's output), "pre" (from
    the pre-activation rounded to the dtype: :data:`DERIVATIVES`'s GELU and SiLU, and every epilogue whose
    derivative :func:`fxfuse.derivative.derivative_text` writes), or None (no derivative: the generic backward).

    Example:
        >>> derivative_kind("relu(a0)"), derivative_kind("sin(mul(30.0,a0))"), derivative_kind("abs(a0)")
        ('out', 'pre', None)
    """
    if epilogue in DERIVATIVES:
        return DERIVATIVES[epilogue][0]
    return "pre" if derivative_text(epilogue) is not None else None


def gradient_lines(epilogue: str, g: str, h: str, a: str, prefix: str, is_fp32: str) -> tuple[list[str], str]:
    """Triton lines and the expression of act'(a) * g for this canonical epilogue, on fp32 values ``g`` (the
    incoming gradient), ``h`` (the activation's output) and ``a`` (the pre-activation); ``prefix`` names the
    lines' temporaries; ``is_fp32``: a compile-time Triton condition, the gradients are fp32 (16-bit ones take the
    hardware's sine and cosine: :mod:`fxfuse.kernels.fast_math`)."""
    if epilogue in DERIVATIVES:
        return [], DERIVATIVES[epilogue][1].format(g=g, h=h, a=a)
    text = derivative_text(epilogue)
    if text is None:
        raise ValueError(f"no derivative for {epilogue}")
    lines, result = epilogue_lines(ep.parse(text), [a], [], prefix, is_fp32)
    return lines, f"{g} * {result}"


_HELPERS = '''\
@triton.jit
def _gelu_tanh_grad(a):
    u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)


'''

# The fp32 dW accumulators of all layers live in registers for the whole program: at most this many elements
# (nerf64's 32-64-64-64-16 chain holds 11264); a wider chain's backward is the walk (``walks``).
MAX_GRADIENT_ELEMENTS = 16 * 1024
# The widest layer the backward kernel takes: its weight tiles and [BLOCK_M, width] intermediates live on
# chip (a 256-wide layer's 128 KB fp16 weight tile would not).
MAX_BACKWARD_WIDTH = 128
# All the chain's padded weight tiles, in bytes: nerf128's in fp16 are 96 KB; in fp32 (192 KB) the kernel asked
# for 272 KB of shared memory on the H200 (227 KB there).
MAX_BACKWARD_WEIGHT_BYTES = 128 * 1024

_HEADER = '''\
# Generated by fxfuse (chain backward template version {version}). Do not edit: regenerated from
# fxfuse/kernels/chain_backward_template.py whenever it is missing or differs.
#
#   layers:    {layers}
#   epilogues: {epilogues}
#
# Gradients of out = stage_{last}( ... stage_0(x) ... ), stage_i(h) = epilogue_i(h @ W_i^T + b_i): the forward
# recomputed on chip, then dx, and per-program fp32 partial sums of every dW_i and db_i.
import triton
import triton.language as tl

from fxfuse.kernels.chain_backward_template import chain_backward_configs, prune_chain_backward_configs
from fxfuse.kernels.tuning import autotune

EPILOGUES = {epilogue_list!r}


'''

_DOC = '''\
    """Gradients of the chain for the row blocks ``pid, pid + programs, ...``.

    x_ptr:     input ``[M, D0]`` (``stride_xm``, ``stride_xk``); dy_ptr: output gradient ``[M, D{layers}]``
               (``stride_dym``, ``stride_dyn``); dx_ptr: input gradient ``[M, D0]`` (``stride_dxm``,
               ``stride_dxk``), written only if ``NEED_DX`` (otherwise any valid pointer).
    w{{i}}_ptr:  layer i weight ``[D{{i+1}}, D{{i}}]`` (``stride_w{{i}}n``, ``stride_w{{i}}k``); b{{i}}_ptr: its bias
               ``[D{{i+1}}]`` (``stride_b{{i}}``), read only if ``HAS_BIAS{{i}}``.
    part_ptr:  fp32 ``[programs, TOTAL]``, contiguous: this program's row gets dW_i (row-major ``[D{{i+1}}, D{{i}}]``)
               at ``OFF_W{{i}}`` and db_i at ``OFF_B{{i}}``, every element written.
    M:         rows; M_BUCKET: power-of-2 bucket of M (autotuning key only).
    D{{i}}:      true widths; P{{i}}: the same padded to a power of two >= 16 (tile sizes).
    INPUT_PRECISION: ``tl.dot`` precision for fp32 inputs; BLOCK_M: rows per block;
    RELOAD_WEIGHTS: load the weight tiles for every block (from L1/L2) instead of once per program;
    PER_SM:    programs per SM (read by the launcher's grid only).
    """
'''


def backward_fits(epilogues: Sequence[str], widths: Sequence[int], elem_size: int = 2) -> bool:
    """Whether the backward kernel takes this chain: every epilogue has a derivative here, no layer is wider
    than :data:`MAX_BACKWARD_WIDTH`, and the padded weights (``elem_size`` bytes each) fit on chip.

    Example:
        >>> backward_fits(["relu(a0)"] * 3 + ["a0"], [32, 64, 64, 64, 16], 4)
        True
        >>> backward_fits(["relu(a0)"] * 3 + ["a0"], [64, 128, 128, 128, 64], 2)
        True
        >>> backward_fits(["relu(a0)"] * 3 + ["a0"], [64, 128, 128, 128, 64], 4)
        False
        >>> backward_fits(["relu(a0)", "a0"], [64, 256, 64]), backward_fits(["abs(a0)"], [16, 16])
        (False, False)
    """
    if len(widths) != len(epilogues) + 1 or any(derivative_kind(canonical(e)) is None for e in epilogues):
        return False
    pads = [pad_width(d) for d in widths]
    return max(widths) <= min(MAX_BACKWARD_WIDTH, MAX_CHAIN_WIDTH) and \
        sum(a * b for a, b in zip(pads, pads[1:])) * elem_size <= MAX_BACKWARD_WEIGHT_BYTES


def walks(widths: Sequence[int]) -> bool:
    """Whether a chain of these widths gets the walk backward (:mod:`fxfuse.kernels.chain_walk_template`): its
    padded weight gradients pass :data:`MAX_GRADIENT_ELEMENTS`, too many for one kernel's registers.

    Example:
        >>> walks([32, 64, 64, 64, 16]), walks([64, 128, 128, 128, 64])
        (False, True)
    """
    return _walks(tuple(widths))  # asked on every gradient-recording forward and backward of a chain


@functools.lru_cache(maxsize=1024)
def _walks(widths: tuple[int, ...]) -> bool:
    pads = [pad_width(d) for d in widths]
    return sum(a * b for a, b in zip(pads, pads[1:])) > MAX_GRADIENT_ELEMENTS


def stores_gradient(epilogues: Sequence[str], layer: int) -> bool:
    """Whether the walk writes a layer's activation gradient (False for a last identity: it is dy).

    Example:
        >>> stores_gradient(["relu(a0)", "a0"], 1), stores_gradient(["relu(a0)", "sigmoid(a0)"], 1)
        (False, True)
    """
    return not (layer == len(epilogues) - 1 and canonical(epilogues[layer]) == "a0")


@functools.lru_cache(maxsize=1024)
def canonical(epilogue: str) -> str:
    """An epilogue's canonical text (parsed once: the launchers ask on every backward)."""
    return str(ep.parse(epilogue))


def gradient_layout(widths: Sequence[int], has_bias: Sequence[bool], weights: bool = True) \
        -> tuple[list[int], list[int], int]:
    """Offsets of each dW_i (-1 without ``weights``: the walk's dW are GEMMs) and db_i in a program's row of the
    partial-sum buffer, and the row's length.

    Example:
        >>> gradient_layout([4, 8, 2], [True, False])
        ([0, 40], [32, 56], 56)
        >>> gradient_layout([4, 8, 2], [True, False], weights=False)
        ([-1, -1], [0, 8], 8)
    """
    off_w, off_b, total = [], [], 0
    for d_in, d_out, bias in zip(widths, widths[1:], has_bias):
        off_w.append(total if weights else -1)
        total += d_in * d_out if weights else 0
        off_b.append(total)
        total += d_out if bias else 0
    return off_w, off_b, total


# The input gradient from the first layer's activation gradient d (both backward kernels end their walk so).
DX_LINES = [
    "if NEED_DX:",
    "    dx = tl.dot(d, w0, input_precision=INPUT_PRECISION).to(dx_ptr.dtype.element_ty)",
    "    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + k0[None, :] * stride_dxk, dx,",
    "             mask=m_mask[:, None] & (k0[None, :] < D0))",
]


def backward_texts(epilogues: Sequence[str]) -> list[str]:
    """The canonical epilogue texts of a chain both backward kernels take.

    Raises:
        ValueError: an epilogue without a derivative (:func:`derivative_kind`).
    """
    texts = [canonical(e) for e in epilogues]
    missing = [t for t in texts if derivative_kind(t) is None]
    if missing:
        raise ValueError(f"no fused backward for epilogue(s) {missing}: an op with a kink or an operand")
    return texts


def backward_params(layers: int, tensors: Sequence[str] = ()) -> list[str]:
    """The parameters both backward kernels take, in order: x, each layer's weight and bias, dy, dx, the
    partial sums, then ``tensors`` (a kernel's own pointers), the row count, strides, widths and bias flags."""
    params = ["x_ptr", *(p for i in range(layers) for p in (f"w{i}_ptr", f"b{i}_ptr")), "dy_ptr", "dx_ptr",
              "part_ptr", *tensors, "M", "M_BUCKET", "stride_xm", "stride_xk"]
    params += [p for i in range(layers) for p in (f"stride_w{i}n", f"stride_w{i}k", f"stride_b{i}")]
    params += ["stride_dym", "stride_dyn", "stride_dxm", "stride_dxk"]
    params += [f"D{i}: tl.constexpr" for i in range(layers + 1)]
    params += [f"P{i}: tl.constexpr" for i in range(layers + 1)]
    return params + [f"HAS_BIAS{i}: tl.constexpr" for i in range(layers)]


def backward_head(header: str, version: int, texts: Sequence[str], tuner: str, name: str, params: Sequence[str],
                  doc: str) -> str:
    """A backward kernel module's source up to the kernel's body: ``header``, the helpers, the autotuned
    signature of ``name`` (its configs from ``{tuner}_configs()``, pruned by ``prune_{tuner}_configs()``, keyed
    by the row bucket, dx and the widths) and ``doc``."""
    layers = len(texts)
    src = header.format(version=version, layers=layers, epilogues=" ; ".join(texts), last=layers - 1,
                        epilogue_list=list(texts))
    if any(uses_trig(ep.parse(t)) or uses_trig(ep.parse(derivative_text(t) or "a0")) for t in texts):
        src = src.replace("\nEPILOGUES =", f"\n{IMPORT_LINE}\n\nEPILOGUES =", 1)
    src += _HELPERS
    src += (f'@autotune(configs={tuner}_configs(), key=["M_BUCKET", "NEED_DX", '
            + ", ".join(f'"D{i}"' for i in range(layers + 1))
            + f"], prune_configs_by=prune_{tuner}_configs())\n@triton.jit\ndef {name}(\n")
    return src + "".join(f"    {p},\n" for p in params) + "):\n" + doc.format(layers=layers)


def render_chain_backward(epilogues: Sequence[str]) -> str:
    """The backward kernel module source for a chain whose stage ``i`` applies ``epilogues[i]``.

    Raises:
        ValueError: an epilogue without a derivative (:func:`derivative_kind`).
    """
    texts = backward_texts(epilogues)
    layers = len(texts)
    params = backward_params(layers)
    params += [f"OFF_W{i}: tl.constexpr" for i in range(layers)] + [f"OFF_B{i}: tl.constexpr" for i in range(layers)]
    params += ["TOTAL: tl.constexpr", "NEED_DX: tl.constexpr", "INPUT_PRECISION: tl.constexpr",
               "BLOCK_M: tl.constexpr", "RELOAD_WEIGHTS: tl.constexpr", "PER_SM: tl.constexpr"]

    src = backward_head(_HEADER, CHAIN_BACKWARD_TEMPLATE_VERSION, texts, "chain_backward",
                        "fused_chain_backward_kernel", params, _DOC)

    body = ["pid = tl.program_id(0)", "dtype = x_ptr.dtype.element_ty",
            "# The fp32 gradient accumulators stay in registers across all of the program's row blocks. Each",
            "# weight tile serves twice (W_i^T for the forward product, W_i for the gradient of its input); it is",
            "# loaded once per program, or (RELOAD_WEIGHTS) per block from L1/L2, which frees its registers."]
    weights = []
    for i in range(layers):
        body += [
            f"k{i} = tl.arange(0, P{i})",
            f"n{i} = tl.arange(0, P{i + 1})",
            f"w{i}_mask = (n{i}[:, None] < D{i + 1}) & (k{i}[None, :] < D{i})",
            f"if HAS_BIAS{i}:",
            f"    bias{i} = tl.load(b{i}_ptr + n{i} * stride_b{i}, mask=n{i} < D{i + 1}, other=0.0).to(tl.float32)",
            f"dw{i} = tl.zeros((P{i + 1}, P{i}), dtype=tl.float32)",
            f"db{i} = tl.zeros((P{i + 1},), dtype=tl.float32)",
        ]
        weights += [
            f"w{i} = tl.load(w{i}_ptr + n{i}[:, None] * stride_w{i}n + k{i}[None, :] * stride_w{i}k, mask=w{i}_mask,"
            " other=0.0)",
            f"wt{i} = tl.trans(w{i})  # a view of the same tile: a second load of W^T cost registers",
        ]
    body += ["if not RELOAD_WEIGHTS:"] + ["    " + line for line in weights]
    loop = ["if RELOAD_WEIGHTS:"] + ["    " + line for line in weights] + [
        "offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)",
        "m_mask = offs_m < M",
        "h0 = tl.load(x_ptr + offs_m[:, None] * stride_xm + k0[None, :] * stride_xk,",
        "             mask=m_mask[:, None] & (k0[None, :] < D0), other=0.0)",
        "# Forward, recomputed as the chain kernel runs it. Rows past M read x as 0 and dy as 0 below, so",
        "# every gradient they produce is 0.",
    ]
    kinds = [derivative_kind(t) for t in texts]
    for i, text in enumerate(texts):
        lines, result = epilogue_lines(ep.parse(text), [f"a{i}"], [], f"_f{i}_",
                                       "x_ptr.dtype.element_ty == tl.float32")
        if i == layers - 1 and text == "a0":
            break  # the last layer's output is not needed: an identity passes dy through
        loop += [f"a{i} = tl.dot(h{i}, wt{i}, input_precision=INPUT_PRECISION)",
                 f"if HAS_BIAS{i}:",
                 f"    a{i} += bias{i}[None, :]"]
        if i < layers - 1 or (kinds[i] == "out" and text != "a0"):
            loop += lines + [f"h{i + 1} = {result}.to(dtype)"]
        if kinds[i] == "pre":  # the derivative reads the pre-activation as eager saved it: rounded
            loop.append(f"a{i} = a{i}.to(dtype).to(tl.float32)")
    loop += [
        f"g = tl.load(dy_ptr + offs_m[:, None] * stride_dym + n{layers - 1}[None, :] * stride_dyn,",
        f"            mask=m_mask[:, None] & (n{layers - 1}[None, :] < D{layers}), other=0.0).to(tl.float32)",
    ]
    for i in reversed(range(layers)):
        lines, grad = gradient_lines(texts[i], g="g", h=f"h{i + 1}.to(tl.float32)", a=f"a{i}", prefix=f"_d{i}_",
                                     is_fp32="x_ptr.dtype.element_ty == tl.float32")
        loop += [f"# layer {i}: {texts[i]}", *lines,
            f"d = ({grad}).to(dtype)  # eager's gradient of the activation, in the dtype",
        ]
        loop.append(f"dw{i} += tl.dot(tl.trans(d), h{i}, input_precision=INPUT_PRECISION)")
        loop += [
            f"db{i} += tl.sum(d.to(tl.float32), axis=0)",
        ]
        if i > 0:
            loop.append(f"g = tl.dot(d, w{i}, input_precision=INPUT_PRECISION).to(dtype).to(tl.float32)")
        else:
            loop += DX_LINES
    body += ["num_tiles = tl.cdiv(M, BLOCK_M)", "for tile in range(pid, num_tiles, tl.num_programs(0)):"]
    body += ["    " + line for line in loop]
    body.append("# This program's partial sums: its row of the buffer, every element written (zeros without rows).")
    body.append("row = part_ptr + pid.to(tl.int64) * TOTAL")
    for i in range(layers):
        body.append(f"tl.store(row + OFF_W{i} + n{i}[:, None] * D{i} + k{i}[None, :], dw{i}, mask=w{i}_mask)")
        body += [
            f"if HAS_BIAS{i}:",
            f"    tl.store(row + OFF_B{i} + n{i}, db{i}, mask=n{i} < D{i + 1})",
        ]
    src += "".join(f"    {line}\n" for line in body)
    return src


def _config(bm: int, warps: int, per_sm: int, reload: bool = False) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "PER_SM": per_sm, "RELOAD_WEIGHTS": reload}, num_warps=warps, num_stages=1)


def chain_backward_configs() -> list[triton.Config]:
    """Rows per block, warps, programs per SM, weights held or reloaded (one small config in the interpreter,
    with reloaded weights: the tests run that variant; the GPU tests run every config).

    H200, nerf64 fp16 at M = 2^20 (``benchmarks/probes/probe_chain_backward.py``, W^T as a view of W's tile), µs against
    eager's backward (1211-1216): 128 rows w8 held 515-540, 128 w8 reloaded 566-595, 64 w4 2/SM reloaded
    567-604, 64 w4 held 892-924. Every variant spills: the fp32 dW accumulators and the weight tiles are live at
    once. (nerf128's gradients in this kernel, written to memory for dW GEMMs, took 2172-2411 µs with the
    GEMMs; its walk backward takes 1774.)
    """
    if _interpreting():
        return [_config(16, 4, 1, True)]
    return [_config(128, 8, 1), _config(64, 4, 2, True), _config(64, 4, 1), _config(128, 8, 1, True)]


def _prune(configs, named_args, **kwargs):
    # No register model: every config compiles (spilling), and the measured fastest is not the one with the
    # least estimated pressure. Without autotuning, the first (the fastest measured at NeRF widths) runs.
    return configs if autotune_enabled() else configs[:1]


def prune_chain_backward_configs() -> dict | None:
    return None if _interpreting() else {"early_config_prune": _prune}
