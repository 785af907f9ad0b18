"""Mixture-of-experts layers at run time: the experts modules' forward on the grouped kernels.

Each experts module :mod:`fxfuse.moe_match` recognizes gets, on the optimized copy, a forward that runs
:func:`fxfuse.kernels.moe_launch.run_moe` (routing, then two grouped kernels) in place of its loop over the
experts, guarded:

* a call runs the kernels on a 2-D input of the weights' dtype on a GPU (or the interpreter); under CUDA autocast
  to fp16 / bf16, on the input, weights and biases cast to that dtype as autocast casts a Linear's (fp32 weights'
  casts kept as :mod:`fxfuse.autocast` keeps a region's; with autograd in a call that records gradients), the
  output in the input's dtype; a call that records gradients as one autograd node,
  :class:`fxfuse.kernels.moe_backward_launch.MoEExpertsFunction`, with gradients for the input, the routing weights,
  the weights and the biases (``FXFUSE_MOE_TRAINING=0``: such calls run the original forward); other calls run the
  original forward;
* the first call that could run them runs both and compares: a module whose original forward computes something
  else (a clamp, another gate/up layout) keeps its original forward for good (logged at WARNING), never a wrong
  answer;
* the first call in each power-of-two bucket of token counts times both on its routing and keeps the faster for
  that bucket, for every experts module of that class and shape (logged at INFO): transformers' default
  ``grouped_mm`` implementation is fast at some shapes, and fxfuse never makes a layer slower by replacing it. A
  call that records gradients has its own choice per bucket, a forward and its backward timed together.
* while Dynamo traces it (``torch.compile`` of the optimized model), a checked module's call is one op,
  :func:`fxfuse.moe_op.moe_experts`, in the graph; an unchecked one traces its own forward.

Example:
    >>> from torch import nn
    >>> experts_installs(nn.Linear(2, 2))[1]  # no experts module here
    {}
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.utils.checkpoint
from torch import nn

from . import autocast as fx_autocast
from .cost import ceilings_for
from .install import Install
from .kernels.measured import store_times, stored_times
from .kernels.moe_backward_launch import MoEExpertsFunction
from .kernels.moe_launch import ExpertsForm, run_moe
from .kernels.template import interpreting, next_pow2
from .kernels.tuning import TuningDuringCapture
from .module_state import Settings
from .moe_match import activation_of, experts_form, experts_modules, gate_form, why_not_experts
from .moe_op import moe_experts
from .ops import on_its_device
from .roofline import Verdict, classify
from .strategy import ORIGINAL_OPS, for_cuda_graphs, measured_choice_enabled, time_candidates
from .transforms import transformed

__all__ = ["MOE_PATTERN", "ExpertsTiming", "activation_of", "experts_form", "experts_installs", "experts_modules",
           "experts_timings", "gate_form", "moe_forward", "why_not_experts"]

log = logging.getLogger(__name__)

MOE_PATTERN = "moe_experts"
_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")  # (the kernels' order)
_AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SETTINGS_ATTR = "_fxfuse_moe_settings"  # (Settings of the module as optimized, its act_fn): see _changed_since
# torch.utils.checkpoint stops a recomputation early by raising this through the forward: never a failure.
_CHECKPOINT_CONTROL = tuple(c for c in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if c)
# A first call's check of the kernels against the original forward: relative error by dtype.
_CHECK_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def training_enabled() -> bool:
    """Whether calls with gradients to record run the kernels and their backward: yes unless
    ``FXFUSE_MOE_TRAINING=0`` (read on every call, so tests and users can flip it)."""
    return os.environ.get("FXFUSE_MOE_TRAINING", "1") != "0"


def _records_grad(module: nn.Module, hidden: torch.Tensor, weights: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (hidden.requires_grad or weights.requires_grad or any(
        p is not None and p.requires_grad for p in module._parameters.values()))


def _autocast_dtype(hidden: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for ``hidden``'s device type, or None where autocast is off for it."""
    device = "cuda" if hidden.is_cuda else hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _usable(module: nn.Module, hidden: Any, index: Any, weights: Any,
            autocast: Optional[torch.dtype]) -> bool:
    """Whether the kernels take this call; ``autocast``: :func:`_autocast_dtype` of ``hidden``."""
    gate_up = module.gate_up_proj
    if not (type(hidden) is torch.Tensor and type(index) is torch.Tensor and type(weights) is torch.Tensor):
        return False  # (FakeTensor, a tracer's proxy: the original forward)
    if transformed():  # (vmap's batched tensors, forward AD's tangents: only the original ops follow them)
        return False
    if hidden.dim() != 2 or index.dim() != 2 or index.dtype.is_floating_point or gate_up.dtype not in _KERNEL_DTYPES:
        return False  # (float64 after .double(): the original forward, as for the dense regions)
    if hidden.device != gate_up.device or (hidden.device.type != "cuda" and not interpreting()):
        return False
    if _records_grad(module, hidden, weights) and not training_enabled():
        return False
    if autocast is None:
        return hidden.dtype is gate_up.dtype
    return (autocast in _AUTOCAST_DTYPES and hidden.device.type in fx_autocast.FUSED_AUTOCAST_DEVICES
            and hidden.dtype in (torch.float32, autocast))


