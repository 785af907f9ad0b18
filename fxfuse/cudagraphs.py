"""CUDA graphs for static shapes: replay a module's forward instead of running its Python.

At decode sizes a forward's Python costs more than its kernels (a GPT-2-medium MLP at one row: about 100 µs
of host time for a few µs of GPU work). :func:`cuda_graphed` records the forward in a ``torch.cuda.CUDAGraph``
once per call *signature* and replays it on later calls with that signature: the inputs are copied into the
graph's static inputs, the graph is replayed, its outputs are returned (cloned unless ``static_outputs``).

The signature (:func:`call_key`) is every tensor argument's shape, stride, dtype, device and ``requires_grad``,
every other argument's type and value, and the grad mode, inference mode, training flag and autocast state.
A call is replayed only when all of these hold, otherwise the plain forward runs (the reason logged once, INFO):

* every tensor argument is a CUDA tensor of one device, and the other arguments are plain values (``None``,
  bool, int, float, str, dtype, device, enums) inside tuples, lists and dicts: the graph cannot see
  what an object (a KV cache, say) holds or does;
* the module is in eval mode, and grad is off (``torch.no_grad()`` / ``torch.inference_mode()``) or nothing
  (no input, no parameter) requires grad;
* the first call with that signature (it runs plainly) modified none of its tensor arguments in place, and
  returned tensors and plain values in containers ``torch.utils._pytree`` rebuilds (tuple, list, dict,
  namedtuple, Hugging Face ``ModelOutput``);
* the capture succeeded (one that fails, e.g. on a ``.item()``, leaves that signature plain for good);
* its replay is faster than the plain call: right after the capture both are timed (ten calls back to back,
  five interleaved rounds, each side's fastest) and a graph is kept only if its replay is at least 3% faster;
  a tie goes to the plain call (no graph memory, no input copy and output clone per call).
  A single fused MLP, whose plain call is one bound launch per stage, can lose to its replay's input copy and
  output clone (H200, Llama MLP at one row: 80.8 µs per call plain, 88.7 replayed); a whole model wins;
* fewer than ``max_graphs`` graphs exist for the module;
* the module tree is still the one the graphs were captured with (below).

A miss runs the plain forward for the caller, then twice more on a side stream (so Triton autotuning,
fxfuse's measured choice and lazy library set-up happen outside the capture), then captures one call into
a graph; all graphs of a module share one memory pool. fxfuse's regions choose their kernels for such calls
by GPU time alone (a replay skips the host path; :func:`fxfuse.strategy.scoring_for_cuda_graphs`).

Parameters and buffers are read in place, by address: copying into them (``load_state_dict``, ``p.copy_``) is
seen by the next replay; replacing them (``m.weight = nn.Parameter(...)``, ``.to(dtype)``) changes an address,
which a check of every parameter's and buffer's ``data_ptr`` on each call notices: all graphs are dropped and
recaptured.

A replay skips every submodule's call, so before each one the module tree is compared with the tree as the
graphs were captured (:class:`_TreeSnapshot`): a submodule replaced, added or removed (one without parameters
too, such as ``mlp.act = nn.ReLU()``, which changes no address), one switched to the other mode alone
(``drop.train()``), a hook or an instance ``forward`` set on one, a class swapped, a setting changed in place
(``act.approximate = "tanh"``, :class:`fxfuse.module_state.Settings`) or one of torch's global module hooks
registered drops all graphs likewise (the reason logged once, INFO): that call runs plainly and captures for
the new state, as a miss does. The root's own hooks run in its ``__call__``, around the replay, and need no
check. The comparison is a few C-level passes over lists kept at the capture: ~60 µs per replay for 300 modules
on the dev CPU (2 shared, loaded cores; ~2 µs for an MLP), about what the parameter check costs for that model.

What a graph cannot see: Python side effects of the forward (counters, prints, hooks of submodules registered
before the capture) run only in the plain calls (a new signature's first call runs the forward about 25 times:
plain, warm-up, capture, the timing against the replay); a tensor the forward reads that is neither an argument
nor a parameter or buffer of the module (a global, a plain tensor attribute) is read at the address it had when
captured; settings read through another object (``self.config.x``) and module-level names are not compared.

Example:
    >>> fast = fxfuse.cuda_graphed(model.cuda().eval())      # doctest: +SKIP
    >>> with torch.no_grad():                                # doctest: +SKIP
    ...     y = fast(x)  # first call with this shape: plain forward, then capture
    ...     y = fast(x)  # replay
"""

