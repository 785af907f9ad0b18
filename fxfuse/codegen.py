"""Render the stage template for one ``(num_linears, epilogue)`` pair into a cached ``.py`` file and import it.

Triton reads a kernel's source with ``inspect.getsource`` (interpreter included), so generated kernels
live in real files: ``$FXFUSE_CACHE_DIR`` or ``~/.cache/fxfuse/kernels``, named by a hash of the
rendered source (which is a function of the template version, the template, ``num_linears`` and the
epilogue text). The header of each file shows its epilogue, so a user can open and read it.
Files are written atomically (temp file + ``os.replace``), so concurrent processes are safe; a cached
file whose content differs from the rendering (corrupt, truncated, hand-edited) is rewritten. Each
module is imported once per process.

Example:
    >>> mod = generated_kernel(1, "gelu_tanh(a0)")  # doctest: +SKIP
    >>> mod.EPILOGUE, kernel_path(1, "gelu_tanh(a0)").exists()  # doctest: +SKIP
    ('gelu_tanh(a0)', True)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Optional

from . import epilogue as ep
from .kernels.fast_math import IMPORT_LINE, epilogue_lines, uses_trig
from .kernels.template import KERNEL_TEMPLATE, TEMPLATE_VERSION

logger = logging.getLogger(__name__)

__all__ = ["cache_dir", "clear_loaded", "generated_chain_backward_kernel", "generated_chain_kernel",
           "generated_chain_walk_kernel", "generated_decode_kernel", "generated_kernel",
           "generated_tma_kernel", "kernel_path", "render"]

_modules: dict[tuple, ModuleType] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where generated kernels are written: ``$FXFUSE_CACHE_DIR``, else ``~/.cache/fxfuse/kernels``."""
    env = os.environ.get("FXFUSE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fxfuse" / "kernels"


def _canonical(num_linears: int, epilogue: str) -> tuple[ep.Expr, str]:
    if num_linears not in (1, 2):
        raise ValueError(f"a stage has 1 or 2 linears, got {num_linears}")
    expr = ep.parse(epilogue)
    if ep.num_accumulators(expr) != num_linears:
        raise ValueError(f"epilogue {epilogue!r} must use exactly a0..a{num_linears - 1}")
    return expr, str(expr)


def render(num_linears: int, epilogue: str, *, template: str = KERNEL_TEMPLATE,
           version: int = TEMPLATE_VERSION, is_fp32: Optional[str] = "out_ptr.dtype.element_ty == tl.float32") -> str:
    """The kernel module source for one stage (see :mod:`fxfuse.kernels.template` for the rules).

    ``template`` / ``version``: another stage template written with the same line rules (the TMA one, which
    also tags lines ``# [not gated]``: kept only for one linear). ``is_fp32``: the template's compile-time
    condition that the output is fp32 (an epilogue with sin or cos takes the hardware's for 16-bit outputs:
    :mod:`fxfuse.kernels.fast_math`), or None: libdevice's for every dtype (the TMA template: inline assembly
    would abort its warp-specialized configs, which its pruning keeps for any epilogue without fast forms).

    Example:
        >>> src = render(2, "mul(a0,silu(a1))")
        >>> "acc1 = tl.dot" in src and "w1_ptr" in src
        True
    """
    expr, text = _canonical(num_linears, epilogue)
    n_ops = ep.num_operands(expr)
    names = dict(acc_names=["acc0", "acc1"][:num_linears], operand_names=[f"v{i}" for i in range(n_ops)])
    results = {}

    def body(line: str, fast: bool) -> list[str]:  # at the marker line's indentation
        indent = line[: len(line) - len(line.lstrip())]
        if fast or is_fp32 is None:
            lines, results[fast] = ep.to_triton(expr, **names, indent=indent, prefix="_f" if fast else "_e",
                                                fast=fast)
            return lines
        lines, results[False] = epilogue_lines(expr, names["acc_names"], names["operand_names"], "_e", is_fp32)
        return [indent + line for line in lines]

    lines: list[str] = []
    for line in template.splitlines():
        if line.endswith("# [gated]"):
            if num_linears == 2:
                lines.append(line[: -len("# [gated]")].rstrip())
        elif line.endswith("# [not gated]"):
            if num_linears == 1:
                lines.append(line[: -len("# [not gated]")].rstrip())
        elif line.endswith("# [each operand]"):
            lines.extend(line[: -len("# [each operand]")].rstrip().replace("v@", f"v{i}") for i in range(n_ops))
        elif line.strip() == "# [epilogue]":
            lines.extend(body(line, fast=False))
        elif line.strip() == "# [epilogue fast]":  # the hardware forms (epilogue.FAST_FORMS): bf16 under FAST_MATH
            lines.extend(body(line, fast=True))
        else:
            lines.append(line)
    src = "\n".join(lines) + "\n"
    if is_fp32 is not None and uses_trig(expr):
        anchor = "from fxfuse.kernels.tuning import autotune\n"
        src = src.replace(anchor, anchor + IMPORT_LINE + "\n", 1)
    for key, value in (("$TEMPLATE_VERSION", str(version)), ("$NUM_LINEARS", str(num_linears)),
                       ("$EPILOGUE", text), ("$HAS_FAST_FORMS", str(ep.has_fast_forms(expr))),
                       ("$RESULT_FAST", results.get(True, "")), ("$RESULT", results.get(False, ""))):
        src = src.replace(key, value)
    return src


def clear_loaded() -> None:
    """Forget the modules imported by this process (the next call re-reads, and if needed rewrites, the files)."""
    with _lock:
        _modules.clear()


def _file_name(src: str, prefix: str = "fxfuse_stage") -> str:
    return f"{prefix}_{hashlib.sha256(src.encode()).hexdigest()[:20]}.py"


def kernel_path(num_linears: int, epilogue: str) -> Path:
    """Path of the generated source file of this stage (generating it if needed), e.g. to show a user."""
    return Path(generated_kernel(num_linears, epilogue).__file__)


def _write_atomic(path: Path, src: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(src)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _ensure_file(path: Path, src: str) -> None:
    try:
        if path.read_text(encoding="utf-8") == src:
            return
        logger.warning("fxfuse: cached kernel %s differs from its template rendering; regenerating", path)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        logger.warning("fxfuse: unreadable cached kernel %s (%s); regenerating", path, e)
    _write_atomic(path, src)


def _import(path: Path) -> ModuleType:
    name = path.stem  # top-level, unique per source hash
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import generated kernel {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so inspect / pickling / Inductor can find it by module name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def generated_kernel(num_linears: int, epilogue: str) -> ModuleType:
    """Import (generating if needed) the kernel module of one stage.

    The module has ``fused_stage_kernel`` (the autotuned Triton kernel), ``NUM_LINEARS``, ``EPILOGUE``
    and ``__file__`` (the generated source). Raises ``ValueError`` for an invalid epilogue.

    Example:
        >>> mod = generated_kernel(1, "relu(a0)")  # doctest: +SKIP
        >>> mod.fused_stage_kernel  # doctest: +SKIP
    """
    module = _modules.get((num_linears, epilogue))  # fast path: no parsing on every launch
    if module is not None:
        return module
    _, text = _canonical(num_linears, epilogue)
    key = (num_linears, text)
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = _write_and_import(render(num_linears, text), "fxfuse_stage")
            logger.debug("fxfuse: loaded stage kernel %s for %d:%s", module.__file__, num_linears, text)
        _modules[key] = _modules[(num_linears, epilogue)] = module
        return module


def generated_chain_kernel(epilogues: tuple[str, ...]) -> ModuleType:
    """Import (generating if needed) the fused-chain kernel module for these stage epilogues.

    The module has ``fused_chain_kernel`` and ``EPILOGUES`` (see :mod:`fxfuse.kernels.chain_template`).

    Example:
        >>> generated_chain_kernel(("relu(a0)", "a0")).EPILOGUES  # doctest: +SKIP
        ['relu(a0)', 'a0']
    """
    def source() -> str:
        from .kernels.chain_template import render_chain

        return render_chain(epilogues)

    return _cached(("chain", epilogues), source, "fxfuse_chain")


def generated_chain_backward_kernel(epilogues: tuple[str, ...]) -> ModuleType:
    """Import (generating if needed) the one-kernel fused-chain backward module for these stage epilogues.

    The module has ``fused_chain_backward_kernel`` and ``EPILOGUES`` (see
    :mod:`fxfuse.kernels.chain_backward_template`). Raises ``ValueError`` for an epilogue without a derivative.

    Example:
        >>> generated_chain_backward_kernel(("relu(a0)", "a0")).EPILOGUES  # doctest: +SKIP
        ['relu(a0)', 'a0']
    """
    def source() -> str:
        from .kernels.chain_backward_template import render_chain_backward

        return render_chain_backward(epilogues)

    return _cached(("chain_backward", epilogues), source, "fxfuse_chain_backward")


def generated_chain_walk_kernel(epilogues: tuple[str, ...]) -> ModuleType:
    """Import (generating if needed) the backward walk kernel module of a wide chain with these stage epilogues.

    The module has ``chain_backward_walk_kernel`` and ``EPILOGUES`` (see
    :mod:`fxfuse.kernels.chain_walk_template`). Raises ``ValueError`` for an epilogue without a derivative.
    """
    def source() -> str:
        from .kernels.chain_walk_template import render_chain_walk

        return render_chain_walk(epilogues)

    return _cached(("chain_walk", epilogues), source, "fxfuse_chain_walk")


def generated_decode_kernel(num_linears0: int, epilogue0: str, epilogue1: str) -> ModuleType:
    """Import (generating if needed) the decode kernel module for a two-stage MLP with these epilogues.

    The module has ``fused_decode_kernel``, ``NUM_LINEARS0`` and ``EPILOGUES``
    (see :mod:`fxfuse.kernels.decode_template`). Raises ``ValueError`` for invalid epilogues.

    Example:
        >>> generated_decode_kernel(2, "mul(silu(a0),a1)", "a0").EPILOGUES  # doctest: +SKIP
        ['mul(silu(a0),a1)', 'a0']
    """
    def source() -> str:
        from .kernels.decode_template import render_decode

        return render_decode(num_linears0, epilogue0, epilogue1)

    return _cached(("decode", num_linears0, epilogue0, epilogue1), source, "fxfuse_decode")


def generated_gemv_kernel(num_linears: int, epilogue: str) -> ModuleType:
    """Import (generating if needed) the small-M stage kernel module (:mod:`fxfuse.kernels.gemv_template`).

    The module has ``fused_gemv_kernel``, ``NUM_LINEARS`` and ``EPILOGUE``. Raises ``ValueError`` for an
    invalid epilogue.

    Example:
        >>> generated_gemv_kernel(2, "mul(silu(a0),a1)").EPILOGUE  # doctest: +SKIP
        'mul(silu(a0),a1)'
    """
    def source() -> str:
        from .kernels.gemv_template import render_gemv

        return render_gemv(num_linears, epilogue)

    return _cached(("gemv", num_linears, epilogue), source, "fxfuse_gemv")


def generated_grid_sync_kernel(num_linears0: int, epilogue0: str, epilogue1: str) -> ModuleType:
    """Import (generating if needed) the grid-sync decode kernel module (:mod:`fxfuse.kernels.grid_sync_template`).

    The module has ``fused_grid_sync_kernel``, ``NUM_LINEARS0`` and ``EPILOGUES``. Raises ``ValueError`` for
    invalid epilogues.

    Example:
        >>> generated_grid_sync_kernel(1, "gelu_tanh(a0)", "a0").EPILOGUES  # doctest: +SKIP
        ['gelu_tanh(a0)', 'a0']
    """
    def source() -> str:
        from .kernels.grid_sync_template import render_grid_sync

        return render_grid_sync(num_linears0, epilogue0, epilogue1)

    return _cached(("grid_sync", num_linears0, epilogue0, epilogue1), source, "fxfuse_grid_sync")


def generated_tma_kernel(num_linears: int, epilogue: str) -> ModuleType:
    """Import (generating if needed) the Hopper TMA stage kernel module (:mod:`fxfuse.kernels.tma_template`).

    The module has ``fused_stage_tma_kernel``, ``NUM_LINEARS`` and ``EPILOGUE``. Raises ``ValueError`` for an
    invalid epilogue.

    Example:
        >>> generated_tma_kernel(2, "mul(gelu_tanh(a0),a1)").EPILOGUE  # doctest: +SKIP
        'mul(gelu_tanh(a0),a1)'
    """
    module = _modules.get(("tma", num_linears, epilogue))  # fast path: no parsing on every launch
    if module is not None:
        return module
    from .kernels.tma_template import TMA_TEMPLATE, TMA_TEMPLATE_VERSION

    _, text = _canonical(num_linears, epilogue)
    with _lock:
        module = _modules.get(("tma", num_linears, text))
        if module is None:
            src = render(num_linears, text, template=TMA_TEMPLATE, version=TMA_TEMPLATE_VERSION, is_fp32=None)
            module = _write_and_import(src, "fxfuse_tma")
            logger.debug("fxfuse: loaded TMA stage kernel %s for %d:%s", module.__file__, num_linears, text)
        _modules[("tma", num_linears, text)] = _modules[("tma", num_linears, epilogue)] = module
        return module


def _cached(key: tuple, source: Callable[[], str], prefix: str) -> ModuleType:
    """The module for ``key``: imported once per process, rendered by ``source()`` on the first call."""
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = _modules[key] = _write_and_import(source(), prefix)
            logger.debug("fxfuse: loaded %s for %s", module.__file__, key)
        return module


def _write_and_import(src: str, prefix: str) -> ModuleType:
    path = cache_dir() / _file_name(src, prefix)
    try:
        _ensure_file(path, src)
    except OSError as e:  # read-only home or cache: fall back to a private temp dir
        path = Path(tempfile.gettempdir()) / f"fxfuse-kernels-{getattr(os, 'getuid', lambda: 'user')()}" / path.name
        logger.warning("fxfuse: cannot write the kernel cache (%s); using %s", e, path.parent)
        _ensure_file(path, src)
    return _import(path)
