"""Autocast: what a fused region does under ``torch.autocast``.

Under autocast eager runs each ``nn.Linear`` of a region in the autocast dtype (its input, weight and bias cast
to it, weights cast once per autocast context) and the pointwise ops between them in whatever dtype they get.
A fused region (:func:`fxfuse.ops.fused_mlp`) follows that when it has no extra operands and only activations
autocast leaves alone (:data:`AUTOCAST_NEUTRAL_OPS`):

* **Weights already in the autocast dtype** (a bf16 model under ``torch.autocast("cuda", torch.bfloat16)``): the
  region runs fused on its input in the autocast dtype, as the first Linear would cast it.
* **fp32 weights, a call that records no gradients** (fp32 master weights evaluated or generating under
  autocast: timm's ``validate.py --amp``, a Trainer's evaluation with ``bf16=True``): the weights and biases are
  cast to the autocast dtype too, as autocast casts them, and the region runs fused on the casts. The casts are
  kept (:data:`weight_casts`) while each parameter's storage and version are unchanged, like autocast's own cache,
  so a decode loop inside one autocast context reads the narrow weights, not a new cast, at every step; in each
  new context they are cast again (into the same memory), as autocast's own are; they are dropped at the first
  fused call made without autocast, or one that records gradients (training), and with their parameter. With
  autocast's cache turned off (``cache_enabled=False``) the original ops run.
* **fp32 weights, a call that records gradients** (mixed-precision training), same conditions: the weights,
  biases and input are cast with autograd (``.to``, as autocast casts a Linear's: gradients flow back to the fp32
  parameters) and the region runs as one in the autocast dtype would: a narrow chain keeps its fused forward and
  fused backward every step; another region runs fused until its first backward marks it trained, and then its
  original ops, which autocast casts itself.
* An fp32 input in a call that records no gradients is not cast here: the chain kernel rounds it to the
  autocast dtype as it loads it, other strategies cast it as the first step of their replay
  (:func:`fxfuse.ops._run_kernels`).

Anything else (an epilogue with ``exp``/``log``/``pow``, which autocast runs in fp32, an operand that type
promotion would widen) runs the region's ops as the model wrote them, under autocast: eager's Linear layers and
dtypes; an activation written out as a formula that fxfuse recognised as one op (GPT-2's tanh-GELU) runs as that
op, which can differ from eager's by a rounding of the autocast dtype. A trained region's call that records
gradients there, under ``FXFUSE_GATED_TRAINING=1``, runs a whole gated MLP as one autograd node on its tensors cast
to the autocast dtype, as autocast casts a Linear's inputs (:mod:`fxfuse.gated_mlp_training`), and another gated
stage's ``act(g) * u`` as one kernel each way (:mod:`fxfuse.gated_training`): autocast leaves that product in the
dtype the projections give it.

The fused path is taken for CUDA autocast only (:data:`FUSED_AUTOCAST_DEVICES`: the op lists it was checked
against); autocast on another device type than the input's changes nothing here.

Example:
    >>> import torch
    >>> x, w = torch.randn(2, 8), torch.randn(4, 8)
    >>> autocast_args(x, [w], [], [], "1:relu(a0)") == (x, [w], [])  # no autocast: the tensors as they are
    True
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from . import epilogue as ep
from .spec import MLPSpec

__all__ = ["AUTOCAST_NEUTRAL_OPS", "FUSED_AUTOCAST_DEVICES", "REFERENCE", "WeightCasts", "any_autocast",
           "autocast_args", "cast_params", "records_grad", "weight_casts"]

# Whether autocast is on for any device type (one C call; checked on every call of a fused graph).
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or \
    (lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))

# Epilogue ops that run in their input's dtype under CUDA autocast (none is on its fp32 or lower-precision lists;
# ``div`` is left out: ``c / x`` is ``__rtruediv__``, which CUDA autocast runs in fp32).
AUTOCAST_NEUTRAL_OPS = frozenset({"abs", "add", "clamp_max", "clamp_min", "gelu", "gelu_tanh", "hardtanh", "leaky_relu",
                                  "maximum", "minimum", "mul", "neg", "relu", "sigmoid", "silu", "sin", "cos", "sub",
                                  "tanh"})
# Device types whose autocast may run a region fused (tests add "cpu" to run the interpreter under it).
FUSED_AUTOCAST_DEVICES = {"cuda"}
_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

REFERENCE = None  # autocast_args's answer when the original ops must run


class WeightCasts:
    """fp32 parameters cast to an autocast dtype for fused regions, each kept while its parameter is unchanged.

    Eager's Linear layers under autocast read an fp32 weight's cast from autocast's cache, made once per autocast
    context. This keeps the same casts for fused regions (autocast's cache cannot be read from Python), checked
    on every use against the parameter's storage and version counter (an optimizer step or any in-place write
    bumps it), and made again in each new autocast context (:meth:`expire`, at the exit of the outermost one,
    when autocast clears its cache): a write through ``.data``, which bumps no version, is seen in the next
    context, as eager sees it. A new cast goes into the old one's memory, so the addresses replays are keyed by
    stay. A cast goes with its parameter, and all go on :meth:`clear`.

    Example:
        >>> casts, w = WeightCasts(), torch.randn(4, 8)
        >>> c = casts.get(w, torch.float16)
        >>> c.dtype, casts.get(w, torch.float16) is c
        (torch.float16, True)
        >>> _ = w.mul_(2)  # a new version: cast again
        >>> torch.equal(casts.get(w, torch.float16), w.half()), len(casts), casts.nbytes
        (True, 1, 64)
    """

    def __init__(self):
        # id of the parameter -> (weak reference to it, its version and address at the cast, the dtype, the cast,
        # the generation it was cast in)
        self._casts: dict[int, tuple[weakref.ref, int, int, torch.dtype, Tensor, int]] = {}
        self.generation = 0  # one per autocast context (expire)

    def get(self, t: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
        """fp32 ``t`` cast to ``dtype`` (no autograd history): the kept cast while ``t`` is unchanged in this
        autocast context; cast again into the same memory when the context is new or ``t``'s version changed (the
        addresses that replays are keyed by stay); a new cast for a new storage; None for a tensor this does not
        cast (not fp32; an inference tensor, which has no version)."""
        kept = self._casts.get(id(t))
        if kept is not None and kept[0]() is t and kept[3] is dtype and kept[2] == t.data_ptr():
            if kept[1] == t._version and kept[5] == self.generation:
                return kept[4]
            cast = kept[4]
            if cast.shape == t.shape:
                cast.copy_(t.detach())
                self._casts[id(t)] = (kept[0], t._version, kept[2], dtype, cast, self.generation)
                return cast
        if t.dtype is not torch.float32 or t.is_inference():
            return None
        cast = t.detach().to(dtype)
        key = id(t)
        self._casts[key] = (weakref.ref(t, functools.partial(self._forget, key)), t._version, t.data_ptr(), dtype,
                            cast, self.generation)
        return cast

    def expire(self) -> None:
        """A new autocast context: every kept cast is made again at its next use, into its own memory (a write
        through ``.data`` bumps no version: autocast's own cache lives for one context for that reason)."""
        self.generation += 1

    def _forget(self, key: int, ref: weakref.ref) -> None:
        kept = self._casts.get(key)
        if kept is not None and kept[0] is ref:  # (not a newer entry under a reused id)
            del self._casts[key]

    def clear(self) -> None:
        self._casts.clear()

    def __len__(self) -> int:
        return len(self._casts)

    def __iter__(self):
        """The kept casts."""
        return (kept[4] for kept in list(self._casts.values()))

    @property
    def nbytes(self) -> int:
        """The memory the kept casts hold."""
        return sum(cast.untyped_storage().nbytes() for cast in self)


weight_casts = WeightCasts()  # the fused regions' casts (see the module doc)


def _clears_weight_casts(clear):
    """``torch.clear_autocast_cache`` that also expires :data:`weight_casts`. Autocast's ``__exit__`` calls it when
    the outermost context exits, so a kept cast is good for one context, as autocast's own: a parameter written
    through ``.data`` (which bumps no version counter: an EMA or momentum teacher's update) between two contexts
    is cast again in the next, as eager's Linear layers cast it (into the same memory: replays keep their keys)."""
    if getattr(clear, "_fxfuse_clears_weight_casts", False):  # (this module imported again)
        return clear

    @functools.wraps(clear)
    def clear_autocast_cache() -> None:
        clear()
        weight_casts.expire()

    clear_autocast_cache._fxfuse_clears_weight_casts = True
    return clear_autocast_cache


torch.clear_autocast_cache = _clears_weight_casts(torch.clear_autocast_cache)


@functools.lru_cache(maxsize=256)
def _neutral(spec: str) -> bool:
    """Whether every epilogue op of ``spec`` runs in its input's dtype under autocast, with no operands."""
    def ops(expr):
        if isinstance(expr, ep.Call):
            yield expr.op
            for arg in expr.args:
                yield from ops(arg)
        elif isinstance(expr, ep.Operand):
            yield "operand"

    return all(set(ops(stage.expr)) <= AUTOCAST_NEUTRAL_OPS for stage in MLPSpec.loads(spec).stages)


def records_grad(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor],
                 operands: Sequence[Tensor] = ()) -> bool:
    """Whether autograd records a region's call on these tensors (grad mode on and some input requires grad)."""
    if not torch.is_grad_enabled():
        return False
    for group in (weights, biases, operands):
        for t in group:
            if t.requires_grad:
                return True
    return x.requires_grad


