"""The ``fxfuse`` logger family, wired into ``TORCH_LOGS`` (``TORCH_LOGS="+fxfuse"`` shows the matcher's reasons)."""

import logging
import os

log = logging.getLogger("fxfuse")


def register_with_torch_logs() -> None:
    """Make ``fxfuse`` a name that ``TORCH_LOGS`` and ``torch._logging.set_logs`` understand."""
    try:
        from torch._logging import _internal
    except ImportError:  # pragma: no cover - very old torch
        return
    _internal.register_log("fxfuse", "fxfuse")
    # torch read TORCH_LOGS when it was imported, before fxfuse existed: read it again.
    if "fxfuse" in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()
