"""Built-in fusion patterns (installed as ``fxfuse.patterns``).

Each module declares plain pattern functions (see :mod:`fxfuse.pattern`); ``BUILTINS`` lists them in
priority order. They are traced once, on first use.
"""

from .gated import gated_mlp
from .mlp import mlp

BUILTINS = [gated_mlp, mlp]

__all__ = ["BUILTINS", "gated_mlp", "mlp"]
