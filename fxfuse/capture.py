"""Capture: trace the parts of a model that can be traced, as FX graphs that remember where each op came from.

Real models rarely trace whole: attention has Python control flow, ``forward`` takes ``**kwargs`` and
caches, layers check dtypes. Capture therefore works on *scopes* (one method of one module) with a
tracer built for that:

* **Failing submodules become leaves.** When tracing fails inside a submodule (attention, a rotary
  embedding), that submodule is kept opaque (a ``call_module`` node) and the scope is traced again.
  Only an error in the scope's own code makes the scope fail.
* **Arguments are specialized, and the specialization is recorded.** A parameter without a default
  is a placeholder; one whose default is ``None`` (or a bool, number, string) is traced with that
  default; ``*args`` / ``**kwargs`` are traced empty. :class:`ArgSpec` records this so that the code
  running the fused graph can check, on each call, that the call is one the graph stands for
  (:mod:`fxfuse.hosts`).
* **Every op remembers its Python frames** (``node.meta["fxfuse_frames"]``: the module path and code
  object of each enclosing method of a module of the scope), so the smallest method that contains a
  chain can be found even when the chain spans sibling submodules or sits inline in a layer.
* Known activation modules (``transformers.activations``, ``torch.nn``) stay leaves, classified by
  class.

:func:`discover` walks the model top-down: it traces ``forward`` of the largest modules it can, recurses
into whatever stayed opaque, and where a ``forward`` cannot be traced at all, tries the module's other
methods that call its submodules (``BertLayer.feed_forward_chunk``, ``TransformerEncoderLayer._ff_block``)
and then its children. Discovery traces are *permissive* (a Python ``if`` on a traced value takes the
``False`` branch): they only say where the chains are; the graphs that run are traced strictly.

Nothing is copied: graphs reference the user's modules and parameters.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import gc
import inspect
import itertools
import logging
import operator
import os
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy

from .module_state import runs_own_code
from .pointwise import is_known_activation

__all__ = ["ArgSpec", "AutocastStateError", "CaptureFailure", "Discovery", "GlobalModeError", "Scope",
           "SideEffectError", "discover", "leaving_unchanged", "record_inputs", "trace_scope", "weight_count"]

log = logging.getLogger(__name__)



def _folder(path: str) -> str:
    """``path`` as code objects' file names are compared with it: resolved (``..``, symlinks), with a final
    separator (so that torch's folder does not hold torchvision's)."""
    return os.path.normcase(os.path.realpath(path)) + os.sep


_FX_DIR = _folder(os.path.dirname(fx.__file__))
_TORCH_DIR = _folder(os.path.dirname(torch.__file__))
_FXFUSE_DIR = _folder(os.path.dirname(__file__))
_STDLIB_DIR = _folder(os.path.dirname(os.__file__))
_SITE_FOLDERS = ("site-packages", "dist-packages")  # (inside the standard library's folder in conda and others)


@functools.lru_cache(maxsize=4096)
def _file_in(filename: str, folders: tuple[str, ...]) -> bool:
    """Whether a code object's file is under one of ``folders`` (resolved paths: an import through a path such as
    ``scripts/../fxfuse`` names its files that way). The standard library's folder holds no installed packages."""
    if filename.startswith("<frozen "):  # (the standard library's frozen modules: os, codecs, importlib)
        return _STDLIB_DIR in folders
    path = os.path.normcase(os.path.realpath(filename))
    for folder in folders:
        if path.startswith(folder):
            return folder != _STDLIB_DIR or path[len(folder):].split(os.sep, 1)[0] not in _SITE_FOLDERS
    return False
_MAX_LEAF_RETRIES = 24
# Methods never traced during discovery (they change the model or are not computations).
_LIFECYCLE_PREFIXES = ("_init", "init_", "reset", "tie_", "_tie", "load", "_load", "save", "_save", "set_", "_set",
                       "get_", "_get", "resize", "prune", "post_init", "gradient_checkpointing", "register",
                       "_register", "_apply", "_replicate", "_conv_forward", "extra_repr")
_LIFECYCLE_NAMES = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "train", "eval", "apply",
                    "zero_grad", "share_memory", "requires_grad_", "type", "ipu", "xpu", "mtia", "to_empty"}


@dataclass
class CaptureFailure:
    module_path: str  # "" is the whole model
    error: str


@dataclass(frozen=True)
class ArgSpec:
    """How one parameter of a traced method was treated.

    ``mode`` is ``"proxy"`` (a placeholder of the graph), ``"const"`` (traced with ``value``: a call must
    pass exactly that value, or leave the default) or ``"empty"`` (``*args`` / ``**kwargs``: must be empty).
    """

    name: str
    kind: inspect._ParameterKind
    mode: str
    value: Any = None
    has_default: bool = False