from __future__ import annotations

import contextlib
import copy
import enum
import gc
import inspect
import itertools
import logging
import operator
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from .autocast import any_autocast as _any_autocast
from .kernels.workspace import zero_after_capture
from .module_state import GLOBAL_HOOKS, Settings
from .strategy import scoring_for_cuda_graphs

__all__ = ["GraphedForward", "call_key", "cuda_graphed"]

log = logging.getLogger(__name__)

MAX_GRAPHS = 16
# A captured graph is kept only if its replay beats the plain call (see the module doc); tests of the capture
# machinery itself turn this off.
keep_only_faster = True
# Ten calls back to back: the first call's host latency is spread over them, as over a decode loop's calls (with
# three, a replay 6 µs slower per call on the GPU than the plain call tied with it: H200, Llama MLP at one row).
# Kept only when the replay is at least 3% faster: within that, the two timings of a few µs each are host noise.
# Five interleaved rounds, each side's fastest: with two, a host's slow stretch can keep a graph whose replay path
# (input copy, replay, output clone) is slower than the plain call (most likely gpt2m_mlp_m1 in an H100 benchmark:
# 24-47 µs per call against 14-43). Five rounds of ten calls cost ~3 ms per capture.
_TIMED_CALLS, _TIMED_ROUNDS, _KEEP_MARGIN = 10, 5, 0.97


def _per_call_us(fn: Callable[[], Any], calls: int = _TIMED_CALLS) -> float:
    """µs per call of ``calls`` back-to-back calls of ``fn``, synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6

_VALUE_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                          torch.layout, torch.memory_format})
_TENSOR_TYPES = (torch.Tensor, nn.Parameter)  # subclasses with their own semantics are not copied into graphs
_MISSING = object()


def call_key(args: tuple, kwargs: dict, state: tuple = ()) -> Optional[tuple[tuple, list[torch.Tensor]]]:
    """The cache key of a call and its tensor arguments in a fixed order; ``None`` when it cannot be graphed.

    A pure function of its arguments: ``state`` carries the global modes (grad, inference, training,
    autocast) that :class:`GraphedForward` reads. Tensors enter the key by shape, stride, dtype, device and
    ``requires_grad``; other values by type and value (``1`` and ``True`` differ); keyword order is ignored.

    Example:
        >>> key, tensors = call_key((torch.ones(2, 3),), {"scale": 2.0}, state=(False,))
        >>> len(tensors), call_key((torch.ones(2, 3),), {"scale": 2.0}, state=(False,))[0] == key
        (1, True)
        >>> call_key((object(),), {}) is None
        True
    """
    tensors: list[torch.Tensor] = []
    parts: list[Any] = [len(args)]
    for a in args:
        if not _walk(a, tensors, parts):
            return None
    if kwargs:
        names = sorted(kwargs)
        parts.append(tuple(names))
        for name in names:
            if not _walk(kwargs[name], tensors, parts):
                return None
    return (state, tuple(parts)), tensors


def _walk(obj: Any, tensors: list, parts: list) -> bool:
    """Append ``obj``'s key parts (prefix order, containers with their type and length); False if unsupported."""
    cls = type(obj)
    if cls in _TENSOR_TYPES:
        tensors.append(obj)
        parts.append((obj.shape, obj.stride(), obj.dtype, obj.device, obj.requires_grad))
        return True
    if cls in _VALUE_TYPES or isinstance(obj, enum.Enum):
        parts.append((cls, obj))
        return True
    if cls is tuple or cls is list or (isinstance(obj, tuple) and hasattr(cls, "_fields")):
        parts.append((cls, len(obj)))
        return all(_walk(o, tensors, parts) for o in obj)
    if isinstance(obj, dict):
        parts.append((cls, tuple(obj)))
        return all(_walk(v, tensors, parts) for v in obj.values())
    return False