def cast_params(tensors: Sequence[Tensor], dtype: torch.dtype, training: bool) -> Optional[Sequence[Tensor]]:
    """``tensors`` (the weights or the biases) with every one not in ``dtype`` replaced by its cast, or None when the
    original ops must run (a tensor autocast leaves, autocast's cache off for a call without gradients).

    A call that records gradients (``training``) casts them with autograd (``.to``, as autocast casts a Linear's
    weight: the gradient flows back to the fp32 parameter) and drops the kept casts; one that does not takes its
    kept casts."""
    out = None
    for i, t in enumerate(tensors):
        if t.dtype is not dtype:
            if out is None:
                cache = torch.is_autocast_cache_enabled()
                if training or not cache:
                    weight_casts.clear()  # (training: autocast keeps its own casts, if any; cache off: none wanted)
                if dtype is torch.float32 or not (training or cache):
                    return None
                out = list(tensors)
            if training:
                cast = t.to(dtype) if t.dtype is torch.float32 else None
            else:
                cast = weight_casts.get(t, dtype)
            if cast is None:
                return None
            out[i] = cast
    return tensors if out is None else out


def autocast_args(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor], operands: Sequence[Tensor],
                  spec: str) -> Optional[tuple[Tensor, Sequence[Tensor], Sequence[Tensor]]]:
    """``(x, weights, biases)`` for a fused region under the current autocast state, or :data:`REFERENCE` (None)
    when the original ops must run for eager's result (see the module doc): the tensors as they are when
    autocast does not touch x's device type; else fp32 weights and biases replaced by their kept casts
    (:data:`weight_casts`) in a call that records no gradients, and x cast to the autocast dtype, except an fp32
    x in a call that records no gradients, which the kernels round as they read it."""
    device = "cuda" if x.is_cuda else x.device.type  # (is_cuda: a tenth of device.type's cost)
    if not torch.is_autocast_enabled(device):
        return x, weights, biases
    dtype = torch.get_autocast_dtype(device)
    if device not in FUSED_AUTOCAST_DEVICES or operands or x.dtype not in _CAST_DTYPES or not _neutral(spec):
        return REFERENCE
    training = records_grad(x, weights, biases)  # (once: the casts and the input's decision all depend on it)
    cast_weights = cast_params(weights, dtype, training)
    cast_biases = None if cast_weights is None else cast_params(biases, dtype, training)
    if cast_biases is None:
        return REFERENCE
    if x.dtype is dtype or (x.dtype is torch.float32 and not training):
        # (fp32 x, no gradients: the kernels round it to ``dtype`` as they load it, or cast it first as a step of
        # the region's replay; see fxfuse.ops._run_kernels)
        return x, cast_weights, cast_biases
    return x.to(dtype), cast_weights, cast_biases