@dataclass
class Scope:
    """One traced method of one module: ``gm`` (root = that module), and how it was traced."""

    module_path: str
    method: str
    gm: fx.GraphModule
    args: list[ArgSpec]
    leaves: list[str] = field(default_factory=list)  # submodules kept opaque because they failed to trace
    permissive_used: bool = False  # a Python branch on a traced value was taken blindly (discovery only)
    permissive_reason: str = ""
    constants: dict[str, Any] = field(default_factory=dict)  # attributes the tracer created (tensor constants)
    mode_dependent: bool = True  # the graph may differ between training and eval mode
    # The trace was watched and touched no autocast state, so the graph is the same under torch.autocast (its ops
    # then autocast as the method's would). False when that could not be watched (another profiler).
    autocast_free: bool = False
    autocast_used: str = ""  # what of the autocast state the code used ("" for nothing): not a host then
    modes_used: str = ""  # torch's global modes the code switched or read (torch.no_grad(), ...): not a host then
    side_effects: list[str] = field(default_factory=list)  # what the code changed besides tensors: not a host then
    # The path of the submodule of every module call the trace made (leaf or traced into), in order: those the graph
    # does not call as modules skip their hooks, so the installed method checks them (fxfuse.install).
    calls: list[str] = field(default_factory=list)


def weight_count(module: nn.Module) -> int:
    """Number of weight matrices (2-D parameters and buffers) at or below ``module``, a tied one once per module
    that holds it (two linears sharing a weight are a chain); a lazy module's uninitialized parameters are not
    counted."""
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    return sum(1 for _, p in named if not is_lazy(p) and p.dim() == 2)


def _short(err: BaseException) -> str:
    """The error's type and first sentence."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    cut = first.find(". ")
    return f"{type(err).__name__}: {first[:cut + 1] if cut > 0 else first}"[:200]


class _Proxy(fx.Proxy):
    """A proxy whose in-place operators are recorded as such (``x += y`` is ``operator.iadd(x, y)``): FX's own
    proxy has none, so Python runs ``x = x + y``, which leaves alone a tensor the caller or a buffer still holds."""


def _inplace_operator(op: Any, plain: Any) -> Any:
    def method(self: _Proxy, other: Any) -> fx.Proxy:
        # A number's ``n += 1`` makes a new number: FX writes an in-place op as ``n += 1`` on the variable of its
        # first argument, which would change what other readers of that value (``m = n`` before) see.
        return self.tracer.create_proxy("call_function", plain if _a_number(self.node) else op, (self, other), {})
    method.__name__ = f"__{op.__name__}__"
    return method


_IN_PLACE = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
             operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
             operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
             operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
             operator.irshift: operator.rshift}
for _op, _plain in _IN_PLACE.items():
    setattr(_Proxy, f"__{_op.__name__}__", _inplace_operator(_op, _plain))

_SIZE_ATTRS = ("shape", "ndim", "is_cuda", "dtype", "device")
_SIZE_METHODS = ("size", "dim", "numel", "item", "tolist", "stride", "element_size", "nelement")


def _a_number(node: fx.Node) -> bool:
    """Whether a traced value is a number (or a size) rather than a tensor: read from a tensor's sizes, or computed
    by Python's operators from such values alone."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _SIZE_ATTRS
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op == "call_function" and node.target in (len, operator.getitem):
        return node.target is len or (isinstance(node.args[0], fx.Node) and _a_number(node.args[0]))
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        args = [a for a in node.args if isinstance(a, fx.Node)]
        return bool(args) and all(_a_number(a) for a in args)
    return False