def _rebuild(obj: Any, statics: Any) -> Any:
    """``obj`` with its tensors replaced, in :func:`_walk` order, by the next ones of the iterator ``statics``."""
    cls = type(obj)
    if cls in _TENSOR_TYPES:
        return next(statics)
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        return cls(*[_rebuild(o, statics) for o in obj])
    if cls is tuple or cls is list:
        return cls(_rebuild(o, statics) for o in obj)
    if isinstance(obj, dict):
        return cls((k, _rebuild(v, statics)) for k, v in obj.items())
    return obj


def _state(module: nn.Module) -> tuple:
    autocast = None
    if _any_autocast():
        autocast = tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu")) + \
            (torch.is_autocast_cache_enabled(),)
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), module.training, autocast


# ------------------------------------------------------------------------------------- parameter watch

# Bumped whenever any module anywhere registers a submodule, parameter or buffer (assignment included):
# a watch then re-reads which dicts hold its module's tensors.
_registrations = [0]
_hooks: list = []


def _registered(*_: Any) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    if not _hooks:
        from torch.nn.modules import module as m

        _hooks.extend([m.register_module_module_registration_hook(_registered),
                       m.register_module_parameter_registration_hook(_registered),
                       m.register_module_buffer_registration_hook(_registered)])


class _ParameterWatch:
    """Whether a module's parameters and buffers still live where they did: one ``data_ptr`` per tensor per call.

    The dicts that hold them (``_parameters`` / ``_buffers`` of every submodule) are collected once and again
    after any registration; reading the dicts on every call also sees tensors swapped in directly
    (``torch.func.functional_call``). Cost on the H200 host: ~1 µs for an MLP, ~14 µs for 121 tensors.
    """

    def __init__(self):
        _watch_registrations()
        self._dicts: list[dict] = []
        self._seen = -1
        self._pointers: Optional[tuple] = None

    def dicts(self, module: nn.Module) -> list[dict]:
        if self._seen != _registrations[0]:
            self._seen = _registrations[0]
            self._dicts = [d for m in module.modules() for d in (m._parameters, m._buffers) if d]
        return self._dicts

    def changed(self, module: nn.Module) -> bool:
        """True when the addresses differ from the last call's (and on the first call)."""
        pointers = tuple([t.data_ptr() for d in self.dicts(module) for t in d.values() if t is not None])
        if pointers == self._pointers:
            return False
        self._pointers = pointers
        return True

    def any_requires_grad(self, module: nn.Module) -> bool:
        return any(t is not None and t.requires_grad for d in self.dicts(module) for t in d.values())


# ---------------------------------------------------------------------------------------- module tree

_TRAINING = operator.itemgetter("training")
_CHILDREN = operator.itemgetter("_modules")
_FORWARD = itertools.repeat("forward")  # (endless: for map(dict.get, dicts, _FORWARD))
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _hook_copies(dicts: Sequence[dict]) -> tuple:
    return tuple(type(d)(d) for d in dicts)


