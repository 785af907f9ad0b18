"""The ``fxfuse`` logger family, wired into ``TORCH_LOGS`` (``TORCH_LOGS="+fxfuse"`` shows the matcher's reasons)."""

import logging
import os
import sys

log = logging.getLogger("fxfuse")


def register_with_torch_logs() -> None:
    """Make ``fxfuse`` a name that ``TORCH_LOGS`` and ``torch._logging.set_logs`` understand."""
    try:
        from torch._logging import _internal
    except ImportError:  # pragma: no cover - very old torch
        return
    _internal.register_log("fxfuse", "fxfuse")
    # torch read TORCH_LOGS when it was imported, before fxfuse existed: read it again. Unless torch is reading it
    # now: its parser imports a name it does not know (this very import) and sets up its handlers afterwards
    # (a second set-up from in here would leave two handlers: every line printed twice).
    if "fxfuse" in os.environ.get("TORCH_LOGS", "") and not _inside(_internal._init_logs):
        _internal._init_logs()


def _inside(fn) -> bool:
    """Whether ``fn`` is running further up this thread's stack."""
    code, frame = getattr(fn, "__code__", None), sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