class _Tracer(fx.Tracer):
    def __init__(self, forced_leaves: set[int], permissive: bool):
        # No autowrapping of ``math`` functions: it rescans each module's globals on every call.
        super().__init__(autowrap_modules=())
        # Buffers are read through the graph like parameters: FX's default runs code on a buffer while tracing
        # (``self.buf.mul_(2)`` would change the user's buffer; ``self.buf[:3]`` would be frozen into a constant).
        self.proxy_buffer_attributes = True
        self.forced_leaves = forced_leaves
        self.permissive = permissive
        self.permissive_used = False
        self.permissive_reason = ""
        self.arg_specs: list[ArgSpec] = []
        self.calls: list[str] = []

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def create_arg(self, a: Any) -> Any:
        # A tensor computed from a parameter while tracing (``OrderedDict(self.named_parameters())`` read in
        # forward, as the official SIREN's BatchLinear does: ``bias.unsqueeze(-2)`` runs on the real parameter)
        # would be stored as a constant: a view keeping the parameter of trace time (stale once it is replaced)
        # and its autograd node (a copy of the model cannot be made). Such a method is left as it is.
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and (
                a.grad_fn is not None or isinstance(getattr(a, "_base", None), nn.Parameter)):
            raise ParameterConstantError("a tensor computed from a parameter the trace does not see "
                                         "(named_parameters() read in the method?) would be a constant")
        return super().create_arg(a)

    # --- what stays opaque
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if id(m) in self.forced_leaves or is_known_activation(m) or runs_own_code(m):
            return True  # (hooks, an instance forward: a call of the module runs them, a trace through it would not)
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        try:
            self.calls.append(self.path_of_module(m))
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:
            if not hasattr(err, "_fxfuse_module"):  # the innermost module the error came from
                try:
                    err._fxfuse_module = self.path_of_module(m)
                except Exception:
                    pass
            raise

    # --- control flow on traced values
    def to_bool(self, obj) -> bool:
        if not self.permissive:
            return super().to_bool(obj)
        if not self.permissive_used:
            self.permissive_used = True
            try:
                super().to_bool(obj)
            except Exception as err:
                self.permissive_reason = _short(err)
        return False

    # --- arguments: placeholders for required parameters, defaults for the rest (recorded)
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        sig = inspect.signature(inspect.unwrap(root_fn))
        params = list(sig.parameters.values())[1:]  # drop self
        pos: list[Any] = []
        kw: dict[str, Any] = {}
        specs: list[ArgSpec] = []
        for p in params:
            if p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD:
                specs.append(ArgSpec(p.name, p.kind, "empty"))
                continue
            has_default = p.default is not p.empty
            if has_default:  # not passed: the call sees its default, as a plain call would
                specs.append(ArgSpec(p.name, p.kind, "const", p.default, True))
                continue
            value = self.create_proxy("placeholder", p.name, (), {})
            specs.append(ArgSpec(p.name, p.kind, "proxy"))
            if p.kind is p.KEYWORD_ONLY:
                kw[p.name] = value
            else:
                pos.append(value)
        self.arg_specs = specs
        root = self.root

        def call(*_):
            return root_fn(root, *pos, **kw)

        return call, []

    # --- where every op comes from
    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind in ("call_function", "call_method", "call_module"):
            node.meta["fxfuse_frames"] = self._frames()
            node.meta["fxfuse_grad"] = torch.is_grad_enabled()
        return node

    def _frames(self) -> tuple:
        """(module path, code) of every enclosing method of a module of the scope, outermost first."""
        paths = self.submodule_paths or {}
        out = []
        f = sys._getframe(2)
        while f is not None:
            code = f.f_code
            if code is _TRACE_CODE:
                break
            if code.co_argcount and not _file_in(code.co_filename, (_FX_DIR,)):
                first = code.co_varnames[0]  # (usually "self"; a method may name it otherwise)
                owner = f.f_locals.get(first)
                if isinstance(owner, nn.Module) and (first == "self" or _is_method(owner, code)):
                    path = paths.get(owner)
                    if path is not None:
                        out.append((path, code))
            f = f.f_back
        out.reverse()
        return tuple(out)


_TRACE_CODE = fx.Tracer.trace.__code__


def _is_method(owner: nn.Module, code: Any) -> bool:
    """Whether ``code`` is the code of a method of ``owner``'s class (and not a function given a module)."""
    fn = inspect.getattr_static(type(owner), code.co_name, None)
    while fn is not None and not isinstance(fn, type):
        if getattr(fn, "__code__", None) is code:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False

try:  # code generated only when used: most discovery graphs are only read
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover
    _GraphModule = fx.GraphModule