class _TreeSnapshot:
    """The module tree below a root as it was when snapshot, and a cheap test that it still is: what a replay
    assumes about the modules whose calls it skips.

    A replay runs no Python, so it cannot see what would make the forward compute something else: a submodule
    replaced, added or removed (one without parameters included: no address changes), one switched to the other
    mode alone (``drop.train()``), a hook registered on one, an instance ``forward`` set on one (accelerate's),
    a class swapped, a setting changed in place (``act.approximate``: :class:`fxfuse.module_state.Settings`),
    or one of torch's global module hooks registered. :meth:`changed` tests all of these; :meth:`what_changed`
    says which, for the log. The root's own hooks and ``forward`` are left out: they run in its ``__call__``,
    outside the graph (its ``forward`` is the graphed one).

    Everything is read at snapshot time into flat tuples (the modules, their ``__dict__``, their hook dicts, which
    torch mutates and never rebinds, their ``_modules`` dicts, which torch rebinds only after deleting from them,
    as ``del layers[0]`` does, the settings' ``itemgetter``), so a test is a few C-level ``map``s and list
    compares: ~60 µs for 300 modules on the dev CPU, about as much as reading the parameters' addresses of a
    model that size (:class:`_ParameterWatch`). A ``_modules`` or ``__dict__`` replaced by hand as a whole is not
    seen. The root is read through the argument, never held: its ``__dict__`` holds the graphed forward, which
    holds this snapshot.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> tree = _TreeSnapshot(model)
        >>> tree.changed(model)
        False
        >>> model[1].approximate = "tanh"
        >>> tree.changed(model), tree.what_changed(model)
        (True, "1.approximate was 'none', is 'tanh'")
    """

    def __init__(self, root: nn.Module):
        named = [(name, m) for name, m in root.named_modules() if m is not root]
        self.names = tuple(name for name, _ in named)
        mods = self.modules = tuple(m for _, m in named)
        dicts = self.dicts = tuple(m.__dict__ for m in mods)
        self.classes = list(map(type, mods))
        self.training = list(map(_TRAINING, dicts))
        self.forwards = list(map(dict.get, dicts, _FORWARD))
        children = list(map(_CHILDREN, dicts))
        self.children_then = [dict(d) for d in children]  # (the same children, by name and identity)
        self.leaves = tuple(d for d in children if not d)  # (stay empty)
        self.parents = tuple(d for d in children if d)
        self.parents_then = tuple(then for then in self.children_then if then)
        hooks = [tuple(getattr(m, name) for name in _HOOK_DICTS) for m in mods]
        self.hooks_then = [_hook_copies(h) for h in hooks]
        self.unhooked = tuple(d for h in hooks for d in h if not d)  # (stay empty)
        self.hooked = tuple(d for h in hooks for d in h if d)
        self.hooked_then = _hook_copies(self.hooked)
        self.global_then = _hook_copies(GLOBAL_HOOKS)
        settings = self.settings = list(map(Settings.of, mods))
        kept = [(m.__dict__, s) for m, s in zip(mods, settings) if s is not None]
        read = [(state, s) for state, s in kept if s.keys]  # (a bias-free Linear's has only its empty bias slot)
        self.readers = tuple(s.read for _, s in read)
        self.setting_dicts = tuple(state for state, _ in read)
        self.values = [s.values for _, s in read]
        self.absent = tuple((state, s) for state, s in kept if s.absent)  # (parameter slots that held None)
        self.root_class, self.root_training = type(root), root.training
        self.root_children = dict(root._modules)
        self.root_settings = Settings.of(root)

    def changed(self, root: nn.Module) -> bool:
        """Whether anything above differs from the snapshot: the test before every replay."""
        try:
            return type(root) is not self.root_class or root.training is not self.root_training \
                or root._modules != self.root_children or GLOBAL_HOOKS != self.global_then \
                or (self.root_settings is not None and self.root_settings.changed(root)) \
                or list(map(type, self.modules)) != self.classes \
                or list(map(_TRAINING, self.dicts)) != self.training \
                or any(self.leaves) or self.parents != self.parents_then \
                or any(self.unhooked) or self.hooked != self.hooked_then \
                or list(map(dict.get, self.dicts, _FORWARD)) != self.forwards \
                or list(map(operator.call, self.readers, self.setting_dicts)) != self.values \
                or any(s.filled(state) for state, s in self.absent)
        except KeyError:  # (a setting or the training flag deleted)
            return True

    def what_changed(self, root: nn.Module) -> Optional[str]:
        """What :meth:`changed` found, as text (for the log); None when nothing changed."""
        if type(root) is not self.root_class:
            return f"its class was changed to {type(root).__qualname__}"
        if root.training is not self.root_training:
            return f"it is in {'training' if root.training else 'eval'} mode"
        if GLOBAL_HOOKS != self.global_then:
            return "torch's global module hooks changed"
        if self.root_settings is not None and self.root_settings.changed(root):
            return f"its {self.root_settings.what_changed(root)}"
        found = _children_changed("", root._modules, self.root_children)
        if found:
            return found
        for path, m, state, cls, training, forward, then, hooks_then, settings in zip(
                self.names, self.modules, self.dicts, self.classes, self.training, self.forwards,
                self.children_then, self.hooks_then, self.settings):
            found = _children_changed(path, m._modules, then)
            if found:
                return found
            if type(m) is not cls:
                return f"{path}'s class was changed to {type(m).__qualname__}"
            if state.get("training") != training:
                return f"{path} is in {'training' if state.get('training') else 'eval'} mode" \
                    if "training" in state else f"{path}.training was removed"
            if state.get("forward") != forward:
                return f"{path} has an instance forward" if forward is None else \
                    f"{path}'s instance forward was {'replaced' if 'forward' in state else 'removed'}"
            for name, was in zip(_HOOK_DICTS, hooks_then):
                if getattr(m, name) != was:
                    return f"{path} has {name.strip('_').replace('_', ' ')}" if not was else \
                        f"{path}'s {name.strip('_').replace('_', ' ')} changed"
            if settings is not None and settings.changed(m):
                return f"{path}.{settings.what_changed(m)}"
        return "a submodule changed" if self.changed(root) else None


