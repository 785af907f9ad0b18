"""Mixture-of-experts layers: find the experts modules and run them with the grouped kernels.

transformers keeps a MoE layer's experts as ONE module with stacked 3-D weights (``MixtralExperts`` and ~50 classes
with the same forward: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, ``act_fn``, and
``forward(hidden_states, top_k_index, top_k_weights)``). Its forward loops over the experts behind data-dependent
routing, which no tracer captures; fxfuse installs, on the optimized copy, a forward that runs
:func:`fxfuse.kernels.moe_launch.run_moe` instead (two grouped kernels), guarded:

* the module is recognized by structure: the two weights' shapes agree, the forward takes those three arguments,
  the module has no other parameters (a bias, as gpt-oss's experts have, is another computation), and ``act_fn``
  equals SiLU, tanh-GELU or erf-GELU on a probe of values (:func:`activation_of`);
* a call runs the kernels only without gradients to record, without autocast, on a 2-D input of the weights'
  dtype on a GPU (or the interpreter); other calls run the original forward;
* the first call that could run them runs both and compares: a module whose original forward computes something
  else (a clamp, another gate/up layout) keeps its original forward for good (logged at WARNING), never a wrong
  answer;
* the first call in each power-of-two bucket of token counts times both on its routing and keeps the faster for
  that bucket, for every experts module of that class and shape (logged at INFO): transformers' default
  ``grouped_mm`` implementation is fast at some shapes, and fxfuse never makes a layer slower by replacing it.

Example:
    >>> from torch import nn
    >>> activation_of(nn.SiLU()), activation_of(nn.GELU(approximate="tanh")), activation_of(nn.ReLU())
    ('silu', 'gelu_pytorch_tanh', None)
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Optional

import torch
from torch import nn

from .autocast import any_autocast
from .install import Install
from .kernels.moe_launch import run_moe
from .kernels.template import interpreting, next_pow2
from .kernels.tuning import TuningDuringCapture
from .ops import on_its_device
from .strategy import for_cuda_graphs, time_candidates

__all__ = ["MOE_PATTERN", "activation_of", "experts_installs", "experts_modules", "moe_forward", "why_not_experts"]

log = logging.getLogger(__name__)

MOE_PATTERN = "moe_experts"
_FORWARD_ARGS = ["hidden_states", "top_k_index", "top_k_weights"]
_PROBE = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_pytorch_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}
# A first call's check of the kernels against the original forward: relative error by dtype.
_CHECK_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def activation_of(act_fn: Any) -> Optional[str]:
    """The name of the kernels' activation that ``act_fn`` computes (on a probe from -8 to 8), or None."""
    try:
        with torch.no_grad():
            got = act_fn(_PROBE.float()).double()
    except Exception:
        return None
    for name, ref in _ACTIVATIONS.items():
        if got.shape == _PROBE.shape and torch.allclose(got, ref(_PROBE), rtol=1e-5, atol=1e-6):
            return name
    return None