def trace_scope(module: nn.Module, module_path: str = "", method: str = "forward", *, permissive: bool = False,
                leaves: Optional[set[int]] = None, failing: Optional[dict] = None) -> Scope:
    """Trace ``module.<method>`` (see the module doc); raise the tracer's error if its own code fails.

    ``leaves``: ids of submodules to keep opaque from the start. ``failing``: a cache shared between
    calls: submodule classes that failed before start as leaves, which saves a retry per layer.
    ``Scope.mode_dependent`` says whether the graph may differ between training and eval mode (it reads
    ``.training`` somewhere, or has a dropout). A strict trace whose code reads or sets the autocast state
    (``torch.is_autocast_enabled()``, ``with torch.autocast(...)``) fails: its graph would not follow it.
    """
    forced = set(leaves or ())
    failing = failing if failing is not None else {}
    for sub in module.modules():
        if sub is not module and type(sub) in failing:
            forced.add(id(sub))

    before = set(vars(module))
    for _ in range(_MAX_LEAF_RETRIES):
        tracer = _Tracer(forced, permissive)
        tracer.traced_func_name = method
        codes: set = set()
        autocast: list[str] = []
        grad_modes: list[str] = []
        stores: list[str] = []
        state = _snapshot(module)
        try:
            graph = _trace_watching(tracer, module, codes, autocast, grad_modes, stores)
            gm = _GraphModule(module, graph, type(module).__name__)
        except Exception as err:
            culprit = getattr(err, "_fxfuse_module", None)
            if not culprit:
                raise
            sub = module.get_submodule(culprit)
            if id(sub) in forced:  # (kept opaque already, and still failing: its call's arguments are the cause)
                raise
            failing[type(sub)] = err
            # Every module of that class (the same attention in each layer) is kept opaque at once.
            forced.update(id(m) for m in module.modules() if type(m) is type(sub) and m is not module)
            log.debug("fxfuse: %s kept opaque in %s.%s: %s", culprit, module_path or "<root>", method, _short(err))
            continue
        finally:
            constants = _take_new_attributes(module, before, tracer)
            effects = _changes(state)
            _restore(state)
        used = _autocast_used(autocast)
        if used and not permissive:
            raise AutocastStateError(f"its code uses the autocast state ({used}), which a traced graph would not "
                                     "follow")
        effects += [e for e in dict.fromkeys(stores) if e not in effects]
        if effects and not permissive:
            raise SideEffectError(f"its code changes state a traced graph would not change ({', '.join(effects[:3])})")
        modes = ", ".join(dict.fromkeys(grad_modes))
        if modes and not permissive:
            raise GlobalModeError(f"its code switches or reads torch's global modes ({modes}), which FX does not "
                                  "record: the graph would run with the modes of its trace, not the caller's")
        leaf_paths = {n.target for n in graph.nodes if n.op == "call_module"}
        opaque = {p for p in leaf_paths if id(module.get_submodule(p)) in forced}
        return Scope(module_path, method, gm, tracer.arg_specs, sorted(opaque), tracer.permissive_used,
                     tracer.permissive_reason, constants, _mode_dependent(gm, codes), autocast_free=not autocast,
                     autocast_used=used, modes_used=modes, side_effects=effects, calls=tracer.calls)
    raise RuntimeError(f"too many submodules fail to trace (> {_MAX_LEAF_RETRIES})")


def _autocast_used(names: list) -> str:
    """What the traced code used of the autocast state, in a few words ("" for nothing or unknown)."""
    names = [n for n in names if n is not None]
    if any(n.startswith("torch.amp.") for n in names):
        return "torch.autocast"
    return ", ".join(sorted(set(names))[:3])


class AutocastStateError(RuntimeError):
    """A method's code reads or sets the autocast state: a graph traced from it would not follow it."""


class GlobalModeError(RuntimeError):
    """A method's code switches grad mode (``with torch.no_grad():``) or reads one of torch's global modes
    (``torch.is_grad_enabled()``, ``torch.are_deterministic_algorithms_enabled()``): FX records no node for either,
    so a graph traced from it would compute those ops with gradients (or fuse a chain across the switch), or
    take the branch its trace took whatever the caller's mode."""


# torch's global modes that model code may read to pick a branch (each a C function or one of torch's own).
_MODE_READS = {"is_grad_enabled", "is_inference_mode_enabled", "are_deterministic_algorithms_enabled",
               "is_deterministic_algorithms_warn_only_enabled", "is_anomaly_enabled", "is_anomaly_check_nan_enabled"}


class ParameterConstantError(RuntimeError):
    """A method's code computes a tensor from a parameter outside the tracer's view (its parameters read through
    ``named_parameters()``): the graph would hold the result as a constant of trace time."""


class SideEffectError(RuntimeError):
    """A method's code changes Python state as it runs (``self.cache = h``, ``self.calls += 1``,
    ``log.append(h)`` on a list that outlives the call): the traced graph computes tensors only, so a host
    running it would skip those changes."""


_CONTAINER_WRITES = {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove",
                     "discard", "clear", "appendleft", "extendleft"}
# Code whose container writes are its own business (torch, fxfuse, the standard library), not the model's.
_LIBRARY_DIRS = (_TORCH_DIR, _FXFUSE_DIR, _STDLIB_DIR)


