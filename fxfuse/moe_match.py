"""Mixture of experts, the match stage: which modules are experts modules the grouped kernels can run, and in
what form (:class:`fxfuse.kernels.moe_launch.ExpertsForm`).

transformers keeps a MoE layer's experts as ONE module with stacked 3-D weights: ``MixtralExperts`` and ~50 classes
with the same forward (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, ``act_fn``,
``forward(hidden_states, top_k_index, top_k_weights)``), and gpt-oss's ``GptOssExperts`` (``gate_up_proj [E, H,
2I]``, ``down_proj [E, I, H]``, a bias for each, a clamped SwiGLU in ``_apply_gate``). A module is recognized by
structure (:func:`experts_form`): the weights' shapes pair, the forward takes three arguments of known names, the
module has no other parameters or submodules, and its gate is known on a probe of values: ``act_fn`` equals SiLU,
tanh-GELU or erf-GELU (:func:`activation_of`), or, for biased ``[E, in, out]`` experts, ``_apply_gate`` equals
``act(gate) * up`` with the columns interleaved or in halves, the act one of those or gpt-oss's clamped SwiGLU with
the module's ``alpha`` and ``limit`` (:func:`gate_form`). The runtime (:mod:`fxfuse.moe`) still checks the kernels
against the module's own forward at their first call.

Example:
    >>> import torch
    >>> from torch import nn
    >>> activation_of(nn.SiLU()), activation_of(nn.GELU(approximate="tanh")), activation_of(nn.ReLU())
    ('silu', 'gelu_pytorch_tanh', None)
    >>> class Biased(nn.Module):  # gpt-oss's layout: [E, in, out] weights, biases, gate/up interleaved
    ...     alpha, limit = 1.702, 7.0
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.gate_up_proj = nn.Parameter(torch.ones(4, 8, 6))
    ...         self.gate_up_proj_bias = nn.Parameter(torch.ones(4, 6))
    ...         self.down_proj, self.down_proj_bias = nn.Parameter(torch.ones(4, 3, 8)), nn.Parameter(torch.ones(4, 8))
    ...     def _apply_gate(self, gate_up):
    ...         gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
    ...         return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
    ...     def forward(self, hidden_states, router_indices=None, routing_weights=None): ...
    >>> str(experts_form(Biased()))
    'clamped_swiglu(alpha=1.702, limit=7), [E, in, out] weights, gate/up interleaved'
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional, Union

import torch
from torch import nn

from .kernels.moe_launch import ExpertsForm

__all__ = ["activation_of", "experts_form", "experts_modules", "gate_form", "why_not_experts"]

# The experts forwards' argument names: transformers' common one, and gpt-oss's.
_FORWARD_ARGS = (["hidden_states", "top_k_index", "top_k_weights"], ["hidden_states", "router_indices",
                                                                    "routing_weights"])
_PROBE = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64)
# A gate_up row probe for _apply_gate: 16 rows of 2 x 12 columns from -12 to 12, in a fixed shuffled order (halves
# and interleaved columns then differ; |values| above gpt-oss's limit of 7 exercise its clamps).
_GATE_PROBE = torch.linspace(-12.0, 12.0, 16 * 24, dtype=torch.float64)[
    torch.randperm(16 * 24, generator=torch.Generator().manual_seed(0))].reshape(16, 24)
_BIASED = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_pytorch_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
}

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


def gate_form(module: nn.Module) -> Optional[ExpertsForm]:
    """The :class:`ExpertsForm` (transposed) whose gate equals ``module._apply_gate(gate_up)`` on a probe of values,
    or None: ``act(gate) * up`` with gate and up interleaved or in halves, ``act`` SiLU, tanh-GELU, erf-GELU or the
    clamped SwiGLU with the module's float ``alpha`` and ``limit``."""
    apply_gate = getattr(module, "_apply_gate", None)
    if not callable(apply_gate):
        return None
    try:
        with torch.no_grad():
            got = apply_gate(_GATE_PROBE.clone())
    except Exception:
        return None
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    clamped = isinstance(alpha, (int, float)) and isinstance(limit, (int, float)) and not isinstance(alpha, bool)
    acts = {name: (lambda g, u, f=fn: f(g) * u) for name, fn in _ACTIVATIONS.items()}
    if clamped:
        acts["clamped_swiglu"] = functools.partial(_clamped_swiglu, alpha=float(alpha), limit=float(limit))
    for interleaved in (True, False):
        g, u = (_GATE_PROBE[..., ::2], _GATE_PROBE[..., 1::2]) if interleaved else _GATE_PROBE.chunk(2, -1)
        for name, act in acts.items():
            if isinstance(got, torch.Tensor) and got.shape == g.shape \
                    and torch.allclose(got.double(), act(g, u), rtol=1e-5, atol=1e-6):
                return ExpertsForm(name, transposed=True, interleaved=interleaved,
                                   **(dict(alpha=float(alpha), limit=float(limit)) if name == "clamped_swiglu" else {}))
    return None


def _clamped_swiglu(g: torch.Tensor, u: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate on float64 values (the kernels' ACT 3)."""
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (u + 1) * g * torch.sigmoid(g * alpha)


def experts_form(module: nn.Module) -> Union[ExpertsForm, str]:
    """The :class:`ExpertsForm` of an experts module the kernels can run, or why ``module`` is not one."""
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return "no stacked gate_up_proj / down_proj"
    biased = set(params) == _BIASED
    children = [name for name, _ in module.named_children() if name != "act_fn" or biased]
    if not (set(params) == {"gate_up_proj", "down_proj"} or biased) or children:
        return ("other parameters or submodules besides gate_up_proj, down_proj (their biases) and act_fn: "
                + ", ".join(sorted(set(params) - _BIASED) + children))
    if biased:  # gpt-oss's layout: [E, in, out] weights
        e, h, two_i = gate_up.shape
        shapes_pair = tuple(down.shape) == (e, two_i // 2, h) and tuple(params["gate_up_proj_bias"].shape) == (
            e, two_i) and tuple(params["down_proj_bias"].shape) == (e, h)
    else:
        e, two_i, h = gate_up.shape
        shapes_pair = tuple(down.shape) == (e, h, two_i // 2)
    if two_i % 2 or not shapes_pair:
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not pair"
                + (" (with their biases, as [E, in, out])" if biased else ""))
    try:
        names = list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return "forward has no signature"
    if names not in _FORWARD_ARGS:
        return f"forward takes {names}, not {' or '.join(map(str, _FORWARD_ARGS))}"
    if biased:
        form = gate_form(module)
        return form if form is not None else (
            "_apply_gate is not act(gate) * up (interleaved or halves) for a known act or gpt-oss's clamped SwiGLU")
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        # (DeepSeek-V4's and Step-3.7's clamp gate and up there, past values a probe may not reach)
        return "_apply_gate is the class's own, not transformers' act_fn(gate) * up (a clamp?)"
    act = activation_of(getattr(module, "act_fn", None))
    return ExpertsForm(act) if act is not None else "act_fn is not SiLU, tanh-GELU or erf-GELU"


def why_not_experts(module: nn.Module) -> Optional[str]:
    """Why ``module`` is not an experts module the kernels can run, or None when it is."""
    form = experts_form(module)
    return form if isinstance(form, str) else None


def experts_modules(model: nn.Module) -> dict[str, ExpertsForm]:
    """Path -> form of every experts module in ``model`` the kernels can run."""
    found = {}
    for path, module in model.named_modules():
        if "gate_up_proj" in module._parameters:
            form = experts_form(module)
            if isinstance(form, ExpertsForm):
                found[path] = form
    return found