def why_not_experts(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not an experts module the kernels can run, or None when it is."""
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return "no stacked gate_up_proj / down_proj"
    others = [name for name, _ in module.named_children() if name != "act_fn"]
    if set(params) != {"gate_up_proj", "down_proj"} or others:
        return "other parameters or submodules besides gate_up_proj, down_proj and act_fn"
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not pair"
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return "forward has no signature"
    if names != _FORWARD_ARGS:
        return f"forward takes {names}, not {_FORWARD_ARGS}"
    if activation_of(getattr(module, "act_fn", None)) is None:
        return "act_fn is not SiLU, tanh-GELU or erf-GELU"
    return None


def experts_modules(model: nn.Module) -> dict[str, str]:
    """Path -> activation of every experts module in ``model`` the kernels can run."""
    found = {}
    for path, module in model.named_modules():
        if "gate_up_proj" in module._parameters and why_not_experts(module) is None:
            found[path] = activation_of(module.act_fn)
    return found


def _usable(module: nn.Module, hidden: Any, index: Any, weights: Any) -> bool:
    gate_up = module.gate_up_proj
    if not (type(hidden) is torch.Tensor and type(index) is torch.Tensor and type(weights) is torch.Tensor):
        return False  # (FakeTensor, a tracer's proxy: the original forward)
    if hidden.dim() != 2 or index.dim() != 2 or hidden.dtype is not gate_up.dtype or index.dtype.is_floating_point:
        return False
    if hidden.device != gate_up.device or (hidden.device.type != "cuda" and not interpreting()):
        return False
    if torch.is_grad_enabled() and (hidden.requires_grad or weights.requires_grad or gate_up.requires_grad
                                    or module.down_proj.requires_grad):
        return False
    return not any_autocast()


# (class, experts implementation, E, 2I, H, top_k, dtype, device, activation, for a CUDA graph, token bucket: the
# power of two at or above the call's tokens) -> "kernels" or "original", shared by every layer of a model (a
# Mixtral's 32 experts modules time once per bucket).
_CHOICES: dict[tuple, str] = {}


def _choice_key(module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, act: str) -> tuple:
    config = getattr(module, "config", None)
    return (type(module), getattr(config, "_experts_implementation", None), *module.gate_up_proj.shape,
            index.shape[1], hidden.dtype, hidden.device, act, for_cuda_graphs(), next_pow2(hidden.shape[0]))


def _timed_choice(module: nn.Module, kernels: Any, original: Any, key: tuple) -> str:
    """Time the kernels and the module's own forward on this call's routing as the planner times its candidates
    (:func:`fxfuse.strategy.time_candidates`: the larger of GPU and host time per call, the GPU time alone when
    planned for a CUDA graph) and keep the faster for the key's token bucket, logged with both times."""
    what = f"{type(module).__name__} experts"
    times = time_candidates(what, key[-1], {"kernels": kernels, "original": original})
    choice = min(times, key=times.get)
    log.info("fxfuse: %s at %d-%d tokens: the experts kernels %.1f µs, its own forward (%s) %.1f µs per call: "
             "runs %s", type(module).__name__, key[-1] // 2 + 1, key[-1], times.get("kernels", float("inf")),
             key[1] or "its forward", times["original"], "the kernels" if choice == "kernels" else "its own forward")
    return choice


def moe_forward(orig: Any, act: str) -> Any:
    """The experts module's forward: the kernels where they apply, agreed with ``orig`` at their first call and
    were the faster of the two at this call's token bucket (timed on a GPU at its first call), else ``orig``."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        state = self.__dict__.get("_fxfuse_moe")  # None: not checked yet; True: agreed; False: kept original
        if state is False or not _usable(self, hidden_states, top_k_index, top_k_weights):
            return orig(self, hidden_states, top_k_index, top_k_weights)
        if not on_its_device(hidden_states):  # another GPU's layer (device_map="auto"): launch on that GPU
            with torch.cuda.device(hidden_states.device):
                return forward(self, hidden_states, top_k_index, top_k_weights)
        key = _choice_key(self, hidden_states, top_k_index, act)
        choice = _CHOICES.get(key)
        if choice == "original":
            return orig(self, hidden_states, top_k_index, top_k_weights)
        on_gpu = hidden_states.device.type == "cuda"
        if (choice is None or not state) and on_gpu and torch.cuda.is_current_stream_capturing():
            return orig(self, hidden_states, top_k_index, top_k_weights)  # no timing or check inside a capture

        def kernels():
            return run_moe(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, act)

        def original():
            return orig(self, hidden_states, top_k_index, top_k_weights)

        try:
            fused = kernels()
        except TuningDuringCapture:  # a CUDA graph being captured: it records the original forward
            return original()
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # never fail the user's forward: the original runs from now on
            log.warning("fxfuse: the experts kernels of %s failed (%s: %s); it keeps its forward",
                        type(self).__name__, type(err).__name__, err)
            self.__dict__["_fxfuse_moe"] = False
            return original()
        if not state:
            out = original()
            err = ((fused.double() - out.double()).norm() / out.double().norm().clamp_min(1e-30)).item()
            ok = err <= _CHECK_TOL.get(hidden_states.dtype, 3e-2)
            self.__dict__["_fxfuse_moe"] = ok
            if not ok:
                log.warning("fxfuse: %s's experts kernels differ from its forward (rel err %.1e); it keeps its "
                            "forward", type(self).__name__, err)
                return out
        if choice is None:
            # The interpreter has no GPU time to compare: there the kernels run (what its tests check).
            choice = _CHOICES[key] = _timed_choice(self, kernels, original, key) if on_gpu else "kernels"
            if choice == "original":
                return original()
        return fused

    functools.update_wrapper(forward, orig)
    return forward


def experts_installs(model: nn.Module) -> tuple[dict[str, Install], dict[str, str]]:
    """What :func:`fxfuse.install.assemble` installs on the experts modules of ``model`` (path -> Install), and
    their activations (path -> name)."""
    found = experts_modules(model)
    installs = {}
    for path, act in found.items():
        orig = type(model.get_submodule(path)).forward
        installs[path] = Install({"forward": (("fxfuse.moe", act), moe_forward(orig, act))})
    return installs, found