def _children_changed(path: str, now: dict, then: dict) -> Optional[str]:
    """Which child of the module at ``path`` was added, removed or replaced since ``then``, or None."""
    if now == then and list(now) == list(then):
        return None
    prefix = f"{path}." if path else ""
    for name in [*then, *now]:
        if name not in now:
            return f"{prefix}{name} was removed"
        if name not in then:
            return f"{prefix}{name} was added"
        if now[name] is not then[name]:
            return f"{prefix}{name} was replaced"
    return f"{path or 'the root'}'s submodules were reordered"


# --------------------------------------------------------------------------------------------- graphs

class _Graph:
    """One captured call: static inputs, the graph, its output leaves and how to rebuild the output."""

    __slots__ = ("graph", "inputs", "leaves", "spec", "clone", "owned")

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: list, leaves: list, spec: Any, clone: bool,
                 owned: Sequence[torch.Tensor] = ()):
        self.graph, self.inputs, self.leaves, self.clone = graph, inputs, leaves, clone
        self.owned = owned  # memory the replays use that no output holds (workspaces): kept from the pool
        single = spec.is_leaf() and isinstance(leaves[0], torch.Tensor)
        self.spec = None if single else spec  # None: the output is the one tensor leaves[0]

    def run(self, tensors: list[torch.Tensor]) -> Any:
        for static, t in zip(self.inputs, tensors):
            static.copy_(t)
        self.graph.replay()
        if self.spec is None:
            return self.leaves[0].clone() if self.clone else self.leaves[0]
        leaves = self.leaves
        if self.clone:
            clones: dict[int, torch.Tensor] = {}  # one clone per tensor: outputs that were one tensor stay one
            leaves = [clones.setdefault(id(t), t.clone()) if isinstance(t, torch.Tensor) else t for t in leaves]
        return pytree.tree_unflatten(leaves, self.spec)


