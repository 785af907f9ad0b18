"""Install: the optimized model, a copy of the user's in which each host method runs its fused graph.

The result is a shallow copy of the user's model in which every module is a shallow copy (its own training
flag, submodule dict and hook dicts; parameters and buffers shared); each host copy gets a subclass of its own
class that overrides the host method with a *guarded* call of the fused graph. The guards check, on each call,
what the strict trace assumed:

* the arguments: required ones are not ``None``; those traced with their default still have it
  (``None``, a flag); ``*args`` / ``**kwargs`` are empty;
* the module's training mode is the one it was traced in (dropout was removed in eval mode);
* the submodules whose calls the graph absorbed or traced into are the same objects, in the modes they were
  traced in, without hooks or an instance ``forward`` (the graph skips their ``__call__``), and no global module
  hook is registered;
* what the trace baked in is unchanged: the host's settings its method reads (``self.scale``, and through a
  plain object, ``self.config.scale``), those submodules' settings, the module-level plain values and functions
  the method and their forwards read (``SCALE = 2.0``), and the class's method itself (not patched since);
* the fused weights share one dtype (code like T5's ``if hidden.dtype != self.wo.weight.dtype: cast`` is
  traced for the uniform case); under autocast, only a graph whose trace touched no autocast state runs (a
  method that reads or sets it is not a host at all, :class:`fxfuse.capture.AutocastStateError`; one traced
  while another profiler hid that runs only without autocast), and each fused region in it follows autocast
  itself (:mod:`fxfuse.autocast`).

A call that fails a guard runs the original method, so the result is always the original function.
Everything else (class, methods such as ``generate``, ``config``, parameters, buffers, hooks) is the
user's model: ``state_dict()`` has the same keys and tensors, ``.to()`` acts on the same tensors (``.eval()``
only on the model it is called on), and the fused graph reads the parameters through ``self`` on every call.

Example:
    >>> import fxfuse, torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> opt = fxfuse.optimize(mlp)
    >>> [path for path, _ in fused_graphs(opt)]
    ['forward']
    >>> opt.state_dict().keys() == mlp.state_dict().keys()
    True
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import types
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch.fx as fx
from torch import nn

from .autocast import any_autocast as _any_autocast
from .capture import ArgSpec, Scope
from .inline import InlineChain, install_parts
from .kernels.template import kernels_run
from .lift import lift_params
from .meta import param_getter
from .module_state import GLOBAL_HOOKS, GlobalReads, Settings, original_because, runs_own_code, self_reads, submodule
from .shortcut import Shortcut, region_call
from .transforms import checkpointed

if TYPE_CHECKING:
    from .hosts import Host

__all__ = ["Install", "assemble", "bind_call", "fused_graphs", "guard_text"]

_GRAPHS_ATTR = "_fxfuse_graphs"
_MODULES_ATTR = "_fxfuse_modules_"  # + the method's name: what _changed reads (_installed_modules)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ guarded call

def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(a) in (int, float, str) and a == b)


def bind_call(scope_or_specs: Any, args: tuple, kwargs: dict, sig: Optional[inspect.Signature] = None) \
        -> Optional[list]:
    """The placeholder values for a call, or ``None`` when the call is not one the graph stands for."""
    specs: list[ArgSpec] = scope_or_specs.args if isinstance(scope_or_specs, Scope) else scope_or_specs
    if sig is None:
        sig = _signature_of(specs)
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    values = []
    for s in specs:
        if s.mode == "empty":
            if bound.get(s.name):
                return None
        elif s.mode == "const":
            if s.name in bound and not _same(bound[s.name], s.value):
                return None
        else:
            v = bound.get(s.name)
            if v is None:
                return None
            values.append(v)
    return values


def guard_text(specs: list[ArgSpec]) -> str:
    """The calls a graph traced with ``specs`` stands for, as text: ``bias=None, no **kwargs``."""
    parts = []
    for s in specs:
        if s.mode == "const":
            parts.append(f"{s.name}={s.value!r}")
        elif s.mode == "empty":
            parts.append(f"no {'*' if s.kind is inspect.Parameter.VAR_POSITIONAL else '**'}{s.name}")
    return ", ".join(parts)


def _signature_of(specs: list[ArgSpec]) -> inspect.Signature:
    params = [inspect.Parameter(s.name, s.kind, default=s.value if s.has_default else inspect.Parameter.empty)
              for s in specs]
    return inspect.Signature(params)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _bypassed(scope: Scope) -> list[str]:
    """The submodules the trace called that the fused graph does not call as modules (traced into, or absorbed
    into a region): their hooks and an instance ``forward`` would not run in it."""
    kept = Counter(str(n.target) for n in scope.gm.graph.nodes if n.op == "call_module")
    return [path for path, n in Counter(scope.calls).items() if kept[path] < n]


def _changed(self: nn.Module, attr: str) -> Optional[str]:
    """Why the fused graph would not compute what the method computes now, or None. ``self.<attr>``:
    ``(number of children, hook dicts, own settings, ((first path part, other parts, module, class, training mode
    or None, settings, number of children, called), ...), module-level names)`` of the submodules in
    :func:`_bypassed` (called) and the containers below the host (``ModuleList``: not called, iterated), as
    installed (their mode where the graph depends on it); the hook dicts are those submodules' own (torch's global ones,
    :data:`fxfuse.module_state.GLOBAL_HOOKS`, are checked as well); the module-level names
    (:class:`fxfuse.module_state.GlobalReads`) are the plain globals the method and those submodules' forwards
    read; the settings (:class:`fxfuse.module_state.Settings`) are the host's that its method reads
    and those submodules'.

    The graph skips those modules' ``__call__`` and baked in what they were: one replaced or removed, one with
    hooks or an instance ``forward`` (accelerate's), one in another mode (a dropout switched on alone, as Monte
    Carlo dropout does), a setting changed in place (``act.approximate``), its class swapped, a global module
    hook, or children added (a ``Sequential`` runs them all, a loop over a ``ModuleList`` too) makes the original
    method run. This runs on every call of a fused
    method (the hook dicts are bound once: torch mutates them and never rebinds them), so it only tests;
    :func:`_what_changed` says what."""
    kept = self.__dict__.get(attr)
    if kept is None:  # (not installed by assemble)
        return None
    n_children, hooks, own, inner, glob = kept
    children = self._modules
    # (torch's global hook dicts are read here, not kept: a deep copy of the model would copy kept ones)
    if len(children) != n_children or any(hooks) or any(GLOBAL_HOOKS) or (glob is not None and glob.changed()):
        return _what_changed(self, kept)
    try:
        if own is not None and (own.read(self.__dict__) != own.values
                                or (own.nested and own.nested_changed(self.__dict__))  # (self.config.x)
                                or (own.absent and own.filled(self.__dict__))):
            return _what_changed(self, kept)
        for first, rest, want, cls, training, settings, n, called in inner:
            m = children.get(first)
            for part in rest:
                m = m._modules.get(part) if m is not None else None
            if m is not want or m.__class__ is not cls or len(m._modules) != n:
                return _what_changed(self, kept)
            state = m.__dict__  # (read here: a deep copy or unpickling gives the module a new one)
            if (called and "forward" in state) \
                    or (training is not None and state.get("training", training) is not training) \
                    or (settings is not None and (settings.read(state) != settings.values
                                                  or (settings.nested and settings.nested_changed(state))
                                                  or (settings.absent and settings.filled(state)))):
                return _what_changed(self, kept)
    except KeyError:  # a setting deleted
        return _what_changed(self, kept)
    return None


def _what_changed(self: nn.Module, kept: tuple) -> str:
    n_children, _, own, inner, glob = kept
    if len(self._modules) != n_children:
        return "its submodules were added or removed"
    if any(GLOBAL_HOOKS):
        return "a global module hook is registered"
    if glob is not None and glob.changed():
        return glob.what_changed()
    if own is not None and own.changed(self):
        return f"its {own.what_changed(self)}"
    for first, rest, want, cls, training, settings, n, called in inner:
        name, m = ".".join((first, *rest)), submodule(self, (first, *rest))
        if m is not want:
            return f"{name} was replaced or removed"
        if m.__class__ is not cls:
            return f"{name}'s class was changed to {m.__class__.__qualname__}"
        if len(m._modules) != n:
            return f"{name}'s submodules were added or removed"
        if called and runs_own_code(m):
            return f"{name} has hooks or its own forward"
        if training is not None and m.training is not training:
            return f"{name} is in {'training' if m.training else 'eval'} mode"
        if settings is not None and settings.changed(m):
            return f"{name}.{settings.what_changed(m)}"
    return "a submodule changed"


def _installed_modules(host: nn.Module, paths: list[str], modal: bool, method: Any) -> tuple:
    """What :func:`_changed` reads, for the submodules at ``paths`` of ``host`` as installed, whose method
    ``method`` was fused."""
    inner, hooks = [], []
    functions = [(method, type(host))]  # (whose module-level names the trace may have baked in)
    for path in paths:
        m = host.get_submodule(path)
        first, *rest = path.split(".")
        # (a submodule's forward traced into the graph: its private settings and config objects it reads, too)
        settings = Settings.of(m, reads=self_reads(type(m).forward, type(m)))
        inner.append((first, tuple(rest), m, type(m), m.training if modal else None, settings, len(m._modules),
                      True))
        hooks += [m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks]
        functions.append((type(m).forward, type(m)))
    # The containers below the host that the trace may have iterated without calling them (``for layer in
    # self.layers``): a layer appended or removed there makes the original method run.
    for path, m in host.named_modules():
        if path and path not in paths and isinstance(m, _CONTAINERS):
            first, *rest = path.split(".")
            inner.append((first, tuple(rest), m, type(m), None, None, len(m._modules), False))
    return len(host._modules), tuple(hooks), Settings.of(host, self_reads(method, type(host))), tuple(inner), \
        GlobalReads.of(functions)


def _make_method(orig: Any, specs: list[ArgSpec], fused: Any, training: Optional[bool], weight_paths: list[str],
                 lifted_paths: Sequence[str] = (), autocast_free: bool = False, shortcut_attr: Optional[str] = None,
                 modules_attr: Optional[str] = None, *, owner: tuple[type, str]):
    """The host method: the fused graph when the guards hold, else the original method.

    ``training``: the mode the graph was traced in, ``None`` when the graph is the same in both.
    ``autocast_free``: the graph may run under autocast (its trace touched no autocast state; each fused region
    then follows autocast itself, :mod:`fxfuse.autocast`).
    ``lifted_paths``: the parameters the fused graph takes as trailing arguments (:mod:`fxfuse.lift`), read
    here through the modules' dicts on every call.
    ``shortcut_attr``: the instance attribute holding the module's :class:`fxfuse.shortcut.Shortcut` (a graph
    that is one region on one input): a call of that input alone tries it first, and teaches it afterwards.
    ``modules_attr``: the instance attribute :func:`_changed` reads (the submodules as installed).
    ``owner``: ``(class, method name)`` that ``orig`` was read from: a class whose method was replaced since (a
    library's patch of ``LlamaMLP.forward``) runs its new method, which the graph does not stand for."""
    sig = _signature_of(specs)
    guards = guard_text(specs) or "required arguments not None"
    # A positional call of exactly the leading required parameters needs no binding.
    n_fast = 0
    for s in specs:
        if s.mode == "proxy" and s.kind in _POSITIONAL and not s.has_default:
            n_fast += 1
        else:
            break
    if any(s.mode == "proxy" for s in specs[n_fast:]):
        n_fast = -1
    get_lifted = param_getter(list(lifted_paths)) if lifted_paths else None
    get_weights = param_getter(weight_paths) if len(weight_paths) > 1 else None
    # The dtype guard's weights among the lifted tensors (read once per call), when all of them are.
    in_lifted = [lifted_paths.index(p) for p in weight_paths] if get_weights is not None and \
        all(p in lifted_paths for p in weight_paths) else None
    weight_at = in_lifted if in_lifted is not None else range(len(weight_paths))  # the weights' places in ws

    owner_cls, name = owner

    def method(self, *args, **kwargs):
        if getattr(owner_cls, name) is not orig:  # (patched on the class since)
            original_because(self, f"{owner_cls.__qualname__}.{name} was replaced since it was fused")
            return getattr(owner_cls, name)(self, *args, **kwargs)
        if not kernels_run():  # (a CPU-only process: every region would run its original ops)
            return orig(self, *args, **kwargs)
        if checkpointed():  # (its recomputation must run what this forward runs: see transforms.checkpointed)
            original_because(self, "it records gradients inside activation checkpointing")
            return orig(self, *args, **kwargs)
        if (training is None or self.training is training) and (autocast_free or not _any_autocast()):
            if modules_attr is not None:
                why = _changed(self, modules_attr)
                if why is not None:
                    original_because(self, f"{why} since it was fused")
                    return orig(self, *args, **kwargs)
            extra = get_lifted(self) if get_lifted is not None else ()
            if extra is None:  # a tensor the graph reads is None or gone now
                original_because(self, "a parameter or buffer the fused graph reads is None or gone")
                return orig(self, *args, **kwargs)
            shortcut = None
            if shortcut_attr is not None and not kwargs and len(args) == 1:
                shortcut = self.__dict__.get(shortcut_attr)
                if shortcut is not None:  # (its entries check the dtype of every region tensor, among the rest)
                    out = shortcut(args[0], extra)
                    if out is not None:
                        return out
            if get_weights is not None:
                ws = extra if in_lifted is not None else get_weights(self)
                if ws is None:
                    original_because(self, "a fused weight is None or gone")
                    return orig(self, *args, **kwargs)
                dtype = ws[weight_at[0]].dtype
                for i in weight_at:
                    if ws[i].dtype is not dtype:
                        original_because(self, "its fused weights' dtypes differ")
                        return orig(self, *args, **kwargs)
            if not kwargs and len(args) == n_fast:
                for a in args:
                    if a is None:
                        original_because(self, "a call passed None for an argument the graph takes as a tensor")
                        return orig(self, *args, **kwargs)
                if shortcut is not None:
                    out = fused(self, *args, *extra)
                    shortcut.learn(args[0], extra)
                    return out
                return fused(self, *args, *extra)
            values = bind_call(specs, args, kwargs, sig)
            if values is not None:
                return fused(self, *values, *extra)
            # (said once: a model that passes such an argument on every call never runs the fused graph)
            original_because(self, f"a call's arguments are not those it was traced for ({guards})")
        elif training is not None and self.training is not training:
            original_because(self, f"it was fused in {'training' if training else 'eval'} mode and runs in "
                                   f"{'training' if self.training else 'eval'} mode")
        else:
            original_because(self, "it runs under autocast and its traced code touches autocast state")
        return orig(self, *args, **kwargs)

    functools.update_wrapper(method, orig)
    return method


_class_cache: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _host_class(orig_cls: type, methods: dict[str, tuple], graphs: dict[str, fx.GraphModule]) -> type:
    """A subclass of ``orig_cls`` overriding ``methods`` (``name -> (key, function)``); cached per key."""
    key = (orig_cls, tuple(sorted((name, k) for name, (k, _) in methods.items())))
    try:
        cached = _class_cache.get(key)
    except TypeError:  # an unhashable default value in a key: no caching
        key, cached = None, None
    if cached is not None:
        return cached

    def body(ns: dict) -> None:
        for name, (_, fn) in methods.items():
            ns[name] = fn
        ns[_GRAPHS_ATTR] = graphs
        ns["__module__"] = orig_cls.__module__
        ns["__qualname__"] = orig_cls.__qualname__
        ns["__reduce_ex__"] = _reduce_as_original
        ns["__copy__"] = _copy_same_class
        ns["__deepcopy__"] = _deepcopy_same_class
        ns["_fxfuse_original_class"] = orig_cls

    cls = types.new_class(orig_cls.__name__, (orig_cls,), exec_body=body)
    if key is not None:
        _class_cache[key] = cls
    return cls


def _reduce_as_original(self, protocol):
    """Pickle (``torch.save(model)``) an optimized module as the original one: optimize again after loading."""
    state = {k: v for k, v in self.__dict__.items() if not k.startswith("_fxfuse")}
    return _rebuild, (self._fxfuse_original_class, state)


def _rebuild(cls: type, state: dict) -> nn.Module:
    obj = cls.__new__(cls)
    obj.__setstate__(state)
    return obj


def _copy_same_class(self):
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    return new


def _deepcopy_same_class(self, memo):
    new = object.__new__(type(self))
    memo[id(self)] = new
    for k, v in self.__dict__.items():
        new.__dict__[k] = copy.deepcopy(v, memo)
    return new


def _code_key(gm: fx.GraphModule) -> tuple:
    fn = type(gm).forward
    glob = tuple(sorted((k, id(v)) for k, v in fn.__globals__.items() if not k.startswith("__")))
    return gm.code, glob


# --------------------------------------------------------------------------------------------- assembly

@dataclass
class Install:
    """What one module of the result gets: overridden methods (``name -> (cache key, function)``),
    fused graphs (for inspection) and instance attributes."""

    methods: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    # attribute -> (submodule paths, whether the graph depends on their modes, the fused method): set to what
    # _changed reads, as the result holds them, once it is assembled
    modules: dict[str, tuple[list[str], bool, Any]] = field(default_factory=dict)


def assemble(model: nn.Module, hosts: list[Host], inline: Sequence[InlineChain] = (),
             extra: Optional[dict[str, Install]] = None) -> nn.Module:
    """A shallow copy of ``model`` with each host's method replaced (see the module doc); ``extra``: more
    installs by module path (the experts modules of :mod:`fxfuse.moe`)."""
    by_path: dict[str, list[Install]] = {path: [inst] for path, inst in (extra or {}).items()}
    for h in hosts:
        by_path.setdefault(h.module_path, []).append(_host_install(model.get_submodule(h.module_path), h))
    for chain in inline:
        for path, (methods, attrs) in install_parts(model, chain).items():
            by_path.setdefault(path, []).append(Install(methods, {}, attrs))
    # Every module is copied (its own training flag, submodule dict and hooks; parameters and buffers shared), a
    # module reachable at two paths once, so `.train()` / `.eval()` on either model leaves the other as it was.
    installs_of: dict[int, list[Install]] = {}
    on_the_way: set[int] = set()  # the modules with installs and their parents: these must be copies
    for path, installs in by_path.items():
        installs_of.setdefault(id(model.get_submodule(path)), []).extend(installs)
        parts = path.split(".") if path else []
        on_the_way.update(id(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts) + 1))
    copied: dict[int, nn.Module] = {}

    def copy_tree(module: nn.Module) -> nn.Module:
        if id(module) in copied:
            return copied[id(module)]
        new = _copy_module(module, installs_of.get(id(module), []), required=id(module) in on_the_way)
        copied[id(module)] = new
        if new is not module:
            for name, child in module._modules.items():
                if child is not None:
                    new._modules[name] = copy_tree(child)
        return new

    root = copy_tree(model)
    for new in copied.values():  # (a model optimized before: its hosts' kept submodules are now their copies)
        for attr, kept in list(new.__dict__.items()):
            if attr.startswith(_MODULES_ATTR):
                new.__dict__[attr] = _remapped(kept, copied)
    copies = dict(root.named_modules(remove_duplicate=False))
    for path, installs in by_path.items():
        new = copies[path]
        for inst in installs:
            for attr, (paths, modal, method) in inst.modules.items():
                new.__dict__[attr] = _installed_modules(new, paths, modal, method)
    return root