def _trace_watching(tracer: _Tracer, module: nn.Module, codes: set, autocast: list, grad_modes: list,
                    stores: list) -> fx.Graph:
    """:func:`_trace_watched`, and whether the code drew from Python's or NumPy's global random generators
    (``random.random() < self.layerdrop``: the trace would keep that one draw's branch for every call), which are
    put back as they were."""
    generators = _python_generators()
    states = [get() for _, get, _ in generators]
    try:
        return _trace_watched(tracer, module, codes, autocast, grad_modes, stores)
    finally:
        for (name, get, put), before in zip(generators, states):
            if not _same_state(get(), before):
                stores.append(f"a draw from {name} random generator")
                put(before)


def _python_generators() -> list[tuple[str, Callable, Callable]]:
    """``(name, get_state, set_state)`` of Python's global random generator, and NumPy's where it is imported."""
    out = [("Python's", random.getstate, random.setstate)]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out.append(("NumPy's global", numpy.random.get_state, numpy.random.set_state))
    return out


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # (NumPy's key array)
        return a.shape == b.shape and bool((a == b).all())
    return a == b


def _trace_watched(tracer: _Tracer, module: nn.Module, codes: set, autocast: list, grad_modes: list,
                   stores: list) -> fx.Graph:
    """``tracer.trace(module)``, collecting the code objects that ran and read a ``training`` attribute, the
    names of the autocast functions and contexts the code used (``None`` in ``codes`` and ``autocast`` when
    that cannot be watched: another profiler is installed), the grad-mode switches it made (seen by the
    profiler, or, without one, as ops recorded in another grad mode than the trace began in) and the writes of
    the model's code to Python containers that are not its own locals (``log.append(h)``)."""
    grad_at_start = torch.is_grad_enabled()
    if sys.getprofile() is not None:
        codes.add(None)
        autocast.append(None)
        with _functions_as_calls(tracer):
            graph = tracer.trace(module)
        if any(n.meta.get("fxfuse_grad") is not grad_at_start for n in graph.nodes if "fxfuse_grad" in n.meta):
            grad_modes.append("a grad-mode switch")
        return graph

    watched: dict[tuple[int, str], tuple[dict, str, Any]] = {}  # (globals, name) -> the value before
    written: dict[int, tuple[Any, Any]] = {}  # id -> (a container kept outside the call, its items before)

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if "training" in code.co_names:
                codes.add(code)
            for name in _stored_globals(code):  # (model code with ``global N``: is N changed by the end?)
                watched.setdefault((id(frame.f_globals), name), (frame.f_globals, name,
                                                                 frame.f_globals.get(name, _MISSING)))
            if code.co_filename.endswith("autocast_mode.py"):  # torch.autocast's __enter__, amp's helpers
                autocast.append(f"torch.amp.{code.co_name}")
            elif code.co_name == "__enter__" and code.co_filename.endswith("grad_mode.py"):  # inference_mode, ...
                grad_modes.append(f"torch.{code.co_qualname.split('.')[0]}")
            elif code.co_name in _MODE_READS and _model_code(frame.f_back):  # torch's Python readers
                grad_modes.append(f"torch.{code.co_name}()")
        elif event == "c_call":
            name = getattr(arg, "__name__", "")
            if "autocast" in name:  # torch.is_autocast_enabled, ...
                autocast.append(f"torch.{name}")
            elif name == "_set_grad_enabled" and not grad_modes:  # (no_grad() etc. were named at __enter__)
                grad_modes.append("torch.set_grad_enabled")
            elif name in _MODE_READS and _model_code(frame):
                grad_modes.append(f"torch.{name}()")
            elif name in _CONTAINER_WRITES and type(getattr(arg, "__self__", None)) in (list, dict, set) \
                    and _model_code(frame):
                owner = arg.__self__
                if not any(v is owner for v in frame.f_locals.values()):
                    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                    stores.append(f"{type(owner).__name__}.{name} on a {type(owner).__name__} kept outside the call"
                                  f" ({where})")
                    if id(owner) not in written:  # (before this first write: undone after the trace)
                        written[id(owner)] = (owner, type(owner)(owner))

    # No garbage collection while watching: a finalizer of some earlier object (its __del__, a weakref callback)
    # would run inside the trace and read as the traced code's.
    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        with _functions_as_calls(tracer):
            return tracer.trace(module)
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
        for g, name, old in watched.values():
            if g.get(name, _MISSING) is not old:  # recorded, and undone: tracing leaves the model's module as it was
                stores.append(f"global {name}")
                if old is _MISSING:
                    g.pop(name, None)
                else:
                    g[name] = old
        for owner, items in written.values():  # (``ACTIVATIONS.append(h)``: no proxy left in the user's list)
            owner.clear()
            if type(owner) is list:
                owner.extend(items)
            else:
                owner.update(items)