def _kernel_inputs(module: nn.Module, hidden: torch.Tensor, training: bool,
                   dtype: Optional[torch.dtype]) -> Optional[tuple[torch.Tensor, list]]:
    """``(hidden, [gate_up, down, gate_up_bias, down_bias])`` as the kernels take them: as they are without
    autocast; under it, cast to the autocast dtype as :func:`fxfuse.autocast.cast_params` casts a region's
    (kept casts of fp32 parameters, or casts with autograd in a call that records gradients), or None when the
    module's forward must run (a parameter autocast would leave alone). ``dtype``: the autocast dtype or None."""
    params = [module._parameters.get(name) for name in _PARAMS]
    if dtype is None:
        return hidden, params
    present = [p for p in params if p is not None]
    cast = fx_autocast.cast_params(present, dtype, training)
    if cast is None or any(c.dtype is not dtype for c in cast):
        return None
    it = iter(cast)
    return hidden.to(dtype), [next(it) if p is not None else None for p in params]


# (class, experts implementation, E, 2I, H, top_k, dtype, autocast dtype, device, form, for a CUDA graph, a call
# that records gradients, token bucket: the power of two at or above the call's tokens) -> "kernels" or
# "original", shared by every layer of a model (a Mixtral's 32 experts modules time once per bucket).
_CHOICES: dict[tuple, str] = {}


@dataclass(frozen=True)
class ExpertsTiming:
    """One token bucket's timed choice for one experts class and shape, as :func:`fxfuse.report` shows it."""

    tokens: tuple[int, int]  # the bucket's range
    training: bool  # a forward and its backward (else a forward)
    kernels_us: float
    original_us: float  # the module's own forward (its experts implementation), µs per call
    runs: str  # "kernels" or "original"
    verdict: Optional[Verdict] = None  # what bounds the kernels' time (roofline), where its work was counted

    def __str__(self) -> str:
        runs = "kernels" if self.runs == "kernels" else "its forward kept"
        why = f", {self.verdict}" if self.verdict is not None else ""
        return (f"{self.kernels_us:.1f} / {self.original_us:.1f} at {self.tokens[0]}-{self.tokens[1]} tokens"
                f"{' (training step)' if self.training else ''} ({runs}{why})")


# The _CHOICES key of each timed choice -> its timing.
_TIMINGS: dict[tuple, ExpertsTiming] = {}


def experts_timings(cls: type, gate_up_shape: tuple[int, ...]) -> list[ExpertsTiming]:
    """The timed choices so far in this process for experts modules of class ``cls`` with ``gate_up_proj`` of
    ``gate_up_shape``, by token bucket (forward first)."""
    found = [(key[-1], key[-2], t) for key, t in _TIMINGS.items() if key[0] is cls and key[2:5] == gate_up_shape]
    return [t for _, _, t in sorted(found, key=lambda f: (f[1], f[0]))]


def _choice_key(module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, form: ExpertsForm,
                training: bool = False, autocast: Optional[torch.dtype] = None) -> tuple:
    config = getattr(module, "config", None)
    return (type(module), getattr(config, "_experts_implementation", None), *module.gate_up_proj.shape,
            index.shape[1], hidden.dtype, autocast, hidden.device, form, for_cuda_graphs(), training,
            next_pow2(hidden.shape[0]))