def _remapped(kept: tuple, copied: dict[int, nn.Module]) -> tuple:
    """:func:`_installed_modules`'s record for a copy of its host: the submodules it kept as their copies (with
    their own hook dicts); one not copied (replaced since) stays, and keeps failing the guard."""
    n_children, _, own, inner, glob = kept
    inner = tuple((first, rest, copied.get(id(m), m), *more) for first, rest, m, *more in inner)
    hooks = tuple(d for _, _, m, *_, called in inner if called
                  for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks))
    return n_children, hooks, own, inner, glob


def _host_install(module: nn.Module, h: Host) -> Install:
    getattr(h.scope.gm, "real_recompile", lambda: None)()  # a lazy GraphModule: generate its code now
    orig = getattr(type(module), h.method)
    training = module.training if h.scope.mode_dependent else None
    # Parameters as arguments (fxfuse.lift): the module's own __getattr__ per read costs more than the dicts.
    gm, lifted = lift_params(h.scope.gm)
    autocast_free = h.scope.autocast_free
    attrs = dict(h.scope.constants)
    call = region_call(gm) if len(h.scope.args) == 1 else None
    shortcut_attr = None
    if call is not None:  # one region on the method's one input (fxfuse.shortcut): each instance keeps its own
        shortcut_attr = f"_fxfuse_shortcut_{h.method}"
        attrs[shortcut_attr] = Shortcut(call, autocast_free)
    modules_attr = f"{_MODULES_ATTR}{h.method}"
    key = (_code_key(gm), tuple(h.scope.args), training, autocast_free, tuple(h.weight_targets), tuple(lifted),
           shortcut_attr, modules_attr)
    fn = _make_method(orig, h.scope.args, type(gm).forward, training, h.weight_targets, lifted, autocast_free,
                      shortcut_attr, modules_attr, owner=(type(module), h.method))
    return Install({h.method: (key, fn)}, {h.method: h.scope.gm}, attrs,
                   {modules_attr: (_bypassed(h.scope), training is not None, orig)})