class GraphedForward:
    """A module's ``forward`` (installed as an instance attribute) that replays CUDA graphs; see the module doc.

    ``num_graphs`` counts the graphs held; ``describe()`` says how it is set up.
    """

    def __init__(self, module: nn.Module, *, static_outputs: bool = False, max_graphs: int = MAX_GRAPHS,
                 warmup: int = 2, plain: Optional[Callable] = None):
        self._module = weakref.ref(module)
        self._plain = plain  # an instance-level forward the module had before, else its class's forward
        self.static_outputs, self.max_graphs, self.warmup = static_outputs, max_graphs, warmup
        self._graphs: dict[tuple, Optional[_Graph]] = {}  # None: this signature runs plainly
        self._watch = _ParameterWatch()
        self._tree: Optional[_TreeSnapshot] = None  # the module tree as the graphs were captured in (None: no graph)
        self._pool: Any = None
        self._logged: set = set()
        self._busy = threading.Lock()  # held while a call copies into the static inputs, replays or captures
        self._name = type(module).__name__
        fn = plain if plain is not None else type(module).forward
        self.__name__ = getattr(fn, "__name__", "forward")
        self.__qualname__ = getattr(fn, "__qualname__", "forward")
        self.__doc__ = getattr(fn, "__doc__", None)
        try:  # inspect.signature(module.forward) as before (generate() reads it)
            sig = inspect.signature(fn)
            self.__signature__ = sig if plain is not None else sig.replace(parameters=list(sig.parameters.values())[1:])
        except (TypeError, ValueError):
            pass

    @property
    def num_graphs(self) -> int:
        return sum(g is not None for g in self._graphs.values())

    def describe(self) -> str:
        outputs = "static output buffers (overwritten by the next call)" if self.static_outputs else "outputs cloned"
        kept = "kept where its replay beats the plain call" if keep_only_faster else "always kept"
        return f"on for {self._name}.forward ({outputs}; one graph per input signature, {kept}, at most " \
            f"{self.max_graphs})"

    def __repr__(self) -> str:
        return f"<CUDA-graphed forward of {self._name}: {self.num_graphs} graph(s)>"

    def _call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if self._plain is not None:
            return self._plain(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)

    def _plainly(self, module: nn.Module, args: tuple, kwargs: dict, reason: str) -> Any:
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("fxfuse: %s.forward runs without a CUDA graph: %s", self._name, reason)
        return self._call(module, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise ReferenceError("the module of this CUDA-graphed forward no longer exists")
        state = _state(module)
        if state[2]:
            return self._plainly(module, args, kwargs, "the module is in train mode")
        found = call_key(args, kwargs, state)
        if found is None:
            return self._plainly(module, args, kwargs, "an argument is not a tensor or a plain value (None, bool, "
                                 "int, float, str, dtype, device) in tuples, lists or dicts")
        key, tensors = found
        if not tensors:
            return self._plainly(module, args, kwargs, "no tensor arguments")
        device = tensors[0].get_device()
        for t in tensors:
            if t.get_device() != device or device < 0:
                return self._plainly(module, args, kwargs, "the tensor arguments are not all on one CUDA device")
        grad, autocast = state[0], state[3]
        if grad and any(t.requires_grad for t in tensors):
            return self._plainly(module, args, kwargs, "grad is enabled and an input requires grad")
        if (grad or (autocast is not None and autocast[-1])) and self._watch.any_requires_grad(module):
            # (autocast caches the casts of weights that require grad until its context exits: a graph would
            # keep reading them after that)
            why = "grad is enabled and parameters require grad (use torch.no_grad() or torch.inference_mode())" \
                if grad else "autocast caches weight casts (use torch.autocast(..., cache_enabled=False))"
            return self._plainly(module, args, kwargs, why)
        if torch.cuda.is_current_stream_capturing():
            return self._call(module, args, kwargs)  # inside a graph being captured (ours or the caller's)
        # One call at a time uses the graphs' static buffers: another thread's call meanwhile (a server's pool)
        # runs plainly instead of copying its inputs over them.
        if not self._busy.acquire(blocking=False):
            return self._call(module, args, kwargs)
        try:
            return self._replayed(module, key, tensors, args, kwargs)
        finally:
            self._busy.release()

    def _replayed(self, module: nn.Module, key: tuple, tensors: list, args: tuple, kwargs: dict) -> Any:
        if self._watch.changed(module) and self._graphs:
            log.info("fxfuse: %s: parameters or buffers were replaced or moved; %d CUDA graph(s) dropped",
                     self._name, self.num_graphs)
            self._graphs.clear()
        entry = self._graphs.get(key, _MISSING)
        if entry is None:
            return self._call(module, args, kwargs)
        if self._tree is not None and self._tree.changed(module):  # (a replay would skip the changed modules)
            self._drop_for_tree(module)
            entry = _MISSING
        if entry is _MISSING:
            return self._miss(module, key, tensors, args, kwargs)
        return entry.run(tensors)

    def _drop_for_tree(self, module: nn.Module) -> None:
        """Drop every graph (recaptured for the new state), the module tree having changed since the capture."""
        why = self._tree.what_changed(module) or "a submodule changed"
        if ("tree", why) not in self._logged:
            self._logged.add(("tree", why))
            log.info("fxfuse: %s: the module changed since its capture (%s); %d CUDA graph(s) dropped, "
                     "recaptured for the new state", self._name, why, self.num_graphs)
        self._graphs.clear()
        self._tree = None

    def _miss(self, module: nn.Module, key: tuple, tensors: list, args: tuple, kwargs: dict) -> Any:
        if self.num_graphs >= self.max_graphs:
            return self._plainly(module, args, kwargs, f"{self.max_graphs} graphs exist (max_graphs); new input "
                                 "signatures run plainly")
        versions = [None if t.is_inference() else t._version for t in tensors]
        with scoring_for_cuda_graphs():  # fxfuse's regions plan for replays: by GPU time, not host time
            out = self._call(module, args, kwargs)  # this call's result, computed as always
        reason = _why_not(tensors, versions, out)
        after = call_key(args, kwargs, key[0])
        if reason is None and (after is None or after[0] != key):
            reason = "the forward modifies its arguments (a list or dict it was given)"
        entry = None
        if reason is None:
            try:
                with scoring_for_cuda_graphs():  # (the same choices as the call above)
                    entry = self._capture(module, args, kwargs, tensors)
            except Exception as err:  # never fail the user's call: this signature stays plain
                cause = err.__context__ if err.__context__ is not None else err
                reason = f"capture failed: {type(cause).__name__}: {str(cause).strip().splitlines()[0]}"
        if entry is not None and keep_only_faster:
            reason = self._slower_than_plain(entry, module, args, kwargs, tensors)
            if reason is not None:
                entry = None
        if entry is None:
            log.info("fxfuse: %s.forward: no CUDA graph for %s: %s", self._name, _describe(tensors), reason)
        else:
            # The module tree the replays assume: as this call left it. When its forward changed it (graphs of
            # other signatures were captured before), those graphs are dropped.
            if self._tree is not None and self._tree.changed(module):
                self._drop_for_tree(module)
            if self._tree is None:
                self._tree = _TreeSnapshot(module)
            log.info("fxfuse: %s.forward: CUDA graph %d captured for %s", self._name, self.num_graphs + 1,
                     _describe(tensors))
        self._graphs[key] = entry
        return out

    def _slower_than_plain(self, entry: _Graph, module: nn.Module, args: tuple, kwargs: dict,
                           tensors: list) -> Optional[str]:
        """Why the replay of ``entry`` is not worth keeping (slower than the plain call), or None."""
        def plain() -> None:
            self._call(module, args, kwargs)

        plain()  # the plain path's own first call at this signature (its regions planned for plain calls)
        replay_us, plain_us = [], []
        for _ in range(_TIMED_ROUNDS):
            replay_us.append(_per_call_us(lambda: entry.run(tensors)))
            plain_us.append(_per_call_us(plain))
        if min(replay_us) <= min(plain_us) * _KEEP_MARGIN:
            return None
        return f"its replay ({min(replay_us):.1f} µs per call) is not {1 - _KEEP_MARGIN:.0%} faster than the plain " \
            f"call ({min(plain_us):.1f} µs)"

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict, tensors: list) -> _Graph:
        device = tensors[0].device
        statics = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in tensors]
        for static, t in zip(statics, tensors):
            static.copy_(t)
        it = iter(statics)
        s_args = tuple(_rebuild(a, it) for a in args)
        s_kwargs = {name: _rebuild(kwargs[name], it) for name in sorted(kwargs)}  # (call_key's order)
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._call(module, s_args, s_kwargs)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        capturing = False
        try:
            # fxfuse's split-K workspaces: zeroed once below instead of by a fill kernel in every replay
            # The collector is paused before the capture begins: torch.cuda.graph no longer collects on entry
            # (torch.compiler.config.force_cudagraph_gc), so garbage may be waiting for the next collection.
            with _gc_paused(), torch.cuda.device(device), zero_after_capture() as workspaces, \
                    torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                capturing = True
                out = self._call(module, s_args, s_kwargs)
        except Exception:
            if capturing:
                _recover(device, self._pool)
            raise
        for t in workspaces:  # before the first replay, on the stream that replays; the kernels keep them zero
            t.zero_()
        leaves, spec = pytree.tree_flatten(out)
        pytree.tree_unflatten(leaves, spec)  # the output can be rebuilt (checked by _why_not, made sure here)
        return _Graph(graph, statics, leaves, spec, clone=not self.static_outputs, owned=workspaces)

    # Pickling and copying make a fresh cache for the new module (graphs are not copied).
    def __reduce__(self):
        return _restore, (self._module(), self.static_outputs, self.max_graphs, self.warmup, self._plain)

    def __deepcopy__(self, memo: dict) -> GraphedForward:
        return GraphedForward(copy.deepcopy(self._module(), memo), static_outputs=self.static_outputs,
                              max_graphs=self.max_graphs, warmup=self.warmup, plain=copy.deepcopy(self._plain, memo))


