"""Shortcuts: a host method whose fused graph is one region calls that region's replay directly.

A decode-size region's call is a stack of checks, each there for a reason: the host method's guards (training
mode, autocast, the arguments), the fused graph's code, :func:`fxfuse.ops.fused_mlp`'s (tracing, dispatch and
function modes, autocast, gradients), the op's dispatch, and the replay's key (:func:`fxfuse.replay.replay_key`:
every tensor's address, shape, strides and dtype, the stream). On the H200 machine's host that is ~10 µs of a
~19 µs call of GPT-2 medium's MLP at one row, around a ~7 µs replay (an output's ``torch.empty`` and one launch).

When a host method's fused graph is nothing but one region on its arguments (``GPT2MLP``, ``LlamaMLP``, timm's
``Mlp`` and ``nn.Sequential`` MLPs in eval mode), the host method keeps a :class:`Shortcut`: after a call that
went the full way and found its replay, it learns an *entry* for the input's shape holding

* a ``TensorGuards`` over the input and the region's tensors (dynamo's C++ check of type, dtype, device, shape,
  strides, ``requires_grad`` and dispatch keys: ~0.5 µs for five tensors, a third of the same in Python),
* the tensors' addresses, the input's 16-byte alignment, the stream, the TF32 flag for fp32, the
  ``torch.use_deterministic_algorithms`` flag (part of the replay's key),
* whether any tensor requires gradients (then only calls without grad mode may take it),
* the replay itself, and the replays' ``generation`` when it was learned.

A later call takes the entry when all of that holds and nothing must see the op: no tracing or compiling, no
dispatch or function mode, no autocast and no kept autocast casts, no CUDA graph capture, and no replay dropped
or replaced since (a dropped replay can mean a changed choice). Otherwise it goes the full way, which may learn
the entry again. So the shortcut runs exactly what the full path's replay would, with the same checks made in
fewer frames.

Example:
    >>> call = region_call(lifted_gm)                       # doctest: +SKIP
    >>> shortcut = Shortcut(call) if call is not None else None  # doctest: +SKIP
    >>> out = shortcut(x, params)   # None: take the full path, then shortcut.learn(x, params)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import torch
import torch.fx as fx
from torch import Tensor

from . import replay
from .autocast import any_autocast, weight_casts
from .kernels.fastlaunch import _raw_stream
from .ops import _traced_or_watched, current_cuda_device, fused_mlp
from .transforms import transformed

try:  # dynamo's C++ tensor check (torch >= 2.1); without it there are no shortcuts
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch without dynamo's guards
    TensorGuards = None

__all__ = ["GraphRegion", "RegionCall", "Shortcut", "graph_region", "region_call"]

log = logging.getLogger(__name__)

_MAX_ENTRIES = 8  # input shapes per host method; past it, all are learned again
_MAX_MISSES = 8  # full-path calls at one input shape that found no replay before that shape stops learning
_data_ptr = Tensor.data_ptr
_requires_grad = operator.attrgetter("requires_grad")


class RegionCall(NamedTuple):
    """Where a one-region graph's tensors are among the host method's extra (lifted) arguments, and its spec."""

    weights: tuple[int, ...]
    biases: tuple[int, ...]
    operands: tuple[int, ...]
    spec: str


def _one_call(gm: fx.GraphModule) -> Optional[tuple[list[fx.Node], fx.Node, object]]:
    """``(placeholders, the call, what the graph returns)`` of a graph that is its placeholders, one fused region
    ``fused_mlp(x, weights, biases, operands, spec)`` and its output; None for any other graph."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    rest = nodes[len(placeholders):]
    if len(placeholders) < 2 or any(n.op == "placeholder" for n in rest) or len(rest) != 2:
        return None
    call, output = rest
    if call.op != "call_function" or call.target is not fused_mlp or call.kwargs or len(call.args) != 5 \
            or output.op != "output" or len(output.args) != 1 or not isinstance(call.args[4], str):
        return None
    return placeholders, call, output.args[0]