def _copy_module(module: nn.Module, installs: list[Install], required: bool = True) -> nn.Module:
    try:
        new = copy.copy(module) if not hasattr(type(module), _GRAPHS_ATTR) else _copy_same_class(module)
    except Exception as err:  # (a scripted or C++-backed module): shared, as the fused graph does not touch it
        if required:
            raise
        log.debug("%s is shared with the original model, not copied: %s", type(module).__name__, err)
        return module
    # Its own submodules and hooks (the same objects in them): a submodule set or a hook registered on the optimized
    # model is not on the user's, nor the other way round. Parameters and buffers stay shared, as documented.
    for name, value in vars(module).items():
        if (name == "_modules" or "_hooks" in name) and type(value) in (dict, OrderedDict):
            new.__dict__[name] = type(value)(value)
    if not installs:
        return new
    methods, graphs = {}, {}
    for inst in installs:
        methods.update(inst.methods)
        graphs.update(inst.graphs)
        new.__dict__.update(inst.attrs)
    new.__class__ = _host_class(type(module), methods, graphs)
    return new


def fused_graphs(module: nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """``(module path, graph)`` of every fused method in ``module`` (for inspection and tests)."""
    out = []
    for path, m in module.named_modules():
        graphs = getattr(type(m), _GRAPHS_ATTR, None)
        if graphs:
            out += [(f"{path}.{name}" if path else name, gm) for name, gm in graphs.items()]
    return out