# Custom autograd.Functions whose backward is exactly the gradient of their forward: traced through (their ops
# fuse). Bloom's is the tanh GELU with its derivative written out (``bloom_gelu_back``).
_TRANSPARENT_FUNCTIONS = {"transformers.models.bloom.modeling_bloom.GeLUFunction"}


@contextlib.contextmanager
def _functions_as_calls(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing, a custom ``torch.autograd.Function`` applied to traced values is recorded as one call of it
    (FX would run its ``forward`` on the proxies and record those ops: its own ``backward`` would be lost, say a
    gradient-reversal layer's). Such a call is no pointwise op, so no chain is fused across it (but across those
    known to be their forward's exact gradient, ``_TRANSPARENT_FUNCTIONS``)."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if f"{cls.__module__}.{cls.__qualname__}" not in _TRANSPARENT_FUNCTIONS and \
                any(isinstance(a, fx.Proxy) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            return tracer.create_proxy("call_function", _applier(cls), args, kwargs)
        return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original


_APPLIERS: dict[type, Any] = {}


def _applier(cls: type) -> Any:
    """``cls.apply`` as a function of this module (FX writes a torch function's call by its import path, which
    ``Function.apply`` bound to a class has none of; this one it keeps as a global of the graph's code)."""
    fn = _APPLIERS.get(cls)
    if fn is None:
        def fn(*args, **kwargs):
            return cls.apply(*args, **kwargs)
        fn.__name__ = fn.__qualname__ = f"{cls.__name__}_apply"
        _APPLIERS[cls] = fn
    return fn


def _model_code(frame: Any) -> bool:
    """Whether ``frame`` runs the model's code (not torch's, fxfuse's or the standard library's)."""
    return frame is not None and not _file_in(frame.f_code.co_filename, _LIBRARY_DIRS)


_GLOBAL_STORES: dict[Any, tuple[str, ...]] = {}


def _stored_globals(code: Any) -> tuple[str, ...]:
    """The module globals a code object of the model's assigns or deletes (``global N; N += 1``)."""
    names = _GLOBAL_STORES.get(code)
    if names is None:
        names = () if _file_in(code.co_filename, _LIBRARY_DIRS) else tuple(
            ins.argval for ins in dis.get_instructions(code) if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"))
        _GLOBAL_STORES[code] = names
    return names


_DROPOUT_TARGETS = {F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


def _mode_dependent(gm: fx.GraphModule, codes: set) -> bool:
    if None in codes or any(not _file_in(c.co_filename, (_TORCH_DIR,)) for c in codes):
        return True
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.modules.dropout._DropoutNd):
            return True
        if node.op == "call_function" and node.target in _DROPOUT_TARGETS:
            return True
    return False


_State = list[tuple[nn.Module, dict, dict, dict, dict]]
_MISSING = object()


def _snapshot(module: nn.Module) -> _State:
    """The attributes of every module below ``module`` (model code may cache values on modules while it
    runs: with a tracer those would be proxies), and copies of the public lists, dicts and sets among them."""
    return [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers),
             {k: type(v)(v) for k, v in vars(m).items() if type(v) in (list, dict, set) and not k.startswith("_")})
            for m in module.modules()]


def _same_items(a: Any, b: Any) -> bool:
    if type(a) is dict:
        return a.keys() == b.keys() and all(v is b[k] for k, v in a.items())
    return len(a) == len(b) and (type(a) is set or all(x is y for x, y in zip(a, b)))


def _changes(state: _State) -> list[str]:
    """What tracing set on the modules of ``state`` (``self.cache = h``, ``self.calls += 1``, a list attribute
    appended to, ``self.cache[key] = h``): a graph would not do that on each call."""
    out = []
    for m, attrs, params, buffers, containers in state:
        current = vars(m)
        for k in sorted(current.keys() | attrs.keys()):
            new = current.get(k, _MISSING)
            if new is not attrs.get(k, _MISSING) or (k in containers and not _same_items(new, containers[k])):
                out.append(f"{type(m).__name__}.{k}")
        for live, saved in ((m._parameters, params), (m._buffers, buffers)):
            out += [f"{type(m).__name__}.{k}" for k in sorted(live.keys() | saved.keys())
                    if live.get(k, _MISSING) is not saved.get(k, _MISSING)]
    return out


def _restore(state: _State) -> None:
    """Undo whatever tracing changed on the user's modules."""
    for m, attrs, params, buffers, containers in state:
        current = vars(m)
        if current.keys() != attrs.keys() or any(current[k] is not v for k, v in attrs.items()):
            current.clear()
            current.update(attrs)
        for k, saved in containers.items():  # (the same list or dict: what tracing wrote into it, proxies too)
            live = attrs[k]
            if not _same_items(live, saved):
                live.clear()
                if type(live) is list:
                    live.extend(saved)
                else:
                    live.update(saved)
        for live, saved in ((m._parameters, params), (m._buffers, buffers)):
            if live.keys() != saved.keys() or any(live[k] is not v for k, v in saved.items()):
                live.clear()
                live.update(saved)


def _take_new_attributes(module: nn.Module, before: set[str], tracer: fx.Tracer) -> dict[str, Any]:
    """The tracer stores tensor constants on the traced module (``_tensor_constant0``): move them off the user's
    module. Other new attributes are the traced code's own (``self.last_hidden = h``): left for :func:`_changes`
    to see (a side effect) and :func:`_restore` to undo."""
    constants = set(getattr(tracer, "tensor_attrs", {}).values())
    created = {k: v for k, v in vars(module).items()
               if k not in before and (k in constants or _TRACER_CONSTANT.fullmatch(k))}
    for k in created:
        delattr(module, k)
    return created


_TRACER_CONSTANT = re.compile(r"_\w+_constant_?\d+")  # (fx's names for other constants it interns)


# ------------------------------------------------------------------------------------------- discovery

@dataclass
class Discovery:
    scopes: list[Scope] = field(default_factory=list)
    failures: list[CaptureFailure] = field(default_factory=list)


def discover(model: nn.Module) -> Discovery:
    """Trace the model top-down, as large as possible, to find where its chains are (see the module doc)."""
    out = Discovery()
    failing: dict = {}
    _visit(model, "", out, failing, set())
    return out


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _visit(module: nn.Module, path: str, out: Discovery, failing: dict, seen: set[int]) -> None:
    if id(module) in seen:
        return
    if any(is_lazy(p) for p in module.parameters()):  # (no shapes to plan with, nor a forward to trace)
        seen.add(id(module))
        out.failures.append(CaptureFailure(path, LAZY_NOTE))
        return
    # (an experts module's own 2-D parameters are its biases, gpt-oss's: not weights of a chain to capture)
    experts = _stacked_weights(module) >= 2
    if experts or weight_count(module) < 2:
        if experts or _holds_stacked_experts(module):  # say why a mixture of experts stays as it is
            seen.add(id(module))
            out.failures.append(CaptureFailure(path, MOE_NOTE))
        elif weight_count(module) == 1 and isinstance(failing.get(type(module)), Exception):
            # (kept opaque in its parent's trace, with a linear a chain may run through: DeBERTa's ContextPooler,
            # whose forward builds its activation module on each call, then the classifier)
            seen.add(id(module))
            out.failures.append(CaptureFailure(path, f"{_short(failing[type(module)])} (kept opaque: a chain "
                                                     "through its linear is not seen)"))
        return
    seen.add(id(module))
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or type(module).forward is nn.Module.forward:
        for name, child in module.named_children():
            _visit(child, _join(path, name), out, failing, seen)
        return
    try:
        # A class whose forward failed in its own code fails again (attention in every layer): skip it.
        known = failing.get(("forward", type(module)))
        if known is not None:
            raise known
        scope = trace_scope(module, path, permissive=True, failing=failing)
    except Exception as err:
        failing[("forward", type(module))] = err
        out.failures.append(CaptureFailure(path, _short(err)))
        log.debug("fxfuse: %s could not be traced: %s", path or "<root>", _short(err))
        for method in _candidate_methods(module):
            try:
                out.scopes.append(trace_scope(module, path, method, permissive=True, failing=failing))
            except Exception as m_err:
                log.debug("fxfuse: %s.%s could not be traced: %s", path or "<root>", method, _short(m_err))
        for name, child in module.named_children():
            _visit(child, _join(path, name), out, failing, seen)
        return
    out.scopes.append(scope)
    if scope.permissive_used:  # only its chains are used (each from a method that traces strictly)
        out.failures.append(CaptureFailure(path, scope.permissive_reason))
    # Whatever the trace kept opaque may hold chains of its own.
    for node in scope.gm.graph.nodes:
        if node.op == "call_module":
            sub = module.get_submodule(node.target)
            if not is_known_activation(sub):
                _visit(sub, _join(path, node.target), out, failing, seen)


LAZY_NOTE = ("a lazy module not yet initialized (nn.LazyLinear & co.): call the model once, or pass example_inputs "
             "to optimize, before optimizing it")
MOE_NOTE = ("mixture of experts (stacked 3-D expert weights): its per-expert MLPs run behind data-dependent "
            "routing, which fxfuse does not fuse")


def _holds_stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` keeps at least two 3-D weights outside convolutions: experts stacked along dim 0, as
    transformers' ``MixtralExperts`` / ``Qwen3MoeExperts`` keep ``gate_up_proj`` and ``down_proj``."""
    return sum(_stacked_weights(mod) for mod in module.modules()
               if not isinstance(mod, nn.modules.conv._ConvNd)) >= 2


def _stacked_weights(module: nn.Module) -> int:
    """The 3-D parameters ``module`` holds itself with more than one expert along dim 0 (a ``[1, N, D]`` class
    token, mask token or position embedding, as ViT's and ViT-MAE's decoder keep, is not a stack of experts)."""
    return sum(1 for p in module.parameters(recurse=False) if not is_lazy(p) and p.dim() == 3 and p.shape[0] > 1)


def _candidate_methods(module: nn.Module) -> list[str]:
    """Methods (other than ``forward``) of the module's class that call at least two of its submodules
    and take an input: where a chain spanning siblings lives when ``forward`` itself cannot be traced."""
    if hasattr(type(module), "from_pretrained"):  # a whole model: its methods are not computations
        return []
    children = set(module._modules)
    found = []
    for cls in type(module).__mro__:
        if cls in (nn.Module, object) or cls.__module__.startswith("torch.nn.modules.module"):
            break
        for name, fn in vars(cls).items():
            if name == "forward" or name.startswith("__") or name in found or not inspect.isfunction(fn):
                continue
            if name in _LIFECYCLE_NAMES or name.startswith(_LIFECYCLE_PREFIXES):
                continue
            code = inspect.unwrap(fn).__code__
            if code.co_argcount < 2:
                continue
            if len(children & set(code.co_names)) >= 2:
                found.append(name)
    return found


# ------------------------------------------------------------------------------------------ example inputs

def record_inputs(model: nn.Module, example_inputs: tuple) -> dict[int, tuple[tuple, dict]]:
    """Run ``model`` once (without gradients, leaving it as it was: :func:`leaving_unchanged`) and keep the
    ``(args, kwargs)`` of the first call of every submodule."""
    seen: dict[int, tuple[tuple, dict]] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if id(mod) not in seen:
            seen[id(mod)] = (args, dict(kwargs))

    handles = []
    try:
        with leaving_unchanged(model, example_inputs), torch.no_grad():
            handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]
            try:
                model(*example_inputs)
            finally:
                for h in handles:
                    h.remove()
    except Exception as err:
        log.info("fxfuse: running the example inputs failed (%s); shapes stay unknown", _short(err))
    return seen


@contextlib.contextmanager
def leaving_unchanged(module: nn.Module, inputs: Any = (), values: bool = True) -> Iterator[None]:
    """Run the user's code (``module``'s, on example ``inputs``) and leave the model as it was: a training-mode
    forward updates BatchNorm's running statistics, ``self.steps += 1`` a buffer, ``self.cache = h`` an attribute,
    and a dropout draws from the random generator. Afterwards every module's attributes and parameter and buffer
    dicts hold what they held (:func:`_restore`), every buffer its values (copied back from a clone, in place), and
    the random generators (the CPU's, and those of the CUDA devices of the model's tensors and of ``inputs``)
    their states. Parameters are neither copied nor written back (a forward that writes one in place keeps it).
    ``values=False``: the code runs on proxies (a symbolic trace), which write no tensor: the buffers' values are
    neither copied nor compared (a meta-device model's cannot be)."""
    state = _snapshot(module)
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for m in module.modules() if values else ():
        for t in m._buffers.values():
            if isinstance(t, torch.Tensor) and id(t) not in saved \
                    and not isinstance(t, nn.parameter.UninitializedTensorMixin):
                with torch.no_grad():
                    saved[id(t)] = (t, t.detach().clone())
    tensors = [*module.parameters(), *(t for t, _ in saved.values()),
               *(t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
    devices = sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                      for t in tensors if t.device.type == "cuda"})
    generators = _python_generators()  # (Python's and NumPy's draws: LayerDrop written with random.uniform)
    states = [get() for _, get, _ in generators]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for (_, _, put), before in zip(generators, states):
            put(before)
        _restore(state)
        with torch.no_grad():
            for t, copy in saved.values():
                try:
                    if t.shape != copy.shape or t.dtype != copy.dtype:  # (``self.buf.data = ...``, ``resize_``)
                        t.data = copy
                    elif not torch.equal(t, copy):  # (an unchanged one keeps its version counter)
                        t.copy_(copy)
                except Exception as err:  # pragma: no cover - a buffer that cannot be written back
                    log.warning("fxfuse: could not restore a buffer the example inputs changed (%s)", _short(err))