def _region_on(call: fx.Node, places: dict[fx.Node, int]) -> Optional[RegionCall]:
    """The region ``call``'s tensors by their ``places``, or None when one of them is not placed."""
    _, weights, biases, operands, spec = call.args
    groups = (weights, biases, operands)
    if not all(isinstance(g, (list, tuple)) and all(places.get(t, -1) >= 0 for t in g) for g in groups):
        return None
    return RegionCall(*(tuple(places[t] for t in g) for g in groups), spec)


def region_call(gm: fx.GraphModule) -> Optional[RegionCall]:
    """The region of a lifted graph (:func:`fxfuse.lift.lift_params`) that is exactly ``fused_mlp(x, params...)``
    on its first placeholder and the trailing ones, returned as is; None for any other graph."""
    found = _one_call(gm)
    if found is None:
        return None
    placeholders, call, result = found
    if result is not call or call.args[0] is not placeholders[0]:
        return None
    return _region_on(call, {n: i - 1 for i, n in enumerate(placeholders)})  # (among the extra arguments)


class GraphRegion(NamedTuple):
    """A compile backend's graph that is one region on its placeholders (:func:`graph_region`)."""

    x: int  # the input's place among the graph's arguments
    call: RegionCall  # the region's tensors' places among all of the graph's arguments
    tupled: bool  # the graph returns the region's output in a 1-tuple (Dynamo's graphs do)


def graph_region(gm: fx.GraphModule) -> Optional[GraphRegion]:
    """The region of a graph whose arguments are the input and the region's tensors in any order (Dynamo's graph
    of an MLP module, fused), returning its output alone or in a 1-tuple; None for any other graph."""
    found = _one_call(gm)
    if found is None:
        return None
    placeholders, call, result = found
    tupled = isinstance(result, (tuple, list)) and len(result) == 1
    if (result[0] if tupled else result) is not call or call.args[0] not in placeholders:
        return None
    region = _region_on(call, {n: i for i, n in enumerate(placeholders)})
    return None if region is None else GraphRegion(placeholders.index(call.args[0]), region, tupled)


def _tensor_getter(call: RegionCall) -> Callable[[Sequence[Tensor]], tuple]:
    """``extra -> (weights..., biases..., operands...)``: the region's tensors among the extra arguments, in C."""
    index = call.weights + call.biases + call.operands
    return operator.itemgetter(*index) if len(index) > 1 else (lambda extra, i=index[0]: (extra[i],))


def _entry(call: RegionCall, get: Callable[[Sequence[Tensor]], tuple], x: Tensor, tensors: tuple, key: tuple,
           run: Callable[[Tensor], Tensor], autocast_free: bool) \
        -> Optional[Callable[[Tensor, Sequence[Tensor]], Optional[Tensor]]]:
    """A learned entry (see the module doc) for the replay ``run`` kept under ``key``: ``(x, extra) -> out``, or
    None when a check fails. ``get``: :func:`_tensor_getter` of ``call``; ``tensors``: what it gave for x's call."""
    try:
        guards = TensorGuards(x, *tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception as err:  # pragma: no cover - another torch's constructor: no shortcut
        log.debug("fxfuse: no shortcut for %s (TensorGuards: %s)", call.spec, err)
        return None
    check = guards.check
    ptrs = tuple(map(_data_ptr, tensors))
    aligned = x.data_ptr() % 16 == 0
    device = x.get_device()
    on_gpu = device >= 0  # (CPU tensors: the tests' stand-in replays; no streams, no capture)
    stream_of = _raw_stream if on_gpu else (lambda device: 0)
    current = current_cuda_device if on_gpu else (lambda: device)  # (another GPU current: the full path guards)
    stream = stream_of(device)
    # (the C query itself: ``torch.cuda.is_current_stream_capturing`` is a Python frame around it)
    capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing) \
        if on_gpu else (lambda: False)
    fp32 = x.dtype is torch.float32
    tf32 = torch.backends.cuda.matmul.allow_tf32 if fp32 else None
    needs_no_grad = x.requires_grad or any(map(_requires_grad, tensors))
    is_deterministic = torch.are_deterministic_algorithms_enabled
    deterministic = is_deterministic()  # (as the replay's key has it: learned right after the call that found it)
    learned = replay.replays.generation
    replays = replay.replays
    is_grad_enabled = torch.is_grad_enabled
    casts = weight_casts._casts  # (its dict: truth-tested in C, not through ``WeightCasts.__len__``)

    def take(x: Tensor, extra: Sequence[Tensor]) -> Optional[Tensor]:
        ts = get(extra)
        if replays.generation != learned or not check(x, *ts) or tuple(map(_data_ptr, ts)) != ptrs \
                or (x.data_ptr() % 16 == 0) is not aligned or current() != device or stream_of(device) != stream:
            return None
        if (needs_no_grad and is_grad_enabled()) or _traced_or_watched(x) or casts \
                or (autocast_free and any_autocast()) or capturing() or transformed():
            return None
        if (fp32 and torch.backends.cuda.matmul.allow_tf32 != tf32) or is_deterministic() is not deterministic:
            return None
        try:
            return run(x)
        except ReferenceError:  # a tensor it held weakly is gone: as the full path does, drop it (and this entry)
            replays.pop(key, None)
        except Exception as err:  # never expected; the full path decides again
            log.warning("fxfuse: replaying %s failed (%s: %s); dropped", call.spec, type(err).__name__, err)
            replays.pop(key, None)
        return None

    return take