def _disk_key(key: tuple, what: str) -> tuple:
    """What a :func:`_choice_key` is kept under in the tuning cache (:func:`fxfuse.kernels.measured.store_times`):
    everything but the device, which the cache keys by its name, and the class by its qualified name.

    Example:
        >>> form = ExpertsForm("silu")
        >>> _disk_key((nn.Module, "grouped_mm", 8, 28672, 4096, 2, torch.bfloat16, None, torch.device("cuda", 0),
        ...            form, False, False, 16), "forward")[:3]
        ('torch.nn.modules.module.Module', 'grouped_mm', 8)
    """
    cls, impl, e, a, b, top_k, dtype, autocast, _device, form, graphs, training, bucket = key
    return f"{cls.__module__}.{cls.__qualname__}", impl, e, a, b, top_k, dtype, autocast, form, graphs, what, bucket


def _timed_choice(module: nn.Module, kernels: Any, original: Any, key: tuple, what: str = "forward",
                  work: Optional[Callable[[], tuple[float, float]]] = None) -> str:
    """Time the kernels and the module's own forward on this call's routing as the planner times its candidates
    (:func:`fxfuse.strategy.time_candidates`: the larger of GPU and host time per call, the GPU time alone when
    planned for a CUDA graph) and keep the faster for the key's token bucket, logged with both times and kept
    for the report (:func:`experts_timings`). ``what``: "forward", or "training step" when the runners are a
    forward and its backward; ``work``: the call's ``(FLOPs, minimum bytes)``, for the report's verdict.

    On a GPU the times are kept in the tuning cache (:mod:`fxfuse.tuning_cache`, by GPU name and torch and Triton
    versions), so another process on the same machine takes the same choice without timing again."""
    bucket = key[-1]
    device = key[8]
    # (a GPU's only: a CPU device has no name there; "kernels" may be missing, a candidate that failed when timed)
    times = stored_times("moe experts", _disk_key(key, what), (ORIGINAL_OPS,), device)
    cached = times is not None
    if not cached:
        # (as ORIGINAL_OPS, the module's forward is never dropped: its error is the user's, raised)
        times = time_candidates(f"{type(module).__name__} experts ({what})", bucket,
                                {"kernels": kernels, ORIGINAL_OPS: original})
        store_times("moe experts", _disk_key(key, what), times, device)
    choice = "kernels" if times.get("kernels", float("inf")) < times[ORIGINAL_OPS] else "original"
    if cached and choice == "kernels":
        try:  # (once, as timing them would have: kernels that fail leave this bucket to the module's forward)
            kernels()
        except (torch.OutOfMemoryError, *_CHECKPOINT_CONTROL):
            raise
        except Exception as err:
            log.warning("fxfuse: the experts kernels of %s failed (%s: %s); its own forward runs at %d-%d tokens",
                        type(module).__name__, type(err).__name__, err, bucket // 2 + 1, bucket)
            choice = "original"
    log.info("fxfuse: %s at %d-%d tokens, %s: the experts kernels %.1f µs, its own forward (%s) %.1f µs per call%s: "
             "runs %s", type(module).__name__, bucket // 2 + 1, bucket, what, times.get("kernels", float("inf")),
             key[1] or "its forward", times[ORIGINAL_OPS], " (from the tuning cache)" if cached else "",
             "the kernels" if choice == "kernels" else "its own forward")
    kernels_us = times.get("kernels", float("inf"))
    verdict = None
    if work is not None and kernels_us < float("inf"):
        flops, nbytes = work()
        ceilings = ceilings_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
        # (launches: routing, gate/up, down, combine; a training step adds G, the gate's backward, dx and the two
        # weight gradients, a few more where those run on grouped_mm (its gathers): the count only weighs the
        # overhead-bound verdict, which a step of milliseconds is not. key[7]: the autocast dtype the kernels ran in)
        verdict = classify(flops, nbytes, 4 if what == "forward" else 9, ceilings, str(key[7] or key[6]),
                           gpu_us=kernels_us)
    _TIMINGS[key] = ExpertsTiming((bucket // 2 + 1, bucket), what != "forward", kernels_us, times[ORIGINAL_OPS],
                                  choice, verdict)
    return choice


def _experts_work(module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, training: bool) -> tuple[float, float]:
    """``(FLOPs, minimum bytes)`` of the experts on this call's routing: each routed pair's gate/up and down
    products; the weights of the experts hit read once (and, training, their gradients written once), the input
    and output once. (One host sync, at a bucket's timing only: the experts hit.)"""
    num = module.gate_up_proj.shape[0]
    per_expert = module.gate_up_proj[0].numel() + module.down_proj[0].numel()  # H x 3I weights
    pairs = int(((index >= 0) & (index < num)).sum())
    hit = int(index[(index >= 0) & (index < num)].unique().numel())
    elem = module.gate_up_proj.element_size()
    flops = 2.0 * pairs * per_expert * (3 if training else 1)  # (a backward: twice the forward's products)
    nbytes = hit * per_expert * elem * (2 if training else 1) + 2 * hidden.numel() * hidden.element_size()
    return flops, float(nbytes)


def moe_forward(orig: Any, form: Union[str, ExpertsForm]) -> Any:
    """The experts module's forward: the kernels where they apply, agreed with ``orig`` at their first call and
    were the faster of the two at this call's token bucket (timed on a GPU at its first call), else ``orig``.
    ``form``: the module's :class:`ExpertsForm` (an activation name for Mixtral's layout)."""
    form = ExpertsForm(form) if isinstance(form, str) else form
    signature = inspect.signature(orig)

    def forward(self, *args, **kwargs):
        if kwargs or len(args) != 3:  # (gpt-oss's MLP passes them by position; others may name them)
            try:
                bound = tuple(signature.bind(self, *args, **kwargs).arguments.values())[1:]
            except TypeError:
                bound = ()
            if len(bound) != 3:
                return orig(self, *args, **kwargs)  # (as called: its own result, or its own error)
            args = bound
        if torch.compiler.is_compiling():
            return _traced(self, orig, form, args)
        return _eager(self, *args)

    def _eager(self, *args):
        hidden_states, top_k_index, top_k_weights = args
        state = self.__dict__.get("_fxfuse_moe")  # None: not checked yet; True: agreed; False: kept original
        if state is False or _changed_since(self):
            return orig(self, *args)
        autocast = _autocast_dtype(hidden_states) if type(hidden_states) is torch.Tensor else None
        if not _usable(self, hidden_states, top_k_index, top_k_weights, autocast):
            return orig(self, *args)
        if not on_its_device(hidden_states):  # another GPU's layer (device_map="auto"): launch on that GPU
            with torch.cuda.device(hidden_states.device):
                return _eager(self, *args)
        on_gpu = hidden_states.device.type == "cuda"
        capturing = on_gpu and torch.cuda.is_current_stream_capturing()
        training = _records_grad(self, hidden_states, top_k_weights)

        def original():
            return orig(self, *args)

        # (a training call's choice is its own: forward and backward timed together)
        key = _choice_key(self, hidden_states, top_k_index, form, training, autocast)
        choice = _CHOICES.get(key)
        if choice == "original" or (capturing and (choice is None or not state)):
            return original()  # (the faster in this bucket; or no timing or check inside a capture)
        inputs = _kernel_inputs(self, hidden_states, training, autocast)
        if inputs is None:
            return original()
        x, params = inputs

        def kernels():
            return run_moe(x, top_k_index, top_k_weights, *params[:2], form, gate_up_bias=params[2],
                           down_bias=params[3], out_dtype=hidden_states.dtype)

        if training:
            def node_at(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
                return MoEExpertsFunction.apply(hidden.to(x.dtype), top_k_index, weights, *params, form,
                                                hidden_states.dtype)  # (.to: autocast's cast, with autograd)

            if not state:  # the kernels' forward against the module's, without gradients
                with torch.no_grad():
                    _first_check(self, kernels, original, x.dtype)
                if not self.__dict__["_fxfuse_moe"]:
                    return original()
            if choice is None:
                choice = _CHOICES[key] = _training_choice(
                    self, node_at, lambda hidden, weights: orig(self, hidden, top_k_index, weights), args, key,
                    _timed_here(hidden_states))
            node = functools.partial(node_at, hidden_states, top_k_weights)
            return _guarded(self, node, original) if choice == "kernels" else original()
        if not state:
            fused, out = _first_check(self, kernels, original, x.dtype)
            if fused is None:
                return out if out is not None else original()
        else:
            fused = _guarded(self, kernels, original)
            if self.__dict__["_fxfuse_moe"] is False:
                return fused  # (the original's output: the kernels failed)
        if choice is None:
            # The interpreter has no GPU time to compare: there the kernels run (what its tests check), as they do
            # everywhere with FXFUSE_AUTOTUNE=0.
            choice = _CHOICES[key] = _timed_choice(
                self, kernels, original, key, work=lambda: _experts_work(self, x, top_k_index, False)) \
                if _timed_here(hidden_states) else "kernels"
            if choice == "original":
                return original()
        return fused

    # Never compiled: where torch.compile runs this frame itself (a graph break's fallback), the frames it calls
    # would be compiled one by one (the kernels' launch code, the Triton interpreter's), failing the kernels.
    _eager = torch.compiler.disable(_eager)
    functools.update_wrapper(forward, orig)
    return forward


def _traced(module: nn.Module, orig: Any, form: ExpertsForm, args: tuple) -> torch.Tensor:
    """The forward as Dynamo traces it (``torch.compile`` of an optimized model): the kernels as one op
    (:mod:`fxfuse.moe_op`) for a module an eager call checked, on a call the plain kernels take (no gradients, no
    autocast, a 2-D input of the weights' dtype); else the module's own forward, traced as it is."""
    hidden, index, weights = args
    gate_up = module.gate_up_proj
    if getattr(module, "_fxfuse_moe", None) is not True or _records_grad(module, hidden, weights) \
            or torch.is_autocast_enabled(hidden.device.type) or hidden.dim() != 2 or hidden.dtype != gate_up.dtype:
        return orig(module, *args)  # (the op has no backward: any parameter that trains takes this way)
    return moe_experts(hidden, index, weights, gate_up, module.down_proj, getattr(module, "gate_up_proj_bias", None),
                       getattr(module, "down_proj_bias", None), form.act, form.transposed, form.interleaved,
                       form.alpha, form.limit)


def _training_choice(module: nn.Module, node_at: Any, original_at: Any, args: tuple, key: tuple, timed: bool) -> str:
    """The choice at a bucket's first call that records gradients, each runner (``node_at(hidden, weights)``, the
    kernels' node, and ``original_at``, the module's forward) a forward and its backward: the gradients of the
    input, the routing weights and every parameter that requires them, for one random output gradient, taken at
    detached copies of the call's input and routing weights (a backward through the call's own would run into the
    model's graph upstream, freeing what the step's backward needs). Timed, by :func:`_timed_choice`; untimed (the
    interpreter, ``FXFUSE_AUTOTUNE=0``), the kernels once their backward has run here, so that kernels that fail
    (logged) leave the module's forward for good rather than an error in the user's ``backward()``."""
    hidden, index, weights = (t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() else t
                              for t in args)
    wanted = [t for t in (hidden, weights, *module._parameters.values()) if t is not None and t.requires_grad]
    # (from a generator of its own: the user's random stream is theirs, and a resumed run must draw what an
    # uninterrupted one does, though only a new process times this choice)
    dout = torch.randn(hidden.shape, dtype=hidden.dtype, device=hidden.device,
                       generator=torch.Generator(hidden.device).manual_seed(0))

    def step(run_at: Any) -> Any:  # (allow_unused: a parameter the module's own forward leaves out of this call)
        return lambda: torch.autograd.grad(run_at(hidden, weights), wanted, dout, allow_unused=True)

    # (what these backwards save stays off any saved-tensor hooks of the caller's: activation checkpointing counts
    # what a layer's forward saves, and its recomputation, which skips this choice, must save the same)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if timed:
            return _timed_choice(module, step(node_at), step(original_at), key, "training step",
                                 work=lambda: _experts_work(module, hidden, index, True))
        try:
            step(node_at)()
        except (torch.OutOfMemoryError, *_CHECKPOINT_CONTROL):
            raise
        except Exception as err:  # never fail the user's step: the original runs from now on
            _kernels_failed(module, err)
            return "original"
    return "kernels"


def _timed_here(hidden: torch.Tensor) -> bool:
    """Whether a bucket's first call times the kernels against the module's forward: on a GPU, unless
    ``FXFUSE_AUTOTUNE=0`` (the interpreter has no GPU time to compare; there, and untimed, the kernels run)."""
    return hidden.is_cuda and measured_choice_enabled()


def _first_check(module: nn.Module, kernels: Any, original: Any,
                 dtype: torch.dtype) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Run the kernels and the module's forward and record whether they agree (``_fxfuse_moe``): ``(the kernels'
    output or None where they disagree or failed, the forward's output or None where it did not run)``."""
    fused = _guarded(module, kernels, lambda: None)
    if fused is None:  # (the kernels failed: logged, and the module keeps its forward)
        return None, None
    out = original()
    err = ((fused.double() - out.double()).norm() / out.double().norm().clamp_min(1e-30)).item()
    ok = err <= _CHECK_TOL.get(dtype, 3e-2)
    module.__dict__["_fxfuse_moe"] = ok
    if not ok:
        log.warning("fxfuse: %s's experts kernels differ from its forward (rel err %.1e); it keeps its forward",
                    type(module).__name__, err)
    return (fused if ok else None), out


def _guarded(module: nn.Module, kernels: Any, original: Any) -> torch.Tensor:
    """``kernels()``, or where they fail ``original()``: for good (logged), or for this call only when a CUDA graph
    being captured would have tuned them (it records the original forward)."""
    try:
        return kernels()
    except TuningDuringCapture:
        return original()
    except (torch.OutOfMemoryError, *_CHECKPOINT_CONTROL):
        raise
    except ValueError as err:  # (a call the kernels' checks refuse, such as [T, E] routing weights: this one only)
        log.info("fxfuse: the experts kernels of %s do not take this call (%s); its forward runs",
                 type(module).__name__, err)
        return original()
    except Exception as err:  # never fail the user's forward: the original runs from now on
        _kernels_failed(module, err)
        return original()


def _settings_of(module: nn.Module) -> tuple:
    """What :func:`_changed_since` compares: the module's settings, its ``act_fn``'s class and settings (the optimized
    model's ``act_fn`` is a copy: compared by what it is, not by identity)."""
    act = module._modules.get("act_fn")
    return Settings.of(module), type(act), (Settings.of(act) if act is not None else None)


def _changed_since(module: nn.Module) -> bool:
    """Whether a setting the kernels baked in changed since optimize (gpt-oss's ``alpha`` / ``limit``, ``act_fn``
    replaced): then the module's own forward runs (logged once)."""
    kept = module.__dict__.get(_SETTINGS_ATTR)
    if kept is None:
        return False
    settings, act_type, act_settings = kept
    act = module._modules.get("act_fn")
    same_act = type(act) is act_type and (act_settings is None or not act_settings.changed(act))
    if same_act and (settings is None or not settings.changed(module)):
        return False
    if not module.__dict__.get("_fxfuse_moe_changed_logged"):
        module.__dict__["_fxfuse_moe_changed_logged"] = True
        log.info("fxfuse: %s's settings changed since it was optimized (%s); it runs its forward",
                 type(module).__name__, "act_fn replaced or changed" if not same_act else settings.what_changed(module))
    return True


def _kernels_failed(module: nn.Module, err: Exception) -> None:
    log.warning("fxfuse: the experts kernels of %s failed (%s: %s); it keeps its forward", type(module).__name__,
                type(err).__name__, err)
    module.__dict__["_fxfuse_moe"] = False


def experts_installs(model: nn.Module) -> tuple[dict[str, Install], dict[str, ExpertsForm]]:
    """What :func:`fxfuse.install.assemble` installs on the experts modules of ``model`` (path -> Install), and
    their forms (path -> :class:`ExpertsForm`)."""
    found = experts_modules(model)
    installs = {}
    for path, form in found.items():
        module = model.get_submodule(path)
        orig = type(module).forward
        installs[path] = Install({"forward": (("fxfuse.moe", form), moe_forward(orig, form))}, {},
                                 {_SETTINGS_ATTR: _settings_of(module)})
    return installs, found