def _restore(module: nn.Module, static_outputs: bool, max_graphs: int, warmup: int, plain: Any) -> GraphedForward:
    return GraphedForward(module, static_outputs=static_outputs, max_graphs=max_graphs, warmup=warmup, plain=plain)


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection inside: a collection during a capture can free an unreachable CUDA graph of
    an earlier module, whose destruction is an operation a capturing stream forbids, and the capture fails (H200:
    `test_grad_and_train_mode_run_plainly_frozen_parameters_are_graphed` after other GPU tests, depending on when
    the collector ran; with the collector off, never). It is paused from before ``capture_begin``: the same test
    failed once more on an H100 (session 28) with the collector paused only inside the body, which left a window
    after ``capture_begin``; ``torch.cuda.graph`` no longer collects before it begins."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _recover(device: torch.device, pool: Any) -> None:
    """Undo what a failed capture leaves behind, so the process goes on as before.

    torch's ``capture_end`` raises at the failed ``cudaStreamEndCapture``, before it stops routing allocations
    to the graph's pool and before it takes CUDA's RNG out of capture mode (every later ``torch.randn`` on the
    GPU would then raise "Offset increment outside graph capture"). Ending the routing by hand and capturing
    one trivial graph, whose ``capture_end`` completes, restores both. (The failed graph's reference to the
    pool is not released: the pool's cached blocks stay with the process.)
    """
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except (AttributeError, RuntimeError):  # capture_end got that far, or another torch: nothing to end
        pass
    scratch = torch.zeros(1, device=device)
    with torch.cuda.device(device), torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
        scratch.add_(1)