class Shortcut:
    """A one-region host method's direct calls of its replays, by input shape (see the module doc).

    Args:
        call: the region's place among the host method's arguments (:func:`region_call`).
        autocast_free: the host method runs its graph under autocast too (then the shortcut checks autocast
            itself: under it the region follows autocast, which a replay does not).
    """

    def __init__(self, call: RegionCall, autocast_free: bool = False):
        self.call = call
        self.autocast_free = autocast_free
        self._tensors = _tensor_getter(call)
        self.entries: dict[torch.Size, Callable[[Tensor, Sequence[Tensor]], Optional[Tensor]]] = {}
        self.misses: dict[torch.Size, int] = {}  # full-path calls per shape that found no replay to learn
        self.hits = 0  # calls that took the shortcut (tests read it)

    def __copy__(self) -> Shortcut:
        return Shortcut(self.call, self.autocast_free)  # entries are learned again (they hold C++ guards)

    def __deepcopy__(self, memo: dict) -> Shortcut:
        return Shortcut(self.call, self.autocast_free)

    def __call__(self, x: object, extra: Sequence[Tensor]) -> Optional[Tensor]:
        """The region's output through a learned entry, or None: then the caller takes the full path and
        calls :meth:`learn`."""
        if type(x) is not Tensor:
            return None
        entry = self.entries.get(x.shape)
        if entry is None:
            return None
        out = entry(x, extra)
        if out is not None:
            self.hits += 1
        return out

    def learn(self, x: object, extra: Sequence[Tensor]) -> None:
        """After a full-path call: keep an entry for x's shape if that call's replay exists and a later call
        like it may take it (plain CUDA tensors, no gradients recorded, nothing watching)."""
        if TensorGuards is None or type(x) is not Tensor or not x.is_cuda:
            return
        shape = x.shape
        if self.misses.get(shape, 0) >= _MAX_MISSES:
            return
        call = self.call
        tensors = self._tensors(extra)
        # (runs after every full-path call: a grad-recording call, which never has a replay, leaves first)
        if (torch.is_grad_enabled() and (x.requires_grad or any(map(_requires_grad, tensors)))) \
                or _traced_or_watched(x) or any_autocast() or weight_casts \
                or torch.cuda.is_current_stream_capturing() or not replay.may_replay(call.spec, x):
            return
        n_weights, n_biases = len(call.weights), len(call.biases)
        key = replay.replay_key(x, tensors[:n_weights], tensors[n_weights:n_weights + n_biases],
                                tensors[n_weights + n_biases:], call.spec)
        run = replay.replays.get(key)
        entry = None if run is None else _entry(call, self._tensors, x, tensors, key, run, self.autocast_free)
        if entry is None:
            self.misses[shape] = self.misses.get(shape, 0) + 1
            return
        if len(self.entries) >= _MAX_ENTRIES:
            self.entries.clear()
        self.entries[shape] = entry
        log.debug("fxfuse: %s at %s called through its shortcut from now on", call.spec, tuple(shape))
