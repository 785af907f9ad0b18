"""What one fused region computes: a chain of stages, serialised as the ``spec`` string of the op.

A stage is one GEMM (or two GEMMs over the same input: the gate/up pair of a gated MLP) followed by
an epilogue (see :mod:`fxfuse.epilogue`) that maps the fp32 accumulators to the stage's output::

    h = x
    for stage in spec.stages:
        accs = [h @ W.T + b for (W, b) in stage's linears]
        h = stage.epilogue(accs, stage's operands)

Each stage is written ``<linears><bias flags>:<epilogue>``, one flag per linear: ``b`` has a bias,
``-`` has none. So a GPT-2 MLP is ``1b:gelu_tanh(a0);1b:a0``, a SwiGLU MLP
``2--:mul(a0,silu(a1));1-:a0`` (``a0`` the up projection here, because canonical order sorts it
first) and a NeRF chain ``1b:relu(a0);1b:relu(a0);1b:relu(a0);1b:a0``. The flags let the op take
only the biases that exist (a list with holes would hide them from autograd).

Example:
    >>> spec = MLPSpec.loads("1b:gelu_tanh(a0);1-:a0")
    >>> [s.num_linears for s in spec.stages], spec.dumps()
    ([1, 1], '1b:gelu_tanh(a0);1-:a0')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from . import epilogue as ep

__all__ = ["MLPSpec", "Stage"]


@dataclass(frozen=True)
class Stage:
    """One GEMM (or a gated pair of GEMMs over the same input) and its epilogue."""

    num_linears: int
    epilogue: str = "a0"
    has_bias: tuple[bool, ...] = ()  # one flag per linear; () means none has a bias
    expr: ep.Expr = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.num_linears not in (1, 2):
            raise ValueError(f"a stage has 1 or 2 linears, got {self.num_linears}")
        if not self.has_bias:
            object.__setattr__(self, "has_bias", (False,) * self.num_linears)
        if len(self.has_bias) != self.num_linears:
            raise ValueError("one bias flag per linear")
        expr = ep.parse(self.epilogue)
        if ep.num_accumulators(expr) != self.num_linears:
            raise ValueError(f"epilogue {self.epilogue!r} must use exactly a0..a{self.num_linears - 1}")
        object.__setattr__(self, "expr", expr)

    @property
    def num_operands(self) -> int:
        return ep.num_operands(self.expr)

    @property
    def is_identity(self) -> bool:
        return self.epilogue == "a0"


@dataclass(frozen=True)
class MLPSpec:
    """The stages of a fused region, in order."""

    stages: tuple[Stage, ...]

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a fused region needs at least one stage")

    @property
    def num_linears(self) -> int:
        return sum(s.num_linears for s in self.stages)

    @property
    def num_operands(self) -> int:
        return sum(s.num_operands for s in self.stages)

    @property
    def is_gated(self) -> bool:
        return any(s.num_linears == 2 for s in self.stages)

    @property
    def has_bias(self) -> tuple[bool, ...]:
        return tuple(b for s in self.stages for b in s.has_bias)

    def with_biases(self, flags) -> MLPSpec:
        """The same stages with these bias flags (one per linear, in order)."""
        flags = list(flags)
        stages = []
        for s in self.stages:
            stages.append(Stage(s.num_linears, s.epilogue, tuple(flags[:s.num_linears])))
            flags = flags[s.num_linears:]
        return MLPSpec(tuple(stages))

    def dumps(self) -> str:
        return ";".join(
            f"{s.num_linears}{''.join('b' if b else '-' for b in s.has_bias)}:{s.epilogue}" for s in self.stages
        )

    @staticmethod
    @functools.cache
    def loads(text: str) -> MLPSpec:
        """Parse ``dumps()`` output (cached: the forward path calls this with the same few strings)."""
        stages = []
        for part in text.split(";"):
            head, _, epi = part.partition(":")
            n = int(head[0])
            flags = tuple(c == "b" for c in head[1:]) if len(head) > 1 else ()
            stages.append(Stage(n, epi, flags))
        return MLPSpec(tuple(stages))