def _why_not(tensors: list, versions: list, out: Any) -> Optional[str]:
    """Why the call that just ran (with ``out``) cannot be replayed from a graph, or None."""
    for t, v in zip(tensors, versions):
        if v is not None and t._version != v:
            return "the forward modifies a tensor argument in place"  # a replay would modify its static copy
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            if type(leaf) not in _TENSOR_TYPES or not leaf.is_cuda:
                return f"an output is a {type(leaf).__name__} on {leaf.device}"
        elif type(leaf) not in _VALUE_TYPES and not isinstance(leaf, enum.Enum):
            return f"the output holds a {type(leaf).__name__}, which cannot be rebuilt from a graph"
    return None


def _describe(tensors: list) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors[:4]) + \
        (", ..." if len(tensors) > 4 else "")


def cuda_graphed(module: nn.Module, *, static_outputs: bool = False, max_graphs: int = MAX_GRAPHS,
                 warmup: int = 2) -> nn.Module:
    """Make ``module``'s forward replay CUDA graphs for input signatures it has seen (see the module doc).

    Installs a :class:`GraphedForward` as ``module.forward`` (an instance attribute: the class and every other
    instance are untouched; ``del module.forward`` undoes it) and returns ``module``. Calls that cannot be
    graphed (CPU tensors, grad or train mode, objects as arguments...) run the plain forward.

    Args:
        static_outputs: return the graph's own output tensors instead of clones. Saves a copy per output, but
            the next call of this module (any signature) may overwrite them: clone what you keep (as
            ``torch.compile(mode="reduce-overhead")`` asks).
        max_graphs: graphs kept per module; past it, new signatures run plainly.
        warmup: extra plain runs on a side stream before each capture.

    Example:
        >>> fast = fxfuse.cuda_graphed(nn.Linear(8, 8).cuda().eval())   # doctest: +SKIP
        >>> with torch.no_grad():                                      # doctest: +SKIP
        ...     y = fast(torch.randn(4, 8, device="cuda"))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"cuda_graphed takes an nn.Module, got {type(module).__name__}")
    plain = module.__dict__.get("forward")
    if isinstance(plain, GraphedForward):  # graphed already (or a shallow copy of a graphed module)
        plain = plain._plain
    module.forward = GraphedForward(module, static_outputs=static_outputs, max_graphs=max_graphs, warmup=warmup,
                                    plain=plain)
    return module
